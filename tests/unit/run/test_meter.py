"""run/meter.py: every rank's window figures name the rank that waited most."""
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
