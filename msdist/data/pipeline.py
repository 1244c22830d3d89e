"""ImageFolder data: the class map, the file listing, and MindSpore's C++ reading/transform chain.

Three separate things:

* the class map (`class_map`): labels come from one class->index map built from Training/ and reused
  for Test/, so a class missing from Test cannot shift labels;
* the index plan (`msdist.data.plan`, pure Python): which sample each rank reads at each step and
  with which augmentation parameters;
* the chain (`build_train_dataset`, `build_span_dataset` for steps of several epochs in one pass,
  `build_eval_dataset`): MindSpore's `ImageFolderDataset` reads and
  decodes in C++ worker threads, in exactly the plan's order (a `SubsetSampler` over the reader's own
  file positions), and C++ ops resize (and, for evaluation and unaugmented training, normalize). The
  per-sample crop/flip, which no C++ op can take as per-row parameters, and normalizing are one NumPy
  call per batch (`msdist.data.augment`) on uint8 pixels, run by the batch op's parallel workers like
  the C++ stages before it.

Why not `ImageFolderDataset(num_shards, shard_id)`: its DistributedSampler pads shards by repeating
samples, and its shards are not the single-card batches.
"""
import os
from dataclasses import dataclass, replace
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from msdist.data import plan
from msdist.data.augment import (Regularization, color_jitter, flip_batch, mix_batch, normalize, pad_crop_flip_batch,
                                 resized_crop_box, soft_labels, to_nchw)
from msdist.base.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # ImageNet statistics, as in the model zoo
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
TRAIN_SPLIT, TEST_SPLIT = "Training", "Test"


@dataclass(frozen=True)
class Split:
    """The usable images of one split, in a fixed order, and where MindSpore's reader finds them.

    `positions[i]` is file i's index in `ImageFolderDataset(root, class_indexing=classes,
    extensions=extensions)`, which lists every image, including the ones msdist leaves out.
    """
    files: Tuple[str, ...]
    labels: Tuple[int, ...]
    ignored: int = 0   # non-image files passed over
    root: str = ""
    positions: Tuple[int, ...] = ()
    extensions: Tuple[str, ...] = ()
    classes: Tuple[Tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.files)


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def check_data_dir(data_dir: str) -> None:
    """Fail early, naming the path, when data_dir is unset or missing."""
    if not data_dir:
        raise DataError("data_dir is not set; pass --data_dir DIR (a folder with Training/ and Test/), "
                        "or make demo data with: python -m msdist.data synth DIR")
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir {data_dir!r} does not exist; pass --data_dir pointing at a folder "
                        f"with {TRAIN_SPLIT}/ and {TEST_SPLIT}/")


def split_dir(data_dir: str, split: str) -> str:
    path = os.path.join(data_dir, split)
    if not os.path.isdir(path):
        raise DataError(f"{path} not found; data_dir must hold {TRAIN_SPLIT}/ and {TEST_SPLIT}/ "
                        "with one folder per class")
    return path


def class_map(data_dir: str) -> Dict[str, int]:
    """Class name -> label, from the folders of Training/ in sorted order."""
    train = split_dir(data_dir, TRAIN_SPLIT)
    names = sorted(d for d in os.listdir(train) if os.path.isdir(os.path.join(train, d)))
    if not names:
        raise DataError(f"{train} has no class folders; put each class's images in {train}/<class>/")
    return {name: i for i, name in enumerate(names)}


def list_split(data_dir: str, split: str, classes: Dict[str, int], exclude: Iterable[str] = ()) -> Split:
    """Every image of a split with its label from `classes`, in a fixed (sorted) order.

    Raises:
        DataError: the split has a class that Training/ does not know, or no images at all.
    """
    root = split_dir(data_dir, split)
    present = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    unknown = [c for c in present if c not in classes]
    if unknown:
        raise DataError(f"{root} has classes unknown to {TRAIN_SPLIT}/: {', '.join(unknown)}; "
                        f"add them to {TRAIN_SPLIT}/ or remove them from {split}/")
    skip = set(exclude)
    files, labels, positions, extensions, ignored, listed = [], [], [], set(), 0, 0
    for name in present:
        folder = os.path.join(root, name)
        # Sorted by name like MindSpore's ImageFolder reader (folders and files), so a file's position
        # in this walk is its index there.
        for fname in sorted(os.listdir(folder)):
            path = os.path.join(folder, fname)
            if not is_image(fname):
                ignored += 1
                continue
            if path not in skip:
                files.append(path)
                labels.append(classes[name])
                positions.append(listed)
            listed += 1
            extensions.add(os.path.splitext(fname)[1])
    if not files:
        raise DataError(f"{root} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return Split(tuple(files), tuple(labels), ignored, root, tuple(positions), tuple(sorted(extensions)),
                 tuple(sorted(classes.items(), key=lambda kv: kv[1])))


