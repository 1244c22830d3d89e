"""run/meter.py: the one meter (data wait counted, the compile step not), the log window's compute time across
the blocking loss read, and every rank's window figures naming the rank that waited most."""
import time

import pytest

from msdist.run import meter
from msdist.run.meter import RankFigures
from msdist.run.result import input_wait_line


def test_rank_figures_name_the_rank_that_waited_most():
    figures = RankFigures()
    assert figures.summary() == {} and input_wait_line({}) == ""
    # One log window: training s/step and input-wait s/step, a value per rank.
    assert figures.add([0.4, 0.1], [0.1, 0.4]) == {"rank_step_s": [0.5, 0.5], "rank_input_wait": [0.2, 0.8]}
    figures.add([0.3, 0.3], [0.0, 0.2])
    summary = figures.summary()
    assert summary["most_input_wait_rank"] == 1
    assert summary["ranks"] == [{"rank": 0, "median_step_s": 0.4, "input_wait_share": 0.125},
                                {"rank": 1, "median_step_s": 0.5, "input_wait_share": 0.6}]
    assert input_wait_line(summary) == ("input wait rank 1 waited most: 60.0% of its time | "
                                        "rank 0: 0.400 s/step, 12.5% | rank 1: 0.500 s/step, 60.0%")


def test_one_meter_counts_data_wait_but_not_the_compile_step(monkeypatch):
    clock = iter([0.0,            # the meter is made
                  0.0,            # epoch start
                  1.0, 11.0,      # first batch after 1 s, first step (compile) 10 s
                  12.0, 14.0,     # 1 s waiting for data, 2 s compute
                  15.0, 17.0])
    monkeypatch.setattr(meter.time, "perf_counter", lambda: next(clock))
    timer = meter.Meter(images_per_step=6)
    timer.start_epoch()
    for _ in range(3):
        timer.data_ready()
        timer.step_done()
    assert timer.first_step_s == 10.0 and timer.data_s == 3.0
    assert timer.images_per_sec() == pytest.approx(2 * 6 / 6.0)   # result.json: 2 steady steps in 6 s of wall time
    # The step line's rate reads the same clock readings: the 2 steps after the compile step, 6 s apart.
    assert timer.sec_per_step() == pytest.approx(3.0) and timer.recent_images_per_sec() == pytest.approx(2.0)
    assert timer.epoch_seconds() == 17.0 and timer.epoch_images_per_sec() == pytest.approx(3 * 6 / 17.0)


def test_window_compute_time_includes_the_blocking_read():
    timer = meter.Meter(images_per_step=8)
    for _ in range(3):
        timer.data_ready()
        timer.step_done()  # launches return at once
    timer.data_ready()
    time.sleep(0.2)  # the blocking read at the log step waits for the queued steps
    timer.step_done()
    compute, data = timer.take_window()
    assert compute >= 0.2 / 4 and data < 0.05
    assert timer.take_window() == (0.0, 0.0)
