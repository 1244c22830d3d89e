"""The checkpoint file format: atomic writes with a sha256 sidecar, resume state inside the file, newest-good
lookup, pruning, loading with integrity and shape checks.

What the model part of a checkpoint means (its metadata, loading its weights) is `checkpoint_model.py`; what a
run saves and restores, and when, is `checkpoint_saver.py`. This module knows files, names and integrity only.

File layout in `{output_dir}/ckpt/`:
    {prefix}_rank{r}-{epoch}_{step}.ckpt        MindSpore checkpoint; epoch, step, global_step and
                                               config_hash are stored inside (append_dict)
    {prefix}_rank{r}-{epoch}_{step}.ckpt.json  sidecar: sha256 of the .ckpt plus a copy of the state,
                                               so listing and ordering never open (or parse names of)
                                               the big files; and `world_size` (since issue 41): which
                                               files make a complete checkpoint is `checkpoint_sets.py`
    {prefix}_rank{r}_best.ckpt (+ .json)       the model at its best evaluation so far (which one is
                                               best_checkpoint.py's rule); the sidecar adds `accuracy`.
                                               Never pruned. Taken at the position of the
                                               save just made, it is that checkpoint (a hard link; the
                                               training state in it is ignored by evaluation)
    {prefix}_rank{r}_ema.ckpt (+ .json)        with --ema_decay: the newest EMA weights under the model's
                                               names. Never pruned.

Data-parallel replicas write byte-identical files, so a rank's file that equals rank 0's is a hard link
to it (one copy on disk), numbered, best and EMA alike.

Training also stores the model's metadata (`checkpoint_model.model_meta`) inside every checkpoint
(`msdist_meta`, a JSON string) and in its sidecar (`meta`), so eval, predict, export and resume rebuild the
same network from the checkpoint alone. The key is part of the file's layout, so it is named here.

A checkpoint counts as good only when its sidecar exists and the sha256 matches. The sidecar is
renamed into place last, so a crash at any point leaves either a complete pair or a hidden tmp, which the
rank removes at its next start (`remove_temporaries`); a write that fails removes its own.
"""
import glob
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional

from msdist.base.errors import CheckpointError, first_line
from msdist.base.files import atomic_write_text, replace_durably
from msdist.run.position import Position

_logger = logging.getLogger(__name__)

STATE_KEYS = ("epoch", "step", "global_step", "config_hash")
WORLD_KEY = "world_size"   # in a training checkpoint's sidecar: how many ranks the job that wrote it had
# Inside the .ckpt the state is stored under prefixed names: the optimizer's own `global_step`
# Parameter is saved too, and a bare `global_step` entry would overwrite it.
_STATE_PREFIX = "msdist_state."
META_KEY = "msdist_meta"  # JSON string: the model metadata (checkpoint_model.model_meta)
MAX_CHECKPOINT_BYTES = 8 << 30   # refuse absurd files before reading them
_SUFFIXES = (".ckpt", ".safetensors")


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    position: Position  # where training stood when it was saved
    config_hash: str


def position_of(state: Dict) -> Position:
    """The position a checkpoint's state (or sidecar) records."""
    return Position(int(state["epoch"]), int(state["step"]), int(state["global_step"]))


def file_name(prefix: str, rank: int, epoch: int, step: int) -> str:
    return f"{prefix}_rank{rank}-{epoch}_{step}.ckpt"


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_pair(params: List[dict], path: str, append: Dict, sidecar: Dict) -> None:
    """Write the .ckpt and then its sidecar (sha256 + `sidecar`), each atomically and durably."""
    import mindspore as ms

    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    # Hidden, and ending in .ckpt because save_checkpoint appends that suffix otherwise.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.ckpt")
    try:
        # async_save stays off: the rename below must follow a finished write.
        ms.save_checkpoint(params, tmp, append_dict=append)
        replace_durably(tmp, path)
        atomic_write_text(f"{path}.json", json.dumps({"sha256": sha256_file(path), **sidecar}), durable=True)
    except BaseException:
        # MindSpore's own temporary is `{tmp minus .ckpt}.tmp`; a .ckpt renamed into place without its sidecar too.
        for leftover in glob.glob(f"{glob.escape(tmp[:-len('.ckpt')])}*") + [f"{path}.json.{os.getpid()}.tmp"] + \
                ([path] if read_sidecar(path) is None else []):
            _remove_quietly(leftover)
        raise


