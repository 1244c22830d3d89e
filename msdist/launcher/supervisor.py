"""The supervisor behind `python -m msdist.launch`: start, watch, stop and restart a job's ranks.

Starts MindSpore's dynamic cluster without OpenMPI: one scheduler (on node 0) and N local workers
running `python -m msdist.train`. MindSpore-free; msdist/launch.py parses and checks the options.

* any worker that exits non-zero, dies by a signal, or stops beating (see msdist.cluster.heartbeat)
  fails the attempt: every other process is stopped within seconds, and one line names the rank, how it
  failed and the last epoch/step it reported, followed by the tail of its traceback;
* with `--max_restarts K` it then restarts all ranks with `--resume auto`, up to K times
  (msdist.launcher.restarts);
* SIGTERM and the preemption signal (--preempt_signal) are passed on to every rank, which saves at one
  agreed step and exits with preemption.REQUEUE_EXIT; once every rank did, the launcher exits with that
  status and does not restart (msdist.cluster.preemption). A signal between attempts ends the job with
  that status too: it is where a requeue continues. Repeats are the same request. SIGINT stops every
  process it started at once; each worker also gets SIGKILL from the kernel if the launcher itself dies
  (PR_SET_PDEATHSIG), so no path leaves orphans behind.

Two watches on the heartbeats (msdist.cluster.heartbeat), which msdist.train writes from before cluster
init, both under the one stall policy (msdist.cluster.stall) the ranks' own watchdogs obey elsewhere:

* progress: a rank in one phase longer than its --stall_timeout allows (main thread stuck in a collective,
  a dead read, a deadlock; the heartbeat thread still writes) fails the attempt with one line that names
  it, what it was doing and where the other ranks wait, after every rank dumped its threads' stacks;
* liveness: no heartbeat at all (a stopped process, a hang that holds the Python lock): past
  --stall_startup_timeout before the rank's first training step, --stall_silence_timeout after it.

And one watch on MindSpore's scheduler log (node 0, msdist.cluster.registration): a rank not registered
--stall_register_timeout after all the others is named in one line and respawned with the same node id
(a rank that misses its registration is not stuck for good: a new process joins at once, issue #34).

How a failed attempt is described (the rank, how it failed, its traceback) is msdist.launcher.failures.
"""
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from msdist.base.files import rank_log_path
from msdist.cluster import heartbeat, preemption, registration, rendezvous
from msdist.cluster.stall import StallPolicy
from msdist.launcher import scheduler_generation
from msdist.launcher.failures import Failure, describe_exit, first_cause, traceback_tail, with_cluster_cause
from msdist.launcher.forwarder import Forwarder

_POLL_S = 0.5
_TERM_GRACE_S = 4.0            # SIGTERM -> SIGKILL; keeps "all stopped" well under 15 s
_PORT_RELEASE_S = 30.0         # an explicit port must come free again before a restart
_RESOLVE_RETRY_S = 10.0        # nodes > 0: node 0's host name may appear in DNS a little after they start
_STACK_DUMP_S = 1.0            # a stalled job's ranks write their stacks before they are stopped
_USER_ERROR_EXIT = 2             # msdist.base.cli.cli_main's status for a UserError
_MAX_RESPAWNS = 2                # per rank and attempt; then the attempt fails (--max_restarts: a new port)


def say(message: str) -> None:
    print(f"msdist.launch: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- options

@dataclass(frozen=True)
class Plan:
    """What to launch on this node, resolved once from the command line (msdist/launch.py); built by name."""
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int            # 0 = pick a free port for each attempt (single node only)
    max_restarts: int
    stall: StallPolicy           # the train options' --stall_*, obeyed here as the ranks' watchdogs would
    train_args: List[str]
    output_dir: str
    preempt_signal: int = signal.SIGTERM   # the train option --preempt_signal: passed on to the ranks
    max_nodes: int = 0           # --nnodes MIN:MAX's MAX (msdist.launcher.elastic when above nnodes)
    wait_for_nodes: float = 30.0  # --wait_for_nodes: elastic node 0 waits this long for more than MIN nodes

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_dir, "logs")


# ---------------------------------------------------------------- processes

