"""This rank's heartbeat: its progress file (the format: msdist.cluster.heartbeat), written from a daemon
thread, and this rank's Python stacks on demand.

The training loop reports with `enter(phase)` and `step_done(...)`: attribute writes (and one file write per
epoch), no host sync. The thread keeps writing while the main thread is stuck, so a stuck rank shows up as a
phase that does not end, not as silence.
"""
import collections
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Dict, Optional

from msdist.base.files import atomic_write_text
from msdist.cluster.heartbeat import DEFAULT_INTERVAL_S, STACK_DUMP_SIGNAL, WARMUP_STEPS, path_for, state_letter
from msdist.cluster.phases import Phase
from msdist.cluster.stall import StallPolicy

SLOW_DISK_BYTES_PER_S = 10e6  # a checkpoint save is expected to take its size at this rate
_STEP_WINDOW = 101           # steps the median step time is taken over
# Collectives.gather: its name and file (this package's distributed.py), looked for on the loop's stack.
_COLLECTIVE = ("gather", os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed.py"))


def _in_collective(frame) -> bool:
    """Whether a thread whose innermost frame is `frame` is inside msdist's host-side collective."""
    while frame is not None:
        if frame.f_code.co_name == _COLLECTIVE[0] and os.path.abspath(frame.f_code.co_filename) == _COLLECTIVE[1]:
            return True
        frame = frame.f_back
    return False


class Heartbeat:
    """Writes this rank's heartbeat file from a daemon thread until the process ends.

    Args:
        log_dir: the run's log directory (`{output_dir}/logs`).
        rank: global rank of this process.
        policy: the stall limits (msdist.cluster.stall).
        interval_s: seconds between writes.
    """

    def __init__(self, log_dir: str, rank: int, policy: StallPolicy, interval_s: float = DEFAULT_INTERVAL_S):
        self.path = path_for(log_dir, rank)
        self.rank = rank
        self.policy = policy
        self.interval_s = interval_s
        self._host = socket.gethostname()
        self._loop_thread = threading.get_ident()   # the training loop's (created where it runs)
        self._loop_tid = threading.get_native_id()
        # Written by the loop, read by the thread. Each is replaced whole (one reference assignment), so
        # the thread never sees half an update and the loop never waits for a lock.
        self._position = (0, 0, 0)                          # epoch (1-based), step in epoch, global step
        self._phase = (Phase.START_UP, time.time(), 0.0, 0)  # name, began (time.time), eval batches, save bytes
        self._measured: Dict[Phase, float] = {}              # phase -> its longest duration so far
        self._step_gaps: collections.deque = collections.deque(maxlen=_STEP_WINDOW)
        self._last_step_at: Optional[float] = None
        self._lock = threading.Lock()  # the writes of start() and the thread go through one tmp file
        self._thread = threading.Thread(target=self._run, name="msdist-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def enter(self, phase: Phase, *, batches: int = 0, nbytes: int = 0) -> None:
        """The main thread begins `phase` (see the module docstring for the names).

        Args:
            batches: evaluation: the batches this rank will run (its allowance scales with them).
            nbytes: checkpoint save: the bytes this rank will write.
        """
        now = time.time()
        name, began = self._phase[:2]
        if now - began > self._measured.get(name, 0.0):
            self._measured[name] = now - began
        self._phase = (phase, now, batches, nbytes)

    def step_done(self, epoch: int, step: int, global_step: int) -> None:
        """An optimizer step finished: 1-based `epoch`, `step` within it, `global_step` in all.

        The first step of an epoch is written at once (one small file per epoch), so that readers (the
        launcher's report, tests that aim a fault at an epoch) see that moment exactly.
        """
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_gaps.append(now - self._last_step_at)
        self._last_step_at = now
        new_epoch = epoch != self._position[0]
        self._position = (epoch, step, global_step)
        if new_epoch:
            self._write()

    def median_step_s(self) -> Optional[float]:
        gaps = list(self._step_gaps)
        return statistics.median(gaps) if gaps else None

    def snapshot(self) -> dict:
        """The heartbeat as it would be written now."""
        now = time.time()
        (epoch, step, global_step), (phase, began, batches, nbytes) = self._position, self._phase
        median = self.median_step_s()
        expected = batches * (median or 0.0) + (self._measured.get(Phase.COMPILE, 0.0) if batches else 0.0) + \
            nbytes / SLOW_DISK_BYTES_PER_S
        limit = self.policy.limit(phase, median_step_s=median, warm=len(self._step_gaps) >= WARMUP_STEPS - 1,
                                  expected_s=expected, measured_s=self._measured.get(phase, 0.0),
                                  compile_s=self._measured.get(Phase.COMPILE, 0.0))
        return {"time": now, "pid": os.getpid(), "rank": self.rank, "host": self._host, "epoch": epoch, "step": step,
                "global_step": global_step, "phase": phase, "phase_s": round(now - began, 3),
                "in_collective": _in_collective(sys._current_frames().get(self._loop_thread)),  # noqa: SLF001
                "loop_state": state_letter(f"/proc/self/task/{self._loop_tid}/stat"), "loop_tid": self._loop_tid,
                "limit_s": None if limit is None else round(limit, 1),
                "median_step_s": None if median is None else round(median, 4)}

    def _write(self) -> None:
        with self._lock:
            try:  # readers never see a half-written file
                atomic_write_text(self.path, json.dumps(self.snapshot()))
            except OSError:  # a full or vanished disk must not kill training; readers see silence
                pass

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self._write()


def dump_stacks(log_path: str, why: str) -> None:
    """Append every thread's Python stack of this process to its log (faulthandler: no lock taken, so it
    works while the main thread is stuck anywhere)."""
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"--- msdist: {why}; Python stacks of every thread (most recent call first) ---\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)


def dump_stacks_on_signal(log_path: str) -> None:
    """Let a supervisor ask for this process's stacks: STACK_DUMP_SIGNAL appends every thread's to `log_path`.

    faulthandler answers the signal in C, from whichever thread can take it, so a rank whose main
    thread is stuck (or holds the Python lock) still answers; it keeps the file open for that.
    """
    faulthandler.register(STACK_DUMP_SIGNAL, file=open(log_path, "a", encoding="utf-8"),  # noqa: SIM115
                          all_threads=True)
