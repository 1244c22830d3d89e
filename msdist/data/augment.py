"""Batch-level augmentation in NumPy, driven by the index plan's per-sample parameters.

MindSpore's C++ vision ops draw their own random numbers and take no per-row parameters, so the
per-sample choices (a pure function of seed, epoch and sample) are applied here, once per batch
(one Python call per batch, not per image), on the HWC uint8 images the C++ chain decoded and resized,
and the batch is normalized here too (`normalize`, bit for bit MindSpore's Normalize). The batch map
runs in the dataset's parallel workers.
"""
from dataclasses import dataclass
from typing import Tuple

import numpy as np


@dataclass(frozen=True)
class Regularization:
    """The timm/MindCV-style options beyond crop-and-flip; the defaults change nothing.

    Attributes:
        train_crop: "resize" (resize to the training size, then the padded random crop) or
            "random_resized" (a random area/aspect crop of the decoded image, resized; no padding).
        crop_scale, crop_ratio: random_resized's (min, max) area fraction and aspect ratio.
        color_jitter: brightness, contrast and saturation factors drawn from [1 - F, 1 + F].
        mixup, cutmix: Beta(alpha, alpha) of batch mixing; 0 = off; both on = half the steps each.
        label_smoothing: share of each target spread over all classes.
        num_classes: the width of soft targets.
    """
    train_crop: str = "resize"
    crop_scale: Tuple[float, float] = (0.08, 1.0)
    crop_ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0
    num_classes: int = 0

    @property
    def mixing(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    @property
    def soft_labels(self) -> bool:
        """Targets are float class distributions (the loss must take them), not class indices."""
        return self.mixing or self.label_smoothing > 0


def _overlap(offset: int, size: int):
    """Source and target ranges of a shift by `offset` (the crop window minus the padding)."""
    lo, hi = max(0, offset), min(size, size + offset)
    return slice(lo, hi), slice(lo - offset, hi - offset)


def pad_crop_flip_batch(images, params: np.ndarray, padding: int) -> np.ndarray:
    """Random crop at the training resolution from each zero-padded image of a batch, then optional mirror,
    as one NCHW uint8 array, without materializing the padded images (tests/conftest.py `pad_crop_flip`
    is the plain definition).

    Args:
        images: N HWC uint8 images of one shape: the list a batch map receives, each copied (and
            transposed) straight into the result, never stacked first.
        params: (N, 3) rows of (dy, dx, flip) from `plan.augment_params`.
        padding: the padding the offsets refer to.
    """
    h, w, c = images[0].shape
    out = np.empty((len(images), c, h, w), np.uint8)
    # A shift of at most `padding` leaves only a frame that wide uncovered: zero the frame, copy the rest.
    for rows, cols in ((slice(0, padding), slice(None)), (slice(h - padding, h), slice(None)),
                       (slice(None), slice(0, padding)), (slice(None), slice(w - padding, w))):
        out[:, :, rows, cols] = 0
    for i, (dy, dx, flip) in enumerate(params.tolist()):
        (src_y, dst_y), (src_x, dst_x) = _overlap(dy - padding, h), _overlap(dx - padding, w)
        source = images[i][src_y, src_x].transpose(2, 0, 1)
        if flip:  # mirrored in the same copy: target columns counted from the right
            out[i, :, dst_y, w - dst_x.stop:w - dst_x.start] = source[..., ::-1]
        else:
            out[i, :, dst_y, dst_x] = source
    return out


def to_nchw(images) -> np.ndarray:
    """The HWC images of a batch map as one NCHW array."""
    return np.stack(images).transpose(0, 3, 1, 2).copy()


def flip_batch(images: np.ndarray, flips: np.ndarray) -> np.ndarray:
    """Mirror the NCHW images whose flag is set."""
    out = images.copy()
    out[flips.astype(bool)] = out[flips.astype(bool)][..., ::-1]
    return out


def normalize(images: np.ndarray, mean, std) -> np.ndarray:
    """(x - mean) / std per channel of NCHW pixel values in float32: bit for bit MindSpore's C++ Normalize,
    which computes the same in float32, in one pass plus one in place (a 4-D C++ Normalize after the batch
    costs twice as much CPU, tests/unit/data/test_pipeline.py checks the bits)."""
    out = np.subtract(images, np.asarray(mean, np.float32).reshape(-1, 1, 1), dtype=np.float32)
    return np.divide(out, np.asarray(std, np.float32).reshape(-1, 1, 1), out=out)


def resized_crop_box(height: int, width: int, uniforms: np.ndarray, scale, ratio):
    """(top, left, h, w) of a random-resized crop, Inception style, from pre-drawn uniforms.

    Each attempt draws an area fraction in `scale` and a log-uniform aspect ratio in `ratio`; the
    first that fits wins. If none fits, the centre crop at the nearest allowed ratio is taken.
    """
    area = height * width
    log_lo, log_hi = np.log(ratio[0]), np.log(ratio[1])
    for u_area, u_ratio, u_top, u_left in uniforms:
        target = area * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = np.exp(log_lo + u_ratio * (log_hi - log_lo))
        w = int(round(np.sqrt(target * aspect)))
        h = int(round(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


_GRAY = np.array([0.299, 0.587, 0.114], dtype=np.float32).reshape(1, 3, 1, 1)   # ITU-R 601 luma


def color_jitter(images: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """Brightness, then contrast, then saturation of each NCHW image by its (n, 3) factors; float32 in 0..255."""
    x = images.astype(np.float32) * factors[:, 0, None, None, None].astype(np.float32)
    x = np.clip(x, 0, 255)
    mean = (x * _GRAY).sum(axis=1, keepdims=True).mean(axis=(2, 3), keepdims=True)
    x = np.clip(mean + (x - mean) * factors[:, 1, None, None, None].astype(np.float32), 0, 255)
    gray = (x * _GRAY).sum(axis=1, keepdims=True)
    return np.clip(gray + (x - gray) * factors[:, 2, None, None, None].astype(np.float32), 0, 255)


def soft_labels(labels: np.ndarray, num_classes: int, smoothing: float) -> np.ndarray:
    """One-hot float32 targets with `smoothing` of the mass spread evenly over all classes."""
    out = np.full((len(labels), num_classes), smoothing / num_classes, dtype=np.float32)
    out[np.arange(len(labels)), labels] += 1.0 - smoothing
    return out


def mix_batch(images: np.ndarray, partners: np.ndarray, targets: np.ndarray, partner_targets: np.ndarray,
              lam: float, box=None):
    """Mixup (box None) or cutmix (box = fractions top, left, bottom, right) of a batch with its partners.

    Cutmix's label weight is the share of the image left uncovered by the pasted box.
    Returns:
        (float32 images, float32 targets)
    """
    if box is None:
        weight = np.float32(lam)
        return images * weight + partners * (1 - weight), targets * weight + partner_targets * (1 - weight)
    h, w = images.shape[2:]
    top, left, bottom, right = (int(round(f * n)) for f, n in zip(box, (h, w, h, w)))
    out = images.astype(np.float32, copy=True)
    out[:, :, top:bottom, left:right] = partners[:, :, top:bottom, left:right]
    weight = np.float32(1.0 - (bottom - top) * (right - left) / (h * w))
    return out, targets * weight + partner_targets * (1 - weight)
