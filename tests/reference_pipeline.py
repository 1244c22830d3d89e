"""msdist's training input pipeline as it was before issue 26 (commit 1732485), frozen as the reference.

Issue 26 moved the per-sample work into the dataset's parallel workers; its batches must stay bitwise
equal to these, so this module keeps the old chain whole: C++ decode, resize, HWC2CHW (and normalize
when every option commutes with it), then one NumPy call per batch, in one thread, for the per-sample
crop/flip, color jitter, random resized crop and batch mixing. Only the pure pieces that issue 26
left alone (the index plan, the resized-crop box, soft targets) are imported from the package.
"""
from dataclasses import replace

import numpy as np

from msdist.data import plan
from msdist.data.augment import resized_crop_box, soft_labels
from msdist.data.pipeline import MEAN, STD

_GRAY = np.array([0.299, 0.587, 0.114], dtype=np.float32).reshape(1, 3, 1, 1)


def _overlap(offset, size):
    lo, hi = max(0, offset), min(size, size + offset)
    return slice(lo, hi), slice(lo - offset, hi - offset)


def _pad_crop_flip_batch(images, params, padding, fill=0):
    c, h, w = images[0].shape
    out = np.empty((len(images), c, h, w), images[0].dtype)
    frame = np.asarray(fill, out.dtype).reshape(-1, 1, 1)
    for rows, cols in ((slice(0, padding), slice(None)), (slice(h - padding, h), slice(None)),
                       (slice(None), slice(0, padding)), (slice(None), slice(w - padding, w))):
        out[:, :, rows, cols] = frame
    for i, (dy, dx, flip) in enumerate(params.tolist()):
        (src_y, dst_y), (src_x, dst_x) = _overlap(dy - padding, h), _overlap(dx - padding, w)
        if flip:
            out[i, :, dst_y, w - dst_x.stop:w - dst_x.start] = images[i][:, src_y, src_x][..., ::-1]
        else:
            out[i, :, dst_y, dst_x] = images[i][:, src_y, src_x]
    return out


def _flip_batch(images, flips):
    out = images.copy()
    out[flips.astype(bool)] = out[flips.astype(bool)][..., ::-1]
    return out


def _color_jitter(images, factors):
    x = images.astype(np.float32) * factors[:, 0, None, None, None].astype(np.float32)
    x = np.clip(x, 0, 255)
    mean = (x * _GRAY).sum(axis=1, keepdims=True).mean(axis=(2, 3), keepdims=True)
    x = np.clip(mean + (x - mean) * factors[:, 1, None, None, None].astype(np.float32), 0, 255)
    gray = (x * _GRAY).sum(axis=1, keepdims=True)
    return np.clip(gray + (x - gray) * factors[:, 2, None, None, None].astype(np.float32), 0, 255)


def _mix_batch(images, partners, targets, partner_targets, lam, box=None):
    if box is None:
        weight = np.float32(lam)
        return images * weight + partners * (1 - weight), targets * weight + partner_targets * (1 - weight)
    h, w = images.shape[2:]
    top, left, bottom, right = (int(round(f * n)) for f, n in zip(box, (h, w, h, w)))
    out = images.astype(np.float32, copy=True)
    out[:, :, top:bottom, left:right] = partners[:, :, top:bottom, left:right]
    weight = np.float32(1.0 - (bottom - top) * (right - left) / (h * w))
    return out, targets * weight + partner_targets * (1 - weight)


