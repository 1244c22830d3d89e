"""msdist.launch: real launcher processes, real MindSpore workers, hard time limits.

Every launcher runs with a unique MSDIST_TEST_TAG in its environment, which every process it starts
inherits (workers and scheduler), so "nothing left behind" is checked on exactly this test's
processes, never on other jobs running on the machine.

The slow runs start together in module fixtures and are shared between assertions, so the file
costs a few launcher runs of wall time rather than one per assertion: `background_jobs` (no interaction) and
`failing_runs` (each ended by what a thread does to it: SIGSTOP, SIGKILL, a user error).
"""
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from msdist import launch
from msdist.base.errors import ConfigError, DataError
from msdist.cluster import heartbeat
from msdist.cluster.rendezvous import free_port
from msdist.launcher import failures, supervisor
from msdist.run import checkpoint
from conftest import REPO
from conftest import REAL_DATA as DATA_DIR


RETRY_SCRIPT = os.path.join(REPO, "scripts", "run_distribute_train_retry.sh")
RUN_LIMIT_S = 240          # hard limit for any one launcher run
STOP_BOUND_S = 15          # the bound: failure seen -> everything stopped
# Five short epochs (12 steps each): two epoch-boundary checkpoints before the kill in epoch 3, and time to aim it.
TINY_CONFIG = os.path.join(REPO, "configs", "tiny_test.yaml")
EXACT_ARGS = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--batch_size", "16", "--epochs", "5",
              "--deterministic", "true", "--log_every", "5", "--keep_checkpoint_max", "5"]
SHORT_ARGS = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--epochs", "4", "--max_steps", "40", "--log_every", "5"]


# ---------------------------------------------------------------- helpers

class Job:
    """One `python -m msdist.launch` run (or another `command`) in the background, its stderr in a file."""

    def __init__(self, tmp_dir, name, launcher_args, train_args, env=None, output_name=None, command=None,
                 before_start=None):
        self.tag = f"msdist-test-{uuid.uuid4().hex}"
        self.output_dir = os.path.join(str(tmp_dir), output_name or name)
        if before_start is not None:
            before_start(self.output_dir)
        self.err_path = os.path.join(str(tmp_dir), f"{name}.launcher.err")
        full_env = dict(os.environ, PYTHONPATH=REPO, MSDIST_TEST_TAG=self.tag, **(env or {}))
        with open(self.err_path, "wb") as err, open(os.path.join(str(tmp_dir), f"{name}.launcher.out"), "wb") as out:
            command = command or [sys.executable, "-m", "msdist.launch"]
            self.proc = subprocess.Popen([*command, *launcher_args, *train_args, "--output_dir", self.output_dir],
                                         # cwd: MindSpore drops rank_*/om/analyze_fail.ir there on a compile error
                                         cwd=str(tmp_dir), env=full_env, stdout=out, stderr=err)
        self.started = time.monotonic()

    def wait(self, limit_s=RUN_LIMIT_S) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.started + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launcher did not finish within {limit_s} s:\n{self.stderr()}") from None

    def stderr(self) -> str:
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for_checkpoint(self, rank, at_least_step, limit_s=RUN_LIMIT_S) -> int:
        """Block until `rank` has a complete checkpoint at `global_step >= at_least_step`; return its step.

        Polled every 50 ms, not read from a heartbeat: beats come every 2 s, long enough for a fast host to run
        the rest of a tiny job, so a signal sent on a beat can land after the last step."""
        deadline = time.monotonic() + limit_s
        while (step := _newest_checkpoint_step(self, rank)) < at_least_step:
            assert time.monotonic() < deadline, f"rank {rank} saved no step >= {at_least_step}:\n{self.stderr()}"
            assert self.proc.poll() is None, f"launcher ended early:\n{self.stderr()}"
            time.sleep(0.05)
        return step

    def wait_for_text(self, text, limit_s=RUN_LIMIT_S) -> float:
        """Block until the launcher printed `text`; return when (monotonic)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if text in self.stderr():
                return time.monotonic()
            assert self.proc.poll() is None or text in self.stderr(), f"launcher ended early:\n{self.stderr()}"
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not printed within {limit_s} s:\n{self.stderr()}")

    def wait_for_beat(self, rank, at_least_step=0, limit_s=RUN_LIMIT_S, other_than_pid=None) -> dict:
        """Block until `rank` reports `global_step >= at_least_step` (0: any heartbeat at all), from a process
        other than `other_than_pid` when given."""
        path = heartbeat.path_for(os.path.join(self.output_dir, "logs"), rank)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            beat = heartbeat.read(path)
            if beat is not None and beat["global_step"] >= at_least_step and beat["pid"] != other_than_pid:
                return beat
            assert self.proc.poll() is None, f"launcher ended early:\n{self.stderr()}"
            time.sleep(0.1)
        raise AssertionError(f"rank {rank} never reached global step {at_least_step}:\n{self.stderr()}")

    def leftovers(self, settle_s=5.0) -> list:
        """Processes still carrying this job's tag, after giving exiting ones `settle_s` to go."""
        deadline = time.monotonic() + settle_s
        while True:
            alive = _tagged_pids(self.tag)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def final_params(self, rank) -> dict:
        import mindspore as ms
        info = checkpoint.latest_good(os.path.join(self.output_dir, "ckpt"), "resnet_tiny", rank)
        assert info is not None, f"no good checkpoint for rank {rank} in {self.output_dir}"
        # Everything with a value: weights, BN statistics, optimizer moments and step, saved state.
        return {k: v.asnumpy() for k, v in ms.load_checkpoint(info.path).items() if hasattr(v, "asnumpy")}


