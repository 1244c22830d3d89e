"""`msdist.launch --nnodes MIN:MAX`: the job goes on when a node is lost, and takes in nodes that ask to join.

The launchers talk through msdist.launcher.peers; msdist.launcher.membership decides (pure). This module runs
the attempts (msdist.launcher.supervisor.run_attempt) of one launcher under the views they agree on:

* first formation: the launcher started with --node_rank 0 forms view 1 once MAX nodes asked, or MIN nodes
  asked and --wait_for_nodes passed since (fewer than MIN within --stall_startup_timeout: the named failure);
  the others wait for a view that holds them;
* a node lost (no answer for --membership_timeout, or it failed) or a node that stopped its ranks: every
  launcher stops its ranks at once and says "re-forming" and why;
* a node asking to join, while the view has fewer than MAX nodes: node 0 says "saving", every launcher sends
  its ranks the preemption signal, so they save a complete checkpoint at one agreed step and exit with
  preemption.REQUEUE_EXIT (msdist.cluster.preemption); then "reforming": nothing is lost;
* a stop signal to a launcher: every rank saves at one agreed step and exits 200; then the nodes signalled
  leave (a drain) and the others go on, or the job stops (msdist.launcher.drain tells the two apart);
* reforming: the first member of the old view not gone (membership.leader) waits until every other member is
  reforming or gone, decides the next view, claims it (msdist.launcher.claims: an exclusive file in the shared
  --output_dir, so two sides of a network partition can never both go on under one generation) and publishes
  it; every member adopts it and restarts its ranks with --resume auto (the newest complete checkpoint) at the
  new world size.

A membership change is one console line on every launcher and one record in logs/membership.jsonl (node 0's
launcher writes it), both once rank 0 said where it resumed. A failure that leaves the membership as it was is
a restart (--max_restarts); a re-form because a member was lost (not one that ended or drained, nor a node
joining) counts against --max_reforms, so a flapping link or host cannot take the job back to its checkpoint
forever.
"""
import dataclasses
import json
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional

from msdist.base.errors import ConfigError
from msdist.base.files import rank_log_path
from msdist.base.launch_env import BATCH_SLOTS_VAR, RESUME_FROM_RANK0_VAR
from msdist.cluster import preemption
from msdist.launcher import claims, drain
from msdist.launcher import peers as peers_mod
from msdist.launcher.failures import Failure
from msdist.launcher.forwarder import Forwarder
from msdist.launcher.membership import (Change, NodeRange, TooFewNodes, View, decide, describe, first_order, host_of,
                                       leader, record)
from msdist.launcher.peers import Peers
from msdist.launcher.supervisor import Plan, report_failure, run_attempt, say

_WAIT_S = 0.2
_RESUMED = re.compile(r"resumed from .*global step (\d+)")
_FRESH = "resume auto: no checkpoint"


@dataclass(frozen=True)
class Limits:
    """An elastic job's membership timing and budget: msdist.launch's options of the same names (docs/elastic.md)."""
    membership_timeout: float = peers_mod.MEMBER_TIMEOUT_S   # a node silent this long is lost
    max_reforms: int = 3          # re-forms after a lost or failed node, at most this many


class _Ended(Exception):
    """This launcher ends without failure (the job finished before it was admitted)."""


class _LeftOut(Exception):
    """The job goes on without this node (the other side of a partition claimed the next view), or no node of it
    answers any more: this launcher's named failure."""


def rank_environment(plan: Plan) -> Dict[str, str]:
    """What every rank of an elastic job gets: the global batch cut into MAX nodes x -n slots at any world size
    (run/options.py, the trainer side), and `--resume auto` from rank 0's newest checkpoint (run/resume_point.py)."""
    return {BATCH_SLOTS_VAR: str(plan.max_nodes * plan.nproc), RESUME_FROM_RANK0_VAR: "1"}


