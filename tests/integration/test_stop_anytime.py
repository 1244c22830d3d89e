"""A stop signal at any moment of a job's life saves (issue 41): a complete checkpoint and 200, or, before the
first step, a clean 200 with nothing to save. Repeats are the same request; the relay finds ranks however they
were started.

Real processes throughout: msdist.launch jobs of the tiny model on 2 ranks, and mpirun under the relay as Slurm
signals it (every process of the step at once). The phases whose checkpoint has no time bound to meet start
together in one module fixture (`unbounded_phases`); the two with a bound (first step, checkpoint write) run alone.
"""
import os
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MPI_ENV, mpirun, processes_below
from msdist.cluster import preemption
from test_launch import EXACT_ARGS, Job
from test_preemption import AGREED, BOUND_S, _assert_saved_at, _pending, _signal_mid_epoch_2

# Long enough that no job ends before the ranks agree; every epoch evaluated, so the "evaluation" phase exists.
ARGS = EXACT_ARGS + ["--epochs", "30", "--eval_every_epochs", "1"]
_FROZEN_S = 3.0


def _signal_all(pids, sig=signal.SIGTERM) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _agreed_steps(job) -> list:
    """(step, seconds from the signal to the complete checkpoint) of each rank that saved on the request."""
    found = []
    for rank in (0, 1):
        path = os.path.join(job.output_dir, "logs", f"rank_{rank}.log")
        with open(path, encoding="utf-8") as f:
            found += [(int(step), float(s)) for step, s in AGREED.findall(f.read())]
    return found


def _assert_saved_or_nothing_to_save(job, phase: str) -> None:
    """Exit 200 and either every rank's newest checkpoint is the step all agreed on, or the launcher ended
    between attempts, where the newest complete checkpoint already is what a requeue takes. Signalled before the
    first step, the ranks save after it; during training, within the bound (one step + one save + 10 s). During an
    evaluation or a restart the bound counts from the end of that phase, which the log does not say: printed."""
    assert job.wait() == preemption.REQUEUE_EXIT, job.stderr()
    agreed = _agreed_steps(job)
    if agreed:
        assert len(agreed) == 2 and agreed[0][0] == agreed[1][0], agreed
        _assert_saved_at(job, agreed[0][0])
        seconds = max(s for _, s in agreed)
        print(f"{phase}: agreed step {agreed[0][0]}, checkpoint complete on every rank {seconds:.1f} s after the signal")
        if phase in ("start-up", "compile"):
            assert agreed[0][0] == 1
        elif phase in ("first step", "checkpoint write"):
            assert seconds <= BOUND_S, agreed
    else:
        assert "not restarting: the job is being preempted" in job.stderr(), job.stderr()
    assert job.leftovers() == []


