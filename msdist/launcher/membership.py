"""Elastic membership for `msdist.launch --nnodes MIN:MAX`: who is in the job, who hosts MindSpore's
scheduler, and which node rank each node gets. Pure functions of what the launchers know; the talking is
msdist.launcher.peers, the restarts msdist.launcher.elastic.

A node is named by its membership address, "IP:PORT" (the port is --master_port + 1 on every node).
A `View` lists the job's nodes in node-rank order:

* survivors keep their relative order, so the lowest surviving node becomes node 0 and hosts the
  scheduler (MS_SCHED_HOST must be a literal IP, and it is: the node's own address);
* nodes admitted are appended after them, in the order they asked (at the first formation: by the
  --node_rank they were started with), up to MAX nodes in all;
* fewer than MIN nodes is `TooFewNodes`, the job's named end.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set, Tuple

from msdist.base.errors import ConfigError


@dataclass(frozen=True)
class NodeRange:
    """--nnodes MIN:MAX (M alone is M:M: a fixed job, no membership service)."""
    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.max > self.min


def parse_nnodes(text: str) -> NodeRange:
    """`--nnodes`: "M" or "MIN:MAX".

    Raises:
        ConfigError: not numbers, MIN < 1, or MIN > MAX.
    """
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if len(parts) > 2 or not 1 <= low <= high:
        raise ConfigError(f"--nnodes {text}: give a node count M or a range MIN:MAX with 1 <= MIN <= MAX, "
                          "e.g. --nnodes 2 or --nnodes 1:4")
    return NodeRange(low, high)


def host_of(member: str) -> str:
    return member.rsplit(":", 1)[0]


@dataclass(frozen=True)
class View:
    """One membership of the job: `members[i]` is node i; node 0 hosts the scheduler."""
    job: str                    # the job's token (one per first formation): claims of two jobs never mix
    generation: int
    members: Tuple[str, ...]

    @property
    def scheduler_host(self) -> str:
        return host_of(self.members[0])

    def as_dict(self) -> dict:
        return {"job": self.job, "generation": self.generation, "members": list(self.members)}

    @staticmethod
    def from_dict(d: dict) -> "View":
        return View(d["job"], int(d["generation"]), tuple(d["members"]))


class TooFewNodes(Exception):
    """Fewer than MIN nodes are left (or came): the elastic job's named failure."""


@dataclass(frozen=True)
class Change:
    """A decided membership: the new view, and who left and joined compared with the previous one."""
    view: View
    left: Tuple[str, ...] = ()
    joined: Tuple[str, ...] = ()
    why: Dict[str, str] = field(default_factory=dict)   # member who left -> why ("lost: no answer for 10 s")


def decide(previous: View, gone: Set[str], waiting: Sequence[str], nodes: NodeRange) -> Change:
    """The next view: the survivors of `previous` in their order, then the waiting nodes, up to nodes.max.

    Args:
        previous: the view every survivor ran (generation 0 and no members before the first formation).
        gone: members of `previous` that are lost or have failed.
        waiting: nodes asking to join, in the order they asked.
        nodes: MIN and MAX.

    Raises:
        TooFewNodes: fewer than nodes.min in the result.
    """
    survivors = [m for m in previous.members if m not in gone]
    room = max(nodes.max - len(survivors), 0)
    # A member that came back before the others saw it go is gone (its ranks are) and waiting: it rejoins.
    joined = [m for m in dict.fromkeys(waiting) if m not in survivors][:room]
    members = survivors + joined
    if len(members) < nodes.min:
        raise TooFewNodes(f"{len(members)} node(s) left, fewer than the minimum {nodes.min} (--nnodes "
                          f"{nodes.min}:{nodes.max})")
    left = tuple(m for m in previous.members if m in gone)
    return Change(View(previous.job, previous.generation + 1, tuple(members)), left, tuple(joined))


def leader(previous: View, gone: Set[str]) -> str:
    """Who decides the next view: the first member of `previous` not gone (the node 0 to be)."""
    for m in previous.members:
        if m not in gone:
            return m
    return ""


def first_order(candidates: Dict[str, Tuple[int, float]]) -> List[str]:
    """The nodes of the first formation in node-rank order: by the --node_rank each was started with, then by
    when it asked. `candidates`: member -> (its --node_rank, when it asked)."""
    return sorted(candidates, key=lambda m: candidates[m])


def describe(change: Change, previous: View, nproc: int, resumed_step) -> str:
    """The one console line of a membership change.

    e.g. "membership 3: node 10.0.0.2 left (lost: no answer for 10 s); 1 node(s), world size 2 -> 1; node 0
    (scheduler) 10.0.0.1; resumed from global step 24"
    """
    parts = [f"node {host_of(m)} left ({change.why.get(m, 'gone')})" for m in change.left]
    parts += [f"node {host_of(m)} joined" for m in change.joined]
    old, new = len(previous.members) * nproc, len(change.view.members) * nproc
    resumed = f"resumed from global step {resumed_step}" if resumed_step is not None else \
        "the ranks ended before they resumed"
    return (f"membership {change.view.generation}: {', '.join(parts)}; {len(change.view.members)} node(s), world "
            f"size {old} -> {new}; node 0 (scheduler) {change.view.scheduler_host}; {resumed}")


def record(change: Change, previous: View, nproc: int, resumed_step, line: str, at: float) -> dict:
    """The change's record in logs/membership.jsonl (one JSON object per change)."""
    return {"time": round(at, 3), "generation": change.view.generation,
            "left": [{"node": host_of(m), "why": change.why.get(m, "gone")} for m in change.left],
            "joined": [host_of(m) for m in change.joined], "nodes": [host_of(m) for m in change.view.members],
            "world_size_before": len(previous.members) * nproc, "world_size": len(change.view.members) * nproc,
            "scheduler_host": change.view.scheduler_host, "resumed_from_step": resumed_step, "line": line}
