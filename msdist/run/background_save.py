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

A write that fails (a full disk, a quota, permissions) is recorded (`failure`) and named by every rank
together: its row of numbers (`failure_row`: the save's global step, the errno, the room left) travels in the
stop check the loop already runs about once a second (rank/preempt_stop.py), and in the one gather that
follows every wait at a save, an evaluation and the end (the Trainer's `_settle_writes`). Then every rank
raises the same one line (`failure_error`: the failing ranks, each with its file, error and room left) and
exits with a failure status. A rank whose write failed thus never leaves the others waiting in a
collective it no longer joins (MindSpore's lost-peer error, minutes later, naming nothing).

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
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from msdist.base.errors import CheckpointError, first_line
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


@dataclass(frozen=True)
class WriteFailure:
    """A failed background write as every rank can name it: from the failing rank's own error, or from the row of
    numbers it shared (`row`; its file follows from the step, its error text from the errno)."""
    rank: int
    global_step: int
    path: str
    errno: int          # 0: not an OSError; its text is then in the failing rank's own log only
    free: float         # MiB left where it was written (checkpoint.free_mib), -1 unknown
    error: str

    def row(self) -> tuple:
        return float(self.global_step), float(self.errno), self.free

    def line(self) -> str:
        return f"rank {self.rank}: background save of global step {self.global_step}: " \
               f"{checkpoint.write_failure(self.path, self.error, self.free)}"


NO_FAILURE = (0.0, 0.0, 0.0)   # a failure_row: no save happens at global step 0


def _errno_text(errno: int) -> str:
    """An OSError's text without its file name, alike on every rank (the file is named beside it)."""
    return f"[Errno {errno}] {os.strerror(errno)}"


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
        self.failure: Optional[WriteFailure] = None     # set by the writer thread; the run stops once it is
        self._crash: Optional[BaseException] = None     # not a failed write: a fault of msdist's, raised at once

    def save(self, at: Position) -> float:
        """Copy the state at `at` and hand it to the writer thread. Returns the seconds the loop waited."""
        began = time.perf_counter()
        self.wait()
        distributed.check_replicas_identical(self.collectives, self.saver.net, f"at global step {at.global_step}")
        if self.failure is not None:
            return time.perf_counter() - began   # the ranks are about to stop and name it: no second write
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
            errno = getattr(e, "errno", None) or 0
            error = _errno_text(errno) if errno else first_line(str(e)) or type(e).__name__
            self.failure = WriteFailure(saver.rank, at.global_step, path, errno, checkpoint.free_mib(saver.directory),
                                        error)
            _logger.info("the background save of global step %d failed; every rank names it at the next stop check",
                         at.global_step)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread by raise_crash()
            self._crash = e

    def failure_row(self) -> tuple:
        """This rank's share of the gather that names failed writes: `WriteFailure.row`, or NO_FAILURE."""
        return self.failure.row() if self.failure is not None else NO_FAILURE

    def failure_error(self, rows: Sequence[Sequence[float]], stop_step: int,
                      steps_per_epoch: int) -> CheckpointError:
        """The one line every rank raises once the gathered `rows` (rank r's `failure_row` in row r) name failed
        writes: each failing rank's file, error and room left, and the global step the ranks stopped at."""
        named = [self._failure_of(rank, row, steps_per_epoch) for rank, row in enumerate(rows)
                 if tuple(row) != NO_FAILURE]
        ranks = ", ".join(str(f.rank) for f in named)
        return CheckpointError(f"background save failed on rank(s) {ranks}; every rank stopped at global step "
                               f"{stop_step}: " + "; ".join(f.line() for f in named))

    def _failure_of(self, rank: int, row: Sequence[float], steps_per_epoch: int) -> WriteFailure:
        if rank == self.saver.rank and self.failure is not None:
            return self.failure
        global_step, errno, free = int(row[0]), int(row[1]), float(row[2])
        at = Position.at(global_step, steps_per_epoch)
        path = os.path.join(self.saver.directory, checkpoint.file_name(self.saver.prefix, rank, at.epoch, at.step))
        error = _errno_text(errno) if errno else f"the error is in rank {rank}'s log"
        return WriteFailure(rank, global_step, path, errno, free, error)

    def raise_crash(self) -> None:
        """Raise, on the main thread, what the writer raised besides a failed write (a fault of msdist's)."""
        if self._crash is not None:
            crash, self._crash = self._crash, None
            raise crash

    def wait(self) -> None:
        """Until the write in flight (if any) is over. A failed write is left in `failure` (named by every rank
        together: the Trainer's `_settle_writes`); anything else the writer raised is raised here.
        """
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        self.raise_crash()
        if self.failure is None:
            self.saver.newest = self._written
