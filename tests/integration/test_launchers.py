"""Launchers other than msdist.launch, for real: MindSpore's msrun, and plain mpirun's failure reports.

Each test starts real ranks of msdist.train on the tiny config and the shipped mini data set. The runs mostly wait
(a start-up, a cluster timeout, a late rank), so they start together in one module fixture (`runs`), each from a
thread of its own, and each test asserts on its run's outcome.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REAL_DATA, REPO, base_env, mpirun, msrun, tiny_args
from msdist.cluster import heartbeat
from msdist.cluster.rendezvous import free_port
from msdist.run import checkpoint

RUN_LIMIT_S = 300


def _msrun_two_workers(tmp_path) -> tuple:
    out = tmp_path / "run"
    cmd, env = msrun(tmp_path, tiny_args(REAL_DATA, out, "--max_steps", "4"))
    return subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S), out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_msrun_two_workers_form_one_job(runs):
    """msrun starts the command three times: its scheduler (MS_ROLE=MS_SCHED) and two workers."""
    proc, out = runs["msrun"].result()
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    assert console.count("eval result") == 1, console[-4000:]   # msrun tails both workers' logs
    with open(out / "result.json", encoding="utf-8") as f:
        assert json.load(f)["world_size"] == 2
    # Local rank and local size come from msrun (DEVICE_ID, --local_worker_num): the ranks split the cores.
    cores = [re.search(r"\| cores ([^|]*) \|", (out / "logs" / f"rank_{r}.log").read_text()).group(1) for r in (0, 1)]
    assert cores[0] != cores[1], cores


def _check_with_a_host_name_then_a_bad_one(_) -> tuple:
    """(the good run, the bad run, seconds the bad one took)."""
    cmd = mpirun(2) + ["--bind-to", "none", sys.executable, "-m", "msdist.check"]
    good = subprocess.run(cmd, cwd=REPO, env={**base_env(), "MS_SCHED_HOST": "localhost"}, capture_output=True,
                          text=True, timeout=RUN_LIMIT_S)
    began = time.monotonic()
    bad = subprocess.run(cmd, cwd=REPO, env={**base_env(), "MS_SCHED_HOST": "no-such-host.invalid"},
                         capture_output=True, text=True, timeout=RUN_LIMIT_S)
    return good, bad, time.monotonic() - began


@pytest.mark.multiprocess
def test_mpirun_ms_sched_host_accepts_a_host_name_and_names_a_bad_one(runs):
    """MS_SCHED_HOST=<name> under plain mpirun: resolved once to an IP; an unknown name is one line, fast.

    Also msdist.check under `--bind-to none`: each local rank binds to its own cores (it passed no
    local_rank before, so both ranks took the first slice).
    """
    good, bad, bad_took = runs["sched_host"].result()
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert "MS_SCHED_HOST localhost resolves to 127.0.0.1" in good.stderr
    cores = sorted(re.findall(r"cores ([\d,]+|not bound)", good.stdout))
    assert len(cores) == 2 and (cores[0] != cores[1] or os.cpu_count() == 1), good.stdout
    assert bad.returncode != 0 and bad_took < 60
    assert "msdist: error: MS_SCHED_HOST 'no-such-host.invalid' does not resolve" in bad.stderr, bad.stderr[-2000:]


def _mpirun_train(tmp_path, name, *extra, extra_env=None) -> subprocess.Popen:
    """Plain `mpirun -n 2 msdist.train` (CPU bridge) in the background; output in `proc.stdout`/`stderr`."""
    return subprocess.Popen(mpirun(2) + [sys.executable, "-m", "msdist.train",
                                         *tiny_args(REAL_DATA, tmp_path / name, *extra)],
                            cwd=str(tmp_path), env={**base_env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=RUN_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _beat_of(output_dir, rank: int, at_least_step: int, proc: subprocess.Popen) -> dict:
    path = heartbeat.path_for(os.path.join(str(output_dir), "logs"), rank)
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        beat = heartbeat.read(path)
        if beat is not None and beat["global_step"] >= at_least_step:
            return beat
        assert proc.poll() is None, "the job ended early"
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never reached global step {at_least_step}")


def _last_msdist_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("msdist")]
    return lines[-1] if lines else ""


def _mpirun_with_rank_1_stopped(tmp_path) -> tuple:
    running = _mpirun_train(tmp_path, "stopped", "--max_steps", "100000", "--epochs", "1000",
                            extra_env={"MS_NODE_TIMEOUT": "10"})
    try:
        os.kill(_beat_of(tmp_path / "stopped", 1, 3, running)["pid"], signal.SIGSTOP)
    finally:
        proc = _finish(running)
    return proc, tmp_path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mpirun_stopped_rank_is_named_by_the_cluster_timeout(runs):
    """SIGSTOP of rank 1 under plain mpirun: MindSpore's scheduler times it out (MS_NODE_TIMEOUT, shortened
    to 10 s here), and rank 0 ends the job with one line naming rank 1 and the cause."""
    proc, tmp_path = runs["stopped"].result()
    assert proc.returncode != 0
    last = _last_msdist_line(proc.stderr)
    assert "msdist: job failed: rank 1 stopped responding" in last and "MS_NODE_TIMEOUT" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(last)[-1]
    assert len([line for line in proc.stderr.splitlines() if line.startswith("msdist") and "rank 1" in line]) == 1
    # The scheduler's own account is one line too, not a traceback.
    with open(tmp_path / "stopped" / "logs" / "scheduler.log", encoding="utf-8") as f:
        sched = [line for line in f if line.startswith("msdist.scheduler:")]
    assert len(sched) == 1 and "worker 1 is the first one timed out" in sched[0], sched


def _mpirun_with_rank_1_raising(tmp_path) -> subprocess.CompletedProcess:
    os.makedirs(tmp_path / "raised" / "ckpt" / f".{checkpoint.file_name('resnet_tiny', 1, 1, 12)}.tmp.ckpt")
    return _finish(_mpirun_train(tmp_path, "raised", "--max_steps", "30"))


@pytest.mark.multiprocess
def test_mpirun_failed_rank_is_named(runs):
    """An exception in rank 1 (a directory where it writes its first checkpoint): the last msdist line
    says which rank and what. (kill -9: mpirun names the rank itself, checked by
    test_launch.py::test_mpirun_killed_rank_ends_job_and_retry_loop_resumes.)"""
    proc = runs["raised"].result()
    assert proc.returncode != 0
    last = _last_msdist_line(proc.stderr)
    assert "IsADirectoryError: For 'save_checkpoint'" in last and "(rank 1)" in last, proc.stderr[-3000:]


_LATE_RANK = """
import os, sys, time
from msdist.base import launch_env
from msdist.rank import device, distributed
dist = distributed.init(launch_env.detect_launch(), device.DevicePlan("CPU", "CPU", "test"), sys.argv[1])
if dist.rank == 1:
    time.sleep(12)  # still compiling, as far as rank 0 can tell
