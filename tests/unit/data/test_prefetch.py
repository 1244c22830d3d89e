"""The one-ahead batch fetch (data/prefetch.py): same items, same order, at most one fetch ahead, errors kept."""
import threading

import numpy as np
import pytest

from msdist.base.errors import DataError
from msdist.data import pipeline, prefetch

WAIT_S = 30  # generous: these waits end as soon as the helper acts; the bound only keeps a broken run finite


class _Source:
    """Items 0..n-1, recording which thread fetched each and how many were fetched when the caller got one."""

    def __init__(self, n: int, fail_at: int = -1):
        self.n, self.fail_at = n, fail_at
        self.fetched, self.threads = 0, set()
        self.started = [threading.Event() for _ in range(n + 1)]

    def __iter__(self):
        for i in range(self.n):
            self.started[i].set()
            self.threads.add(threading.get_ident())
            if i == self.fail_at:
                raise DataError(f"cannot read image {i}")
            self.fetched += 1
            yield i
        self.started[self.n].set()


def test_items_in_order_fetched_by_another_thread_while_the_caller_works():
    source = _Source(5)
    got = []
    for item in prefetch.one_ahead(source):
        # The next fetch starts without the caller asking: that is the overlap with the step.
        assert source.started[item + 1].wait(WAIT_S)
        assert source.fetched <= item + 2  # never more than one ahead
        got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert threading.get_ident() not in source.threads


def test_a_fetch_error_reaches_the_caller_after_the_items_before_it():
    got = []
    with pytest.raises(DataError, match="cannot read image 2"):
        for item in prefetch.one_ahead(_Source(5, fail_at=2)):
            got.append(item)
    assert got == [0, 1]


def test_stopping_early_ends_the_helper_after_the_one_fetch_in_flight():
    source = _Source(10)
    rows = prefetch.one_ahead(source)
    assert [next(rows), next(rows)] == [0, 1]
    rows.close()
    assert source.fetched == 3
    assert not [t for t in threading.enumerate() if t.name.startswith("msdist-fetch")]


def test_real_pipeline_batches_are_bitwise_those_of_plain_iteration(data_dir):
    split = pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))
    spec = pipeline.TrainInput(image_size=32, global_batch=8, seed=5, shuffle=True, augment=True, padding=2,
                               workers=2)
    plain = [(x.asnumpy(), y.asnumpy()) for x, y in
             pipeline.build_train_dataset(split, spec, epoch=1).create_tuple_iterator(num_epochs=1)]
    ahead = [(x.asnumpy(), y.asnumpy()) for x, y in
             prefetch.one_ahead(pipeline.build_train_dataset(split, spec, epoch=1).create_tuple_iterator(num_epochs=1))]
    assert len(ahead) == len(plain) > 1
    for (x, y), (px, py) in zip(ahead, plain):
        assert x.tobytes() == px.tobytes() and np.array_equal(y, py)
