"""Stall detection with real stuck ranks under mpirun, msdist.launch, msrun and srun-style ranks.

The real runs freeze only the main thread of one rank from outside (tests/faults.py: ptrace), so its
heartbeat and watchdog threads keep running, the way a rank stuck in a collective or a dead read looks.

The three runs that end by a stuck rank under mpirun, msrun and srun-style ranks mostly wait (a start-up, then
the stall limit): they start together in one module fixture (`stuck`), each its fault from a thread of its own,
and each test asserts on its run's outcome."""
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REAL_DATA, TINY_CONFIG, base_env, mpirun, msrun, tiny_args
from faults import freeze_main_thread
from test_launch import Job
from msdist.cluster import heartbeat
from msdist.cluster.rendezvous import free_port


RUN_LIMIT_S = 300
STALL_S = 10         # the scaled-down --stall_timeout of the runs that must stop
# Ends only by the stall; no checkpoint to save on the way (a freeze is then almost always in a train step).
# Rank 0 waits where rank 1's last queued step left it (the steps are queued, so a frozen main thread's last one
# may still finish): in the next step, or in a collective after a step (the stop check, the epoch's loss), named.
RANK_0_WAITS = re.compile(r"rank 0 waiting in (step \d+|stop check at step \d+|epoch end at step \d+)")
FROZEN = "(its main thread is stopped by a debugger)"   # the kernel's "t": the tests' ptrace freeze
LONG_RUN = ("--epochs", 1000, "--max_steps", 100000, "--log_every", 50, "--save_every_epochs", 1000)


def _wait_for_beat(log_dir, rank, at_least_step, proc, limit_s=RUN_LIMIT_S, pid=None) -> dict:
    """Block until `rank` reports `global_step >= at_least_step` (from process `pid` when given)."""
    path = heartbeat.path_for(str(log_dir), rank)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        beat = heartbeat.read(path)
        if beat is not None and beat["global_step"] >= at_least_step and (pid is None or beat["pid"] != pid):
            return beat
        assert proc.poll() is None, f"the job ended before rank {rank} reached step {at_least_step}"
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never reached global step {at_least_step}")


def _freeze_rank_1_until_the_job_ends(proc: subprocess.Popen, output_dir):
    """Freeze rank 1's main thread once it has trained a few steps; return (the job's stdout, its stderr,
    seconds from the freeze to the job's end)."""
    frozen = None
    try:
        frozen = freeze_main_thread(_wait_for_beat(output_dir / "logs", 1, 3, proc)["pid"])
        began = time.monotonic()
        out, err = proc.communicate(timeout=STALL_S + 30 + 30)   # + 30: room to see it late, not to pass
        took = time.monotonic() - began
        print(f"the job ended {took:.1f} s after rank 1's main thread was frozen (--stall_timeout {STALL_S})")
        return out, err, took
    finally:
        if frozen is not None:
            frozen.release()
        if proc.poll() is None:
            proc.kill()


def _stacks_dumped(log_dir, rank) -> bool:
    with open(os.path.join(str(log_dir), f"rank_{rank}.log"), encoding="utf-8") as f:
        text = f.read()
    return "Python stacks of every thread" in text and "(most recent call first)" in text


def _failure_record(log_dir) -> dict:
    with open(os.path.join(str(log_dir), heartbeat.FAILURE_FILE), encoding="utf-8") as f:
        return json.load(f)


