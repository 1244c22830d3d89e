"""msdist.launcher.drain: a drain told apart from a stop of the whole job, decided alike on every node."""
import pytest

from msdist.launcher.drain import DRAIN_WINDOW_S, DRAINED, JobStops, after_save, draining_end, lost, next_view
from msdist.launcher.membership import Change, NodeRange, View

A, B, C, D = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"
THREE = View("job", 4, (A, B, C))
SAVED = 100.0


@pytest.mark.parametrize("signalled_at, now, what", [
    (95.0, SAVED, "draining"),                           # the signal that started the save
    (SAVED + DRAIN_WINDOW_S - 0.1, SAVED + 30, "draining"),   # a few seconds after the save: still this stop
    (SAVED + DRAIN_WINDOW_S, SAVED + 30, "draining"),    # the window's last instant counts
    (None, SAVED, "waiting"),
    (None, SAVED + DRAIN_WINDOW_S - 0.1, "waiting"),
    (None, SAVED + DRAIN_WINDOW_S, "staying"),
    (SAVED + DRAIN_WINDOW_S + 0.1, SAVED + DRAIN_WINDOW_S + 0.2, "staying"),   # too late: a new request
], ids=["before the save", "within the window", "at its end", "just saved", "window open", "window over",
        "signal after the window"])
def test_the_window_after_the_save(signalled_at, now, what):
    assert after_save(signalled_at, SAVED, now) == what


def test_the_window_is_an_argument():
    assert after_save(None, SAVED, SAVED + 3, window_s=2) == "staying"
    assert after_save(SAVED + 1.5, SAVED, SAVED + 3, window_s=2) == "draining"


def test_a_drain_leaves_the_others_going_on_from_the_first_staying_node():
    change = next_view(THREE, {A: DRAINED}, [], NodeRange(2, 3))
    assert change.view == View("job", 5, (B, C))   # B, the first staying node, hosts the scheduler now
    assert change.left == (A,) and change.joined == ()


def test_drained_and_lost_nodes_both_leave_and_a_waiting_node_may_make_up_min():
    change = next_view(View("job", 1, (A, B, C, D)), {B: DRAINED, C: "lost: no answer for 10 s"}, [], NodeRange(2, 4))
    assert change.view.members == (A, D) and change.left == (B, C)
    assert next_view(THREE, {A: DRAINED, B: DRAINED}, [D], NodeRange(2, 3)).view.members == (C, D)


@pytest.mark.parametrize("gone, nodes", [
    ({A: DRAINED}, NodeRange(3, 4)),             # a drain of a job at its minimum: it saves and stops
    ({A: DRAINED, B: DRAINED}, NodeRange(2, 3)),  # two of three signalled: one would stay, below MIN 2
    ({A: DRAINED, B: DRAINED, C: DRAINED}, NodeRange(1, 3)),  # a stop of the whole job: no node stays
    ({}, NodeRange(1, 3)),                       # the ranks were signalled, no launcher: the whole job
    ({A: "lost: no answer for 10 s"}, NodeRange(1, 3)),   # a node lost while saving drains nothing
], ids=["at MIN", "below MIN", "every node", "no launcher signalled", "only lost"])
def test_the_job_stops_when_no_node_drained_or_fewer_than_min_stay(gone, nodes):
    with pytest.raises(JobStops):
        next_view(THREE, gone, [], nodes)


def test_a_draining_node_leaves_once_a_newer_view_goes_on():
    assert draining_end(THREE, A, {}, [], View("job", 5, (B, C))) == DRAINED


@pytest.mark.parametrize("phases, gone, end", [
    ({B: "draining", C: "draining"}, [], "stopped"),     # every node signalled
    ({B: "draining", C: "preempted"}, [], "stopped"),    # C stayed alone, below MIN, and stopped
    ({B: "draining"}, [C], "stopped"),                   # C lost
    ({B: "draining"}, [], None),                         # C still waiting out its window, or deciding
    ({}, [], None),
], ids=["all draining", "the stayer stopped", "the stayer lost", "a stayer decides", "nothing heard"])
def test_a_draining_node_waits_until_no_node_stays(phases, gone, end):
    assert draining_end(THREE, A, phases, gone, None) == end


def test_only_lost_or_failed_members_count_against_the_re_form_budget():
    why = {A: DRAINED, B: "lost: no answer for 10 s", C: "preempted", D: "its launcher failed"}
    assert lost(Change(View("job", 2, ()), (A, B, C, D), (), why)) == \
        "node 10.0.0.2 lost: no answer for 10 s; node 10.0.0.4 its launcher failed"
    assert lost(Change(View("job", 2, (A, B)), (C,), (D,), {C: "done"})) == ""   # ended; a node joining is free