total = distributed.Collectives(dist.world_size).sum([float(dist.rank + 1)])[0]
print(f"rank {dist.rank} sum {total:g}", flush=True)
"""


def _srun_style_ranks_one_late(tmp_path) -> tuple:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**base_env(), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2", "MS_SCHED_HOST": "127.0.0.1",
               "MS_SCHED_PORT": port, "MS_NODE_TIMEOUT": "6"}
        procs.append(subprocess.Popen([sys.executable, "-c", _LATE_RANK, str(tmp_path)], cwd=str(tmp_path), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=RUN_LIMIT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, started at once and all ended before a test looks."""
    started = {"msrun": _msrun_two_workers, "sched_host": _check_with_a_host_name_then_a_bad_one,
               "stopped": _mpirun_with_rank_1_stopped, "raised": _mpirun_with_rank_1_raising,
               "late": _srun_style_ranks_one_late}
    with ThreadPoolExecutor(max_workers=len(started)) as pool:
        ended = {name: pool.submit(run, tmp_path_factory.mktemp(name)) for name, run in started.items()}
    return ended


@pytest.mark.multiprocess
def test_a_collective_waits_for_a_rank_still_compiling_longer_than_ms_node_timeout(runs):
    """MindSpore's CPU collectives wait for a peer only MS_NODE_TIMEOUT s; a rank that compiles 12 s longer
    than another (MS_NODE_TIMEOUT=6, kept short for the scheduler's dead-rank detection) must not fail the job.
    Two srun-style ranks (msdist's cluster bridge: rank 0 starts the scheduler), real MindSpore processes."""
    procs, outputs = runs["late"].result()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output[-3000:]
        assert f"rank {rank} sum 3" in output, output[-3000:]