def _mpirun_with_rank_1_frozen(tmp_path) -> tuple:
    """(the job's exit status, its stderr, seconds from the freeze to its end, its output dir)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(mpirun(2) + [sys.executable, "-m", "msdist.train",
                                         *tiny_args(REAL_DATA, out, *LONG_RUN, "--stall_timeout", STALL_S)],
                            cwd=str(tmp_path), env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _, err, took = _freeze_rank_1_until_the_job_ends(proc, out)
    return proc.returncode, err, took, out


def _msrun_with_rank_1_frozen(tmp_path) -> tuple:
    """(the job's exit status, its console, its stderr, seconds from the freeze to its end, its output dir)."""
    out = tmp_path / "run"
    cmd, env = msrun(tmp_path, tiny_args(REAL_DATA, out, *LONG_RUN, "--stall_timeout", STALL_S))
    proc = subprocess.Popen(cmd,
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    console, err, took = _freeze_rank_1_until_the_job_ends(proc, out)
    return proc.returncode, console, err, took, out


def _srun_style_ranks_with_a_fifo_in_their_data(tmp_path) -> tuple:
    """Two ranks started the way srun starts them; once rank 1 trains, one training image becomes a FIFO nobody
    writes. (Both ranks' exit statuses, their stderr, the output dir.)"""
    data = _tree_with_a_big_test_split(tmp_path / "data", copies=1)
    out = tmp_path / "run"
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**base_env(), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2", "MS_SCHED_HOST": "127.0.0.1",
               "MS_SCHED_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "msdist.train",
                                       *tiny_args(data, out, *LONG_RUN, "--stall_timeout", STALL_S)],
                                      cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        _wait_for_beat(out / "logs", 1, 3, procs[1])
        folder = os.path.join(data, "Training", sorted(os.listdir(os.path.join(data, "Training")))[0])
        victim = os.path.join(folder, sorted(os.listdir(folder))[0])
        os.remove(victim)
        os.mkfifo(victim)
        errs = [p.communicate(timeout=STALL_S + 30 + 60)[1] for p in procs]   # + 60: epochs until it is read
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], errs, out


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    """The runs that end by a stuck rank, started at once (each waits out its start-up and the stall limit), all
    ended before the first test looks: none runs on beside another test's job."""
    runs = {"mpirun": _mpirun_with_rank_1_frozen, "msrun": _msrun_with_rank_1_frozen,
            "srun": _srun_style_ranks_with_a_fifo_in_their_data}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        ended = {name: pool.submit(run, tmp_path_factory.mktemp(name)) for name, run in runs.items()}
    return ended


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mpirun_rank_with_a_stuck_main_thread_ends_the_job_named(stuck):
    """Rank 1's main thread frozen (its heartbeat and watchdog threads run on): the watchdog inside the
    ranks ends the mpirun job within the stall timeout + 30 s, with one console line naming rank 1."""
    returncode, err, took, out = stuck["mpirun"].result()
    assert returncode != 0
    assert took < STALL_S + 30, f"the job took {took:.0f} s to end"
    named = [line for line in err.splitlines() if line.startswith("msdist: job failed: rank 1 (host ")]
    assert len(named) == 1 and "stuck in " in named[0] and RANK_0_WAITS.search(named[0]), err[-3000:]
    assert FROZEN in named[0], named[0]
    assert len([line for line in err.splitlines() if line.startswith("msdist")]) == 1, err[-3000:]
    record = _failure_record(out / "logs")
    assert record["rank"] == 1 and record["kind"] == "stall" and record["message"] in named[0]
    assert _stacks_dumped(out / "logs", 0) and _stacks_dumped(out / "logs", 1)