def stop_all(jobs) -> None:
    """SIGKILL every launcher of `jobs` (a dict of Job) still running, and reap it."""
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def assert_same_final_params(job, reference) -> None:
    """Both ranks of `job` end with exactly the parameters (and training state) of the uninterrupted `reference`."""
    assert reference.wait() == 0, reference.stderr()
    for rank in (0, 1):
        got, want = job.final_params(rank), reference.final_params(rank)
        assert sorted(got) == sorted(want)
        different = [name for name in want if not np.array_equal(got[name], want[name])]
        assert not different, f"rank {rank}: {len(different)} parameters differ, e.g. {different[:3]}"


def _tagged_pids(tag) -> list:
    needle = f"MSDIST_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat", "rb") as stat:
                        if stat.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                            found.append(int(entry))
        except OSError:
            continue
    return found


def _newest_checkpoint_step(job, rank) -> int:
    info = checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank)
    return info.position.global_step if info else 0


def _ckpt_files(job, rank, epoch):
    return glob.glob(os.path.join(job.output_dir, "ckpt", f"resnet_tiny_rank{rank}-{epoch}_*.ckpt"))


# ---------------------------------------------------------------- shared runs (started together)

@pytest.fixture(scope="module")
def background_jobs(tmp_path_factory):
    """Runs that need no interaction, started at once so their waits overlap."""
    tmp = tmp_path_factory.mktemp("launch")
    port = free_port()
    jobs = {
        # Uninterrupted reference for the exact-resume check.
        "reference": Job(tmp, "reference", ["-n", "2"], EXACT_ARGS),
        # Rank 1 raises whenever it saves a checkpoint, on every attempt: one restart, then FAILED.
        "always_fails": Job(tmp, "always_fails", ["-n", "2", "--max_restarts", "1"], SHORT_ARGS,
                            before_start=_block_checkpoints_of_rank_1),
    }
    # Two "nodes" on this machine: two launchers, one rank each, one job of world size 2.
    node_args = ["-n", "1", "--nnodes", "2", "--master_port", str(port)]
    loopback = node_args + ["--master_addr", "localhost"]   # a host name: resolved once by each launcher
    jobs["node1"] = Job(tmp, "node1", loopback + ["--node_rank", "1"], SHORT_ARGS, output_name="multinode")
    jobs["node0"] = Job(tmp, "node0", loopback + ["--node_rank", "0"], SHORT_ARGS, output_name="multinode")
    yield jobs
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def _block_checkpoints_of_rank_1(output_dir):
    """Directories where rank 1 writes its checkpoints (epochs 1 and 2) before renaming them: each save raises
    IsADirectoryError in rank 1 only. The first attempt fails at epoch 1; the restart resumes from rank 0's
    epoch-1 checkpoint (rank 1 has none of its own) and fails at epoch 2. (Hidden, so they are no other run's.)"""
    for epoch in (1, 2):
        os.makedirs(os.path.join(output_dir, "ckpt", f".{checkpoint.file_name('resnet_tiny', 1, epoch, 12)}.tmp.ckpt"))


