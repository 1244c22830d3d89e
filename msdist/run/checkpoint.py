"""Checkpoints: atomic writes with a sha256, resume state inside the file, newest-good lookup.

File layout in `{output_dir}/ckpt/`:
    {prefix}_rank{r}-{epoch}_{step}.ckpt        MindSpore checkpoint; epoch, step, global_step and
                                               config_hash are stored inside (append_dict)
    {prefix}_rank{r}-{epoch}_{step}.ckpt.json  sidecar: sha256 of the .ckpt plus a copy of the state,
                                               so listing and ordering never open (or parse names of)
                                               the big files
    {prefix}_rank{r}_best.ckpt (+ .json)       the model at its best evaluation so far; the sidecar adds
                                               `accuracy`. Never pruned. Taken right after a save of the
                                               same model, it is that checkpoint (a hard link; the
                                               training state in it is ignored by evaluation)
    {prefix}_rank{r}_ema.ckpt (+ .json)        with --ema_decay: the newest EMA weights under the model's
                                               names. Never pruned.

Data-parallel replicas write byte-identical files, so a rank's file that equals rank 0's is a hard link
to it (one copy on disk), numbered, best and EMA alike.

Training also stores the model's metadata (model name, num_classes, image_size, class names, and the
padding convention of its weights, models.CONVENTIONS) inside every checkpoint (`msdist_meta`, a JSON
string) and in its sidecar (`meta`), so eval, predict, export and resume rebuild the same network from
the checkpoint alone.

A checkpoint counts as good only when its sidecar exists and the sha256 matches. The sidecar is
renamed into place last, so a crash at any point leaves either a complete pair or an ignorable tmp.
"""
import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from models import DEFAULT_CONVENTION
from msdist.base.errors import CheckpointError, first_line
from msdist.base.files import atomic_write_text, replace_durably
from msdist.run.position import Position

_logger = logging.getLogger(__name__)

STATE_KEYS = ("epoch", "step", "global_step", "config_hash")
# Inside the .ckpt the state is stored under prefixed names: the optimizer's own `global_step`
# Parameter is saved too, and a bare `global_step` entry would overwrite it.
_STATE_PREFIX = "msdist_state."
META_KEY = "msdist_meta"  # JSON string: model, num_classes, image_size, classes, mean, std, convention
MAX_CHECKPOINT_BYTES = 8 << 30   # refuse absurd files before reading them
_SUFFIXES = (".ckpt", ".safetensors")


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    position: Position  # where training stood when it was saved
    config_hash: str


def training_state_prefixes() -> tuple:
    """What a training checkpoint holds besides the model, by parameter-name prefix, as each component
    declares it in its own module: the optimizer's moments and step counter, the reducer's residuals,
    the loss scale, the EMA. `Saver` refuses state outside these, so evaluation, prediction and export
    (`load_weights`) always know which part is the model.
    """
    from msdist.engine import ema, loss_scale, optim, reducers  # MindSpore: only where checkpoints are read
    return optim.STATE_PREFIXES + (reducers.RESIDUAL_PREFIX, loss_scale.STATE_PREFIX, ema.PREFIX)


def _position(state: Dict) -> Position:
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
    # async_save stays off: the rename below must follow a finished write.
    ms.save_checkpoint(params, tmp, append_dict=append)
    replace_durably(tmp, path)
    atomic_write_text(f"{path}.json", json.dumps({"sha256": sha256_file(path), **sidecar}), durable=True)


def _contents(state: Dict, meta: Optional[Dict]):
    """(append_dict, sidecar) of a checkpoint: its state, and its model metadata when given."""
    append = {_STATE_PREFIX + k: state[k] for k in STATE_KEYS}
    sidecar = {k: state[k] for k in STATE_KEYS}
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
    return CheckpointInfo(path, _position(state), state["config_hash"])


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


def read_best(directory: str, prefix: str, rank: int) -> Optional[dict]:
    """The sidecar of this rank's best checkpoint (epoch, accuracy, ...) when it exists and verifies."""
    path = best_path(directory, prefix, rank)
    meta = _read_sidecar(path)
    if meta is None or "accuracy" not in meta or verify(path) is not None:
        return None
    return meta


def keep_best(params: List[dict], directory: str, prefix: str, rank: int, state: Dict, accuracy: float,
              meta: Optional[Dict] = None, saved: Optional[str] = None) -> bool:
    """Make `params` this rank's best checkpoint when `accuracy` beats the best so far (ties keep the earlier).

    Written like every checkpoint (tmp, fsync, rename, then the sidecar with its sha256); the sidecar
    also holds `accuracy`. Every rank sees the same summed accuracy, so all ranks decide alike.

    Args:
        saved: a checkpoint that already holds exactly `params` (and training state): the best becomes
            a hard link to it instead of a second copy of the model.

    Returns:
        Whether a new best was written.
    """
    best = read_best(directory, prefix, rank)
    if best is not None and accuracy <= best["accuracy"]:
        return False
    path = best_path(directory, prefix, rank)
    if saved is None or not _link(saved, path, accuracy=accuracy):
        save_as(params, path, state, meta, accuracy=accuracy)
    return True