# Six short epochs (12 steps each, a checkpoint after each): rank 1 is frozen after the first save.
EXACT = ["--config", TINY_CONFIG, "--data_dir", REAL_DATA, "--batch_size", "16", "--epochs", "6",
         "--deterministic", "true", "--log_every", "5"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_stall_is_named_then_restart_finishes_like_an_uninterrupted_run(tmp_path):
    """msdist.launch with a frozen main thread in rank 1: the supervisor names it (progress, not liveness:
    the heartbeat thread still beats), every rank dumps its stacks, the restart resumes from the newest
    good checkpoint and ends with the counts of a run that was never stopped."""
    reference = Job(tmp_path, "reference", ["-n", "2"], EXACT)
    stalled = Job(tmp_path, "stalled", ["-n", "2", "--max_restarts", "1"], EXACT + ["--stall_timeout", str(STALL_S)])
    logs = os.path.join(stalled.output_dir, "logs")
    beat = stalled.wait_for_beat(1, at_least_step=13)   # epoch 1's checkpoint is written
    frozen = freeze_main_thread(beat["pid"])
    try:
        began = time.monotonic()
        stalled.wait_for_text("restart 1 of 1", limit_s=STALL_S + 30)
        assert time.monotonic() - began < STALL_S + 30
    finally:
        frozen.release()
    assert stalled.wait() == 0, stalled.stderr()
    named = [line for line in stalled.stderr().splitlines() if "stuck in" in line]
    assert len(named) == 1 and named[0].startswith("msdist.launch: rank 1 (host "), stalled.stderr()
    assert (RANK_0_WAITS.search(named[0]) or "rank 0 in " in named[0]) and FROZEN in named[0], named[0]
    record = _failure_record(logs)
    assert record["rank"] == 1 and record["kind"] == "stall" and record["message"] in named[0]
    assert _stacks_dumped(logs, 0) and _stacks_dumped(logs, 1)
    assert stalled.leftovers() == []
    assert reference.wait() == 0, reference.stderr()
    results = []
    for job in (reference, stalled):
        with open(os.path.join(job.output_dir, "result.json"), encoding="utf-8") as f:
            results.append(json.load(f))
    for key in ("correct", "num_samples", "global_steps", "loss"):
        assert results[1][key] == results[0][key], key
    # The closing summary's per-rank figures (issue 27 item 5) are in result.json too.
    assert [r["rank"] for r in results[1]["ranks"]] == [0, 1]
    assert results[1]["most_input_wait_rank"] in (0, 1)


def _tree_with_a_big_test_split(root, copies: int) -> str:
    """The mini data set with its Test split `copies` times over (hard links), for a long evaluation."""
    for split in ("Training", "Test"):
        for cls in sorted(os.listdir(os.path.join(REAL_DATA, split))):
            src = os.path.join(REAL_DATA, split, cls)
            dst = os.path.join(str(root), split, cls)
            os.makedirs(dst)
            for name in sorted(os.listdir(src)):
                for i in range(copies if split == "Test" else 1):
                    os.link(os.path.join(src, name), os.path.join(dst, f"{i}_{name}"))
    return str(root)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_false_alarm_for_long_phases_and_a_slow_but_progressing_rank(tmp_path):
    """An 8 s stall limit under mpirun, and a job that exceeds it in every harmless way: cluster start-up and
    the first compile, evaluations of a Test split 640x the usual one at batch 1 (about 12 s each on a quiet
    2-core host, so one phase outlasts the limit however fast the host; at 320x the faster evaluation of the
    uint8 input took 6.2 s in a quiet CI run, no longer past the limit), checkpoint saves every
    epoch, and rank 1 slowed by 1.5 s freezes of its main thread every 2.5 s (the other rank waits for it
    in every collective). It must finish normally."""
    limit_s = 8
    copies = 640
    data = _tree_with_a_big_test_split(tmp_path / "data", copies=copies)
    out = tmp_path / "run"
    proc = subprocess.Popen(mpirun(2) + [sys.executable, "-m", "msdist.train",
                                         *tiny_args(data, out, "--epochs", 2, "--eval_every_epochs", 1,
                                                    "--eval_batch_size", 1, "--stall_timeout", limit_s)],
                            cwd=str(tmp_path), env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    longest = {}

    def watch_and_slow_down():
        paths = [heartbeat.path_for(str(out / "logs"), r) for r in (0, 1)]
        while proc.poll() is None:
            beats = [heartbeat.read(p) for p in paths]
            for beat in filter(None, beats):
                longest[beat["phase"]] = max(longest.get(beat["phase"], 0.0), beat["phase_s"])
            if beats[1] is not None and beats[1]["phase"] in ("data wait", "train step"):
                try:
                    frozen = freeze_main_thread(beats[1]["pid"])
                except OSError:   # the rank ended meanwhile
                    continue
                time.sleep(1.5)
                frozen.release()
            time.sleep(1.0)

    slower = threading.Thread(target=watch_and_slow_down, daemon=True)
    slower.start()
    try:
        _, err = proc.communicate(timeout=RUN_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        slower.join(timeout=10)
    assert proc.returncode == 0, err[-3000:]
    assert "stuck in" not in err and not os.path.exists(out / "logs" / heartbeat.FAILURE_FILE)
    # The job really had phases longer than the limit.
    print(f"longest phase seen: {longest} (--stall_timeout {limit_s})")
    assert max(longest.get(p, 0.0) for p in ("start-up", "compile", "evaluation")) > limit_s, longest
    with open(out / "result.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["num_samples"] == 64 * copies
    assert result["ranks"][0]["median_step_s"] > 0 and len(result["ranks"]) == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_msrun_rank_with_a_stuck_main_thread_ends_the_job(stuck):
    """The same frozen main thread under MindSpore's msrun: the watchdog inside the ranks ends the job."""
    returncode, console, err, took, out = stuck["msrun"].result()
    assert returncode != 0 and took < STALL_S + 30, (took, err[-3000:])
    # msrun writes each worker's output to its log (its console follows them, but may stop before the end).
    with open(out.parent / "msrun_logs" / "worker_0.log", encoding="utf-8", errors="replace") as f:
        assert "msdist: job failed: rank 1 (host " in f.read(), console[-3000:]
    record = _failure_record(out / "logs")
    assert record["rank"] == 1 and record["kind"] == "stall" and FROZEN in record["message"], record
    assert _stacks_dumped(out / "logs", 0) and _stacks_dumped(out / "logs", 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_srun_style_ranks_with_a_reader_stuck_on_a_fifo_each_end_by_themselves(stuck):
    """Two ranks started the way srun starts them (its variables, and no launcher that would tear the
    others down). One training image becomes a FIFO nobody writes, after the start-up data check: the rank
    whose shard holds it blocks in its reader (open() never returns). Both ranks end by themselves, and
    rank 0 prints the line naming the stuck rank `in data wait`."""
    returncodes, errs, out = stuck["srun"].result()
    assert returncodes == [1, 1], errs[0][-2000:]
    named = [line for line in errs[0].splitlines() if line.startswith("msdist: job failed: rank ")]
    assert len(named) == 1 and "stuck in data wait at step" in named[0], errs[0][-3000:]
    assert "job failed" not in errs[1]
    record = _failure_record(out / "logs")
    assert record["phase"] == "data wait" and f"rank {record['rank']} (host" in named[0]
