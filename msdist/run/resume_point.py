"""`--resume auto`: which checkpoint every rank restores, agreed by all ranks.

The newest complete checkpoint in the directory, whatever world sizes wrote its files (`checkpoint_sets`: one
global step written by a job of W ranks, complete when all W files are there and match their sha256), never
an older one while a newer complete one exists. The ranks check the files together: every rank lists what it
sees, the candidates are the union, and rank q's file of a candidate is hashed by rank q mod the world size
(its own file, where the world size did not change), so a node that sees only its own disk still vouches for
its files. Rank 0 names the checkpoint chosen and, one line each, the newer ones passed over and why.

* Written by this job's world size, or a larger one (the job shrank): each rank restores its own file. Exact:
  per-rank state (BatchNorm statistics without sync_bn, top-K residuals) comes back as it was.
* Written by fewer ranks (the job grew), or the job is elastic (msdist.launch --nnodes MIN:MAX:
  `options.resume_from_rank0`; a rank's own files may be from an older membership): every rank restores rank 0's
  file of it. Gradient-compression residuals are rank-local, so they are dropped (zeros, as at a fresh start)
  and one line says so. `--output_dir` must be storage every rank sees.
* Some rank has no checkpoint file at all (its saves failed, its files are gone, the job grew), or the job is
  elastic, and rank 0's newest good file is newer than the newest complete checkpoint: every rank restores that
  file, as above (`_rank0s_newer`): the job's newest state, never an older one.
"""
import logging
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from msdist.base.errors import CheckpointError
from msdist.run import checkpoint, checkpoint_model, checkpoint_sets
from msdist.run.checkpoint_sets import Key

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    info: checkpoint.CheckpointInfo
    rank0s: bool          # every rank restores rank 0's file (rank-local state dropped)


def agree(directory: str, prefix: str, rank: int, collectives, elastic: bool = False) -> Optional[ResumePoint]:
    """The checkpoint this rank restores; None when there is none to resume from. A collective.

    Args:
        elastic: every rank restores rank 0's file of the checkpoint chosen (`options.resume_from_rank0`).

    Raises:
        CheckpointError: the ranks cannot all read the checkpoint they agreed on.
    """
    world = collectives.world_size
    entries = checkpoint_sets.listing(directory, prefix)
    keys = _union(checkpoint_sets.candidates(entries, world), collectives)

    def judge(key: Key) -> np.ndarray:   # every rank hashes its share of the files; a file seen good is good
        share = [q for q in range(key.world_size) if q % world == rank]
        return collectives.gather(checkpoint_sets.statuses(entries, key, share)).max(axis=0)

    chosen, passed = checkpoint_sets.newest_complete(keys, judge)
    if rank == 0:
        for key, why in passed:
            _logger.warning("resume auto: passed over %s in %s: %s", key, directory, why)
    without, newer = _rank0s_newer(directory, prefix, rank, entries, chosen, collectives, elastic)
    if newer is not None:
        why = "an elastic job (its membership may have changed)" if elastic else \
            f"ranks {without} have no checkpoint of their own (the job grew, or their saves failed or files are gone)"
        return ResumePoint(_every_rank_reads(directory, newer, why, collectives), rank0s=True)
    if chosen is None:
        if keys and rank == 0:
            _logger.warning("resume auto: no complete checkpoint in %s; starting fresh", directory)
        return None
    if rank == 0:
        slots = checkpoint_model.stored_meta(checkpoint_sets.file_of(entries, chosen, 0).path).get(
            checkpoint_model.BATCH_SLOTS_KEY, "unrecorded")
        _logger.info("resume auto: chose %s, batch layout %s slots, in %s: the newest complete checkpoint",
                     chosen, slots, directory)
    if not elastic and chosen.world_size >= world:
        return ResumePoint(checkpoint_sets.file_of(entries, chosen, rank), rank0s=False)  # checked good by this rank
    why = "an elastic job (its membership may have changed)" if elastic else \
        f"ranks {list(range(chosen.world_size, world))} have no checkpoint of their own at {chosen} (the job grew)"
    return ResumePoint(_every_rank_reads(directory, checkpoint_sets.file_of(entries, chosen, 0), why, collectives),
                       rank0s=True)


def _union(keys: List[Key], collectives) -> List[Key]:
    """Every rank's candidates, newest first: the same list on every rank. Two collectives."""
    longest = int(collectives.gather([len(keys)])[:, 0].max())
    rows = np.full((max(longest, 1), 2), -1.0)
    if keys:  # a rank with none sends only the -1 row
        rows[:len(keys)] = [(k.global_step, k.world_size) for k in keys]
    every = collectives.gather(rows.ravel()).reshape(-1, 2)
    return checkpoint_sets.ordered({Key(int(s), int(w)) for s, w in every if s >= 0}, collectives.world_size)


def _rank0s_newer(directory: str, prefix: str, rank: int, entries, chosen: Optional[Key], collectives,
                  elastic: bool):
    """(ranks of this job with no checkpoint file at all, rank 0's newest good file when newer than `chosen`).

    Looked for where such a rank exists (its saves failed, its files are gone, the job grew) or the job is elastic
    (a node lost while it saved): rank 0's newest good file is then the job's newest state (the replicas were
    checked identical before it was written), though no complete checkpoint holds it. Two collectives.
    """
    has_own = collectives.gather([any(e.rank == rank for e in entries)])[:, 0]
    without = [r for r, has in enumerate(has_own) if not has]
    if not (without or elastic):
        return without, None
    newest = checkpoint.latest_good(directory, prefix, 0) if rank == 0 else None
    step = int(collectives.gather([newest.position.global_step if newest else -1])[0, 0])
    if step < 0 or chosen is not None and step <= chosen.global_step:
        return without, None
    mine = [e.info for e in entries if e.rank == 0 and e.info.position.global_step == step]
    return without, (mine[0] if mine else None)


def _every_rank_reads(directory: str, first: Optional[checkpoint.CheckpointInfo], why: str,
                      collectives) -> checkpoint.CheckpointInfo:
    """Rank 0's file `first` (None where this rank does not see it), which every rank restores; one line says why.
    A collective.

    Raises:
        CheckpointError: some rank does not see it.
    """
    seen = collectives.gather([first is not None])[:, 0]
    if not seen.all():
        blind = [r for r, s in enumerate(seen) if not s]
        raise CheckpointError(f"ranks {blind} do not see rank 0's checkpoint {first.path if first else ''} in "
                              f"{directory}; put --output_dir on storage every node shares")
    _logger.warning("resume auto: %s: every rank resumes from rank 0's newest good checkpoint %s (global step %d); "
                    "rank-local gradient-compression residuals are dropped", why, first.path,
                    first.position.global_step)
    return first
