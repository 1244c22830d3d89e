"""ImageFolder data: one class map, exact sharding, deterministic augmentation.

Why an explicit file list and sampler instead of `ds.ImageFolderDataset(num_shards, shard_id)`:

* labels must come from one class->index map built from Training/ and reused for Test/, so a class
  missing from Test cannot shift labels;
* evaluation must see every Test image exactly once over all ranks (MindSpore's DistributedSampler
  pads shards by repeating samples);
* N ranks must train on exactly the single-card batches: at global step s the N shards together
  are the single-card batch s. `train_indices` guarantees it by cutting one per-epoch permutation
  (same seed on every rank) into global batches and dealing each batch out by rank;
* augmentation is a pure function of (seed, epoch, sample), so it is the same on 1 or N cards and
  after a restart, whatever the worker scheduling.

Decoding, resizing and normalizing still run in MindSpore's C++ dataset engine.
"""
import os
from dataclasses import dataclass
from typing import Dict, Iterable, Tuple

import numpy as np

from msdist.errors import ConfigError, DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # ImageNet statistics, as in the model zoo
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
TRAIN_SPLIT, TEST_SPLIT = "Training", "Test"


@dataclass(frozen=True)
class Split:
    files: Tuple[str, ...]
    labels: Tuple[int, ...]
    ignored: int = 0   # non-image files passed over

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
    files, labels, ignored = [], [], 0
    for name in present:
        folder = os.path.join(root, name)
        for fname in sorted(os.listdir(folder)):
            path = os.path.join(folder, fname)
            if not is_image(fname):
                ignored += 1
            elif path not in skip:
                files.append(path)
                labels.append(classes[name])
    if not files:
        raise DataError(f"{root} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return Split(tuple(files), tuple(labels), ignored)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Full global batches per epoch; the remainder is dropped, as on a single card."""
    return num_samples // global_batch


def per_rank_batch(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        raise DataError(f"batch_size {global_batch} is the global batch and must divide evenly over "
                        f"{world_size} ranks; use a multiple of {world_size}, e.g. "
                        f"{max(world_size, global_batch // world_size * world_size)}")
    return global_batch // world_size


def micro_batch_size(per_rank_batch: int, accum_steps: int) -> int:
    """Per-rank micro-batch: the rank's share of one optimizer step's batch, split in `accum_steps`."""
    if per_rank_batch % accum_steps:
        raise ConfigError(f"the per-rank batch {per_rank_batch} does not split into grad_accum_steps "
                          f"{accum_steps} equal micro-batches; make batch_size a multiple of world size x "
                          "grad_accum_steps")
    return per_rank_batch // accum_steps


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The single-card sample order of one epoch; identical on every rank."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def train_indices(num_samples: int, global_batch: int, epoch: int, seed: int, shuffle: bool,
                  world_size: int, rank: int) -> np.ndarray:
    """This rank's samples for one epoch, in order.

    Rank r takes every N-th sample of the epoch's order starting at r. Because the per-rank batch is
    B/N, its step-s batch is positions s*B + r, s*B + r + N, ... < (s+1)*B: the N ranks' step-s
    batches are exactly the single-card step-s batch.
    """
    used = epoch_permutation(num_samples, seed, epoch, shuffle)[: steps_per_epoch(num_samples, global_batch)
                                                                 * global_batch]
    return used[rank::world_size]


def eval_indices(num_samples: int, world_size: int, rank: int) -> np.ndarray:
    """Every sample exactly once over all ranks: no padding, nothing dropped."""
    return np.arange(rank, num_samples, world_size)


def augment_params(seed: int, epoch: int, index: int, padding: int) -> np.ndarray:
    """(dy, dx, flip) for one sample: a pure function, so every rank and every restart agree."""
    rng = np.random.default_rng([seed, epoch, index, 0x5A])
    dy, dx = rng.integers(0, 2 * padding + 1, size=2)
    return np.array([dy, dx, rng.integers(0, 2)], dtype=np.int32)


def pad_crop_flip(image: np.ndarray, params: np.ndarray, padding: int) -> np.ndarray:
    """Random crop at the training resolution from a zero-padded image, then optional mirror."""
    h, w = image.shape[:2]
    dy, dx, flip = (int(v) for v in params)
    if padding:
        image = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))[dy:dy + h, dx:dx + w]
    return np.ascontiguousarray(image[:, ::-1] if flip else image)


class _TrainSource:
    """Random-access source: encoded bytes, label and this epoch's augmentation parameters."""

    def __init__(self, split: Split, seed: int, epoch: int, padding: int):
        self.split, self.seed, self.epoch, self.padding = split, seed, epoch, padding

    def __len__(self):
        return len(self.split)

    def __getitem__(self, index):
        return (np.fromfile(self.split.files[index], dtype=np.uint8), np.array(self.split.labels[index], dtype=np.int32),
                augment_params(self.seed, self.epoch, int(index), self.padding))


class _EvalSource:
    def __init__(self, split: Split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, index):
        return np.fromfile(self.split.files[index], dtype=np.uint8), np.array(self.split.labels[index], dtype=np.int32)


def _decode_resize(image_size: int):
    from mindspore.dataset import vision
    return [vision.Decode(), vision.Resize((image_size, image_size))]


def _normalize():
    from mindspore.dataset import vision
    return [vision.Normalize(MEAN, STD), vision.HWC2CHW()]


def build_train_dataset(split: Split, *, batch_size: int, image_size: int, epoch: int, seed: int,
                        shuffle: bool, augment: bool, padding: int, world_size: int, rank: int,
                        global_batch: int, workers: int, skip_steps: int = 0):
    """One epoch of this rank's training batches (images NCHW float32, labels int32).

    `skip_steps` drops the epoch's first batches, for an exact resume in the middle of an epoch.
    """
    import mindspore.dataset as ds

    indices = train_indices(len(split), global_batch, epoch, seed, shuffle, world_size, rank)[skip_steps * batch_size:]
    data = ds.GeneratorDataset(_TrainSource(split, seed, epoch, padding), ["image", "label", "aug"],
                               sampler=indices.tolist(), num_parallel_workers=1, python_multiprocessing=False)
    data = data.map(_decode_resize(image_size), input_columns="image", num_parallel_workers=workers)
    if augment:
        data = data.map(lambda img, aug: pad_crop_flip(img, aug, padding), input_columns=["image", "aug"],
                        output_columns=["image"], num_parallel_workers=workers)
    data = data.map(_normalize(), input_columns="image", num_parallel_workers=workers)
    return data.project(["image", "label"]).batch(batch_size, drop_remainder=True)


def build_eval_dataset(split: Split, *, batch_size: int, image_size: int, world_size: int, rank: int,
                       workers: int):
    """This rank's evaluation shard, in batches; the last batch may be short."""
    import mindspore.dataset as ds

    indices = eval_indices(len(split), world_size, rank)
    data = ds.GeneratorDataset(_EvalSource(split), ["image", "label"], sampler=indices.tolist(),
                               num_parallel_workers=1, python_multiprocessing=False)
    data = data.map(_decode_resize(image_size) + _normalize(), input_columns="image", num_parallel_workers=workers)
    return data.batch(batch_size, drop_remainder=False)