def _signal_launcher_while_frozen(job, pids) -> None:
    """SIGTERM to the launcher while the ranks `pids` are stopped; they run on once it is pending in each (or after
    _FROZEN_S: a listener thread in sigwait may take it off the pending set even while its process is stopped)."""
    job.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _FROZEN_S
    while not all(_pending(pid, signal.SIGTERM) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    _signal_all(pids, signal.SIGCONT)


def _log_says(path: str, text: str) -> bool:
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        return text in f.read()


def _freeze_on_checkpoint_write(job) -> None:
    """Freeze both ranks as soon as a checkpoint file is being written (its tmp file exists), send SIGTERM to the
    launcher, and let them run on once it reached them: the signal lands in the middle of a write."""
    ckpt = os.path.join(job.output_dir, "ckpt")
    pids = [job.wait_for_beat(rank)["pid"] for rank in (0, 1)]
    deadline = time.monotonic() + 240
    while not (os.path.isdir(ckpt) and any(".tmp" in name for name in os.listdir(ckpt))):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr()
        time.sleep(0.005)
    _signal_all(pids, signal.SIGSTOP)
    _signal_launcher_while_frozen(job, pids)


def _freeze_in_compile(job) -> None:
    """Freeze each rank as its log says it is about to compile the train step (build_model's "gradients:" line comes
    right before it), send SIGTERM to the launcher once both are frozen, and let them run on once it reached them: a
    cold compile of the tiny model takes about a second, shorter than the heartbeat's 2 s between beats."""
    pids = [job.wait_for_beat(rank)["pid"] for rank in (0, 1)]
    logs = [os.path.join(job.output_dir, "logs", f"rank_{rank}.log") for rank in (0, 1)]
    frozen, deadline = set(), time.monotonic() + 240
    while len(frozen) < 2:
        for rank, path in enumerate(logs):
            if rank not in frozen and _log_says(path, "gradients:"):
                os.kill(pids[rank], signal.SIGSTOP)
                frozen.add(rank)
        assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr()
        time.sleep(0.005)
    _signal_launcher_while_frozen(job, pids)


def _lose_a_rank_then_signal_during_the_restart(job) -> None:
    os.kill(job.wait_for_beat(1, at_least_step=3)["pid"], signal.SIGKILL)
    job.wait_for_text("restart 1 of 1")
    job.proc.send_signal(signal.SIGTERM)


_PHASES = {
    "start-up": lambda job: (job.wait_for_text("attempt 1: started"), job.proc.send_signal(signal.SIGTERM)),
    "compile": _freeze_in_compile,
    "first step": lambda job: (job.wait_for_beat(0, at_least_step=1), job.proc.send_signal(signal.SIGTERM)),
    "evaluation": _signal_mid_epoch_2,     # frozen right after rank 1's epoch-1 save, before its evaluation
    "checkpoint write": _freeze_on_checkpoint_write,
    "restart": _lose_a_rank_then_signal_during_the_restart,
}


# Signalled where `_assert_saved_or_nothing_to_save` asks for no time bound: their jobs may run beside each other.
_UNBOUNDED = ("start-up", "compile", "evaluation", "restart")


def _signalled_in(tmp, phase: str) -> Job:
    """A job signalled in `phase`, once it ended."""
    launcher = ["-n", "2"] + (["--max_restarts", "1"] if phase == "restart" else [])
    job = Job(tmp, phase.replace(" ", "_"), launcher, ARGS)
    try:
        _PHASES[phase](job)
        job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
    return job


@pytest.fixture(scope="module")
def unbounded_phases(tmp_path_factory):
    """The jobs signalled in the phases with no time bound, started at once and all ended before a test looks."""
    with ThreadPoolExecutor(max_workers=len(_UNBOUNDED)) as pool:
        ended = {phase: pool.submit(_signalled_in, tmp_path_factory.mktemp(phase.replace(" ", "_")), phase)
                 for phase in _UNBOUNDED}
    return ended


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase", list(_PHASES))
def test_sigterm_to_launch_in_any_phase_ends_with_a_complete_checkpoint_and_200(tmp_path, phase, request):
    if phase in _UNBOUNDED:
        job = request.getfixturevalue("unbounded_phases")[phase].result()
    else:
        job = _signalled_in(tmp_path, phase)
    _assert_saved_or_nothing_to_save(job, phase)


@pytest.mark.multiprocess
def test_slurm_sigterm_to_every_process_of_an_mpirun_step_under_the_relay_saves_once_despite_a_repeat(tmp_path):
    """Slurm's preemption or scancel signals every process of the step: the relay, mpirun (shielded by the relay:
    it would kill its ranks a second later) and the ranks, here started as `<interpreter link> -u -X dev -m
    msdist.train` (the relay finds them by their announcement, not their command line). The same SIGTERM again
    5 s later does not interrupt the save; the relay exits 200 because every rank recorded 200."""
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed")
    interpreter = tmp_path / "interp"   # not named python*
    interpreter.symlink_to(sys.executable)
    ranks_dir = tmp_path / "ranks"
    relay = [sys.executable, "-m", "msdist.launcher.relay", "--", *mpirun(2), str(interpreter), "-u", "-X", "dev",
             "-m", "msdist.train"]
    job = Job(tmp_path, "slurm_mpirun", [], ARGS, command=relay, env={**MPI_ENV, "MSDIST_RANKS_DIR": str(ranks_dir)})
    job.wait_for_checkpoint(1, 12)
    _signal_all(processes_below(job.proc.pid))
    time.sleep(5)
    _signal_all(processes_below(job.proc.pid))  # the repeat: to whatever is still running
    assert job.wait() == preemption.REQUEUE_EXIT, job.stderr()
    err = job.stderr()
    assert re.search(r"msdist\.relay: told ranks \[\d+, \d+\]", err), err
    [(step, seconds_0), (step_1, seconds_1)] = _agreed_steps(job)
    assert step == step_1 >= 12 and max(seconds_0, seconds_1) <= BOUND_S
    print(f"relay over mpirun, SIGTERM to every process and again 5 s later: agreed step {step}, checkpoint "
          f"complete {max(seconds_0, seconds_1):.1f} s after the signal")
    _assert_saved_at(job, step)
    assert sorted(os.listdir(ranks_dir)) == sorted(str(pid) for pid in _told_pids(err))
    assert job.leftovers(settle_s=15) == []


def _told_pids(err: str) -> list:
    return [int(pid) for pid in re.findall(r"\d+", re.search(r"told ranks \[([\d, ]+)\]", err).group(1))]