# ---------------------------------------------------------------- fast checks, no MindSpore

@pytest.mark.multiprocess
def test_busy_explicit_port_is_refused_at_once(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        job = Job(tmp_path, "busy", ["-n", "2", "--master_port", str(port)], SHORT_ARGS)
        code = job.wait(limit_s=30)
    assert code == 2
    assert f"--master_port {port} is already in use" in job.stderr()
    assert not os.path.exists(os.path.join(job.output_dir, "logs", "rank_0.heartbeat"))


@pytest.mark.multiprocess
def test_bad_train_option_fails_before_starting_anything(tmp_path):
    with pytest.raises(ConfigError, match="unknown option --epoch"):
        launch.parse_args(["-n", "2", "--config", "configs/tiny_test.yaml", "--epoch", "3"])
    with pytest.raises(ConfigError, match="--master_addr"):
        launch.parse_args(["-n", "1", "--nnodes", "2", "--node_rank", "1"])
    # A mistyped launcher option is suggested as the launcher option it resembles.
    with pytest.raises(ConfigError, match=r"unknown option --max_restart \(did you mean --max_restarts\?\)"):
        launch.parse_args(["-n", "2", "--max_restart", "3", "--data_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"did you mean --stall_silence_timeout\?"):
        launch.parse_args(["-n", "2", "--stall_silence_timout", "3", "--data_dir", str(tmp_path)])
    with pytest.raises(DataError, match="batch_size 15 is the global batch and must divide evenly over 4 ranks"):
        launch.parse_args(["-n", "2", "--nnodes", "2", "--master_addr", "h", "--master_port", "1", "--batch_size", "15"])
    # A missing data_dir is named once, before any rank starts.
    proc = subprocess.run([sys.executable, "-m", "msdist.launch", "-n", "2", "--data_dir", str(tmp_path / "nowhere"),
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "msdist: error: data_dir" in proc.stderr and "nowhere" in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "logs")


@pytest.mark.multiprocess
def test_unresolvable_master_addr_is_named_at_once(tmp_path):
    # (a name that resolves is used by the two-nodes-on-one-machine run: --master_addr localhost)
    began = time.monotonic()
    job = Job(tmp_path, "unresolvable", ["-n", "1", "--nnodes", "2", "--node_rank", "0", "--master_addr",
                                         "no-such-host.invalid", "--master_port", "29500"], SHORT_ARGS)
    assert job.wait(limit_s=30) == 2
    assert time.monotonic() - began < 30
    err = job.stderr()
    assert err.count("\n") == 1 and "--master_addr 'no-such-host.invalid' does not resolve" in err, err


def test_a_rank_sigtermed_by_the_cluster_is_reported_with_the_rank_the_scheduler_timed_out(tmp_path):
    # MindSpore SIGTERMs the live ranks as soon as it times a node out, but its scheduler writes its
    # verdict and exits up to 5 s later (it checks its nodes every 5 s): the launcher must wait for it.
    log = tmp_path / "scheduler.log"
    verdict = ("msdist.scheduler: MindSpore's scheduler failed: The total number of timed out node is 1. "
               "Timed out node list is: [const vector]{1}, worker 1 is the first one timed out, please check its log.")
    scheduler = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(5); "
                                  "open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')", str(log), verdict])
    failure = failures.with_cluster_cause(failures.Failure(0, "killed by SIGTERM"), scheduler, str(tmp_path))
    assert failure.how.startswith("killed by SIGTERM, after rank 1 stopped responding"), failure.how


@pytest.mark.multiprocess
def test_stall_limit_is_startup_timeout_until_the_first_step(tmp_path):
    plan = launch.parse_args(["-n", "1", "--stall_silence_timeout", "10", "--stall_startup_timeout", "600",
                              "--output_dir", str(tmp_path), "--data_dir", str(tmp_path)])
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        worker = supervisor._Worker(0, sleeper, str(tmp_path / "rank_0.heartbeat"), {})
        for epoch, stalled in ((0, False), (1, True)):
            with open(worker.heartbeat_path, "w") as f:
                json.dump({"time": time.time() - 20, "pid": sleeper.pid, "rank": 0, "epoch": epoch, "step": 0,
                           "global_step": 0}, f)
            failure = supervisor._check_worker(worker, plan)
            assert (failure is not None) == stalled
        assert "stalled: no heartbeat for 20 s (--stall_silence_timeout 10)" in failure.how
        # A process stopped before its first step is not compiling: the training limit applies.
        with open(worker.heartbeat_path, "w") as f:
            json.dump({"time": time.time() - 20, "pid": sleeper.pid, "rank": 0, "epoch": 0, "step": 0,
                       "global_step": 0}, f)
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not heartbeat.is_stopped(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        failure = supervisor._check_worker(worker, plan)
        assert "(process stopped) (--stall_silence_timeout 10)" in failure.how
        # A rank that never wrote a heartbeat is stalled once the start-up limit passes after its spawn.
        os.remove(worker.heartbeat_path)
        sleeper.send_signal(signal.SIGCONT)
        quiet = supervisor._Worker(0, sleeper, worker.heartbeat_path, {}, started=time.time() - 700)
        failure = supervisor._check_worker(quiet, plan)
        assert failure is not None and "no heartbeat in 700 s since start (--stall_startup_timeout 600)" in failure.how
        assert supervisor._check_worker(supervisor._Worker(0, sleeper, worker.heartbeat_path, {}), plan) is None
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.multiprocess
def test_kill9_is_named_fast_and_restart_resumes_exactly(tmp_path, background_jobs):
    """kill -9 of rank 1 in epoch 3, after corrupting rank 1's epoch-2 checkpoint.

    The launcher must name rank 1 and SIGKILL within the bound, stop the other rank, restart with
    --resume auto; the ranks must agree on epoch 1 (rank 1's newest good), and the run must end
    with exactly the parameters of the uninterrupted reference run.
    """
    job = Job(tmp_path, "killed", ["-n", "2", "--max_restarts", "1"], EXACT_ARGS)
    job.wait_for_checkpoint(1, 24)
    [epoch2] = _ckpt_files(job, 1, 2)   # complete (12 steps per epoch); rank 1 is now in epoch 3
    with open(epoch2, "r+b") as f:  # corrupt in place: the sidecar's sha256 no longer matches
        f.seek(100)
        f.write(b"\xff" * 64)
    first_attempt = [heartbeat.read(heartbeat.path_for(os.path.join(job.output_dir, "logs"), r))["pid"]
                     for r in (0, 1)]
    killed_at = time.monotonic()
    os.kill(first_attempt[1], signal.SIGKILL)
    seen = job.wait_for_text("rank 1 failed: killed by SIGKILL", limit_s=STOP_BOUND_S)
    job.wait_for_text("restart 1 of 1", limit_s=STOP_BOUND_S)
    assert time.monotonic() - killed_at < STOP_BOUND_S
    assert seen - killed_at < STOP_BOUND_S
    assert not any(os.path.exists(f"/proc/{pid}") for pid in first_attempt), "first attempt's ranks still alive"
    assert job.wait() == 0, job.stderr()
    assert job.leftovers() == []

    log = open(os.path.join(job.output_dir, "logs", "rank_1.log"), encoding="utf-8").read()
    assert "sha256 mismatch" in log and "resnet_tiny_rank1-2_" in log  # the corrupt one was skipped, by name
    assert "resumed from" in log and "global step 12" in log           # ...and the ranks agreed on epoch 1

    assert_same_final_params(job, background_jobs["reference"])


# ---------------------------------------------------------------- failing runs (started together)

def _stopped_by_sigstop(tmp) -> tuple:
    # Long enough that only the stop can end it; only the heartbeat can tell.
    job = Job(tmp, "stall", ["-n", "2", "--stall_silence_timeout", "10"], SHORT_ARGS + ["--max_steps", "100000",
                                                                                    "--epochs", "1000"])
    beat = job.wait_for_beat(1, at_least_step=4)
    os.kill(beat["pid"], signal.SIGSTOP)
    return job.wait(), job.stderr(), job.leftovers()


def _user_error_in_a_rank(tmp) -> tuple:
    taken = tmp / "user_error" / "ckpt"   # another run's checkpoints: only the ranks look there
    taken.mkdir(parents=True)
    (taken / "resnet_tiny_rank0-1_2.ckpt").write_bytes(b"x")
    job = Job(tmp, "user_error", ["-n", "2", "--max_restarts", "2"], SHORT_ARGS)
    return job.wait(), job.stderr(), job.leftovers()


def _mpirun_retry_loop_with_rank_1_killed_twice(tmp) -> tuple:
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed")
    # The mpirun retry loop: rank 1 is killed (SIGKILL) on both attempts.
    job = Job(tmp, "mpirun_retry", ["2"], SHORT_ARGS + ["--max_steps", "100000", "--epochs", "1000"],
              command=["bash", RETRY_SCRIPT], env={"MAX_RESTARTS": "1"})
    killed = None
    for _ in range(2):
        killed = job.wait_for_beat(1, at_least_step=3, other_than_pid=killed)["pid"]
        os.kill(killed, signal.SIGKILL)
    code = job.wait()
    # Both mpirun jobs ended, the scheduler rank 0 started included (its watchdog allows 10 s).
    return code, job.stderr(), job.leftovers(settle_s=15), job.output_dir


def _launcher_killed_by_sigkill(tmp) -> list:
    job = Job(tmp, "launcher_kill9", ["-n", "2"], SHORT_ARGS)
    job.wait_for_beat(0)
    job.wait_for_beat(1)
    job.proc.kill()
    job.proc.wait()
    # Workers die with the launcher (PR_SET_PDEATHSIG); the scheduler's watchdog allows itself 10 s.
    return job.leftovers(settle_s=20)


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory):
    """Runs ended by a fault a thread of their own causes, started at once (each mostly waits: a start-up, then a
    silence limit, a restart, a launcher's end) and all ended before a test looks; each tells what it saw as it
    ended (nothing left behind is looked for right then, as a test of its own would)."""
    runs = {"sigstop": _stopped_by_sigstop, "user_error": _user_error_in_a_rank,
            "mpirun_retry": _mpirun_retry_loop_with_rank_1_killed_twice, "launcher_kill9": _launcher_killed_by_sigkill}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        ended = {name: pool.submit(run, tmp_path_factory.mktemp(name)) for name, run in runs.items()}
    return ended


@pytest.mark.multiprocess
def test_sigstop_is_detected_by_heartbeat(failing_runs):
    code, err, leftovers = failing_runs["sigstop"].result()
    assert code != 0
    assert "rank 1 failed: stalled: no heartbeat" in err and "(process stopped)" in err
    assert "global step" in err
    assert leftovers == []


@pytest.mark.multiprocess
def test_exception_reported_once_and_restart_budget_exhausted(background_jobs):
    job = background_jobs["always_fails"]
    assert job.wait() == 1
    err = job.stderr()
    assert err.count("restart 1 of 1") == 1
    for epoch in (1, 2):   # the restart continued from rank 0's epoch-1 checkpoint
        assert len(re.findall(rf"rank 1 failed: exit code 1; last reported epoch {epoch} step \d+ \(global step \d+\) "
                              r"in [a-z -]+; stopped", err)) == 1, err
    # The traceback tail is printed once per failure, in the summary, and only this attempt's.
    assert err.count("rank 1 | IsADirectoryError: For 'save_checkpoint'") == 2
    assert "FAILED after 1 restart(s): rank 1 failed: exit code 1" in err.splitlines()[-1]
    assert job.leftovers() == []


@pytest.mark.multiprocess
def test_two_nodes_on_one_machine_form_one_job(background_jobs):
    _assert_one_job_of_two_nodes(background_jobs["node0"], background_jobs["node1"])
    for node in ("node0", "node1"):
        assert "--master_addr localhost resolves to 127.0.0.1" in background_jobs[node].stderr()


def _assert_one_job_of_two_nodes(node0, node1):
    assert node0.wait() == 0, node0.stderr()
    assert node1.wait() == 0, node1.stderr()
    logs = os.path.join(node0.output_dir, "logs")
    for rank in (0, 1):
        text = open(os.path.join(logs, f"rank_{rank}.log"), encoding="utf-8").read()
        assert "world size 2" in text
        saved = checkpoint.latest_good(os.path.join(node0.output_dir, "ckpt"), "resnet_tiny", rank)
        assert saved is not None and saved.position.global_step == 40
    assert os.path.exists(os.path.join(node0.output_dir, "result.json"))
    # The process node 1 started is global rank 1: its heartbeat (written under that rank) has its pid.
    beat = heartbeat.read(heartbeat.path_for(logs, 1))
    assert f"started rank 1 pid {beat['pid']} (world size 2, node 1)" in node1.stderr()


@pytest.mark.multiprocess
def test_user_error_in_a_rank_is_not_restarted(failing_runs):
    code, err, leftovers = failing_runs["user_error"].result()
    assert code == 1
    assert "failed: exit code 2" in err and "holds another run's checkpoints" in err  # the rank's error line
    assert "not restarting" in err and "restart 1 of 2" not in err
    assert leftovers == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM, signal.SIGINT]], ids=["ctrl_c", "sigterm_then_ctrl_c"])
