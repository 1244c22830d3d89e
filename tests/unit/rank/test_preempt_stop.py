"""The stop check's gather carries each rank's fault row (preempt_stop.Agreement)."""
from msdist.rank import preempt_stop
from msdist.rank.distributed import Collectives


def test_a_fault_row_stops_without_a_save_and_is_kept_for_every_rank():
    fault = [0.0, 0.0, 0.0]
    stop = preempt_stop.Agreement(None, Collectives(1), start_step=0, faults=lambda: fault)
    assert stop.stop_at(1) is False and stop.faulted is None   # all zero: nothing to name
    fault[:] = [20.0, 28.0, 1.5]
    assert stop.stop_at(stop.check_step) is False               # not a preemption: no save at an agreed step
    assert stop.agreed_step is None
    assert stop.faulted.tolist() == [[20.0, 28.0, 1.5]]


def test_without_a_listener_the_check_still_runs_and_never_stops_by_itself():
    stop = preempt_stop.Agreement(None, Collectives(1), start_step=5)
    assert stop.stop_at(5) is False and stop.check_step == 6     # before the first check step: no collective
    assert stop.stop_at(6) is False and stop.check_step > 6      # a check ran (next step computed), no stop
    assert stop.faulted is None