def supervise(plan: Plan, forwarder: Forwarder, limits: Limits = Limits()) -> int:
    """Run this node's part of an elastic job until it ends; the exit status (msdist.launcher.supervisor.run)."""
    os.makedirs(plan.log_dir, exist_ok=True)
    os.environ.update(rank_environment(plan))   # every rank inherits it
    port = plan.master_port + 1
    me = f"{plan.master_addr if plan.node_rank == 0 else peers_mod.own_address(plan.master_addr)}:{port}"
    peers = Peers(me, f"{plan.master_addr}:{port}", plan.nproc, plan.node_rank, limits.membership_timeout).start()
    try:
        return _Elastic(plan, limits, peers, forwarder).run()
    finally:
        peers.close()


class _Elastic:
    def __init__(self, plan: Plan, limits: Limits, peers: Peers, forwarder: Forwarder):
        self.plan, self.limits, self.peers, self.forwarder = plan, limits, peers, forwarder
        self.nodes = NodeRange(plan.nnodes, plan.max_nodes)
        self.me = peers.me
        self.seen_gone: Dict[str, str] = {}   # the members the last attempt's watch found gone -> why, then
        self.seen_before: Optional[View] = None   # a newcomer: the job's view before it was admitted

    def run(self) -> int:
        try:
            view = self._form() if self.plan.node_rank == 0 else self._admitted()
        except (TooFewNodes, _LeftOut) as e:
            return self._end("failed", f"FAILED: {e}", 1)
        except _Ended as e:
            return self._end("done", str(e), 0)
        restarts, reforms, attempt, joined = 0, 0, 0, {}
        announce = _changed(self.seen_before, view) if self.seen_before else None
        # A node admitted into a job that ran already continues it, as every restart does.
        train_args = self.plan.train_args + (["--resume", "auto"] if view.generation > 1 else [])
        while True:
            self.peers.set("running", view)
            watch = _Watch(self, view, announce)
            failure = run_attempt(self._plan_for(view), train_args, attempt, joined, self.forwarder, watch.check)
            watch.announce(watch.resumed_step())
            attempt += 1
            status = self._ended(failure, watch.admitting, view)
            if status is not None:
                return status
            self.peers.set("reforming")
            if failure.reform:
                say(f"re-forming: {failure.how}; every local rank stopped")
            self.seen_gone = watch.seen_gone
            try:
                change = self._next(view, stop_save=failure.requeue and not watch.admitting,
                                    drain_window=drain.DRAIN_WINDOW_S if failure.reform else 0.0)
            except drain.JobStops as e:
                return self._end("preempted", f"{e}; {failure.summary()}", preemption.REQUEUE_EXIT)
            except drain.Drained as e:
                return self._drained(e.view)
            except (TooFewNodes, _LeftOut) as e:
                return self._end("failed", f"FAILED: {e}", 1)
            if change.view.members == view.members and not (failure.requeue or failure.reform):
                report_failure(failure, time.monotonic() - failure.seen_at, self.plan.log_dir)
                restarts += 1
                if restarts > self.plan.max_restarts:
                    spent = f" after {self.plan.max_restarts} restart(s)" if self.plan.max_restarts else ""
                    return self._end("failed", f"FAILED{spent}: {failure.summary()}", 1)
                say(f"restart {restarts} of {self.plan.max_restarts}: starting the ranks again with --resume auto")
            reforms += bool(drain.lost(change))
            if reforms > self.limits.max_reforms:
                spent = self.limits.max_reforms
                return self._end("failed", f"FAILED: {drain.lost(change)}; the job re-formed after a lost node {spent} "
                                 f"time(s) already (--max_reforms {spent}): a flapping host or link would take it back "
                                 "to its checkpoint forever", 1)
            announce = change if change.view.members != view.members else None
            view = change.view
            train_args = self.plan.train_args + ["--resume", "auto"]

    def _ended(self, failure: Optional[Failure], admitting: bool, view: View) -> Optional[int]:
        """This launcher's exit status when the attempt's end is the job's (None: the job re-forms)."""
        if failure is None:
            return self._end("done", "all ranks finished", 0)
        # A drain, or a stop of the whole job (msdist.launcher.drain); during an admission's save, only a node
        # signalled itself drains: the others re-form at once, with the newcomer, counting it as drained.
        if failure.requeue and (not admitting or self.forwarder.requested_at is not None):
            end, newer = drain.settle(self.peers, view, self.forwarder, lambda: self._newer(view), self.nodes.min)
            if end == drain.DRAINED:
                return self._drained(newer)
            if end == "stopped":
                return self._end("preempted", f"the job stops (no node goes on): {failure.summary()}",
                                 preemption.REQUEUE_EXIT)
            return None   # this node stays: the job re-forms without the draining nodes, or stops (_next)
        # A stop signal while the ranks stop for a re-form: this node drains from it (_next).
        if failure.user_error or (self.forwarder.requested_at is not None and not failure.reform):
            report_failure(failure, time.monotonic() - failure.seen_at, self.plan.log_dir)
            why = "fix the error above first" if failure.user_error else "the job is being preempted"
            return self._end("failed", f"not restarting: {why}", 1)
        return None

    def _drained(self, newer: View) -> int:
        return self._end(drain.DRAINED, f"drained: the job goes on as membership {newer.generation} on "
                         f"{len(newer.members)} node(s) without this node", drain.DRAINED_EXIT)

    def _plan_for(self, view: View) -> Plan:
        return dataclasses.replace(self.plan, nnodes=len(view.members), node_rank=view.members.index(self.me),
                                   master_addr=view.scheduler_host)

    def _end(self, phase: str, line: str, code: int) -> int:
        """Say why this launcher ends, and stay long enough for the others to hear its last word."""
        say(line)
        self.peers.set(phase)
        time.sleep(3 * peers_mod.POLL_S)
        return code

    # ------------------------------------------------------------ forming

    def _form(self) -> View:
        """Node 0 at the start: wait for MIN..MAX nodes, then decide view 1 in --node_rank order."""
        began, enough_at, limit = time.monotonic(), None, self.plan.stall.stall_startup_timeout
        while True:
            waiting, now = self.peers.waiting(), time.monotonic()
            count = 1 + len(waiting)
            if count >= self.nodes.min and enough_at is None:
                enough_at = now
            if count >= self.nodes.max or (enough_at is not None and now - enough_at >= self.plan.wait_for_nodes):
                break
            if enough_at is None and now - began > limit:
                raise TooFewNodes(f"{count} node(s) joined within --stall_startup_timeout {limit:g} s, fewer than "
                                  f"the minimum {self.nodes.min} (--nnodes {self.nodes.min}:{self.nodes.max})")
            time.sleep(_WAIT_S)
        asked = {self.me: (0, -1)}
        asked.update({m: ((self.peers.state_of(m) or {}).get("node_rank", 0), i) for i, m in enumerate(waiting)})
        change = decide(View(uuid.uuid4().hex, 0, ()), set(), first_order(asked), self.nodes)
        claims.claim(self.plan.log_dir, change.view)
        self.peers.set("running", change.view)
        say(f"membership 1: {len(change.view.members)} node(s) ({', '.join(map(host_of, change.view.members))}), "
            f"world size {len(change.view.members) * self.plan.nproc}; node 0 (scheduler) "
            f"{change.view.scheduler_host}")
        return change.view

    def _admitted(self) -> View:
        """A node that is not in the job yet: ask until a view holds it (or the job ended).

        Raises:
            _Ended: the job finished first.
            _LeftOut: every node of the job stopped answering first.
            ConfigError: no node answers at --master_addr, or the job runs another -n.
        """
        began, told = time.monotonic(), False
        while True:
            view = self.peers.newest_view(None)
            states = [s for s in map(self.peers.state_of, view.members if view else [self.peers.contact]) if s]
            if states and states[0]["nproc"] != self.plan.nproc:
                raise ConfigError(f"the job runs -n {states[0]['nproc']} ranks per node, this launcher -n "
                                  f"{self.plan.nproc}: every node of an elastic job needs the same -n")
            if view is not None and self.me in view.members:
                self.peers.set("running", view)   # no longer "waiting": that would be a restarted launcher
                claims.check_shared(self.plan.log_dir, self.plan.output_dir, view)
                return view
            self.seen_before = view
            if view is None and time.monotonic() - began > self.plan.stall.stall_startup_timeout:
                raise ConfigError(f"no launcher answered at {self.peers.contact} (--master_addr, --master_port + 1) "
                                  f"within --stall_startup_timeout {self.plan.stall.stall_startup_timeout:g} s")
            if view is not None:
                if any(s.get("phase") in peers_mod.ENDED for s in states):
                    raise _Ended("the job ended before this node was admitted")
                if len(self.peers.gone(view)) == len(view.members):
                    raise _LeftOut("every node of the job stopped answering before this node was admitted")
                if not told:
                    say(f"the job runs on {len(view.members)} node(s) (node 0: {view.scheduler_host}); waiting "
                        "to be admitted at its next checkpoint boundary")
                    told = True
            time.sleep(_WAIT_S)

    # ------------------------------------------------------------ re-forming

    def _next(self, view: View, stop_save: bool = False, drain_window: float = 0.0) -> Change:
        """After this node stopped its ranks: the next view, decided here (the leader) or adopted. `stop_save`:
        every rank saved on a stop request; the draining nodes leave (msdist.launcher.drain). `drain_window`: the
        leader, seeing a member drain, waits this long for other signals before it decides.

        Raises:
            drain.JobStops: after a stop save, or a drain leaving fewer than MIN, the job ends here instead.
            drain.Drained: this launcher, signalled while the job re-formed, left it.
        """
        began, drain_seen, signalled = time.monotonic(), None, False
        stop_limit = 2 * self.limits.membership_timeout   # a member that answers but has not stopped its ranks by then
        while True:
            if self.forwarder.requested_at is not None and not signalled:
                signalled = True   # a drain: it never decides; a view decided without hearing it still holds it
                drain.leaving(self.peers, "the job re-forms from a complete checkpoint", self.nodes.min)
            gone = self.peers.gone(view)
            gone.update({m: why for m, why in self.seen_gone.items() if m in gone})  # as first seen
            for m in view.members:   # ended (its ranks finished, or saved on a preemption): not coming back
                state = self.peers.state_of(m) or {}
                if m != self.me and state.get("phase") in peers_mod.ENDED:
                    gone.setdefault(m, state["phase"])
                if m != self.me and any(self.peers.in_phase(m, p, view.generation) for p in drain.LEAVING_PHASES):
                    gone[m] = drain.DRAINED   # also once silent or ended: a drained node may be killed after its save
            if time.monotonic() - began > stop_limit:  # answers, but its ranks never stop: not a hang either
                gone.update({m: f"did not stop its ranks within {stop_limit:.0f} s" for m in view.members
                             if m != self.me and m not in gone and
                             not self.peers.in_phase(m, "reforming", view.generation)})
            newer = self._newer(view)
            if signalled and (newer is None or self.me not in newer.members):
                # It ends as a node draining after a stop save does (`gone` holds the draining and ended members).
                end = drain.draining_end(view, self.me, {}, list(gone), newer)
                if end == drain.DRAINED:
                    raise drain.Drained(newer)
                if end == "stopped":
                    raise drain.JobStops("the job stops (no node goes on): this node was signalled as it re-formed "
                                         "and every other node drained, ended or was lost")
            elif newer is not None:
                if self.me not in newer.members:
                    raise _LeftOut(f"the job went on as membership {newer.generation} without this node (a network "
                                   "partition, or it was too slow to answer)")
                claims.check_shared(self.plan.log_dir, self.plan.output_dir, newer)
                return _changed(view, newer, gone)
            draining = drain.DRAINED in gone.values()
            drain_seen = drain_seen or (time.monotonic() if draining else None)
            held = signalled or (drain_seen is not None and time.monotonic() < drain_seen + drain_window)
            if leader(view, set(gone)) == self.me and self._all_stopped(view, gone) and not held:
                waiting = self.peers.waiting()
                change = drain.next_view(view, gone, waiting, self.nodes) if stop_save or draining else \
                    decide(view, set(gone), waiting, self.nodes)
                change = Change(change.view, change.left, change.joined, gone)
                if claims.claim(self.plan.log_dir, change.view):   # else another node's first: follow it, or leave
                    self.peers.set("reforming", change.view)
                    return change
            time.sleep(_WAIT_S)

    def _all_stopped(self, view: View, gone: Dict[str, str]) -> bool:
        return all(m == self.me or m in gone or self.peers.in_phase(m, "reforming", view.generation)
                   for m in view.members)

    def _newer(self, view: View) -> Optional[View]:
        """The view decided after `view`, heard from a node or claimed by one this node cannot hear (a partition)."""
        newer = self.peers.newest_view(view.job)
        if newer is not None and newer.generation > view.generation:
            return newer
        return claims.claimed_after(self.plan.log_dir, view)