def test_ctrl_c_to_launcher_stops_at_once_even_after_a_sigterm_and_leaves_nothing_behind(tmp_path, signals):
    """Ctrl-C stays "stop now"; SIGTERM asks for a preemption (tests/test_preemption.py), and Ctrl-C after it still
    stops at once. It is sent while the ranks still compile, before they can agree on a step to save at."""
    job = Job(tmp_path, "stopped", ["-n", "2"], SHORT_ARGS)
    job.wait_for_beat(0)
    job.wait_for_beat(1)
    assert len(_tagged_pids(job.tag)) >= 4  # launcher, scheduler (watchdog + scheduler), workers
    for i, sig in enumerate(signals):
        if i:
            time.sleep(2.5)
        job.started = time.monotonic()  # the bound counts from the signal that stops, not from the start-up
        job.proc.send_signal(sig)
    assert job.wait(limit_s=STOP_BOUND_S + 5) == 128 + signals[-1], job.stderr()
    assert f"stopped by {signals[-1].name}" in job.stderr()
    assert job.leftovers() == []


@pytest.mark.multiprocess
def test_mpirun_killed_rank_ends_job_and_retry_loop_resumes(failing_runs):
    code, err, leftovers, output_dir = failing_runs["mpirun_retry"].result()
    assert code == 128 + signal.SIGKILL  # mpirun reports the killed rank's signal
    assert err.count("job failed (exit 137); restart 1 of 1 with --resume auto") == 1
    assert "run_distribute_train_retry: FAILED (exit 137)" in err
    log = open(os.path.join(output_dir, "logs", "rank_0.log"), encoding="utf-8").read()
    assert "resume auto:" in log or "resumed from" in log  # the second run was given --resume auto
    assert leftovers == []


@pytest.mark.multiprocess
def test_kill9_of_launcher_leaves_nothing_behind(failing_runs):
    assert failing_runs["launcher_kill9"].result() == []