def usable_workers(workers: int) -> int:
    """`workers` within 1..cores: MindSpore refuses more dataset workers than the host has cores."""
    return max(1, min(workers, os.cpu_count() or 1))


def reader(split: Split, samples: np.ndarray, workers: int):
    """MindSpore's C++ ImageFolder reader over `samples` (indices into `split`), decoding, in that order."""
    import mindspore.dataset as ds

    # SubsetSampler keeps the given order (SubsetRandomSampler would shuffle it), and the engine
    # delivers rows in sampler order whatever the number of workers.
    sampler = ds.SubsetSampler([split.positions[i] for i in samples.tolist()])
    return ds.ImageFolderDataset(split.root, class_indexing=dict(split.classes), extensions=list(split.extensions),
                                 sampler=sampler, decode=True, num_parallel_workers=workers)


def resize_normalize(image_size: int, mean: Sequence[float] = MEAN, std: Sequence[float] = STD,
                     normalize: bool = True) -> list:
    """C++ ops per decoded image: resize to `image_size`, normalize (unless the graph does), HWC2CHW (evaluation's
    and the plain training chain)."""
    from mindspore.dataset import vision
    return [vision.Resize((image_size, image_size))] + ([vision.Normalize(mean, std)] if normalize else []) + \
        [vision.HWC2CHW()]


def eval_transforms(image_size: int, mean: Sequence[float] = MEAN, std: Sequence[float] = STD) -> list:
    """Encoded image bytes -> normalized CHW float32 at `image_size`: what evaluation (and prediction) sees."""
    from mindspore.dataset import vision
    return [vision.Decode()] + resize_normalize(image_size, mean, std)


class Batches:
    """A built MindSpore dataset of batches whose read/decode failures name the file.

    A file that breaks after the data check (or was never checked) makes MindSpore's C++ reader
    raise a multi-page RuntimeError; iteration turns it into one DataError line naming the file.
    """

    def __init__(self, dataset, files: Sequence[str]):
        self.dataset, self.files = dataset, files

    def create_tuple_iterator(self, **kwargs):
        return self.rows(self.dataset.create_tuple_iterator(**kwargs))

    def unreadable(self, message: str) -> Optional[DataError]:
        """The DataError naming the file when MindSpore's error `message` names one of this dataset's files; else
        None (an error from elsewhere, e.g. a sunk step's graph, which also surfaces the pipeline's own failures)."""
        return _read_error(message, self.files) if any(f in message for f in self.files) else None

    def rows(self, iterator):
        """The rows of `iterator` over this dataset (its own, or a DatasetHelper's), a read failure named."""
        while True:
            try:
                row = next(iterator)
            except StopIteration:
                return
            except RuntimeError as e:
                raise _read_error(str(e), self.files) from None
            yield row


def _read_error(message: str, files: Sequence[str]) -> DataError:
    named = [f for f in files if f in message]
    if named:
        return DataError(f"cannot read image {named[0]}: the file is corrupt or unreadable; run "
                         "`python -m msdist.data check DIR` and fix or remove it (or pass --bad_images skip)")
    reason = next((line.strip() for line in message.splitlines() if "rror" in line and line.strip()), "")
    return DataError(f"the data pipeline failed ({reason[:200] or 'no reason given'}); run "
                     "`python -m msdist.data check DIR`")