def _changed(before: View, after: View, why: Optional[Dict[str, str]] = None) -> Change:
    """A view decided elsewhere, as a change from `before`."""
    return Change(after, tuple(m for m in before.members if m not in after.members),
                  tuple(m for m in after.members if m not in before.members), why or {})


def _kill(workers: List) -> None:
    """SIGKILL every local rank's process group at once: their collectives wait for ranks that are gone, so
    the preemption save that SIGTERM would ask for cannot happen, and the 4 s grace would only delay the job."""
    for w in workers:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _Watch:
    """One attempt's watch on the other nodes (supervisor.run_attempt calls `check` at each poll)."""

    def __init__(self, elastic: _Elastic, view: View, announce: Optional[Change]):
        self.elastic, self.peers, self.view, self.pending = elastic, elastic.peers, view, announce
        self.admitting = False
        self.seen_gone: Dict[str, str] = {}
        self._save = Forwarder(elastic.plan.preempt_signal)
        self._rank0_log = rank_log_path(elastic.plan.log_dir, 0)
        self._offset = os.path.getsize(self._rank0_log) if os.path.exists(self._rank0_log) else 0

    def check(self, workers: List) -> Optional[Failure]:
        if self.pending is not None:
            step = self.resumed_step()
            if step is not None:
                self.announce(step)
        why = self._reason_to_reform()
        if why:
            _kill(workers)
            return Failure(None, why, reform=True)
        if not self.admitting and self._admit():
            self.admitting = True
            self.peers.set("saving")
            say("a node asks to join: every rank saves a checkpoint at the next step all ranks reach, then the "
                "job re-forms with it")
            self._save.request()
        if self.admitting:
            self._save.forward([w.proc.pid for w in workers])
        return None

    def _reason_to_reform(self) -> str:
        """Why this attempt must end now ("" = it goes on): a member gone, or one that stopped its ranks."""
        self.seen_gone = self.peers.gone(self.view)
        if self.seen_gone:
            member, why = next(iter(self.seen_gone.items()))
            return f"node {host_of(member)} {why}"
        stopped = [m for m in self.view.members if self.peers.in_phase(m, "reforming", self.view.generation)]
        return f"node {host_of(stopped[0])} stopped its ranks" if stopped else ""

    def _admit(self) -> bool:
        """Node 0 with room and a node waiting, or another member already saving for an admission."""
        if self.view.members[0] == self.peers.me and len(self.view.members) < self.elastic.nodes.max and \
                self.peers.waiting():
            return True
        return any(self.peers.in_phase(m, "saving", self.view.generation) for m in self.view.members)

    def resumed_step(self) -> Optional[int]:
        try:
            with open(self._rank0_log, encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
        except OSError:
            return None
        found = _RESUMED.findall(text)
        return int(found[-1]) if found else (0 if _FRESH in text else None)

    def announce(self, resumed_step: Optional[int]) -> None:
        """The pending membership change's one line, and node 0's record (rank 0 resumed, or the attempt ended)."""
        if self.pending is None:
            return
        change, self.pending = self.pending, None
        previous = View(change.view.job, change.view.generation - 1,
                        tuple(m for m in change.view.members if m not in change.joined) + change.left)
        line = describe(change, previous, self.elastic.plan.nproc, resumed_step)
        say(line)
        if change.view.members[0] == self.peers.me:
            with open(os.path.join(self.elastic.plan.log_dir, "membership.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record(change, previous, self.elastic.plan.nproc, resumed_step, line,
                                          time.time())) + "\n")
