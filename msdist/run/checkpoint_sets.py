"""Which files in a checkpoint directory make one complete checkpoint, whatever world sizes wrote them.

A checkpoint is a global step written by one job of W ranks: the files `{prefix}_rank{q}-{epoch}_{step}.ckpt` of
ranks q = 0 .. W-1 whose sidecars record that step and W (`checkpoint.WORLD_KEY`). It is complete when all W
files are there and each matches its sha256. A directory can hold files of several jobs (a requeue on fewer or
more nodes): a rank's file of a step is overwritten by a later job of another size, while other ranks' files of
that step stay behind, so files are grouped by (step, W), never by step alone. Files from before the world size
was recorded belong to the world of the ranks whose such files of that step sit beside them (the highest
rank's number + 1): what a job of that size leaves.

`newest_complete` is the one rule, over candidates newest first; the judge of each candidate (`statuses`) is
given, so the same rule serves a rank alone (pruning, reading a checkpoint's metadata before the ranks agree)
and the ranks together (`resume_point.agree`, where each rank checks its share of the files).
"""
import glob
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Collection, List, Optional, Sequence, Tuple

from msdist.run import checkpoint
from msdist.run.checkpoint import CheckpointInfo

_logger = logging.getLogger(__name__)

# What the ranks that look at a rank's file found, ordered so that combining several views takes the maximum.
MISSING, CORRUPT, GOOD = 0, 1, 2


@dataclass(frozen=True, order=True)
class Key:
    """One checkpoint: a global step as one world wrote it."""
    global_step: int
    world_size: int

    def __str__(self) -> str:
        return f"global step {self.global_step} (written by {self.world_size} rank{'s' * (self.world_size > 1)})"


@dataclass(frozen=True)
class Entry:
    """One rank's checkpoint file with a sidecar (not verified)."""
    rank: int
    info: CheckpointInfo
    world_size: Optional[int]   # None: written before the world size was recorded


def listing(directory: str, prefix: str) -> List[Entry]:
    """Every rank's checkpoint files that have a training sidecar in `directory`."""
    found = []
    pattern = re.compile(rf"{re.escape(prefix)}_rank(\d+)-\d+_\d+\.ckpt")
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(prefix)}_rank*-*.ckpt"))):
        match = pattern.fullmatch(os.path.basename(path))
        sidecar = checkpoint.read_sidecar(path) if match else None
        if sidecar is None or not all(k in sidecar for k in checkpoint.STATE_KEYS):
            continue
        world = sidecar.get(checkpoint.WORLD_KEY)
        info = CheckpointInfo(path, checkpoint.position_of(sidecar), str(sidecar["config_hash"]))
        found.append(Entry(int(match.group(1)), info, int(world) if world else None))
    return found


def _step(entry: Entry) -> int:
    return entry.info.position.global_step


def _world_of(entry: Entry, entries: Sequence[Entry]) -> int:
    """The world that wrote `entry`: recorded, or for an old file the ranks whose old files of its step sit beside it."""
    if entry.world_size is not None:
        return entry.world_size
    return 1 + max(e.rank for e in entries if e.world_size is None and _step(e) == _step(entry))


def candidates(entries: Sequence[Entry], world_size: int = 0) -> List[Key]:
    """The checkpoints `entries` belong to, newest first (`ordered`)."""
    return ordered({Key(_step(e), _world_of(e, entries)) for e in entries}, world_size)


def ordered(keys: Collection[Key], world_size: int = 0) -> List[Key]:
    """Newest first; at one step, this job's world size first (an exact resume), then larger worlds (0: no job)."""
    return sorted(keys, key=lambda k: (k.global_step, k.world_size == world_size, k.world_size), reverse=True)


def file_of(entries: Sequence[Entry], key: Key, rank: int) -> Optional[CheckpointInfo]:
    """Rank `rank`'s file of checkpoint `key`, None when it is not among `entries`."""
    for e in entries:
        if e.rank == rank and _step(e) == key.global_step and _world_of(e, entries) == key.world_size:
            return e.info
    return None


