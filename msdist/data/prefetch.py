"""Take the next batch off the input pipeline while the current step runs.

`next()` on MindSpore's dataset iterator costs the caller far more than turning the batch into Tensors
(~10 us, no copy): the C++ pipeline hands the batch over through its own threads, and a consumer that has
been busy elsewhere (running the step) waits ~0.3-2.4 ms for it on this loaded 2-core host
(benchmarks/host_work.py), against ~20 us when the call is repeated back to back. A compiled graph's run
releases the GIL (a Python thread keeps ~80% of its pace during a ResNet-18 step on this host), and so does
the hand-over, so a helper thread can make that call during the step and the loop only collects the result.
"""
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

_END = object()


def one_ahead(rows: Iterable) -> Iterator:
    """The items of `rows`, in order, each fetched by a helper thread while the caller works on the one before.

    Exactly one fetch is in flight at a time, so the pipeline is read no further ahead than one item, and
    the items (and any exception a fetch raises, re-raised here) are the ones plain iteration gives. When
    the caller stops early, closing this generator waits for the one fetch in flight, then the helper ends.
    """
    source = iter(rows)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="msdist-fetch") as fetcher:
        pending = fetcher.submit(next, source, _END)
        while True:
            row = pending.result()
            if row is _END:
                return
            pending = fetcher.submit(next, source, _END)
            yield row