class _BatchTransform:
    """per_batch_map: the plan's per-sample augmentation of batch k, normalizing, then batch mixing and soft targets.

    Rows arrive decoded (and, unless the crop is random_resized, resized) as HWC uint8, in the plan's
    order: this rank's samples of the step, followed by their mixing partners when mixing is on. Out
    come normalized NCHW float32 images. Mixing blends normalized images, except with a pixel-space
    option (color jitter, random resized crop), where it blends pixels and normalizing comes last:
    the orders every earlier run used, kept because they round differently. Batch k is step `at[k]` =
    (epoch, step of the epoch), whose epoch seeds every per-sample choice and whose step the batch's mixing.
    """

    def __init__(self, rows: np.ndarray, at: np.ndarray, labels: np.ndarray, *, seed: int, global_batch: int,
                 augment: bool, padding: int, image_size: int, reg: Regularization, pixels_out: bool = False):
        self.rows, self.at, self.labels = rows, at, labels
        self.seed, self.global_batch, self.augment, self.padding = seed, global_batch, augment, padding
        self.image_size, self.reg, self.pixels_out = image_size, reg, pixels_out
        self.mixes_pixels = reg.mixing and (reg.train_crop == "random_resized" or reg.color_jitter > 0)

    def __call__(self, images, labels, info):
        batch = info.get_batch_num()
        ids = self.rows[batch]
        epoch, step = (int(v) for v in self.at[batch])
        labels = np.asarray(labels).reshape(-1)
        if not np.array_equal(labels, self.labels[ids]):
            # The reader's file order disagrees with msdist's listing: never train on wrong labels.
            raise DataError("MindSpore's ImageFolder reader listed the files in another order than msdist")
        x = self._geometry(images, ids, epoch)
        if self.reg.color_jitter > 0:
            x = color_jitter(x, plan.jitter_factors(self.seed, epoch, ids, self.reg.color_jitter))
        if not (self.mixes_pixels or self.pixels_out):   # pixels_out: the train step normalizes
            x = normalize(x, MEAN, STD)
        if not self.reg.soft_labels:
            return x, labels
        targets = soft_labels(labels, self.reg.num_classes, self.reg.label_smoothing)
        if not self.reg.mixing:
            return x, targets
        own = len(ids) // 2
        mix = plan.mix_for_step(self.seed, epoch, step, self.global_batch, self.reg.mixup, self.reg.cutmix)
        x, targets = mix_batch(x[:own].astype(np.float32), x[own:].astype(np.float32), targets[:own],
                               targets[own:], mix.lam, mix.box)
        return (normalize(x, MEAN, STD) if self.mixes_pixels else x), targets

    def _geometry(self, images, ids: np.ndarray, epoch: int) -> np.ndarray:
        """Crop and flip per sample: NCHW at the training size."""
        params = plan.augment_params(self.seed, epoch, ids, self.padding)
        if self.reg.train_crop == "random_resized":
            x = np.stack([self._resized_crop(image, epoch, int(i)) for image, i in zip(images, ids)])
            return flip_batch(x, params[:, 2]) if self.augment else x
        return pad_crop_flip_batch(images, params, self.padding) if self.augment else to_nchw(images)

    def _resized_crop(self, image: np.ndarray, epoch: int, index: int) -> np.ndarray:
        from mindspore.dataset import vision
        top, left, h, w = resized_crop_box(*image.shape[:2], plan.resized_crop_uniforms(self.seed, epoch, index),
                                           self.reg.crop_scale, self.reg.crop_ratio)
        crop = np.ascontiguousarray(image[top:top + h, left:left + w])
        return vision.Resize((self.image_size, self.image_size))(crop).transpose(2, 0, 1)


@dataclass(frozen=True)
class TrainInput:
    """One rank's training input, resolved once from the options (`msdist.run.options.train_input`): the
    same every epoch, so an epoch's dataset is this plus the epoch and where in it to start.

    Attributes:
        image_size: the square training resolution.
        global_batch: images per optimizer step over all ranks; this rank reads its 1/world_size of them.
        seed, shuffle: the epoch order (`plan.epoch_permutation`) and every per-sample random choice.
        augment, padding: the padded random crop and flip.
        workers: dataset workers (clipped to the host's cores when the dataset is built).
        layout: which shards ("slots") of each global batch this rank reads (`plan.BatchLayout`); one per rank
            unless the job changed its world size.
        regularization: the options beyond crop and flip; with random_resized, the crop applies only
            when `augment` is on.
        device_normalizes: the consumer normalizes uint8 pixels itself (the train step, in its graph), so a batch
            that is still integer pixels leaves the pipeline as uint8 (`pixels_out`).
    """
    image_size: int
    global_batch: int
    seed: int
    shuffle: bool
    augment: bool
    padding: int
    workers: int
    layout: plan.BatchLayout = plan.BatchLayout()
    regularization: Regularization = Regularization()
    device_normalizes: bool = False

    @property
    def batch_size(self) -> int:
        """This rank's share of each global batch: the slots it owns, side by side."""
        return self.layout.rank_batch(self.global_batch)

    @property
    def pixels_out(self) -> bool:
        """The batch stays uint8 pixels to the device, normalized in the train step's graph (a quarter of float32's
        bytes): when the consumer normalizes, unless colour jitter or batch mixing computes in float on the host."""
        return self.device_normalizes and not (self.regularization.color_jitter > 0 or self.regularization.mixing)

    def describe_images(self) -> str:
        """What the batch's images cross to the device as, and their bytes per step on this rank."""
        pixels = self.batch_size * 3 * self.image_size ** 2
        if self.pixels_out:
            return f"uint8 pixels, normalized in the train step's graph: {pixels / 2**20:.1f} MiB per step"
        why = ("colour jitter" if self.regularization.color_jitter > 0 else "mixup/cutmix") + " computes in float" \
            if self.device_normalizes else "its consumer takes normalized images"
        return f"float32, normalized on the host ({why}): {pixels * 4 / 2**20:.1f} MiB per step"