def free_mib(directory: str) -> float:
    """The room left on `directory`'s file system, in MiB; -1 where it cannot be read."""
    try:
        return shutil.disk_usage(directory).free / (1 << 20)
    except OSError:
        return -1.0


def write_failure(path: str, error: str, free: float) -> str:
    """What a failed write of checkpoint `path` says: the file, the error, and the room left (`free_mib`) there."""
    room = f"{free:.1f} MiB free there" if free >= 0 else "free space unknown"
    return f"writing checkpoint {path} failed: {error} ({room})"


def _remove_quietly(path: str) -> None:
    """Remove the file `path` if it is one (never a directory: not something msdist wrote)."""
    if os.path.isfile(path) or os.path.islink(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _contents(state: Dict, meta: Optional[Dict]):
    """(append_dict, sidecar) of a checkpoint: its state, and its model metadata when given."""
    append = {_STATE_PREFIX + k: state[k] for k in STATE_KEYS}
    sidecar = {k: state[k] for k in (*STATE_KEYS, WORLD_KEY) if k in state}
    if meta is not None:
        append[META_KEY] = json.dumps(meta)
        sidecar["meta"] = meta
    return append, sidecar


def save(params: List[dict], directory: str, prefix: str, rank: int, state: Dict,
         meta: Optional[Dict] = None) -> CheckpointInfo:
    """Write `params` ([{'name', 'data'}]) and `state` atomically; return what was written.

    The previous checkpoints are untouched here; `prune` removes old ones only afterwards.

    Args:
        meta: the model's metadata (model, num_classes, image_size, classes), stored in the file and sidecar.
    """
    path = os.path.join(directory, file_name(prefix, rank, state["epoch"], state["step"]))
    _write_pair(params, path, *_contents(state, meta))
    return CheckpointInfo(path, position_of(state), state["config_hash"])


def save_weights(params: List[dict], path: str, meta: Dict) -> None:
    """Write a model's weights alone (no training state: `--pretrained` starts from it, `--resume` refuses it),
    with its metadata, atomically and with the sha256 sidecar like every checkpoint."""
    _write_pair(params, path, {META_KEY: json.dumps(meta)}, {"meta": meta})


def tagged_path(directory: str, prefix: str, rank: int, tag: str) -> str:
    """`{prefix}_rank{r}_{tag}.ckpt` (best, ema): outside `prune`'s `{prefix}_rank{r}-*` pattern, so never pruned."""
    return os.path.join(directory, f"{prefix}_rank{rank}_{tag}.ckpt")


def best_path(directory: str, prefix: str, rank: int) -> str:
    """This rank's best checkpoint, `{prefix}_rank{r}_best.ckpt`."""
    return tagged_path(directory, prefix, rank, "best")


def save_as(params: List[dict], path: str, state: Dict, meta: Optional[Dict] = None, **extra) -> None:
    """Write a checkpoint under a fixed name (best, ema), replacing the previous one atomically.

    Same integrity scheme as `save`: tmp file, fsync, rename, then the sidecar with the sha256, the
    state, the metadata and `extra` (e.g. accuracy).
    """
    append, sidecar = _contents(state, meta)
    _write_pair(params, path, append, {**sidecar, **extra})


def link(source: str, path: str, **extra) -> bool:
    """Make `path` a hard link to the checkpoint `source`, with its own sidecar (source's plus `extra`).

    Returns:
        False, leaving `path` as it was, where the file system has no hard links (some network ones).
    """
    # A rename onto another name of the same file does nothing (POSIX), and would leave the tmp behind.
    if not (os.path.exists(path) and os.path.samefile(source, path)):
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.link.tmp")
        try:
            if os.path.lexists(tmp):
                os.remove(tmp)  # left by a crash
            os.link(source, tmp)
        except OSError:
            return False
        replace_durably(tmp, path)
    atomic_write_text(f"{path}.json", json.dumps({**read_sidecar(source), **extra}), durable=True)
    return True


def read_sidecar(path: str) -> Optional[dict]:
    """The sidecar of checkpoint `path` (sha256, and state, meta, ...), None when missing or incomplete; a
    weights-only file's (`save_weights`) has no training state."""
    try:
        with open(f"{path}.json", encoding="utf-8") as f:
            data = json.load(f)
        return data if "sha256" in data else None
    except (OSError, ValueError):
        return None


def read_training_sidecar(path: str) -> Optional[dict]:
    """The sidecar of a training checkpoint: the sha256 and the training state."""
    data = read_sidecar(path)
    return data if data is not None and all(k in data for k in STATE_KEYS) else None


def list_checkpoints(directory: str, prefix: str, rank: int) -> List[CheckpointInfo]:
    """This rank's checkpoints that have a sidecar, newest (highest global step) first. Not verified."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(prefix)}_rank{rank}-*.ckpt")):
        meta = read_training_sidecar(path)
        if meta is None:
            _logger.warning("checkpoint %s has no valid sidecar %s.json (interrupted save?); ignoring it", path, path)
            continue
        found.append(CheckpointInfo(path, position_of(meta), str(meta["config_hash"])))
    return sorted(found, key=lambda c: c.position.global_step, reverse=True)


def verify(path: str) -> Optional[str]:
    """None when `path` matches its recorded sha256, else the reason it does not."""
    meta = read_sidecar(path)
    if meta is None:
        return "no sidecar with a sha256"
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if size == 0:
        return "zero bytes"
    if sha256_file(path) != meta["sha256"]:
        return "sha256 mismatch (truncated or corrupt)"
    return None


def latest_good(directory: str, prefix: str, rank: int) -> Optional[CheckpointInfo]:
    """The newest checkpoint of this rank that verifies, skipping (with a warning) corrupt ones."""
    for info in list_checkpoints(directory, prefix, rank):
        problem = verify(info.path)
        if problem is None:
            return info
        _logger.warning("skipping checkpoint %s: %s; trying the previous one", info.path, problem)
    return None


def prune(directory: str, prefix: str, rank: int, keep: int, spare: Collection[str] = ()) -> None:
    """Delete all but this rank's newest `keep` checkpoints and the paths in `spare` (the checkpoint a resume would
    restore, `checkpoint_sets.spared`). Call after a save is durable."""
    for info in list_checkpoints(directory, prefix, rank)[keep:]:
        if info.path not in spare:
            _remove_quietly(info.path)
            _remove_quietly(f"{info.path}.json")


def remove_temporaries(directory: str, prefix: str, rank: int) -> List[str]:
    """Delete the temporaries this rank's interrupted writes left (a kill -9, a power cut); return their paths.

    Call at the start of a run, before this rank writes: the hidden `.ckpt` and link temporaries and the
    sidecars' (`base.files.atomic_write_text`) of all its checkpoints (numbered, best, EMA)."""
    mine = glob.escape(f"{prefix}_rank{rank}")
    left = glob.glob(os.path.join(glob.escape(directory), f".{mine}[-_]*.tmp*")) + \
        glob.glob(os.path.join(glob.escape(directory), f"{mine}[-_]*.json.*.tmp"))
    left = [path for path in left if os.path.isfile(path)]
    for path in left:
        _remove_quietly(path)
    return left


