"""The elastic membership decision (msdist.launcher.membership), table-driven, and the launchers' service
(msdist.launcher.peers) talking for real over loopback."""
import time

import pytest

from msdist.base.errors import ConfigError
from msdist.cluster.rendezvous import free_port
from msdist.launcher.membership import (Change, NodeRange, TooFewNodes, View, decide, describe, first_order, leader,
                                       parse_nnodes, record)
from msdist.launcher.peers import Peers

A, B, C, D = "10.0.0.1:7", "10.0.0.2:7", "10.0.0.3:7", "10.0.0.4:7"


@pytest.mark.parametrize("text, nodes", [("1", NodeRange(1, 1)), ("4", NodeRange(4, 4)), ("1:2", NodeRange(1, 2)),
                                         ("2:2", NodeRange(2, 2)), (" 3:8", NodeRange(3, 8))])
def test_parse_nnodes(text, nodes):
    assert parse_nnodes(text) == nodes
    assert nodes.elastic == (nodes.max > nodes.min)


@pytest.mark.parametrize("text", ["0", "3:2", "0:2", "a", "1:b", "1:2:3", ""])
def test_parse_nnodes_refuses(text):
    with pytest.raises(ConfigError, match="--nnodes"):
        parse_nnodes(text)


# previous members, gone, waiting, MIN:MAX -> new members (node-rank order), left, joined
DECISIONS = [
    # node 1 lost: node 0 goes on alone
    ((A, B), {B}, [], (1, 2), (A,), (B,), ()),
    # node 0 lost: the survivor becomes node 0 (and hosts the scheduler)
    ((A, B), {A}, [], (1, 2), (B,), (A,), ()),
    # survivors keep their relative order; the lowest becomes node 0
    ((A, B, C, D), {A, C}, [], (1, 4), (B, D), (A, C), ()),
    # a late node is appended
    ((A,), set(), [B], (1, 2), (A, B), (), (B,)),
    # up to MAX: the first to ask is admitted, the other waits
    ((A,), set(), [C, B], (1, 2), (A, C), (), (C,)),
    ((A, B), set(), [C], (1, 2), (A, B), (), ()),
    # one lost and one waiting in the same decision: the newcomer takes its place at the end
    ((A, B), {A}, [C], (1, 2), (B, C), (A,), (C,)),
    # a member that came back before the others saw it go: gone, and rejoins at the end
    ((A, B, C), {B}, [B], (1, 3), (A, C, B), (B,), (B,)),
    # the first formation (no previous view): the order given
    ((), set(), [A, B], (1, 2), (A, B), (), (A, B)),
    # nothing changed (a failure with the same nodes: a restart)
    ((A, B), set(), [], (1, 2), (A, B), (), ()),
]


@pytest.mark.parametrize("previous, gone, waiting, limits, members, left, joined", DECISIONS)
def test_decide(previous, gone, waiting, limits, members, left, joined):
    change = decide(View("job", 3, previous), gone, waiting, NodeRange(*limits))
    assert change.view == View("job", 4, members)
    assert (change.left, change.joined) == (left, joined)
    assert change.view.scheduler_host == members[0].split(":")[0]


@pytest.mark.parametrize("previous, gone, waiting, limits", [
    ((A, B), {B}, [], (2, 3)),          # 1 left of MIN 2
    ((A, B), {A, B}, [], (1, 2)),        # nobody left
    ((), set(), [A], (2, 2)),            # the first formation with too few
])
def test_fewer_than_min_is_the_named_failure(previous, gone, waiting, limits):
    with pytest.raises(TooFewNodes, match=rf"fewer than the minimum {limits[0]} \(--nnodes {limits[0]}:{limits[1]}\)"):
        decide(View("job", 1, previous), gone, waiting, NodeRange(*limits))


@pytest.mark.parametrize("members, gone, who", [((A, B, C), set(), A), ((A, B, C), {A}, B), ((A, B, C), {A, B}, C),
                                                ((A, B), {A, B}, "")])
def test_leader_is_the_first_member_not_gone(members, gone, who):
    assert leader(View("job", 1, members), gone) == who


def test_first_order_is_by_node_rank_then_by_arrival():
    assert first_order({A: (0, -1), C: (1, 0), B: (1, 1), D: (0, 2)}) == [A, D, C, B]


def test_the_line_and_the_record_of_a_change():
    previous = View("job", 1, (A, B))
    change = Change(View("job", 2, (B,)), left=(A,), why={A: "lost: no answer for 10 s"})
    line = describe(change, previous, nproc=2, resumed_step=12)
    assert line == ("membership 2: node 10.0.0.1 left (lost: no answer for 10 s); 1 node(s), world size 4 -> 2; "
                    "node 0 (scheduler) 10.0.0.2; resumed from global step 12")
    rec = record(change, previous, 2, 12, line, 5.0)
    assert rec == {"time": 5.0, "generation": 2, "left": [{"node": "10.0.0.1", "why": "lost: no answer for 10 s"}],
                   "joined": [], "nodes": ["10.0.0.2"], "world_size_before": 4, "world_size": 2,
                   "scheduler_host": "10.0.0.2", "resumed_from_step": 12, "line": line}


def _until(condition, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_peers_exchange_states_see_a_newcomer_wait_and_a_closed_one_lost():
    """Two launchers' services on loopback addresses: a member and a node asking to join, which is then lost
    after --membership_timeout (1 s here)."""
    port = free_port()
    member = Peers(f"127.0.0.1:{port}", f"127.0.0.1:{port}", nproc=1, node_rank=0, timeout=1.0).start()
    newcomer = Peers(f"127.0.0.2:{port}", f"127.0.0.1:{port}", nproc=1, node_rank=1, timeout=1.0).start()
    running = [member, newcomer]
    try:
        view = View("job", 1, (member.me,))
        member.set("running", view)
        _until(lambda: member.waiting() == [newcomer.me])         # it asked: waiting, in the order it asked
        _until(lambda: newcomer.newest_view("job") == view)         # and it learned the job's view
        assert newcomer.state_of(member.me)["phase"] == "running"
        grown = View("job", 2, (member.me, newcomer.me))
        member.set("running", grown)
        _until(lambda: newcomer.newest_view("job") == grown)
        newcomer.set("running", grown)
        _until(lambda: member.state_of(newcomer.me)["phase"] == "running")
        assert member.waiting() == []
        assert member.gone(grown) == {}
        running.pop().close()
        _until(lambda: newcomer.me in member.gone(grown))
        assert member.gone(grown)[newcomer.me].startswith("lost: no answer for")
    finally:
        for peers in running:
            peers.close()


def test_a_member_asking_to_join_again_is_a_restarted_launcher():
    """A member whose new launcher asks to join (its ranks are gone with the old one) is gone, then waiting."""
    port = free_port()
    member = Peers(f"127.0.0.1:{port}", f"127.0.0.1:{port}", nproc=1, node_rank=0, timeout=1.0).start()
    again = Peers(f"127.0.0.2:{port}", f"127.0.0.1:{port}", nproc=1, node_rank=1, timeout=1.0).start()
    try:
        view = View("job", 2, (member.me, again.me))
        member.set("running", view)
        _until(lambda: member.gone(view) == {again.me: "its launcher restarted"})
        assert member.waiting() == []   # in the view still; once the next view leaves it out, it is admitted again
    finally:
        member.close()
        again.close()
