"""`--profile_steps A:B` on `--profile_ranks`: MindSpore's own profiler for a window of global steps.

MindSpore 2.10's `mindspore.profiler.profile` (mindspore/profiler/profiler.py, class Profile at line 700;
`Profiler` is its deprecated twin) is made with `start_profile=False` and a schedule of one active span as long as the
window (`schedule(wait=0, warmup=0, active=B-A+1, repeat=1)`): `start()` before step A, `step()` after each
step of the window; the schedule's last `step()` stops collection and runs `tensorboard_trace_handler`,
which analyses the data into `output_dir/profile/rank_R/<host>_<pid>_<time>_ascend_ms/`:
`ASCEND_PROFILER_OUTPUT/trace_view.json` (a Chrome trace: chrome://tracing or ui.perfetto.dev) and, on CPU,
`FRAMEWORK/cpu_op_detail_info_0.csv` (each kernel's occurrences and time); MindStudio Insight opens the folder.
Nothing of the profiler is imported or made outside the window's ranks, and nothing runs outside its steps.

On GPU, MindSpore traces device kernels (and NCCL's, the communication) with CUPTI only when the profile's
activities hold GPU (platform/gpu_profiler.py, GpuProfiler.start: `if ProfilerActivity.GPU in ...activities:
self._profiler.enable_op_time()`, lines 53-54), and its plugin dlopens `libcupti.so` for that
(lib/plugin/libmindspore_gpu.so: ccsrc/plugin/gpu/profiler/cupti_interface.cc, "Please check whether configured
the path of CUPTI to LD_LIBRARY_PATH"). So without a libcupti.so the dynamic linker finds, the window profiles
the host side only and says so (`activities`).
"""
import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from msdist.base.errors import ConfigError
from msdist.rank import gpu_plugin

_logger = logging.getLogger(__name__)
PROFILE_DIR = "profile"
CUPTI = "libcupti.so"


def parse_steps(text: str) -> Optional[Tuple[int, int]]:
    """`--profile_steps`: "A:B" -> (A, B), global steps 1 <= A <= B; "" -> None (off).

    Raises:
        ConfigError: anything else.
    """
    if not str(text).strip():
        return None
    first, _, last = str(text).partition(":")
    if first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ConfigError(f"--profile_steps {text!r} must be A:B, global steps with 1 <= A <= B (e.g. 20:25; step 1 "
                      f"includes graph compilation), or empty for no profiling")


def parse_ranks(text: str) -> Optional[Tuple[int, ...]]:
    """`--profile_ranks`: "0,3" -> (0, 3); "all" -> None (every rank).

    Raises:
        ConfigError: not `all` nor comma-separated ranks >= 0.
    """
    if str(text).strip().lower() == "all":
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--profile_ranks {text!r} must be comma-separated ranks (e.g. 0 or 0,3) or all")
    return tuple(sorted({int(p) for p in parts}))


@dataclass(frozen=True)
class ProfileWindow:
    """The steps profiled (global steps `first` to `last`) and on which ranks (None = all)."""
    first: int
    last: int
    ranks: Optional[Tuple[int, ...]]

    def covers(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def activities(device_target: str, cupti: bool) -> Tuple[Tuple[str, ...], str]:
    """(MindSpore ProfilerActivity names to collect, a note for the log or ""): a pure decision.

    CPU: the host kernels (CPU). GPU with CUPTI: the host and the device's kernels, NCCL's among them (CPU,
    GPU). GPU without: the host side only, and a note naming the missing library.
    """
    if device_target != "GPU":
        return ("CPU",), ""
    if cupti:
        return ("CPU", "GPU"), ""
    return ("CPU",), (f"profiler: {CUPTI} is not where the dynamic linker looks, so device kernels and communication "
                      f"are not traced, only the host side; add CUDA's extras/CUPTI/lib64 to LD_LIBRARY_PATH")


class StepProfiler:
    """One rank's profiler window; `open` returns None where the window does not apply, so the loop's hooks read
    `if profiler is not None`."""

    def __init__(self, window: ProfileWindow, rank: int, device_target: str, output_dir: str):
        self.window, self.rank, self.device_target = window, rank, device_target
        self.directory = os.path.join(output_dir, PROFILE_DIR, f"rank_{rank}")
        self._profile = None

    @classmethod
    def open(cls, window: Optional[ProfileWindow], rank: int, device_target: str, output_dir: str,
             start_step: int) -> Optional["StepProfiler"]:
        """The window's profiler on the ranks it covers, unless the run starts past it (resumed); else None.
        Rank 0 says where every profiled rank will write, covered or not."""
        if window is None or start_step >= window.last:
            return None
        if rank == 0:
            ranks = "every rank" if window.ranks is None else "rank(s) " + ",".join(map(str, window.ranks))
            _logger.info("profiler: global steps %d-%d on %s, written under %s", window.first, window.last, ranks,
                         os.path.join(output_dir, PROFILE_DIR, "rank_R", ""))
        return cls(window, rank, device_target, output_dir) if window.covers(rank) else None

    def before_step(self, global_step: int) -> None:
        """Global step `global_step` is about to run: begin collecting at the window's first (or the first step a
        resumed run makes inside it)."""
        if self._profile is None and self.window.first <= global_step <= self.window.last:
            self._start(global_step)

    def after_step(self, global_step: int) -> None:
        """Step `global_step` was launched: count it; after the window's last, MindSpore analyses and writes."""
        if self._profile is None:
            return
        self._profile.step()
        if global_step >= self.window.last:
            self._profile.stop()
            self._profile = None
            _logger.info("profile of global steps %d-%d written to %s: open */ASCEND_PROFILER_OUTPUT/trace_view.json "
                         "in chrome://tracing or https://ui.perfetto.dev, or the folder in MindStudio Insight; "
                         "kernel totals in */FRAMEWORK/*op_detail_info*.csv", self.window.first, self.window.last,
                         self.directory)

    def close(self, global_step: int) -> None:
        """The run ended (its last step, a preemption) inside the window: write what was collected."""
        if self._profile is not None:
            self._profile.stop()   # MindSpore warns "Stop profiler while current state is RECORD...", and analyses
            self._profile = None
            _logger.info("profile of global steps %d-%d (the run ended inside the window) written to %s",
                         self.window.first, global_step, self.directory)

    def _start(self, global_step: int) -> None:
        from mindspore import profiler as ms_profiler
        names, note = activities(self.device_target, self.device_target == "GPU" and gpu_plugin.findable_here(CUPTI))
        if note:
            _logger.warning(note)
        steps = self.window.last - global_step + 1
        os.makedirs(self.directory, exist_ok=True)
        self._profile = ms_profiler.profile(
            activities=[getattr(ms_profiler.ProfilerActivity, name) for name in names], start_profile=False,
            schedule=ms_profiler.schedule(wait=0, warmup=0, active=steps, repeat=1),
            on_trace_ready=ms_profiler.tensorboard_trace_handler(dir_name=self.directory))
        self._profile.start()
        _logger.info("profiling global steps %d-%d on rank %d (%s) into %s", global_step, self.window.last, self.rank,
                     ", ".join(names), self.directory)
