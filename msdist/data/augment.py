"""Batch-level augmentation in NumPy, driven by the index plan's per-sample parameters.

MindSpore's C++ vision ops draw their own random numbers and take no per-row parameters, so the
per-sample choices (a pure function of seed, epoch and sample) are applied here, once per batch
(one Python call per batch, not per image), on uint8 CHW images the C++ chain decoded and resized.
"""
import numpy as np


def pad_crop_flip(image: np.ndarray, params: np.ndarray, padding: int) -> np.ndarray:
    """Random crop at the training resolution from a zero-padded HWC image, then optional mirror.

    The reference definition of the crop; `pad_crop_flip_batch` does the same to a CHW batch.
    """
    h, w = image.shape[:2]
    dy, dx, flip = (int(v) for v in params)
    if padding:
        image = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))[dy:dy + h, dx:dx + w]
    return np.ascontiguousarray(image[:, ::-1] if flip else image)


def _overlap(offset: int, size: int):
    """Source and target ranges of a shift by `offset` (the crop window minus the padding)."""
    lo, hi = max(0, offset), min(size, size + offset)
    return slice(lo, hi), slice(lo - offset, hi - offset)


def pad_crop_flip_batch(images: np.ndarray, params: np.ndarray, padding: int) -> np.ndarray:
    """`pad_crop_flip` on each image of an NCHW batch, without materializing the padded images.

    Args:
        images: (N, C, H, W) uint8.
        params: (N, 3) rows of (dy, dx, flip) from `plan.augment_params`.
        padding: the zero padding the offsets refer to.
    """
    out = np.zeros_like(images)
    h, w = images.shape[2:]
    for i, (dy, dx, flip) in enumerate(params):
        (src_y, dst_y), (src_x, dst_x) = _overlap(int(dy) - padding, h), _overlap(int(dx) - padding, w)
        out[i, :, dst_y, dst_x] = images[i, :, src_y, src_x]
        if flip:
            out[i] = out[i, :, :, ::-1]
    return out