def load(path: str, expected: Dict[str, tuple], optional_prefixes: tuple = (), resume: bool = False) -> Dict:
    """Read a checkpoint after checking its integrity and that it fits the model.

    Args:
        path: a MindSpore .ckpt (protobuf) or .safetensors file.
        expected: parameter name -> (shape, dtype string) of everything that must be restored.
        optional_prefixes: names starting with these may be missing from the file, and extra ones are dropped
            instead of reported as unexpected (evaluation ignores the optimizer state a training checkpoint
            carries; a job of another world size has other gradient-compression residuals).
        resume: `--resume` reads it: a file of weights alone (converted, `save_weights`) is refused.

    Returns:
        {'params': {name: Parameter}, 'state': {epoch, step, global_step, config_hash} (may be empty),
         'meta': the model metadata (may be empty)}

    Raises:
        CheckpointError: wrong format, too large, corrupt, names/shapes/dtypes that do not match, or weights
            alone to resume from.
    """
    raw = read_tensors(path)
    state = {k: _scalar(raw.pop(_STATE_PREFIX + k)) for k in STATE_KEYS if _STATE_PREFIX + k in raw}
    if resume and not state:
        raise CheckpointError(f"--resume {path}: it holds a model's weights alone (no optimizer state, no position to "
                              f"resume from); start training from them with --pretrained {path}")
    meta = json.loads(raw.pop(META_KEY, "{}"))
    for name in [n for n in raw if n not in expected and n.startswith(optional_prefixes)]:
        del raw[name]
    _check_fits(path, raw, {n: v for n, v in expected.items() if n in raw or not n.startswith(optional_prefixes)})
    return {"params": raw, "state": state, "meta": meta}


