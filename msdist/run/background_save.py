"""Saves by steps (`--save_every_steps N`), written in the background.

The training loop waits only for an in-memory copy of the state (`host_copy`). One background thread
writes it: the .ckpt to a hidden temporary, fsync, rename, then the sidecar with its sha256 (the same
`checkpoint.save` as every checkpoint), then prunes to `keep_checkpoint_max`, which counts every kept
checkpoint whatever saved it. At most one write is in flight: the next save, and every other save,
evaluation or exit, first waits for it (`wait`). A rank killed during a write leaves a hidden temporary
(removed at its next start) and no sidecar, so the previous checkpoint stays the newest good one.

The ranks' writes end at different moments, so pruning keeps the newest checkpoint complete on every rank
until a newer one is (`Saver.prune`): a rank whose write is done never deletes the checkpoint a resume
needs while another rank's newer write is still in flight, whatever `keep_checkpoint_max`.

A write that fails (a full disk, a quota, permissions) is named by the loop after the step during which it
failed (`raise_failure`, a flag read, no collective): one line with the rank, the file, the error and the
room left, and the run stops with a failure status.

The thread runs no collective. Collectives must be called by every rank in the same order from one
thread, and the background thread's timing differs per rank; the replica check that precedes every
save runs on the main thread, before the copy. So a background save is not hard-linked to rank 0's
file (`Saver._share_with_rank0` is a collective): each rank keeps its own file.

A save by steps is off schedule: it changes nothing (no `--dist_bn` unify, no EMA sync), so a run
resumed from it continues the uninterrupted run exactly.
"""
import logging
import os
import threading
import time
from typing import List, Optional

import numpy as np

from msdist.base.errors import CheckpointError
from msdist.rank import distributed
from msdist.run import checkpoint
from msdist.run.checkpoint_saver import Saver
from msdist.run.position import Position

_logger = logging.getLogger(__name__)


def host_copy(params) -> List[dict]:
    """`[{'name', 'data'}]` with every Parameter's value copied to host memory, owned by the copy: training
    goes on updating the Parameters in place while the copy is written."""
    import mindspore as ms
    return [{"name": p.name, "data": ms.Tensor(np.array(p.asnumpy(), copy=True))} for p in params]


class BackgroundSaver:
    """The one background writer of a run's saves by steps.

    Args:
        saver: the run's `checkpoint_saver.Saver` (where files go, what they hold); its `newest` is updated on the
            main thread once a background write has completed.
        collectives: for the replica check before each copy (main thread).
    """

    def __init__(self, saver: Saver, collectives):
        self.saver, self.collectives = saver, collectives
        self._thread: Optional[threading.Thread] = None
        self._written: Optional[checkpoint.CheckpointInfo] = None
        self._error: Optional[BaseException] = None

    def save(self, at: Position) -> float:
        """Copy the state at `at` and hand it to the writer thread. Returns the seconds the loop waited."""
        began = time.perf_counter()
        self.wait()
        distributed.check_replicas_identical(self.collectives, self.saver.net, f"at global step {at.global_step}")
        params = host_copy(self.saver.params)
        self._thread = threading.Thread(target=self._write, args=(params, at), name="msdist-checkpoint-writer",
                                        daemon=True)
        self._thread.start()
        return time.perf_counter() - began

    def _write(self, params: List[dict], at: Position) -> None:
        began, saver = time.perf_counter(), self.saver
        try:
            self._written = checkpoint.save(params, saver.directory, saver.prefix, saver.rank, saver.state(at),
                                            saver.meta)
            saver.prune()
            _logger.info("saved %s in the background in %.2f s", self._written.path, time.perf_counter() - began)
        except (OSError, RuntimeError) as e:  # a failed write (MindSpore raises RuntimeError for some); a user's to fix
            path = os.path.join(saver.directory, checkpoint.file_name(saver.prefix, saver.rank, at.epoch, at.step))
            self._error = CheckpointError(f"rank {saver.rank}: background save of global step {at.global_step}: "
                                          f"{checkpoint.write_failure(path, e)}")
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread by raise_failure()
            self._error = e

    def raise_failure(self) -> None:
        """Raise, on the main thread, the failure of the write in flight, if it has failed. After every step.

        Raises:
            CheckpointError: the write failed (rank, path, error, free space); other exceptions as the write raised.
        """
        if self._error is not None:
            self._thread.join()
            self._thread = None
            error, self._error = self._error, None
            raise error

    def wait(self) -> None:
        """Until the write in flight (if any) is complete; its failure is raised here, on the main thread.

        Raises:
            Exception: whatever the write raised (a full disk, a vanished directory).
        """
        if self._thread is None:
            return
        self._thread.join()
        self.raise_failure()
        self._thread = None
        self.saver.newest = self._written
