"""`python -m msdist.data bench DIR`: images/s of msdist's training input pipeline alone."""
import time
from typing import Callable


def images_per_sec(make_epoch: Callable[[int], object], epochs: int) -> float:
    """Images/s over `epochs` epochs, each dataset built by `make_epoch(epoch)` as training does.

    Building and starting each epoch's pipeline counts: training pays for it every epoch too.
    """
    seen, seconds = 0, 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        for _, labels in make_epoch(epoch).create_tuple_iterator(num_epochs=1, output_numpy=True):
            seen += len(labels)
        seconds += time.perf_counter() - start
    return seen / seconds


def train_pipeline_rate(data_dir: str, *, workers: int, image_size: int, augment: bool, batch_size: int,
                        epochs: int, padding: int = 4, seed: int = 1) -> float:
    """Images/s of one rank's `build_train_dataset` on data_dir's Training/ (world size 1)."""
    from msdist.data import pipeline

    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, pipeline.class_map(data_dir))

    def make_epoch(epoch):
        return pipeline.build_train_dataset(split, batch_size=batch_size, image_size=image_size, epoch=epoch,
                                            seed=seed, shuffle=True, augment=augment, padding=padding,
                                            world_size=1, rank=0, global_batch=batch_size, workers=workers)
    return images_per_sec(make_epoch, epochs)