def build_train_dataset(split: Split, spec: TrainInput, epoch: int, skip_steps: int = 0) -> Batches:
    """One epoch of this rank's training batches: images NCHW, uint8 pixels (`spec.pixels_out`) or normalized
    float32, labels int32 (or float32 (batch, classes) targets when `spec.regularization` mixes or smooths them).

    `skip_steps` drops the epoch's first batches, for an exact resume in the middle of an epoch.
    """
    steps = plan.steps_per_epoch(len(split), spec.global_batch)
    return build_span_dataset(split, spec, [(epoch, skip_steps, steps - skip_steps)])


def build_span_dataset(split: Split, spec: TrainInput, spans: Sequence[plan.Span]) -> Batches:
    """The batches of `spans` (each (epoch, first step of the epoch, steps)), one after the other, as one dataset
    read in one pass: batch for batch, those the spans' epochs' datasets (`build_train_dataset`) give at those steps.

    A run's sunk steps on GPU are one such dataset across its epochs (run/feed.py), so one graph serves them all.
    Exact because every choice is a function of (seed, epoch, sample) or (seed, epoch, step) (`plan`): the reader
    reads the spans' samples in order, and the batch map looks each batch's (epoch, step) up by its number.
    """
    from mindspore.dataset import vision

    reg, augment, image_size = spec.regularization, spec.augment, spec.image_size
    workers = usable_workers(spec.workers)
    steps, at = plan.span_samples(len(split), spec.global_batch, spec.seed, spec.shuffle, spec.layout, spans,
                                  reg.mixup, reg.cutmix)
    data = reader(split, steps.reshape(-1), workers)
    if not (augment or reg.color_jitter > 0 or reg.soft_labels):
        # Nothing per sample: the evaluation chain (a native ImageFolderDataset loop's, too), all C++.
        data = data.map(resize_normalize(image_size, normalize=not spec.pixels_out), input_columns="image",
                        num_parallel_workers=workers)
        return Batches(data.batch(spec.batch_size, drop_remainder=True), split.files)
    if not (augment and reg.train_crop == "random_resized"):
        reg = replace(reg, train_crop="resize")
        data = data.map(vision.Resize((image_size, image_size)), input_columns="image", num_parallel_workers=workers)
    transform = _BatchTransform(steps, at, np.asarray(split.labels), seed=spec.seed, global_batch=spec.global_batch,
                                augment=augment, padding=spec.padding, image_size=image_size, reg=reg,
                                pixels_out=spec.pixels_out)
    # One Python call per batch, in as many threads as there are workers: NumPy's copies and arithmetic
    # release the GIL, so batches are cropped side by side while the C++ workers decode the next ones.
    data = data.batch(steps.shape[1], drop_remainder=True, per_batch_map=transform,
                      input_columns=["image", "label"], num_parallel_workers=workers)
    return Batches(data, split.files)


def build_eval_dataset(split: Split, *, batch_size: int, image_size: int, world_size: int, rank: int,
                       workers: int) -> Batches:
    """This rank's evaluation shard, in batches; the last batch may be short."""
    samples = plan.eval_indices(len(split), world_size, rank)
    workers = usable_workers(workers)
    data = reader(split, samples, workers)
    data = data.map(resize_normalize(image_size), input_columns="image", num_parallel_workers=workers)
    return Batches(data.batch(batch_size, drop_remainder=False), [split.files[i] for i in samples])