class _BatchTransform:
    def __init__(self, rows, labels, mixes, *, seed, epoch, augment, padding, image_size, reg, fill):
        self.rows, self.labels, self.mixes = rows, labels, mixes
        self.seed, self.epoch, self.augment, self.padding = seed, epoch, augment, padding
        self.image_size, self.reg, self.fill = image_size, reg, fill

    def __call__(self, images, labels, info):
        step = info.get_batch_num()
        ids = self.rows[step]
        labels = np.asarray(labels).reshape(-1)
        assert np.array_equal(labels, self.labels[step])
        x = self._geometry(images, ids)
        if self.reg.color_jitter > 0:
            x = _color_jitter(x, plan.jitter_factors(self.seed, self.epoch, ids, self.reg.color_jitter))
        if not self.reg.soft_labels:
            return x, labels
        targets = soft_labels(labels, self.reg.num_classes, self.reg.label_smoothing)
        if not self.reg.mixing:
            return x, targets
        own = len(ids) // 2
        mix = self.mixes[step]
        return _mix_batch(x[:own].astype(np.float32), x[own:].astype(np.float32), targets[:own], targets[own:],
                          mix.lam, mix.box)

    def _geometry(self, images, ids):
        params = plan.augment_params(self.seed, self.epoch, ids, self.padding)
        if self.reg.train_crop == "random_resized":
            x = np.stack([self._resized_crop(image, int(i)) for image, i in zip(images, ids)])
            return _flip_batch(x, params[:, 2]) if self.augment else x
        return _pad_crop_flip_batch(images, params, self.padding, self.fill) if self.augment else np.stack(images)

    def _resized_crop(self, image, index):
        from mindspore.dataset import vision
        top, left, h, w = resized_crop_box(*image.shape[:2], plan.resized_crop_uniforms(self.seed, self.epoch, index),
                                           self.reg.crop_scale, self.reg.crop_ratio)
        crop = np.ascontiguousarray(image[top:top + h, left:left + w])
        return vision.Resize((self.image_size, self.image_size))(crop).transpose(2, 0, 1)


def train_dataset(split, spec, epoch, skip_steps=0):
    """The old `pipeline.build_train_dataset`: a MindSpore dataset of (images, labels) batches; the same call
    as the new one (`spec`: pipeline.TrainInput)."""
    import mindspore.dataset as ds
    from mindspore.dataset import vision

    batch_size, image_size, seed, shuffle = spec.batch_size, spec.image_size, spec.seed, spec.shuffle
    augment, padding, slots, owned = spec.augment, spec.padding, spec.layout.slots, spec.layout.owned
    global_batch, workers, reg = spec.global_batch, spec.workers, spec.regularization
    steps = plan.rank_steps(len(split), global_batch, epoch, seed, shuffle, slots, owned, skip_steps)
    mixes = None
    if reg.mixing:
        partners, mixes = plan.rank_partners(len(split), global_batch, epoch, seed, shuffle, slots, owned,
                                             skip_steps, reg.mixup, reg.cutmix)
        steps = np.concatenate([steps, partners], axis=1)
    sampler = ds.SubsetSampler([split.positions[i] for i in steps.reshape(-1).tolist()])
    data = ds.ImageFolderDataset(split.root, class_indexing=dict(split.classes), extensions=list(split.extensions),
                                 sampler=sampler, decode=True, num_parallel_workers=workers)
    normalize = vision.Normalize(MEAN, STD, is_hwc=False)
    if not (augment or reg.color_jitter > 0 or reg.soft_labels):
        chain = [vision.Resize((image_size, image_size)), vision.Normalize(MEAN, STD), vision.HWC2CHW()]
        return data.map(chain, input_columns="image", num_parallel_workers=workers).batch(batch_size,
                                                                                          drop_remainder=True)
    resized_crop = augment and reg.train_crop == "random_resized"
    pixel_space = resized_crop or reg.color_jitter > 0
    if not resized_crop:
        reg = replace(reg, train_crop="resize")
        chain = [vision.Resize((image_size, image_size)), vision.HWC2CHW()]
        if not pixel_space:
            chain.append(normalize)
        data = data.map(chain, input_columns="image", num_parallel_workers=workers)
    black = normalize(np.zeros((len(MEAN), 1, 1), np.uint8)).reshape(-1)
    transform = _BatchTransform(steps, np.asarray(split.labels)[steps], mixes, seed=seed, epoch=epoch,
                                augment=augment, padding=padding, image_size=image_size, reg=reg,
                                fill=0 if pixel_space else black)
    data = data.batch(steps.shape[1], drop_remainder=True, per_batch_map=transform,
                      input_columns=["image", "label"], num_parallel_workers=1)
    if pixel_space:
        data = data.map(normalize, input_columns="image", num_parallel_workers=workers)
    return data
