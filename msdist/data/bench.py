"""`python -m msdist.data bench DIR`: what one rank's training input pipeline costs, to size hardware with.

Three figures, each measured apart:

* start-up: from building an epoch's pipeline to its first batch (training pays it every epoch);
* steady img/s: the images after each epoch's first batch over the time they took;
* CPU microseconds per image for each stage (read + decode, resize, augment, batch), from pipelines
  cut after each stage, run with one worker: CPU time, unlike wall time, barely moves when other
  processes share the host, and it is what a GPU host's cores must supply.
"""
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional

import numpy as np

STAGES = ("read+decode", "resize", "augment", "batch")


@dataclass(frozen=True)
class Rate:
    startup_s: float        # build to first batch, first epoch
    later_startup_s: float  # the same, mean over the later epochs (nan with one epoch)
    steady: float           # img/s after the first batch of each epoch
    cpu_us: float           # process CPU time (all threads) per image after the first batch of each epoch
    images: int             # images counted in `steady`


def measure(make_epoch: Callable[[int], object], epochs: int) -> Rate:
    """Start-up and steady img/s over `epochs` epochs, each dataset built by `make_epoch(epoch)` as training does."""
    startups, seen, seconds, cpu = [], 0, 0.0, 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        first = None
        for row in make_epoch(epoch).create_tuple_iterator(num_epochs=1, output_numpy=True):
            if first is None:
                first, cpu_first = time.perf_counter(), time.process_time()
                continue
            seen += len(row[-1])
        if first is None:
            raise ValueError("the pipeline gave no batch; use a smaller batch_size or more images")
        startups.append(first - start)
        seconds += time.perf_counter() - first
        cpu += time.process_time() - cpu_first
    later = float(np.mean(startups[1:])) if len(startups) > 1 else float("nan")
    nan = float("nan")
    return Rate(startups[0], later, seen / seconds if seen else nan, cpu / seen * 1e6 if seen else nan, seen)


@dataclass(frozen=True)
class Setup:
    """What is benched: data_dir's Training/ as one rank of world size 1 trains on it."""
    data_dir: str
    image_size: int = 100
    augment: bool = True
    batch_size: int = 32
    padding: int = 4
    seed: int = 1
    regularization: Optional[object] = None   # augment.Regularization


def _split(setup: Setup):
    from msdist.data import pipeline
    return pipeline.list_split(setup.data_dir, pipeline.TRAIN_SPLIT, pipeline.class_map(setup.data_dir))


def train_input(setup: Setup, workers: int):
    """The `pipeline.TrainInput` of one rank training on `setup`, as training builds it (`options.train_input`)."""
    from msdist.data import pipeline
    return pipeline.TrainInput(image_size=setup.image_size, global_batch=setup.batch_size, seed=setup.seed,
                               shuffle=True, augment=setup.augment, padding=setup.padding, workers=workers,
                               regularization=setup.regularization or pipeline.Regularization(),
                               device_normalizes=True)


def train_epoch_maker(setup: Setup, workers: int, split=None) -> Callable[[int], object]:
    """epoch -> msdist's training dataset of that epoch (`pipeline.build_train_dataset`)."""
    from msdist.data import pipeline
    split = split or _split(setup)
    spec = train_input(setup, workers)

    def make_epoch(epoch: int):
        return pipeline.build_train_dataset(split, spec, epoch)
    return make_epoch


def native_epoch_maker(setup: Setup, workers: int) -> Callable[[int], object]:
    """epoch -> MindSpore's tutorial pipeline: ImageFolderDataset shuffling, C++ ops per image (Decode,
    Resize, RandomCrop with padding, RandomHorizontalFlip, Normalize, HWC2CHW), batch."""
    import mindspore.dataset as ds
    from mindspore.dataset import vision

    from msdist.data import pipeline
    classes = pipeline.class_map(setup.data_dir)

    def make_epoch(_):
        data = ds.ImageFolderDataset(os.path.join(setup.data_dir, pipeline.TRAIN_SPLIT), class_indexing=classes,
                                     shuffle=True, decode=True, num_parallel_workers=workers)
        ops = [vision.Resize((setup.image_size, setup.image_size))]
        if setup.augment:
            ops += [vision.RandomCrop(setup.image_size, padding=setup.padding), vision.RandomHorizontalFlip()]
        ops += [vision.Normalize(pipeline.MEAN, pipeline.STD), vision.HWC2CHW()]
        return data.map(ops, input_columns="image", num_parallel_workers=workers).batch(setup.batch_size,
                                                                                         drop_remainder=True)
    return make_epoch


def stage_cpu_us(setup: Setup, images: int = 4096, rounds: int = 2) -> Dict[str, float]:
    """CPU microseconds per image of each stage, one worker, over `images` images spread over the tree.

    Each stage's figure is the difference between the pipeline cut after it and the one cut before
    (the lowest of `rounds` passes each, since other load only adds). "batch" is what the plain chain
    adds after resizing (normalize, HWC2CHW, the batch itself); "augment" is what the training chain
    adds to the plain one (0 with augmentation and regularization off, where the two are the same).
    """
    from mindspore.dataset import vision

    from msdist.data import pipeline
    split = _split(setup)
    samples = np.linspace(0, len(split) - 1, min(images, len(split))).astype(np.int64)
    sub = replace(split, files=tuple(split.files[i] for i in samples), labels=tuple(split.labels[i] for i in samples),
                  positions=tuple(split.positions[i] for i in samples))
    batch = min(setup.batch_size, len(sub))

    def decoded():
        return pipeline.reader(sub, np.arange(len(sub)), 1)

    # Pipelines cut after each stage. Only labels reach Python before the batch stage, so the cut costs nothing.
    cuts = (lambda: decoded().project(["label"]).batch(batch),
            lambda: decoded().map(vision.Resize((setup.image_size, setup.image_size)), input_columns="image",
                                  num_parallel_workers=1).project(["label"]).batch(batch),
            lambda: decoded().map(pipeline.resize_normalize(setup.image_size), input_columns="image",
                                  num_parallel_workers=1).batch(batch, drop_remainder=True),
            lambda: train_epoch_maker(replace(setup, batch_size=batch), 1, sub)(0).dataset)
    decode, resize, plain, train = (min(measure(lambda _: cut(), 1).cpu_us for _ in range(rounds)) for cut in cuts)
    return {"read+decode": decode, "resize": max(0.0, resize - decode), "augment": max(0.0, train - plain),
            "batch": max(0.0, plain - resize)}


def cores_needed(gpu_rate: float, cpu_us: float) -> int:
    """Cores one rank needs to feed `gpu_rate` img/s when every image costs `cpu_us` CPU microseconds."""
    return max(1, math.ceil(gpu_rate * cpu_us / 1e6))