def _worker_preexec(stop_signals) -> Callable[[], None]:
    """What runs in each worker before exec: the kernel kills it if the launcher dies, even by SIGKILL (without
    it, not glibc, only a launcher SIGKILL could orphan), and the stop signals wait, blocked, for its
    preempt_stop.Listener: one passed on while its interpreter starts asks for a save, not its death."""
    def preexec() -> None:
        rendezvous.set_parent_death_signal(signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    return preexec


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    heartbeat_path: str
    log_offsets: Dict[str, int]   # log file sizes at spawn: logs are appended to across attempts
    started: float = field(default_factory=time.time)
    respawns: int = 0             # times this rank was started again because it never registered


def _log_paths(log_dir: str, rank: int) -> List[str]:
    """Where a rank's traceback can be: its msdist log (cli_main), else its raw output."""
    return [rank_log_path(log_dir, rank), os.path.join(log_dir, f"rank_{rank}.out")]


def worker_env(plan: Plan, local_rank: int, host: str, port: int) -> Dict[str, str]:
    """The variables a local rank gets on top of the launcher's environment."""
    return {**rendezvous.cluster_env(host, port, plan.world_size), "MS_ROLE": "MS_WORKER",
            "MS_NODE_ID": str(plan.global_rank(local_rank)), "MSDIST_LOCAL_RANK": str(local_rank),
            "MSDIST_LOCAL_WORLD_SIZE": str(plan.nproc)}


def _spawn_worker(plan: Plan, local_rank: int, host: str, port: int, train_args: List[str],
                  extra_env: Optional[Dict[str, str]] = None) -> _Worker:
    rank = plan.global_rank(local_rank)
    env = dict(os.environ, **worker_env(plan, local_rank, host, port), **(extra_env or {}))
    beat = heartbeat.path_for(plan.log_dir, rank)
    if os.path.exists(beat):
        os.remove(beat)  # a previous attempt's heartbeat must not count for this one
    offsets = {path: os.path.getsize(path) if os.path.exists(path) else 0 for path in _log_paths(plan.log_dir, rank)}
    out = None
    if rank != 0:  # rank 0 speaks on the console; the others' raw output goes to a file
        out = open(os.path.join(plan.log_dir, f"rank_{rank}.out"), "ab")
    try:
        # Own session: the whole tree (dataset workers included) can be signalled as one group.
        proc = subprocess.Popen([sys.executable, "-m", "msdist.train", *train_args], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                preexec_fn=_worker_preexec(preemption.stop_signals(plan.preempt_signal)))
    finally:
        if out is not None:
            out.close()
    return _Worker(rank, proc, beat, offsets)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(workers: List[_Worker], scheduler: Optional[subprocess.Popen]) -> None:
    """SIGTERM every worker group, SIGKILL what is left after a grace period, reap everything."""
    for w in workers:
        if w.proc.poll() is None:
            _signal_group(w.proc, signal.SIGTERM)
            _signal_group(w.proc, signal.SIGCONT)  # a stopped (SIGSTOP) rank must run to see SIGTERM
    deadline = time.monotonic() + _TERM_GRACE_S
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(0.1)
    for w in workers:
        _signal_group(w.proc, signal.SIGKILL)  # also takes children left in the group by a leader that exited
        w.proc.wait()
    if scheduler is not None and scheduler.poll() is None:
        scheduler.kill()  # its watchdog; the scheduler proper gets SIGKILL from the kernel (msdist.cluster.scheduler)
    if scheduler is not None:
        scheduler.wait()


def _check_worker(w: _Worker, plan: Plan) -> Optional[Failure]:
    code = w.proc.poll()
    beat = heartbeat.read(w.heartbeat_path)
    if beat is not None and beat.get("pid") != w.proc.pid:
        beat = None  # left by an older process
    if code is not None and code < 0:
        return Failure(w.rank, describe_exit(code), beat)  # killed: there is no traceback to show
    if code is not None and code > 0 and code != preemption.REQUEUE_EXIT:
        return Failure(w.rank, describe_exit(code), beat, traceback_tail(w.log_offsets),
                       user_error=code == _USER_ERROR_EXIT)
    if code is not None:
        return None
    stopped = heartbeat.is_stopped(w.proc.pid)
    limit, option = plan.stall.silence_limit(beat, stopped)
    alive_at = beat["time"] if beat is not None else w.started
    silent = time.time() - alive_at
    if silent <= limit:
        return None
    what = f"no heartbeat for {silent:.0f} s" if beat is not None else f"no heartbeat in {silent:.0f} s since start"
    return Failure(w.rank, f"stalled: {what}{' (process stopped)' if stopped else ''} ({option} {limit:g})", beat,
                   stalled=True, silent_since=alive_at)


# ---------------------------------------------------------------- one attempt

class Stopped(Exception):
    """SIGTERM or SIGINT reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _pick_port(plan: Plan, attempt: int) -> int:
    if plan.master_port == 0:
        return rendezvous.free_port(plan.master_addr)
    if plan.node_rank == 0 and attempt > 0:
        # The previous scheduler was just killed; its socket can linger briefly.
        deadline = time.monotonic() + _PORT_RELEASE_S
        while rendezvous.port_in_use(plan.master_addr, plan.master_port) and time.monotonic() < deadline:
            time.sleep(0.5)
    return plan.master_port


def run_attempt(plan: Plan, train_args: List[str], attempt: int, joined: Dict[str, str],
                forwarder: Forwarder, watch: Optional[Callable[[List[_Worker]], Optional[Failure]]] = None
                ) -> Optional[Failure]:
    """Run every local rank to the end; return None on success or the first failure seen (or the requeue).

    Args:
        joined: carried across attempts: the scheduler generation this node last joined.
        forwarder: passes a preemption signal on to the ranks.
        watch: called with the workers at each poll; a Failure it returns ends the attempt (elastic: a node lost).
    """
    port = _pick_port(plan, attempt)
    scheduler, workers, joining = None, [], None
    try:
        try:
            if plan.node_rank == 0:
                scheduler_generation.new_generation(plan.log_dir)
                scheduler_log = os.path.join(plan.log_dir, "scheduler.log")
                joining = _Joining(plan, registration.LogTail.from_end(scheduler_log))
                scheduler = rendezvous.start_scheduler(plan.master_addr, port, plan.world_size, scheduler_log)
            elif attempt > 0:
                scheduler_generation.wait_for_new_generation(plan.log_dir, joined.get("generation", ""),
                                                     plan.stall.stall_startup_timeout)
            # Only once it listens: a worker that finds none fails its registration tries (see wait_until_listening).
            rendezvous.wait_until_listening(plan.master_addr, port, plan.stall.stall_startup_timeout)
        except RuntimeError as e:
            where = "" if plan.node_rank == 0 else "; check --master_addr/--master_port and that node 0's launcher runs"
            return Failure(None, f"{e}{where}")
        joined["generation"] = scheduler_generation.read_generation(plan.log_dir)
        workers = [_spawn_worker(plan, i, plan.master_addr, port, train_args) for i in range(plan.nproc)]
        ranks = ", ".join(f"rank {w.rank} pid {w.proc.pid}" for w in workers)
        say(f"attempt {attempt + 1}: started {ranks} (world size {plan.world_size}, node {plan.node_rank}); "
             f"logs in {plan.log_dir}")
        # Every rank's beat, other nodes' too when --output_dir is shared: they say where the others wait.
        progress = heartbeat.Tracker({r: heartbeat.path_for(plan.log_dir, r) for r in range(plan.world_size)},
                                     pids={w.rank: w.proc.pid for w in workers})
        while True:
            forwarder.forward([w.proc.pid for w in workers])
            failure = watch(workers) if watch else None
            if failure is not None:
                return failure
            failures = [f for f in (_check_worker(w, plan) for w in workers) if f is not None]
            if failures:
                return with_cluster_cause(first_cause(failures), scheduler, plan.log_dir)
            failure = joining.respawn_unregistered(workers, port, train_args) if joining else None
            if failure is not None:
                return failure
            progress.pids.update({w.rank: w.proc.pid for w in workers})  # a respawned rank has a new pid
            stall = heartbeat.find_stall(progress.poll(), plan.stall)
            if stall is not None:
                _dump_stacks(workers, plan.log_dir, stall.line())
                return Failure(stall.rank, "stalled", stall.culprit.beat, stalled=True, stall=stall)
            if all(w.proc.poll() == preemption.REQUEUE_EXIT for w in workers):
                return _requeue(workers)
            if all(w.proc.poll() == 0 for w in workers):
                # The work is done: the scheduler is stopped in `finally` without waiting for it, as
                # ranks that skip MindSpore's teardown (runtime.exit_without_teardown) never unregister.
                return None
            if scheduler is not None and scheduler.poll() not in (None, 0):
                log = os.path.join(plan.log_dir, "scheduler.log")
                verdict = rendezvous.scheduler_verdict(log)
                how = rendezvous.describe_timeout(verdict) or verdict or f"exit code {scheduler.returncode}"
                return Failure(None, f"{how} (see {log})")
            time.sleep(_POLL_S)
    finally:
        _stop_all(workers, scheduler)


class _Joining:
    """Node 0's view of the ranks joining this attempt's cluster, read from the scheduler's log."""

    def __init__(self, plan: Plan, log: registration.LogTail):
        self.plan = plan
        self.log = log
        self.registrations = registration.Registrations(plan.world_size, plan.stall.stall_register_timeout)
        self.started = time.monotonic()

    def respawn_unregistered(self, workers: List[_Worker], port: int, train_args: List[str]) -> Optional[Failure]:
        """Start again, with the same node id, a local rank still unregistered --stall_register_timeout after
        all the others; a rank of another node, or one already respawned _MAX_RESPAWNS times, fails the attempt."""
        self.registrations.feed(self.log.read())
        for rank in self.registrations.overdue():
            local = [i for i, w in enumerate(workers) if w.rank == rank]
            line = self.registrations.line(rank, socket.gethostname() if local else f"of node {rank // self.plan.nproc}")
            if not local or workers[local[0]].respawns >= _MAX_RESPAWNS:
                return Failure(rank, line)
            old = workers[local[0]]
            say(f"{line}; respawning it with the same node id ({old.respawns + 1} of {_MAX_RESPAWNS})")
            _signal_group(old.proc, signal.SIGKILL)
            old.proc.wait()
            new = _spawn_worker(self.plan, rank - self.plan.global_rank(0), self.plan.master_addr, port, train_args,
                                {registration.RESPAWNED_VAR: "1"})
            workers[local[0]] = dataclasses.replace(new, respawns=old.respawns + 1)
            self.registrations.restart_clock(self.started)
        return None


def _requeue(workers: List[_Worker]) -> Failure:
    """Every rank saved on a preemption and exited with REQUEUE_EXIT: where they stopped."""
    beat = heartbeat.read(workers[0].heartbeat_path)
    where = f" at global step {beat['global_step']}" if beat is not None else ""
    return Failure(None, f"every rank saved a checkpoint{where} and exited with {preemption.REQUEUE_EXIT}; "
                         "requeue the job (it continues with --resume auto)", requeue=True)


def _dump_stacks(workers: List[_Worker], log_dir: str, why: str) -> None:
    """Every live rank appends all its threads' Python stacks to its log (rank/heartbeat_writer.py
    `dump_stacks_on_signal`)."""
    for w in workers:
        if w.proc.poll() is None:
            with open(rank_log_path(log_dir, w.rank), "a", encoding="utf-8") as log:
                log.write(f"--- msdist.launch: {why}; Python stacks of every thread (most recent call first) ---\n")
            os.kill(w.proc.pid, heartbeat.STACK_DUMP_SIGNAL)
    time.sleep(_STACK_DUMP_S)


def report_failure(failure: Failure, stopped_in_s: float, log_dir: str) -> None:
    heartbeat.write_failure(log_dir, failure.record())
    say(f"{failure.summary()}; stopped all processes in {stopped_in_s:.1f} s")
    for line in failure.tail:
        print(f"  rank {failure.rank} | {line}", file=sys.stderr, flush=True)


def _raise_stop(signum, _frame=None):
    # Ignore repeats so a second Ctrl-C cannot interrupt the cleanup of the first.
    for sig in {signal.SIGTERM, signal.SIGINT, signum}:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def run(plan: Plan, supervisor: Callable[[Plan, Forwarder], int]) -> int:
    """Supervise the job `plan` describes until it ends, with `supervisor` (restarts.supervise, or elastic.supervise
    for --nnodes MIN:MAX);
    SIGTERM and the preemption signal are passed on to the ranks (repeats are the same request), Ctrl-C stops
    every process it started."""
    # MindSpore's cluster accepts only literal IPs: a host name is resolved here, once, for every rank.
    # Other nodes may start before node 0's name is in DNS (Kubernetes), so they retry for a few seconds.
    plan = dataclasses.replace(plan, master_addr=rendezvous.resolve_host(
        plan.master_addr, "--master_addr", retry_s=_RESOLVE_RETRY_S if plan.node_rank else 0.0))
    # Scheduler and workers inherit it: a rank that never registers ends the attempt at the latest then.
    os.environ.update(rendezvous.topo_timeout_env(plan.stall.stall_startup_timeout))
    signal.signal(signal.SIGINT, _raise_stop)
    forwarder = Forwarder(plan.preempt_signal)
    forwarder.install()
    try:
        return supervisor(plan, forwarder)
    except Stopped as stop:  # run_attempt's cleanup has already stopped everything
        say(f"stopped by {stop}; all processes it started are gone")
        return 128 + stop.signum
