"""The straggler tests' fault, injected from outside msdist: one rank's input arrives late.

`tests/train_with_test_models.py` installs it when MSDIST_TEST_SLOW_INPUT="RANK:SECONDS:FROM" is set: from
its FROM-th batch on (counted over the whole run, from 1), rank RANK's training loop gets every batch SECONDS
late, as from a slow disk, so the rank waits for its input (the meter's data wait) while the others wait for it.
"""
import itertools
import time

from msdist.base.launch_env import detect_launch
from msdist.data import prefetch

ENV = "MSDIST_TEST_SLOW_INPUT"


def install(spec: str) -> None:
    rank, seconds, first = spec.split(":")
    if detect_launch().rank != int(rank):
        return
    fetched = itertools.count(1)
    one_ahead = prefetch.one_ahead

    def late(rows):
        for row in one_ahead(rows):
            if next(fetched) >= int(first):
                time.sleep(float(seconds))
            yield row

    prefetch.one_ahead = late
