"""`--resume auto`: which checkpoint every rank restores, agreed by all ranks.

* Every rank has a good checkpoint of its own: the newest global step all of them have, each rank from its
  own file. Exact: per-rank state (BatchNorm statistics without sync_bn, top-K residuals) comes back as it
  was, and a corrupt newest file on one rank makes the job go back to the previous step on all of them.
* Some rank has none (the job grew, or a rank's files are gone), or the job is elastic (msdist.launch --nnodes
  MIN:MAX: `options.resume_from_rank0`; a rank's own files may be from an older membership): every rank restores
  rank 0's newest good checkpoint instead of starting fresh. Gradient-compression residuals are rank-local, so
  they are dropped (zeros, as at a fresh start) and one line says so. `--output_dir` must be storage every rank
  sees.
"""
import logging
from dataclasses import dataclass
from typing import Optional

from msdist.base.errors import CheckpointError
from msdist.run import checkpoint

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    info: checkpoint.CheckpointInfo
    rank0s: bool          # every rank restores rank 0's file (rank-local state dropped)


def agree(directory: str, prefix: str, rank: int, collectives, elastic: bool = False) -> Optional[ResumePoint]:
    """The checkpoint this rank restores; None when there is none to resume from. A collective.

    Args:
        elastic: every rank restores rank 0's newest good checkpoint (`options.resume_from_rank0`).

    Raises:
        CheckpointError: the ranks cannot all read the checkpoint they agreed on.
    """
    mine = checkpoint.latest_good(directory, prefix, rank)
    steps = collectives.gather([mine.position.global_step if mine else -1])[:, 0]
    if steps.min() >= 0 and not elastic:
        return ResumePoint(_own_at(directory, prefix, rank, mine, int(steps.min())), rank0s=False)
    first = checkpoint.latest_good(directory, prefix, 0)
    seen = collectives.gather([first.position.global_step if first else -1])[:, 0]
    if seen.max() < 0:
        if steps.max() >= 0:
            _logger.warning("resume auto: rank 0 has no good checkpoint in %s (ranks' newest: global steps %s); "
                            "starting fresh", directory, steps.astype(int).tolist())
        return None
    if seen.min() != seen.max():
        blind = [r for r, s in enumerate(seen) if s != seen[0]]
        raise CheckpointError(f"ranks {blind} do not see rank 0's newest checkpoint in {directory} (rank 0 sees global "
                              f"step {int(seen[0])}); put --output_dir on storage every node shares")
    without = [r for r, s in enumerate(steps) if s < 0]
    why = "an elastic job (its membership may have changed)" if elastic else \
        f"ranks {without} have no checkpoint of their own (the job grew, or their files are gone)"
    _logger.warning("resume auto: %s: every rank resumes from rank 0's newest good checkpoint %s (global step %d); "
                    "rank-local gradient-compression residuals are dropped", why, first.path,
                    first.position.global_step)
    return ResumePoint(first, rank0s=True)


def _own_at(directory: str, prefix: str, rank: int, mine: checkpoint.CheckpointInfo,
            agreed: int) -> checkpoint.CheckpointInfo:
    """This rank's own good checkpoint at global step `agreed` (the newest every rank has)."""
    if mine.position.global_step == agreed:
        return mine
    info = checkpoint.latest_good(directory, prefix, rank, at_most_step=agreed)
    if info is None or info.position.global_step != agreed:
        raise CheckpointError(f"ranks agreed to resume from global step {agreed}, but rank {rank} has no good "
                              f"checkpoint at that step in {directory}; raise keep_checkpoint_max or start fresh")
    return info