def _link(source: str, path: str, **extra) -> bool:
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
    atomic_write_text(f"{path}.json", json.dumps({**_read_sidecar(source), **extra}), durable=True)
    return True


def _read_sidecar(path: str) -> Optional[dict]:
    try:
        with open(f"{path}.json", encoding="utf-8") as f:
            data = json.load(f)
        return data if all(k in data for k in ("sha256",) + STATE_KEYS) else None
    except (OSError, ValueError):
        return None


def list_checkpoints(directory: str, prefix: str, rank: int) -> List[CheckpointInfo]:
    """This rank's checkpoints that have a sidecar, newest (highest global step) first. Not verified."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(prefix)}_rank{rank}-*.ckpt")):
        meta = _read_sidecar(path)
        if meta is None:
            _logger.warning("checkpoint %s has no valid sidecar %s.json (interrupted save?); ignoring it", path, path)
            continue
        found.append(CheckpointInfo(path, _position(meta), str(meta["config_hash"])))
    return sorted(found, key=lambda c: c.position.global_step, reverse=True)


def verify(path: str) -> Optional[str]:
    """None when `path` matches its recorded sha256, else the reason it does not."""
    meta = _read_sidecar(path)
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


def latest_good(directory: str, prefix: str, rank: int, at_most_step: Optional[int] = None) -> Optional[CheckpointInfo]:
    """The newest checkpoint of this rank that verifies, skipping (with a warning) corrupt ones.

    Args:
        at_most_step: ignore checkpoints past this global step (used to agree across ranks).
    """
    for info in list_checkpoints(directory, prefix, rank):
        if at_most_step is not None and info.position.global_step > at_most_step:
            continue
        problem = verify(info.path)
        if problem is None:
            return info
        _logger.warning("skipping checkpoint %s: %s; trying the previous one", info.path, problem)
    return None


def prune(directory: str, prefix: str, rank: int, keep: int) -> None:
    """Delete all but this rank's newest `keep` checkpoints (call after a save is durable)."""
    for info in list_checkpoints(directory, prefix, rank)[keep:]:
        for path in (info.path, f"{info.path}.json"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def load(path: str, expected: Dict[str, tuple], optional_prefixes: tuple = ()) -> Dict:
    """Read a checkpoint after checking its integrity and that it fits the model.

    Args:
        path: a MindSpore .ckpt (protobuf) or .safetensors file.
        expected: parameter name -> (shape, dtype string) of everything that must be restored.
        optional_prefixes: names starting with these may be missing from the file, and extra ones are dropped
            instead of reported as unexpected (evaluation ignores the optimizer state a training checkpoint
            carries; a job of another world size has other gradient-compression residuals).

    Returns:
        {'params': {name: Parameter}, 'state': {epoch, step, global_step, config_hash} (may be empty),
         'meta': the model metadata (may be empty)}

    Raises:
        CheckpointError: wrong format, too large, corrupt, or names/shapes/dtypes that do not match.
    """
    raw = read_tensors(path)
    state = {k: _scalar(raw.pop(_STATE_PREFIX + k)) for k in STATE_KEYS if _STATE_PREFIX + k in raw}
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
    return _read_raw(path)


def stored_meta(path: str) -> Dict:
    """The model metadata of checkpoint `path`, {} when it has none (model zoo, MindCV, a missing file).

    The sidecar's copy when there is one, else the string inside the file: the tensors are never read.
    Checkpoints from before issue 28 have no "convention" in it (models.DEFAULT_CONVENTION applies).
    """
    sidecar = _read_sidecar(path)
    if sidecar is not None and "meta" in sidecar:
        return sidecar["meta"]
    if not os.path.isfile(path):
        return {}
    raw = _read_raw(path, choice_func=_meta_and_one_entry())
    return json.loads(raw[META_KEY]) if META_KEY in raw else {}


def _meta_and_one_entry():
    """A load_checkpoint choice_func that keeps the metadata string and the first entry read, nothing else:
    MindSpore refuses a selection that comes out empty, as it would for a file without metadata."""
    kept = []

    def choose(name: str) -> bool:
        if name == META_KEY:
            return True
        if not kept:
            kept.append(name)
            return True
        return False
    return choose


def meta_convention(meta: Dict) -> str:
    """The padding convention (models.CONVENTIONS) a checkpoint's network was built with; metadata from before
    issue 28, and files without any (model zoo, MindCV), mean MindSpore's."""
    return meta.get("convention", DEFAULT_CONVENTION)


def read_meta(path: str) -> Dict:
    """The model metadata stored in checkpoint `path` (model, num_classes, image_size, classes, convention).

    Raises:
        CheckpointError: the file is missing, unreadable, or was not written by msdist.train.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} not found")
    meta = stored_meta(path)
    if not meta:
        raise CheckpointError(f"checkpoint {path} holds no model metadata (model, classes, image_size); use a "
                              "checkpoint written by this version of msdist.train")
    return meta


def resume_meta(resume: str, directory: str, prefix: str, rank: int) -> Dict:
    """The metadata of the checkpoint `--resume` will restore ({} when there is none to restore).

    The network is built before the resume reads the tensors, and must be built as that checkpoint's was
    (its convention). Every checkpoint of one run shares the metadata, so with `auto` this rank's newest
    listed one answers, before the ranks agree on which one they restore.
    """
    if resume != "auto":
        return stored_meta(resume) if resume else {}
    found = list_checkpoints(directory, prefix, rank) or list_checkpoints(directory, prefix, 0)  # a grown job's new rank
    return stored_meta(found[0].path) if found else {}


def _read_raw(path: str, choice_func=None) -> Dict:
    """ms.load_checkpoint, with any failure to read the file as a one-line CheckpointError."""
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


def _zeros_like(param):
    """A tensor of zeros with `param`'s shape and dtype."""
    import mindspore as ms
    import numpy as np
    return ms.Tensor(np.zeros(param.shape, dtype=ms.dtype_to_nptype(param.dtype)))


def is_training_state(name: str) -> bool:
    """Whether a checkpoint entry is training state (optimizer, residuals) rather than part of the model."""
    return name.startswith(training_state_prefixes())


def _expected(params) -> Dict[str, tuple]:
    return {p.name: (tuple(p.shape), str(p.dtype)) for p in params}


def load_weights(path: str, net) -> None:
    """Load the model's part of a checkpoint into `net` (evaluation, prediction, export).

    Raises:
        CheckpointError: as `load`; training state in the file is ignored, anything else must fit.
    """
    import mindspore as ms
    params = load(path, _expected(net.get_parameters()), optional_prefixes=training_state_prefixes())["params"]
    ms.load_param_into_net(net, params, strict_load=True)


class Saver:
    """Writes and restores a run's resumable state: the model plus the training state the Trainer collects.

    Built once per run. Every rank has one (each rank keeps its own files, `{prefix}_rank{r}-...`),
    and saving first checks that the replicas still agree, so no checkpoint of a diverged job exists.

    Args:
        directory, prefix, rank: where this rank's checkpoints live.
        keep: how many of this rank's newest checkpoints survive pruning.
        config_hash: stored in every checkpoint; a resume under another config warns.
        net: the model; its parameters are the model part of every checkpoint.
        train_state: the other Parameters an exact resume needs (optimizer moments and step counter,
            gradient-compression residuals, loss scale, EMA), each named under `training_state_prefixes()`.
        collectives: `distributed.Collectives`, for the replica check and sharing files with rank 0.
        meta: the model's metadata (`inference.model_meta`), stored in every checkpoint so predict and
            export need nothing else.
    """

    def __init__(self, *, directory: str, prefix: str, rank: int, keep: int, config_hash: str, net,
                 train_state: Sequence, collectives, meta: Optional[Dict] = None):
        outside = [p.name for p in train_state if not is_training_state(p.name)]
        if outside:
            raise ValueError(f"training state {outside[:3]} is not named under {training_state_prefixes()}; "
                             "add its prefix there so evaluation can tell it from the model")
        self.directory, self.prefix, self.rank, self.keep = directory, prefix, rank, keep
        self.config_hash = config_hash
        self.net = net
        self.params = list(net.get_parameters()) + list(train_state)
        self.collectives = collectives
        self.meta = meta
        self.newest: Optional[CheckpointInfo] = None
        self._saved_model: Optional[tuple] = None   # (global step, model digest) of this Saver's newest save

    def state(self, at: Position) -> Dict:
        """What every checkpoint of this run records of position `at` (and the config hash)."""
        return {"epoch": at.epoch, "step": at.step, "global_step": at.global_step, "config_hash": self.config_hash}

    def save(self, at: Position) -> CheckpointInfo:
        """Check the replicas agree, write this rank's checkpoint atomically, then prune old ones."""
        from msdist.cluster.distributed import check_replicas_identical
        check_replicas_identical(self.collectives, self.net, f"at epoch {at.epoch} step {at.step}")
        self.newest = save([{"name": p.name, "data": p} for p in self.params], self.directory, self.prefix,
                           self.rank, self.state(at), self.meta)
        self._saved_model = (at.global_step, self._model_digest())
        self._share_with_rank0(self.newest.path)
        prune(self.directory, self.prefix, self.rank, self.keep)
        _logger.info("saved %s", self.newest.path)
        return self.newest

    def keep_best(self, at: Position, accuracy: float) -> bool:
        """After an evaluation: make the model this rank's `_best` checkpoint if `accuracy` is a new best."""
        # Evaluated right after the save at this step (the usual end of an epoch): the best is that file.
        unchanged = self._saved_model is not None and self._saved_model[0] == at.global_step and \
            self._saved_model[1] == self._model_digest()
        saved = self.newest.path if unchanged else None
        better = keep_best([{"name": p.name, "data": p} for p in self.net.get_parameters()], self.directory,
                           self.prefix, self.rank, self.state(at), accuracy, self.meta, saved=saved)
        self._share_with_rank0(best_path(self.directory, self.prefix, self.rank) if better else None)
        if better:
            _logger.info("best accuracy so far (%.4f at epoch %d): saved %s", accuracy, at.epoch,
                         best_path(self.directory, self.prefix, self.rank))
        return better

    def save_tagged(self, tag: str, params: List[dict], at: Position) -> str:
        """Write `params` as this rank's `{prefix}_rank{r}_{tag}.ckpt` (e.g. the EMA weights); return its path."""
        path = tagged_path(self.directory, self.prefix, self.rank, tag)
        save_as(params, path, self.state(at), self.meta)
        self._share_with_rank0(path)
        return path

    def _model_digest(self) -> str:
        """sha256 of the model's parameters as they are now (BatchNorm statistics included)."""
        digest = hashlib.sha256()
        for param in self.net.get_parameters():
            digest.update(param.name.encode())
            digest.update(param.asnumpy().tobytes())
        return digest.hexdigest()

    def _share_with_rank0(self, path: Optional[str]) -> None:
        """Where this rank's just-written `path` is byte-identical to rank 0's file of the same kind and both
        sit on one file system, keep one copy: this rank's name becomes a hard link to rank 0's file.

        Data-parallel replicas hold the same weights and optimizer state, so N ranks would otherwise
        write N equal files per save (the demo's 2 x 89 MB). Rank-local state (top-K residuals,
        per-rank BatchNorm statistics) makes the bytes differ, and then every rank keeps its own file.
        Collective: every rank calls it at the same point, `path` None where this rank wrote nothing.
        """
        digest = _read_sidecar(path)["sha256"] if path else ""
        digests = self.collectives.gather([float(int(digest[:12], 16)) if digest else -1.0])[:, 0]  # 48 bits: exact
        if self.rank == 0 or not digest or digests[self.rank] != digests[0]:
            return
        name = os.path.basename(path)
        mine = f"{self.prefix}_rank{self.rank}"
        first = os.path.join(os.path.dirname(path), f"{self.prefix}_rank0{name[len(mine):]}")
        theirs = _read_sidecar(first)
        if theirs is not None and theirs["sha256"] == digest:   # else rank 0 writes elsewhere (another host)
            _link(first, path)   # where the file system has no hard links, the copy stays

    def resume(self, path: str, drop_residuals: bool = False) -> CheckpointInfo:
        """Restore every Parameter this Saver writes (model and training state) from checkpoint `path`
        (`--resume PATH`, or the one `resume_point.agree` chose for `--resume auto`).

        Gradient-compression residuals are rank-local: restored only when the file holds exactly this job's
        (same world size, this rank's own file); otherwise they start from zero, as in a fresh run.

        Args:
            drop_residuals: the file is another rank's (rank 0's, for a rank that had none of its own).

        Returns:
            The checkpoint restored, with the position it recorded.
        """
        from msdist.engine import reducers
        residual = reducers.RESIDUAL_PREFIX
        loaded = load(path, _expected(self.params), optional_prefixes=(residual,))
        mine = {p.name for p in self.params if p.name.startswith(residual)}
        theirs = {n for n in loaded["params"] if n.startswith(residual)}
        if mine != theirs and not drop_residuals:  # a rank resuming from rank 0's file has said so already
            _logger.warning("%s holds %d gradient-compression residuals, this job %d (the world size changed): "
                            "they start from zero", path, len(theirs), len(mine))
        keep_residuals = mine == theirs and not drop_residuals
        for param in self.params:  # `load` checked that names, shapes and dtypes are exactly these
            if param.name.startswith(residual) and not keep_residuals:
                param.set_data(_zeros_like(param))
            else:
                param.set_data(loaded["params"][param.name].data, param.sliced)  # as ms.load_param_into_net
        state = loaded["state"]
        if state.get("config_hash") not in (None, self.config_hash):
            _logger.warning("resuming from %s, which was written with a different config (hash %s, now %s)",
                            path, state["config_hash"], self.config_hash)
        return CheckpointInfo(path, _position(state), str(state.get("config_hash", "")))
