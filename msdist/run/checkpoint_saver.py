"""The Saver: what one run writes to and restores from its checkpoints (the file format is `checkpoint.py`)."""
import logging
import os
from typing import Dict, List, Optional, Sequence

from msdist.run import checkpoint, checkpoint_sets
from msdist.run.best_checkpoint import Best
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
        collectives: `distributed.Collectives`, for the replica check and sharing files with rank 0.
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
        self.best = Best(directory, prefix, rank)

    def state(self, at: Position) -> Dict:
        """What every checkpoint of this run records of position `at` (and the config hash, and the world size that
        `checkpoint_sets` tells complete checkpoints by)."""
        return {"epoch": at.epoch, "step": at.step, "global_step": at.global_step, "config_hash": self.config_hash,
                checkpoint.WORLD_KEY: self.collectives.world_size}

    def remove_temporaries(self) -> None:
        """At the start of a run, before any write: remove what this rank's interrupted writes left behind."""
        for path in checkpoint.remove_temporaries(self.directory, self.prefix, self.rank):
            _logger.info("removed %s, left by an interrupted checkpoint write", path)

    def prune(self) -> None:
        """Delete this rank's checkpoints beyond the newest `keep`, never its file of the checkpoint a resume would
        restore (`checkpoint_sets.spared`)."""
        spare = checkpoint_sets.spared(self.directory, self.prefix, self.rank, self.collectives.world_size)
        checkpoint.prune(self.directory, self.prefix, self.rank, self.keep, spare)

    def save(self, at: Position) -> CheckpointInfo:
        """Check the replicas agree, write this rank's checkpoint atomically, then prune old ones."""
        from msdist.rank.distributed import check_replicas_identical
        check_replicas_identical(self.collectives, self.net, f"at epoch {at.epoch} step {at.step}")
        self.newest = checkpoint.save([{"name": p.name, "data": p} for p in self.params], self.directory,
                                      self.prefix, self.rank, self.state(at), self.meta)
        self._share_with_rank0(self.newest.path)
        self.prune()
        _logger.info("saved %s", self.newest.path)
        return self.newest

    def keep_best(self, at: Position, accuracy: float) -> bool:
        """After an evaluation at `at`: make the model this rank's `_best` checkpoint if `accuracy` is a new best.

        Decided by position, with no hash of the weights: the Trainer makes the ranks one model once per epoch
        end, before both the save and the evaluation, and nothing changes the model between them. So a model
        evaluated at the position of this Saver's newest save is that file, and the best becomes a link to it.
        """
        saved = self.newest.path if self.newest is not None and self.newest.position == at else None
        better = self.best.offer([{"name": p.name, "data": p} for p in self.net.get_parameters()], self.state(at),
                                 accuracy, self.meta, saved=saved)
        self._share_with_rank0(self.best.path if better else None)
        if better:
            _logger.info("best accuracy so far (%.4f at epoch %d): saved %s", accuracy, at.epoch, self.best.path)
        return better

    def save_tagged(self, tag: str, params: List[dict], at: Position) -> str:
        """Write `params` as this rank's `{prefix}_rank{r}_{tag}.ckpt` (e.g. the EMA weights); return its path."""
        path = checkpoint.tagged_path(self.directory, self.prefix, self.rank, tag)
        checkpoint.save_as(params, path, self.state(at), self.meta)
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
        loaded = checkpoint.load(path, checkpoint.shapes_of(self.params), optional_prefixes=(residual,),
                                  resume=True)
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
        return CheckpointInfo(path, checkpoint.position_of(state), str(state.get("config_hash", "")))


def _zeros_like(param):
    """A tensor of zeros with `param`'s shape and dtype."""
    import mindspore as ms
    import numpy as np
    return ms.Tensor(np.zeros(param.shape, dtype=ms.dtype_to_nptype(param.dtype)))
