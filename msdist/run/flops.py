"""Achieved FLOP/s: the model's training FLOPs per image, counted from its layers, times the run's img/s.

The convention (Kaplan et al. 2020, Megatron-LM's and nanoGPT's MFU): a multiply-add is 2 FLOPs, and one
training step costs 3 forward passes (forward, plus a backward of about twice the forward: the gradients
of the activations and of the weights). Only Conv2d and Dense layers are counted; BatchNorm, ReLU, pooling
and the residual additions are well under 1% of a ResNet's work. torchvision's "GFLOPS" column counts the
same forward multiply-adds (ResNet-18 1.81, ResNet-50 4.09 at 224 px), so training FLOPs per image are
6 x that figure.

The count walks the network's cells in their order, carrying the feature map's height and width: no
forward pass runs (one in PyNative costs seconds on a CPU, `network_cost.layer_multiply_adds`, which
tests/unit/run/test_flops.py checks this walk against). A cell with a `downsample` child is a residual block:
the shortcut sees the block's input.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

from msdist.engine import precision
from msdist.run import peak

FLOPS_PER_MULTIPLY_ADD = 2
PASSES_PER_TRAINING_STEP = 3      # forward + backward (~2 x forward)
CONVENTION = "training FLOPs = 3 x forward (forward + backward) x 2 FLOPs per multiply-add of every Conv2d and Dense"


def _pair(value) -> Tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[-1]))


def _window_out(size: int, kernel: int, stride: int, dilation: int, pad_mode: str, before: int, after: int) -> int:
    """One spatial side after a convolution or pooling window (MindSpore's pad modes)."""
    if pad_mode == "same":
        return -(-size // stride)
    span = dilation * (kernel - 1) + 1
    padded = size + (before + after if pad_mode == "pad" else 0)
    return (padded - span) // stride + 1


def _conv_padding(cell) -> Tuple[int, int, int, int]:
    """(top, bottom, left, right) of a Conv2d's `padding` (an int or a 4-tuple)."""
    padding = cell.padding
    return (padding,) * 4 if isinstance(padding, int) else tuple(int(p) for p in padding)


def _conv(cell, hw: Tuple[int, int]) -> Tuple[int, Tuple[int, int]]:
    (kh, kw), (sh, sw), (dh, dw) = _pair(cell.kernel_size), _pair(cell.stride), _pair(cell.dilation)
    top, bottom, left, right = _conv_padding(cell)
    mode = cell.pad_mode.lower()
    out = (_window_out(hw[0], kh, sh, dh, mode, top, bottom), _window_out(hw[1], kw, sw, dw, mode, left, right))
    weights = 1
    for dim in cell.weight.shape:
        weights *= int(dim)
    return weights * out[0] * out[1], out


def _pool(cell, hw: Tuple[int, int]) -> Tuple[int, int]:
    (kh, kw), (sh, sw) = _pair(cell.kernel_size), _pair(cell.stride)
    mode = cell.pad_mode.lower()
    return _window_out(hw[0], kh, sh, 1, mode, 0, 0), _window_out(hw[1], kw, sw, 1, mode, 0, 0)


def _walk(cell, hw: Tuple[int, int]) -> Tuple[int, Tuple[int, int]]:
    """(multiply-adds, output height and width) of `cell` on one image of `hw`."""
    from mindspore import nn
    if isinstance(cell, nn.Conv2d):
        return _conv(cell, hw)
    if isinstance(cell, nn.Dense):
        return int(cell.in_channels) * int(cell.out_channels), hw
    if isinstance(cell, (nn.MaxPool2d, nn.AvgPool2d)):
        return 0, _pool(cell, hw)
    if isinstance(cell, nn.Pad):
        (top, bottom), (left, right) = cell.paddings[-2], cell.paddings[-1]
        return 0, (hw[0] + top + bottom, hw[1] + left + right)
    shortcut = getattr(cell, "downsample", None)
    total, out = 0, hw
    for child in cell.name_cells().values():
        if child is not shortcut:
            macs, out = _walk(child, out)
            total += macs
    if isinstance(shortcut, nn.Cell):
        total += _walk(shortcut, hw)[0]
    return total, out


def forward_multiply_adds(net, image_size: int) -> int:
    """Multiply-adds of one forward pass of one `image_size` x `image_size` image (Conv2d and Dense layers)."""
    return _walk(net, (image_size, image_size))[0]


def training_flops_per_image(net, image_size: int) -> float:
    """FLOPs one training image costs: `CONVENTION`."""
    return float(forward_multiply_adds(net, image_size) * FLOPS_PER_MULTIPLY_ADD * PASSES_PER_TRAINING_STEP)


@dataclass(frozen=True)
class FlopRate:
    """What the step line and result.json say about FLOP/s, from the job's img/s.

    Attributes:
        flops_per_image: training FLOPs per image (`training_flops_per_image`).
        world_size: devices in the job.
        device_peak: one device's peak FLOP/s (`peak.device_peak`), None where unknown.
    """
    flops_per_image: float
    world_size: int
    device_peak: Optional[float] = None

    def job(self, images_per_sec: float) -> float:
        return self.flops_per_image * images_per_sec

    def per_device(self, images_per_sec: float) -> float:
        return self.job(images_per_sec) / self.world_size

    def utilisation(self, images_per_sec: float) -> Optional[float]:
        return self.per_device(images_per_sec) / self.device_peak if self.device_peak else None

    def step_line(self, images_per_sec: float) -> str:
        """`0.012 TFLOP/s/device, 0.024 job, 3.1% of peak` (the peak part only where it is known)."""
        used = self.utilisation(images_per_sec)
        peak = f", {100 * used:.1f}% of peak" if used is not None else ""
        return (f"{self.per_device(images_per_sec) / 1e12:.3g} TFLOP/s/device, "
                f"{self.job(images_per_sec) / 1e12:.3g} job{peak}")

    def fields(self, images_per_sec: float) -> dict:
        """The step record's and result.json's fields."""
        used = self.utilisation(images_per_sec)
        out = {"train_gflops_per_image": round(self.flops_per_image / 1e9, 4),
               "tflops_per_device": round(self.per_device(images_per_sec) / 1e12, 5),
               "tflops_job": round(self.job(images_per_sec) / 1e12, 5)}
        if used is not None:
            out.update(device_peak_tflops=round(self.device_peak / 1e12, 4), flops_utilisation=round(used, 5))
        return out


def rate_of(net, image_size: int, dist, amp_level: str, threads_per_rank: int) -> FlopRate:
    """The run's FlopRate: `net`'s training FLOPs per image at `image_size`, over `dist.world_size` devices of
    `dist.device_target` (amp `amp_level` as given: "auto" is O2 on GPU), with the device's peak where known."""
    amp = precision.resolve_amp_level(amp_level, dist.device_target)
    return FlopRate(training_flops_per_image(net, image_size), dist.world_size,
                    peak.device_peak(dist.device_target, amp, threads_per_rank))
