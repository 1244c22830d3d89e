"""run/stragglers.py: the slow rank named, with its verdict, only when it stays slow; msdist.report draws it."""
import json

import pytest

from msdist.run import stragglers
from msdist.run.stragglers import COMPUTE_BOUND, INPUT_BOUND, WAITING, StragglerRule, StragglerWatch, slow_ranks

ALIKE = ([0.5, 0.5, 0.5, 0.5], [0.05, 0.06, 0.04, 0.05], [0.1, 0.1, 0.12, 0.1])


def test_each_verdict_from_where_the_slow_ranks_time_goes():
    assert slow_ranks(*ALIKE, margin=0.2) == {}
    step_s, waits, cores = ALIKE
    assert slow_ranks(step_s, [0.05, 0.6, 0.04, 0.05], cores, 0.2) == {1: INPUT_BOUND}
    assert slow_ranks(step_s, waits, [0.1, 0.1, 0.55, 0.1], 0.2) == {2: COMPUTE_BOUND}
    assert slow_ranks([0.5, 0.5, 0.5, 0.7], waits, cores, 0.2) == {3: WAITING}
    # Input explains it first: a rank waiting for input with its cores taken too is input-bound.
    assert slow_ranks(step_s, [0.05, 0.6, 0.04, 0.05], [0.1, 0.6, 0.1, 0.1], 0.2) == {1: INPUT_BOUND}
    # The ranks that wait for an input-bound one spin runnable in the exchange: their cores look taken, but the
    # input-bound rank is the one to name (a CI run's window of two ranks).
    assert slow_ranks([1.0118, 1.0104], [0.0006, 0.9903], [0.6351, 0.3712], 0.2) == {1: INPUT_BOUND}
    # Within the margin, nobody; one rank has nobody to be compared with.
    assert slow_ranks(step_s, [0.05, 0.24, 0.04, 0.05], cores, 0.2) == {}
    assert slow_ranks([0.5], [0.9], [0.9], 0.2) == {}


def test_a_rank_is_named_once_after_the_windows_in_a_row_and_again_after_it_recovered():
    watch = StragglerWatch(StragglerRule(margin=0.2, windows=2), hosts=["a", "b"])
    slow = ([0.5, 0.5], [0.02, 0.6], [0.1, 0.1])
    assert watch.observe(*slow) == ([], [])
    named, records = watch.observe(*slow)
    assert named == [1]
    assert records == [{"kind": "straggler", "rank": 1, "host": "b", "verdict": INPUT_BOUND, "windows": 2,
                        "step_s": 0.5, "median_step_s": 0.5, "input_wait_share": 0.6,
                        "median_input_wait_share": 0.02, "core_wait_share": 0.1, "time": records[0]["time"]}]
    assert watch.observe(*slow) == ([1], [])           # still slow: marked, not named again
    assert watch.observe([0.5, 0.5], [0.02, 0.03], [0.1, 0.1]) == ([], [])
    watch.observe(*slow)
    assert watch.observe(*slow)[1][0]["rank"] == 1     # a new episode: named again


def test_the_line_names_rank_host_times_share_and_verdict():
    record = {"rank": 1, "host": "b", "verdict": INPUT_BOUND, "windows": 2, "step_s": 0.21, "median_step_s": 0.12,
              "input_wait_share": 0.45, "median_input_wait_share": 0.02, "core_wait_share": 0.03}
    assert stragglers.line(record) == ("slow rank 1 on host b: 0.210 s/step against a median of 0.120 s | input "
                                       "wait 45% of its time (median 2%) | cores taken 3% | input-bound (2 log "
                                       "windows in a row)")


def test_off_or_alone_nothing_is_gathered_or_measured():
    class NoCollectives:
        def gather_text(self, text):
            raise AssertionError("no collective when off")
    assert stragglers.open_watch(StragglerRule(margin=0.0), NoCollectives(), 4, True) == (False, None)
    assert stragglers.open_watch(StragglerRule(), NoCollectives(), 1, True) == (False, None)


def test_core_wait_is_a_share_of_this_processs_thread_time():
    meter = stragglers.CoreWait()
    sum(i * i for i in range(200000))
    assert 0.0 <= meter.take() <= 1.0


@pytest.mark.slow   # matplotlib draws two figures: seconds
def test_the_report_draws_each_ranks_windows_also_when_the_job_changed_size(tmp_path):
    """ranks.png from metrics.jsonl alone: 2 ranks, then 3 after an elastic change, rank 1 named slow."""
    from msdist import report
    step = {"kind": "step", "epoch": 1, "steps_per_epoch": 10, "loss": 1.0, "lr": 0.1, "images_per_sec": 1.0}
    records = [{"kind": "run", "global_step": 0, "world_size": 2},
               {**step, "step": 2, "global_step": 2, "rank_step_s": [0.5, 0.5], "rank_input_wait": [0.0, 0.6]},
               {**step, "step": 4, "global_step": 4, "rank_step_s": [0.5, 0.5], "rank_input_wait": [0.0, 0.6],
                "slow_ranks": [1]},
               {"kind": "straggler", "global_step": 4, "rank": 1, "verdict": INPUT_BOUND, "step_s": 0.5},
               {**step, "step": 6, "global_step": 6, "rank_step_s": [0.4, 0.4, 0.4],
                "rank_input_wait": [0.0, 0.1, 0.0]}]
    (tmp_path / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in records))
    assert report.main([str(tmp_path)]) == 0
    assert (tmp_path / report.RANKS_PNG).stat().st_size > 0
    assert report.load_run(str(tmp_path)).stragglers[0]["rank"] == 1