def check_size(path: str, what: str = "checkpoint") -> None:
    """Refuse a missing file, and one too large to be a model's weights, before anything reads it.

    Raises:
        CheckpointError: not found, or over MAX_CHECKPOINT_BYTES.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{what} {path} not found")
    if os.path.getsize(path) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"{path} is {os.path.getsize(path) >> 20} MiB, over the "
                              f"{MAX_CHECKPOINT_BYTES >> 20} MiB cap; is it really a checkpoint of this model?")


def read_tensors(path: str) -> Dict:
    """Every entry of a checkpoint file (name -> Parameter or appended value), after the safety checks.

    Raises:
        CheckpointError: missing, not .ckpt/.safetensors (never pickle), over the size cap, failing its
            sidecar's sha256, or unreadable.
    """
    check_size(path)
    if not path.endswith(_SUFFIXES):
        raise CheckpointError(f"{path} is not a MindSpore .ckpt or .safetensors file; only those are loaded "
                              "(never pickle)")
    if os.path.exists(f"{path}.json"):
        problem = verify(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} failed its integrity check: {problem}")
    return read_entries(path)


def read_entries(path: str, choice_func=None) -> Dict:
    """ms.load_checkpoint without the integrity check (`read_tensors` has it), any failure to read the file
    being a one-line CheckpointError. `choice_func` selects entries, as MindSpore's."""
    import mindspore as ms
    try:
        return ms.load_checkpoint(path, format="safetensors" if path.endswith(".safetensors") else "ckpt",
                                  choice_func=choice_func)
    except Exception as e:  # noqa: BLE001 - MindSpore raises several types for unreadable files
        raise CheckpointError(f"cannot read checkpoint {path}: {first_line(str(e)) or type(e).__name__}") from None


def _scalar(value):
    if hasattr(value, "asnumpy"):
        value = value.asnumpy().item()
    return value


def _check_fits(path: str, params: Dict, expected: Dict[str, tuple]) -> None:
    problems = []
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)} parameter(s): {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} parameter(s): {', '.join(unexpected[:5])}")
    for name in sorted(set(params) & set(expected)):
        shape, dtype = tuple(params[name].shape), str(params[name].dtype)
        want_shape, want_dtype = expected[name]
        if shape != tuple(want_shape) or dtype != want_dtype:
            problems.append(f"{name} is {dtype}{list(shape)}, model needs {want_dtype}{list(want_shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the model: {'; '.join(problems[:6])}")


def shapes_of(params) -> Dict[str, tuple]:
    """`load`'s `expected` for these Parameters: name -> (shape, dtype string)."""
    return {p.name: (tuple(p.shape), str(p.dtype)) for p in params}
