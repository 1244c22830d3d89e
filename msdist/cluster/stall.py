"""The one stall policy: how long a rank may go without progress, or without a sign of life, before the
job counts as stuck. msdist.launch's supervisor and the watchdog inside the ranks (mpirun, msrun, srun)
obey the same `StallPolicy`, built from the same option family, which msdist.train and msdist.launch
both accept (docs/launch.md, "Stall options"):

* `--stall_timeout`: no progress: a rank in one phase longer than its limit (which scales per phase);
* `--stall_startup_timeout`: no heartbeat before a rank's first training step (cluster init and the
  compiler may hold the Python lock and silence the heartbeat thread);
* `--stall_silence_timeout`: no heartbeat after it, or at any time from a stopped process;
* `--stall_register_timeout`: a rank not registered with MindSpore's scheduler this long after all the
  others have (read from the scheduler's log: msdist.cluster.registration).

A new kind of wait is one `KNOBS` row and one `StallPolicy` field of the same name (the options, their
checks, the launcher and the watchdog follow from them).
"""
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

from msdist.base.errors import ConfigError
from msdist.cluster.phases import Phase

AUTO_FLOOR_S = 300.0         # --stall_timeout auto: at least this...
AUTO_STEP_MULTIPLE = 10.0    # ...and at least this many median steps
# Phases with no duration of their own to scale from get this many stall timeouts, and at least the
# --stall_startup_timeout default: start-up holds cluster init and the data check (rank 0 decodes
# every image once), compile is minutes for big graphs, and both can hold the Python lock and silence
# the heartbeat thread (50 s seen on a 2-core machine at load 20).
UNMEASURED_MULTIPLE = 6.0
UNMEASURED_FLOOR_S = 600.0
# The train loop's own phases: a rank's first steps (and its first stop check) wait for the ranks still compiling.
LOOP_PHASES = (Phase.DATA_WAIT, Phase.TRAIN_STEP, Phase.STOP_CHECK, Phase.EPOCH_END)
EXPECTED_MULTIPLE = 3.0      # evaluation, saving, the first steps: the timeout plus 3x what they should take


def _progress_timeout(text) -> Optional[float]:
    """`--stall_timeout`: `auto` -> None, `0` (off) or seconds > 0."""
    value = str(text).strip().lower()
    if value == "auto":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(f"--stall_timeout {text!r} must be auto, 0 (off) or seconds > 0")
    return seconds


def _seconds(name: str) -> Callable[[Any], float]:
    def parse(value) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ConfigError(f"--{name} {value} must be a number of seconds > 0")
        return seconds
    return parse


@dataclass(frozen=True)
class Knob:
    """One option of the family: its name (also the `StallPolicy` field), type as written, default, help and
    the parser that checks it and gives the policy's value."""
    name: str
    type: type
    default: Any
    help: str
    parse: Callable[[Any], Any]
    renamed_from: str = ""   # its name before the family existed (#31): still accepted, with a notice


KNOBS = (
    Knob("stall_timeout", str, "auto", "end the job when a rank makes no progress for this many seconds (stuck "
         "in a collective, a dead read, a deadlock): auto = max(300, 10x the median step time); compile, "
         "evaluation and checkpoint saves get allowances scaled from their own duration; 0 = off (docs/launch.md)",
         _progress_timeout),
    Knob("stall_startup_timeout", float, 600.0, "end the job when a rank writes no heartbeat for this many "
         "seconds before its first training step (cluster init and compile may hold the Python lock)",
         _seconds("stall_startup_timeout"), renamed_from="startup_timeout"),
    Knob("stall_silence_timeout", float, 120.0, "end the job when a rank writes no heartbeat for this many "
         "seconds after its first training step, or at any time when its process is stopped (SIGSTOP)",
         _seconds("stall_silence_timeout"), renamed_from="heartbeat_timeout"),
    Knob("stall_register_timeout", float, 30.0, "name a rank that has not registered with MindSpore's scheduler "
         "this many seconds after all the others have (msdist.launch respawns it; mpirun and msrun end the job "
         "with exit status 42)", _seconds("stall_register_timeout")),
)
RENAMED = {k.renamed_from: k.name for k in KNOBS if k.renamed_from}


@dataclass(frozen=True)
class StallPolicy:
    """How long a rank may go without progress or without a heartbeat; field names are the options' (`KNOBS`
    holds their defaults: `from_options({})`).

    `stall_timeout` None is `auto`: max(300 s, 10x the median step time); 0 turns the progress watch off.
    """
    stall_timeout: Optional[float]
    stall_startup_timeout: float
    stall_silence_timeout: float
    stall_register_timeout: float

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "StallPolicy":
        """From option values by name (a parsed config's); options not given keep their defaults."""
        return cls(**{k.name: k.parse(values.get(k.name, k.default)) for k in KNOBS})

    @property
    def watches_progress(self) -> bool:
        return self.stall_timeout != 0

    def base(self, median_step_s: Optional[float]) -> float:
        if self.stall_timeout is not None:
            return self.stall_timeout
        return max(AUTO_FLOOR_S, AUTO_STEP_MULTIPLE * (median_step_s or 0.0))

    def limit(self, phase: Phase, *, median_step_s: Optional[float], warm: bool, expected_s: float,
              measured_s: float, compile_s: float) -> Optional[float]:
        """Seconds this rank may stay in `phase`; None when the progress watch is off.

        Args:
            median_step_s: the rank's median step time, None before two steps.
            warm: whether this process has completed its first few steps (msdist.cluster.heartbeat.WARMUP_STEPS).
            expected_s: what this phase should take (evaluation: its batches at the step time; a save:
                its bytes at a slow disk's rate), 0 when unknown.
            measured_s: the longest this phase took before in this process.
            compile_s: how long the train step took to compile here.
        """
        if not self.watches_progress:
            return None
        base = self.base(median_step_s)
        if phase in (Phase.START_UP, Phase.COMPILE):
            return max(base * UNMEASURED_MULTIPLE, UNMEASURED_FLOOR_S)
        if phase in LOOP_PHASES and not warm:
            return base + EXPECTED_MULTIPLE * compile_s
        if phase in (Phase.EVALUATION, Phase.CHECKPOINT_SAVE):
            return base + EXPECTED_MULTIPLE * max(expected_s, measured_s)
        return base

    def silence_limit(self, beat: Optional[dict], stopped: bool) -> Tuple[float, str]:
        """How long a rank whose last heartbeat is `beat` (None: none yet) may stay silent, and the option
        that says so.

        Before the first training step MindSpore's cluster init and compiler may hold the Python lock and
        silence the heartbeat thread (measured: ~8 s on a busy 2-core machine), hence the longer start-up
        limit. A stopped process is not compiling, so it gets the training limit at any time.
        """
        if stopped or (beat is not None and beat.get("epoch", 0) > 0):
            return self.stall_silence_timeout, "--stall_silence_timeout"
        return self.stall_startup_timeout, "--stall_startup_timeout"
