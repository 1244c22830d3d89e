"""Mixed-precision decisions: which amp level and which loss scale a run uses (no MindSpore here).

Pure functions, so config validation can use them before MindSpore loads and tests can check every
device/option combination without a GPU.

- `--amp_level auto` (the default) is O2 on GPU (float16 everywhere except BatchNorm, the level
  MindCV trains ResNets at on GPU) and O0 on CPU: MindSpore's CPU convolutions have float32 kernels
  only, so low precision there adds casts and costs accuracy (docs/performance.md).
- `--loss_scale auto` (the default) is `dynamic` whenever float16 values carry gradients (amp O2/O3
  in float16, or `--grad_compression fp16`) and no scaling (a fixed 1) otherwise: float32 and
  bfloat16 gradients do not underflow. `dynamic` follows `nn.DynamicLossScaleUpdateCell`; a number
  is a fixed scale.
- A fixed scale is checked for overflow every step only where float16 carries gradients: float32
  gradients scaled by any power of two come back exact, so there the check would cost a pass over
  every gradient and a collective per step for nothing (`LossScalePlan.checked`). Such runs, and every
  other, still stop on an inf or NaN at the log steps (`loss_scale.check_finite`).
"""
import difflib
import logging
import math
from dataclasses import dataclass
from typing import Union

from msdist.base.errors import ConfigError

_logger = logging.getLogger(__name__)

AMP_LEVELS = ("auto", "O0", "O2", "O3")
LOSS_SCALE_MODES = ("auto", "dynamic")
# Dynamic loss scaling, as MindSpore's nn.DynamicLossScaleUpdateCell / DynamicLossScaleManager: halve
# on overflow (never below 1), double after SCALE_WINDOW steps in a row without one.
DYNAMIC_INITIAL_SCALE = 2.0 ** 16
SCALE_FACTOR = 2.0
SCALE_WINDOW = 1000


def resolve_amp_level(amp_level: str, device_target: str) -> str:
    """The amp level a run uses: `auto` is O2 on GPU and O0 elsewhere; an explicit level is kept.

    Args:
        amp_level: one of AMP_LEVELS.
        device_target: the device the run uses ("CPU" or "GPU"), already resolved.
    """
    if amp_level != "auto":
        return amp_level
    return "O2" if device_target == "GPU" else "O0"


def bn_stats_precision(device_target: str) -> str:
    """The precision of SyncBatchNorm's statistics (`sync_bn.STATS_PRECISIONS`) on a device: float32 on GPU
    (float64 arithmetic there runs at 1/32-1/64 of float32's rate on consumer cards, and the casts triple the
    memory traffic), float64 on CPU (correctly rounded sums: the 1-vs-N equivalence's floor, docs/equivalence.md)."""
    return "float32" if device_target == "GPU" else "float64"


def warn_if_no_speedup(amp_level: str, device_target: str) -> None:
    """An explicit O2/O3 on CPU runs, but is slower and less accurate there: say so once, name `auto`."""
    if amp_level in ("O2", "O3") and device_target == "CPU":
        _logger.warning("amp_level %s brings no speed on CPU (MindSpore's CPU convolutions are float32-only, so "
                        "low precision only adds casts); use --amp_level auto (O0 on CPU, O2 on GPU)", amp_level)


def parse_loss_scale(text: Union[str, float]) -> Union[str, float]:
    """`--loss_scale` from the command line or YAML: a mode name (lower case) or a fixed number."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return str(text).strip().lower()


def check_loss_scale(value: Union[str, float]) -> None:
    """Raise ConfigError for an unknown mode (with a did-you-mean) or a fixed scale that is not > 0."""
    if isinstance(value, str):
        if value not in LOSS_SCALE_MODES:
            close = difflib.get_close_matches(value, LOSS_SCALE_MODES, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"--loss_scale {value!r} is not one of {', '.join(LOSS_SCALE_MODES)} or a number > 0"
                              f"{hint}")
    elif not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--loss_scale {value} must be a finite number > 0, auto or dynamic")


@dataclass(frozen=True)
class LossScalePlan:
    dynamic: bool         # adjust the scale (skipping steps whose gradients overflow)
    initial: float        # the scale at the start (a fixed scale: the scale)
    checked: bool = True  # check the gradients for inf/NaN every step (dynamic, or float16 gradients)

    def describe(self) -> str:
        """For the start-up line: the scale, and whether each step pays for an overflow check."""
        if self.dynamic:
            return f"dynamic from {self.initial:g}"
        if self.checked:
            return f"fixed {self.initial:g}, overflow checked every step (float16 gradients)"
        return (f"fixed {self.initial:g}, no per-step overflow check (float32 gradients: the scale cannot change "
                "them); inf/NaN caught at log steps")


def loss_scale_plan(loss_scale: Union[str, float], amp_level: str, amp_dtype: str,
                    grad_compression: str) -> LossScalePlan:
    """How the loss is scaled, from `--loss_scale` and the resolved amp level.

    Args:
        loss_scale: "auto", "dynamic" or a fixed number (`parse_loss_scale`).
        amp_level: the resolved amp level (`resolve_amp_level`), O0/O2/O3.
        amp_dtype: float16 or bfloat16.
        grad_compression: an fp16 exchange carries gradients in float16 even at O0.
    """
    check_loss_scale(loss_scale)
    float16_grads = (amp_level != "O0" and amp_dtype == "float16") or grad_compression == "fp16"
    if loss_scale == "dynamic" or (loss_scale == "auto" and float16_grads):
        return LossScalePlan(True, DYNAMIC_INITIAL_SCALE)
    fixed = 1.0 if loss_scale == "auto" else float(loss_scale)
    return LossScalePlan(False, fixed, checked=float16_grads)