def statuses(entries: Sequence[Entry], key: Key, ranks: Collection[int],
             check: Callable[[str], Optional[str]] = checkpoint.verify) -> List[int]:
    """MISSING, CORRUPT or GOOD for each rank of `key`'s world, looking only at the files of `ranks` (MISSING for
    the others). `check` is `checkpoint.verify` (reads and hashes) or a cheaper stand-in that trusts sidecars."""
    found = []
    for rank in range(key.world_size):
        info = file_of(entries, key, rank) if rank in ranks else None
        problem = check(info.path) if info is not None else "missing"
        if info is not None and problem is not None:
            _logger.warning("skipping checkpoint %s: %s", info.path, problem)
        found.append(MISSING if info is None else CORRUPT if problem else GOOD)
    return found


def shortfall(status: Sequence[int]) -> Optional[str]:
    """Why a checkpoint whose ranks' files have these statuses is not complete; None when it is."""
    missing = [q for q, s in enumerate(status) if s == MISSING]
    corrupt = [q for q, s in enumerate(status) if s == CORRUPT]
    reasons = ([f"ranks {missing} have no file of it (an interrupted save, pruned, or overwritten by a job of "
                "another size)"] if missing else []) + \
        ([f"the files of ranks {corrupt} fail their sha256 check"] if corrupt else [])
    return "; ".join(reasons) or None


def newest_complete(keys: Sequence[Key], judge: Callable[[Key], Sequence[int]]
                    ) -> Tuple[Optional[Key], List[Tuple[Key, str]]]:
    """The first of `keys` (newest first) that `judge`'s statuses make complete, and the ones passed over, each
    with why. Never an older checkpoint while a newer complete one exists."""
    passed = []
    for key in keys:
        why = shortfall(judge(key))
        if why is None:
            return key, passed
        passed.append((key, why))
    return None, passed


def _present(path: str) -> Optional[str]:
    """A stand-in for `checkpoint.verify` that trusts a sidecar (written last, after the file is durable)."""
    return None if os.path.exists(path) else "missing"


def newest_seen(directory: str, prefix: str, world_size: int = 0) -> Tuple[Optional[Key], List[Entry]]:
    """The newest checkpoint whose every file this process sees with its sidecar (no hashing), and the listing."""
    entries = listing(directory, prefix)
    everyone = range(max((e.rank for e in entries), default=-1) + 1)
    key, _ = newest_complete(candidates(entries, world_size), lambda k: statuses(entries, k, everyone, _present))
    return key, entries


def spared(directory: str, prefix: str, rank: int, world_size: int) -> List[str]:
    """What pruning this rank's files must keep besides its newest: its file of the checkpoint a resume would
    restore.

    Background writes end at different moments on different ranks, so a rank's newest file may not yet be
    complete elsewhere; the newest complete checkpoint seen is kept until a newer one is complete. Where the
    other ranks' files cannot be seen (each node its own disk), a rank's write can trail another's by two saves
    at most (one in flight, the next one waits for it), so the rank's two files before its newest are kept.
    """
    key, entries = newest_seen(directory, prefix, world_size)
    if key is not None and file_of(entries, key, rank) is not None:
        return [file_of(entries, key, rank).path]
    if world_size == 1 or any(e.rank != rank for e in entries):
        return []
    return [info.path for info in checkpoint.list_checkpoints(directory, prefix, rank)[:3]]


def ranks_beside(path: str) -> int:
    """How many ranks' checkpoints at the position of rank file `path` sit in its directory (1 for another name)."""
    match = re.fullmatch(r"(.+)_rank\d+(-\d+_\d+\.ckpt)", os.path.basename(path))
    if not match:
        return 1
    pattern = f"{glob.escape(match.group(1))}_rank*{glob.escape(match.group(2))}"
    return len(glob.glob(os.path.join(glob.escape(os.path.dirname(path)), pattern))) or 1
