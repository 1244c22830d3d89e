"""A stop signal to an elastic job (`msdist.launch --nnodes MIN:MAX`): one node drained, or the whole job stopped.

SIGTERM (or --preempt_signal) to any node's launcher makes every rank of the job save a complete checkpoint at
one agreed step and exit 200 (msdist.cluster.preemption). Both a drain (one node's launcher signalled: a
Kubernetes node drain, a spot node's notice) and a job-wide stop (every node signalled, seconds apart) start
that way; what each node does once its ranks saved is decided here, from what every node can see alike:

* **the window** (`after_save`): a node whose launcher got a stop signal before its ranks' save ended, or
  within `DRAIN_WINDOW_S` after, is *draining*: it says so in the membership service and leaves. A node not
  signalled by then *stays*; a signal that comes later is a new request (its next ranks save at once);
* **the job** (`next_view`): once every member is draining, staying or gone, the first staying member decides
  the next view without the draining nodes (membership.decide), and the job goes on from the checkpoint just
  saved, as after a lost node. No draining node (the ranks were signalled, not a launcher), or fewer than MIN
  staying (a job-wide stop ends here: no node stays), is `JobStops`: every node exits 200;
* **a draining node** (`draining_end`) exits `DRAINED_EXIT` once a newer view goes on without it, or 200 once
  every member is draining, stopped or gone;
* **a signal while the job re-forms** (the ranks already stopped, the checkpoint it resumes from complete): that
  node says it is draining at once, with nothing more to save (`leaving`), and waits for the next view like any
  member; the first staying member holds its decision for the window after it first sees a draining member, so
  the nodes of a job-wide stop leave together. A view decided before the leader heard of the drain still holds
  the node: it then runs the next attempt, whose ranks save at once, and drains after it.

The decisions are pure functions; `settle` waits after the save and applies them (msdist.launcher.elastic calls
it, and re-forms with `next_view`).
"""
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from msdist.cluster.preemption import REQUEUE_EXIT
from msdist.launcher.forwarder import Forwarder
from msdist.launcher.membership import Change, NodeRange, TooFewNodes, View, decide, host_of
from msdist.launcher.peers import ENDED, Peers
from msdist.launcher.supervisor import say

DRAIN_WINDOW_S = 10.0   # covers signals up to ~10 s after the save (the save itself takes a step and a write)
DRAINED_EXIT = 0        # a drained node's part is done: nothing to requeue there, the job goes on elsewhere
DRAINED = "drained"     # the reason a draining member left the view (membership.describe, membership.jsonl)
LEAVING_PHASES = ("draining", DRAINED)   # a draining launcher's phases, before and once it ended (elastic._end)
_WAIT_S = 0.2


class JobStops(Exception):
    """After a stop save, the job ends: every node exits 200 (preemption.REQUEUE_EXIT)."""


class Drained(Exception):
    """This node drained: `view`, the newer one, goes on without it."""

    def __init__(self, view: View):
        super().__init__()
        self.view = view


def after_save(signalled_at: Optional[float], saved_at: float, now: float,
               window_s: float = DRAIN_WINDOW_S) -> str:
    """What a node does at `now`, its ranks having saved on a stop request and exited 200 at `saved_at`.

    Args:
        signalled_at: when this node's launcher got its first stop signal (None: not yet); all time.monotonic().

    Returns:
        "draining" (signalled before `saved_at + window_s`), "waiting" (not signalled, the window still
        open) or "staying" (the window passed without a signal).
    """
    if signalled_at is not None and signalled_at <= saved_at + window_s:
        return "draining"
    return "waiting" if now < saved_at + window_s else "staying"


def next_view(previous: View, gone: Dict[str, str], waiting: Sequence[str], nodes: NodeRange) -> Change:
    """The view after a stop save: `previous` without its draining and lost members (`gone`: member -> why,
    DRAINED for the draining), with the waiting nodes admitted, as membership.decide.

    Raises:
        JobStops: no member drained (a stop of the whole job), or fewer than nodes.min stay.
    """
    if DRAINED not in gone.values():
        raise JobStops("no node's launcher was signalled: a stop of the whole job")
    try:
        return decide(previous, set(gone), waiting, nodes)
    except TooFewNodes as e:
        raise JobStops(f"the job stops: {e}") from None


def draining_end(previous: View, me: str, phases: Dict[str, str], gone: Sequence[str],
                 newer: Optional[View]) -> Optional[str]:
    """A draining node's end: DRAINED (a newer view went on; a draining node is never in it), "stopped"
    (every other member is draining, stopped with 200 or gone: the job ends) or None (wait).

    Args:
        phases: the other members' last phases under `previous` ("draining", "preempted", ...).
        gone: the members lost (peers.Peers.gone).
        newer: the view decided after `previous`, if any.
    """
    if newer is not None:
        return DRAINED
    if all(m == me or m in gone or phases.get(m) in ("draining", "preempted") for m in previous.members):
        return "stopped"
    return None


def settle(peers: Peers, view: View, forwarder: Forwarder, newer: Callable[[], Optional[View]],
           min_nodes: int) -> Tuple[str, Optional[View]]:
    """After every rank of `view` saved on a stop request: wait out the window, then until a draining node's end.

    Args:
        forwarder: this launcher's (its `requested_at`: when it got its first stop signal).
        newer: the view decided after `view`, if any.

    Returns:
        ("staying", None): this node goes on (elastic's `_next`, with `next_view`); (DRAINED, the newer view) or
        ("stopped", None): this draining node ends.
    """
    saved_at = time.monotonic()
    if after_save(forwarder.requested_at, saved_at, saved_at) == "waiting":
        peers.set("saved")
        say(f"every rank saved on a stop signal another node got: waiting {DRAIN_WINDOW_S:g} s for one here before "
            "the job goes on without the node(s) signalled (a drain)")
    while (now := after_save(forwarder.requested_at, saved_at, time.monotonic())) == "waiting":
        time.sleep(_WAIT_S)
    if now == "staying":
        return now, None
    leaving(peers, "every rank saved", min_nodes)
    while True:
        phases = {m: p for m in view.members for p in ("draining", "preempted")
                  if peers.in_phase(m, p, view.generation)}
        decided = newer()
        end = draining_end(view, peers.me, phases, list(peers.gone(view)), decided)
        if end is not None:
            return end, decided
        time.sleep(_WAIT_S)


def leaving(peers: Peers, saved: str, min_nodes: int) -> None:
    """Say that this signalled node, its checkpoint complete (`saved`: how), drains."""
    peers.set("draining")
    say(f"this node was signalled and {saved}: it leaves the job (a drain), which goes on without it if at least "
        f"{min_nodes} node(s) stay, else stops here (every node then exits {REQUEUE_EXIT})")


def lost(change: Change) -> str:
    """The members `change` left out because they were lost or failed, and why ("" = none: they ended or were
    drained, or nodes only joined): what counts against --max_reforms."""
    return "; ".join(f"node {host_of(m)} {change.why.get(m, 'left')}" for m in change.left
                     if change.why.get(m) not in (*ENDED, DRAINED))
