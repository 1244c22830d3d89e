"""The slow rank, named while it happens: every log window, every rank's figures against the other ranks'.

The figures travel in the log step's one AllGather (`watch.Watch.close_window`), so naming costs no collective.
Per rank and window: its step time (wall seconds per step, input wait included), its input-wait share (the
part of that spent waiting for its next batch) and its core-wait share (the part of its threads' wanted CPU
time spent runnable but without a core, from /proc/self/task/*/schedstat: its cores are taken by others).

In data-parallel training every rank's step ends at the same gradient exchange, so the ranks' step times are
alike whoever is slow: the others wait for the slow one inside the step. What tells the slow rank apart is
where its own time goes. A rank is slow in a window when, against the median of the other ranks,
- its input-wait share is higher by more than the margin: **input-bound** (its input pipeline, disk or
  decoding holds everyone back);
- else its core-wait share is higher by more than the margin: **compute-bound** (its host's cores are busy
  with other work, or it has fewer);
- else its step time is longer by more than the margin (a fraction of the median): **waiting on others**
  (its time goes inside the step, in the exchange: a slower peer or link it waits on).
An input-bound rank explains its window: the other ranks then wait for it inside the exchange, and the threads
that wait there stay runnable, so on a crowded host their core-wait share rises while the input-bound rank,
asleep on its input, shows little (a CI run of two ranks on two busy cores: 64% against 37%). In such a window
only the input-bound ranks are named.
A rank slow in `windows` log windows in a row is named once, in one line and a `straggler` record of
metrics.jsonl; the windows it stays slow carry `slow_rank` in their step records (`msdist.report` marks them).
"""
import glob
import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

_logger = logging.getLogger(__name__)
INPUT_BOUND, COMPUTE_BOUND, WAITING = "input-bound", "compute-bound", "waiting on others"


@dataclass(frozen=True)
class StragglerRule:
    """`--straggler_margin` (0 = never name a rank) and `--straggler_windows`."""
    margin: float = 0.2
    windows: int = 2

    @property
    def on(self) -> bool:
        return self.margin > 0


def _thread_times() -> Tuple[int, int]:
    """(ns on a core, ns runnable without one) summed over this process's threads."""
    ran = waited = 0
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path, encoding="ascii") as f:
                fields = f.read().split()
        except OSError:   # a thread that just ended
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran, waited


class CoreWait:
    """This rank's core-wait share window by window (`take`): 0 where /proc has no schedstat."""

    def __init__(self):
        self._last = _thread_times()

    def take(self) -> float:
        now = _thread_times()
        ran, waited = max(now[0] - self._last[0], 0), max(now[1] - self._last[1], 0)
        self._last = now
        return waited / (ran + waited) if ran + waited else 0.0


def _others_median(values: Sequence[float], rank: int) -> float:
    return statistics.median(v for r, v in enumerate(values) if r != rank)


def slow_ranks(step_s: Sequence[float], input_share: Sequence[float], core_share: Sequence[float],
               margin: float) -> Dict[int, str]:
    """The ranks slow in one window and each one's verdict (module docstring); {} on one rank."""
    if len(step_s) < 2:
        return {}
    input_bound = {rank: INPUT_BOUND for rank in range(len(step_s))
                   if input_share[rank] - _others_median(input_share, rank) > margin}
    if input_bound:
        return input_bound
    found: Dict[int, str] = {}
    for rank in range(len(step_s)):
        if core_share[rank] - _others_median(core_share, rank) > margin:
            found[rank] = COMPUTE_BOUND
        elif step_s[rank] > (1 + margin) * _others_median(step_s, rank):
            found[rank] = WAITING
    return found


class StragglerWatch:
    """Rank 0's account of slow ranks over the run: which are slow now, and for how many windows in a row.

    Args:
        rule: the margin and the persistence.
        hosts: each rank's host name.
    """

    def __init__(self, rule: StragglerRule, hosts: Sequence[str]):
        self.rule, self.hosts = rule, list(hosts)
        self._streak: Dict[int, int] = {}

    def observe(self, step_s: Sequence[float], input_share: Sequence[float],
                core_share: Sequence[float]) -> Tuple[List[int], List[dict]]:
        """One window's figures. Returns (the ranks named and still slow, the `straggler` records of the ranks
        named at this window, without their global step), each record also logged as one line."""
        slow = slow_ranks(step_s, input_share, core_share, self.rule.margin)
        self._streak = {rank: self._streak.get(rank, 0) + 1 for rank in slow}
        named = sorted(r for r, n in self._streak.items() if n >= self.rule.windows)
        records = [self._name(rank, slow[rank], step_s, input_share, core_share)
                   for rank in named if self._streak[rank] == self.rule.windows]
        return named, records

    def _name(self, rank: int, verdict: str, step_s, input_share, core_share) -> dict:
        record = {"kind": "straggler", "rank": rank, "host": self.hosts[rank],
                  "verdict": verdict, "windows": self.rule.windows, "step_s": round(step_s[rank], 4),
                  "median_step_s": round(_others_median(step_s, rank), 4),
                  "input_wait_share": round(input_share[rank], 4),
                  "median_input_wait_share": round(_others_median(input_share, rank), 4),
                  "core_wait_share": round(core_share[rank], 4), "time": round(time.time(), 3)}
        _logger.warning(line(record))
        return record


def line(record: dict) -> str:
    """`slow rank 1 on host a: 0.210 s/step against a median of 0.120 s | input wait 45% (median 2%) | ...`"""
    return (f"slow rank {record['rank']} on host {record['host']}: {record['step_s']:.3f} s/step against a median "
            f"of {record['median_step_s']:.3f} s | input wait {100 * record['input_wait_share']:.0f}% of its time "
            f"(median {100 * record['median_input_wait_share']:.0f}%) | cores taken "
            f"{100 * record['core_wait_share']:.0f}% | {record['verdict']} ({record['windows']} log windows in a row)")


def open_watch(rule: StragglerRule, collectives, world_size: int,
               is_main: bool) -> Tuple[bool, Optional[StragglerWatch]]:
    """(whether this rank measures its core wait, rank 0's StragglerWatch or None): on with a margin and more
    than one rank, the same decision on every rank. Every rank's host name is gathered once, here."""
    if not rule.on or world_size < 2:
        return False, None
    hosts = collectives.gather_text(socket.gethostname())
    return True, StragglerWatch(rule, hosts) if is_main else None
