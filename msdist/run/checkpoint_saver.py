"""The Saver: what one run writes to and restores from its checkpoints (the file format is `checkpoint.py`)."""
import logging
import os
from typing import Dict, List, Optional, Sequence

from msdist.base.errors import CheckpointError
from msdist.run import checkpoint
from msdist.run.checkpoint import CheckpointInfo
from msdist.run.checkpoint_model import is_training_state, training_state_prefixes
from msdist.run.position import Position

_logger = logging.getLogger(__name__)


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
        collectives: `distributed.Collectives`, for the replica check and for agreeing on a resume point.
        meta: the model's metadata (`checkpoint_model.model_meta`), stored in every checkpoint so predict and
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

    def _state(self, at: Position) -> Dict:
        return {"epoch": at.epoch, "step": at.step, "global_step": at.global_step, "config_hash": self.config_hash}

    def save(self, at: Position) -> CheckpointInfo:
        """Check the replicas agree, write this rank's checkpoint atomically, then prune old ones."""
        from msdist.cluster.distributed import check_replicas_identical
        check_replicas_identical(self.collectives, self.net, f"at epoch {at.epoch} step {at.step}")
        self.newest = checkpoint.save([{"name": p.name, "data": p} for p in self.params], self.directory,
                                      self.prefix, self.rank, self._state(at), self.meta)
        self._share_with_rank0(self.newest.path)
        checkpoint.prune(self.directory, self.prefix, self.rank, self.keep)
        _logger.info("saved %s", self.newest.path)
        return self.newest

    def keep_best(self, at: Position, accuracy: float) -> bool:
        """After an evaluation at `at`: make the model this rank's `_best` checkpoint if `accuracy` is a new best.

        Decided by position, with no hash of the weights: the Trainer makes the ranks one model once per epoch
        end, before both the save and the evaluation, and nothing changes the model between them. So a model
        evaluated at the position of this Saver's newest save is that file, and the best becomes a link to it.
        """
        saved = self.newest.path if self.newest is not None and self.newest.position == at else None
        better = checkpoint.keep_best([{"name": p.name, "data": p} for p in self.net.get_parameters()],
                                      self.directory, self.prefix, self.rank, self._state(at), accuracy, self.meta,
                                      saved=saved)
        best = checkpoint.best_path(self.directory, self.prefix, self.rank)
        self._share_with_rank0(best if better else None)
        if better:
            _logger.info("best accuracy so far (%.4f at epoch %d): saved %s", accuracy, at.epoch, best)
        return better

    def save_tagged(self, tag: str, params: List[dict], at: Position) -> str:
        """Write `params` as this rank's `{prefix}_rank{r}_{tag}.ckpt` (e.g. the EMA weights); return its path."""
        path = checkpoint.tagged_path(self.directory, self.prefix, self.rank, tag)
        checkpoint.save_as(params, path, self._state(at), self.meta)
        self._share_with_rank0(path)
        return path

    def _share_with_rank0(self, path: Optional[str]) -> None:
        """Where this rank's just-written `path` is byte-identical to rank 0's file of the same kind and both
        sit on one file system, keep one copy: this rank's name becomes a hard link to rank 0's file.

        Data-parallel replicas hold the same weights and optimizer state, so N ranks would otherwise
        write N equal files per save (the demo's 2 x 89 MB). Rank-local state (top-K residuals,
        per-rank BatchNorm statistics) makes the bytes differ, and then every rank keeps its own file.
        Collective: every rank calls it at the same point, `path` None where this rank wrote nothing.
        """
        digest = checkpoint.read_sidecar(path)["sha256"] if path else ""
        digests = self.collectives.gather([float(int(digest[:12], 16)) if digest else -1.0])[:, 0]  # 48 bits: exact
        if self.rank == 0 or not digest or digests[self.rank] != digests[0]:
            return
        name = os.path.basename(path)
        mine = f"{self.prefix}_rank{self.rank}"
        first = os.path.join(os.path.dirname(path), f"{self.prefix}_rank0{name[len(mine):]}")
        theirs = checkpoint.read_sidecar(first)
        if theirs is not None and theirs["sha256"] == digest:   # else rank 0 writes elsewhere (another host)
            checkpoint.link(first, path)   # where the file system has no hard links, the copy stays

    def resume(self, resume: str) -> Optional[CheckpointInfo]:
        """Restore every Parameter this Saver writes (model and training state) from a checkpoint.

        Args:
            resume: "" (fresh start), "auto" (newest checkpoint every rank has) or a checkpoint path.

        Returns:
            The checkpoint restored, with the position it recorded; None for a fresh start.
        """
        if not resume:
            return None
        if resume == "auto":
            info = _agreed_checkpoint(self.directory, self.prefix, self.rank, self.collectives)
            if info is None:
                _logger.info("resume auto: no checkpoint in %s yet; starting fresh", self.directory)
                return None
            path = info.path
        else:
            path = resume
        loaded = checkpoint.load(path, checkpoint.shapes_of(self.params), resume=True)
        for param in self.params:  # `load` checked that names, shapes and dtypes are exactly these
            param.set_data(loaded["params"][param.name].data, param.sliced)  # as ms.load_param_into_net
        state = loaded["state"]
        if state.get("config_hash") not in (None, self.config_hash):
            _logger.warning("resuming from %s, which was written with a different config (hash %s, now %s)",
                            path, state["config_hash"], self.config_hash)
        return CheckpointInfo(path, checkpoint.position_of(state), str(state.get("config_hash", "")))


def _agreed_checkpoint(directory: str, prefix: str, rank: int, collectives) -> Optional[CheckpointInfo]:
    """Every rank's newest good checkpoint, lowered to the newest step that all ranks have."""
    mine = checkpoint.latest_good(directory, prefix, rank)
    steps = collectives.gather([mine.position.global_step if mine else -1])[:, 0]
    agreed = int(steps.min())
    if agreed < 0:
        if mine is not None or steps.max() >= 0:
            _logger.warning("resume auto: some ranks have no good checkpoint (global steps %s); starting fresh",
                            steps.astype(int).tolist())
        return None
    info = mine if mine.position.global_step == agreed else \
        checkpoint.latest_good(directory, prefix, rank, at_most_step=agreed)
    if info is None or info.position.global_step != agreed:
        raise CheckpointError(f"ranks agreed to resume from global step {agreed}, but rank {rank} has no good "
                              f"checkpoint at that step in {directory}; raise keep_checkpoint_max or start fresh")
    return info
