"""Saves by steps written in the background (issue 33): real mpirun jobs.

A rank killed (kill -9) while its background write is half done leaves the previous checkpoint as its
newest good one, and the job resumed from there ends bitwise equal to an uninterrupted run without any
saves by steps: a save by steps changes nothing.
"""
import glob
import os
import re
import signal
import shutil
import subprocess
import sys
import time

import pytest

from conftest import MPI_ENV, TRAIN_WITH_TEST_MODELS, mpirun
from msdist.run import checkpoint
from test_launch import EXACT_ARGS, Job, assert_same_final_params

MPIRUN_TRAIN = [*mpirun(2), sys.executable, "-m", "msdist.train"]
EVERY = 10
HANG_AT = 20      # rank 1's background write of global step 20 (epoch 2) never finishes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted, no saves by steps."""
    job = Job(tmp_path_factory.mktemp("reference"), "reference", [], EXACT_ARGS, command=MPIRUN_TRAIN, env=MPI_ENV)
    yield job
    if job.proc.poll() is None:
        job.proc.kill()
        job.proc.wait()


def _hidden_tmp(job, rank, step):
    return glob.glob(os.path.join(job.output_dir, "ckpt", f".resnet_tiny_rank{rank}-*_{step % 12 or 12}.ckpt.tmp*"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("keep", [5, 1])
def test_kill9_during_a_background_write_leaves_the_previous_checkpoint_newest_and_resumes_exactly(tmp_path, reference,
                                                                                                   keep):
    """With --keep_checkpoint_max 1 too (issue 41): rank 0, its write of step 20 done while rank 1's hangs, keeps the
    epoch-1 checkpoint the ranks can resume from instead of pruning it."""
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed")
    args = EXACT_ARGS + ["--save_every_steps", str(EVERY), "--keep_checkpoint_max", str(keep)]
    job = Job(tmp_path, "hung", [], args, command=[*mpirun(2), sys.executable, TRAIN_WITH_TEST_MODELS],
              env={**MPI_ENV, "MSDIST_TEST_HANG_WRITE": f"1:{HANG_AT}"})
    deadline = time.monotonic() + 240
    while not _hidden_tmp(job, 1, HANG_AT):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr()
        time.sleep(0.05)
    # The loop did not wait for the write: rank 1 trains on while its write hangs.
    beat = job.wait_for_beat(1, at_least_step=HANG_AT + 3)
    os.kill(beat["pid"], signal.SIGKILL)
    assert job.wait() != 0
    ckpt = os.path.join(job.output_dir, "ckpt")
    newest = [checkpoint.latest_good(ckpt, "resnet_tiny", rank).position.global_step for rank in (0, 1)]
    assert newest == [HANG_AT, 12], newest   # rank 1: the epoch-1 save after the step-10 one, not the half write
    if keep == 1:
        assert [c.position.global_step for c in checkpoint.list_checkpoints(ckpt, "resnet_tiny", 0)] == [HANG_AT, 12]
    assert _hidden_tmp(job, 1, HANG_AT)
    log = open(os.path.join(job.output_dir, "logs", "rank_0.log"), encoding="utf-8").read()
    assert re.search(rf"save by steps at global step {EVERY}: the loop waited [\d.]+ s", log)
    assert "in the background" in log

    resumed = Job(tmp_path, "resumed", [], args + ["--resume", "auto"], output_name="hung", command=MPIRUN_TRAIN,
                  env=MPI_ENV)
    assert resumed.wait() == 0, resumed.stderr()
    assert "global step 12" in open(os.path.join(job.output_dir, "logs", "rank_1.log"), encoding="utf-8").read()
    log = open(os.path.join(job.output_dir, "logs", "rank_0.log"), encoding="utf-8").read()
    assert "resume auto: passed over global step 20 (written by 2 ranks)" in log and "ranks [1] have no file" in log
    assert "resume auto: chose global step 12 (written by 2 ranks), batch layout 2 slots" in log
    assert not _hidden_tmp(job, 1, HANG_AT)   # removed at the resumed run's start
    assert_same_final_params(resumed, reference)


# (extra options, checkpoint files the tmpfs holds, the last global step the ranks may stop at)
NAMED_AT_EPOCH_END = ([], 4.5, 24)      # steps 10 and 12 (4 files while written, then 3: identical files linked)
# No save or evaluation at an epoch's end before the last (step 144): only the stop check can share the failure.
NAMED_AT_STOP_CHECK = (["--save_every_epochs", "12", "--eval_every_epochs", "12", "--epochs", "12"], 2.5, 143)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("extra, files, last", [NAMED_AT_EPOCH_END, NAMED_AT_STOP_CHECK],
                         ids=["at-epoch-end", "at-stop-check"])
def test_a_background_write_to_a_full_disk_is_named_on_every_rank_and_stops_the_job(tmp_path, reference, extra, files,
                                                                                     last):
    """A real ENOSPC: the checkpoint folder is a tmpfs with room for the saves before step 20 and half of step 20's.
    Every rank names the failing rank(s) in one line and exits 2 (issue 41 item 7), whether the failure reaches
    the others through the wait before an epoch-end save or through the stop check's gather."""
    if not shutil.which("mpirun") or os.geteuid() != 0:
        pytest.skip("needs mpirun, and root to mount a tmpfs")
    assert reference.wait() == 0, reference.stderr()
    size = os.path.getsize(os.path.join(reference.output_dir, "ckpt", "resnet_tiny_rank0-1_12.ckpt"))
    mounted = []

    def small_disk(output_dir):
        os.makedirs(os.path.join(output_dir, "ckpt"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * files) + (64 << 10)}", "tmpfs",
                        os.path.join(output_dir, "ckpt")], check=True)
        mounted.append(os.path.join(output_dir, "ckpt"))
    try:
        job = Job(tmp_path, "full", [], EXACT_ARGS + ["--save_every_steps", str(EVERY), "--log_every", "1", *extra],
                  command=MPIRUN_TRAIN, env=MPI_ENV, before_start=small_disk)
        assert job.wait() == 2, job.stderr()[-3000:]   # the ranks' failure status, not MindSpore's lost peer
        failed = r"rank (\d): background save of global step 20: writing checkpoint \S+rank\d-2_8.ckpt failed: " \
                 r"\[Errno 28\] No space left on device \(\d+\.\d MiB free there\)"
        lines = {}
        for rank in (0, 1):   # every rank names the failing rank(s), whichever failed, in the same line
            log = open(os.path.join(job.output_dir, "logs", f"rank_{rank}.log"), encoding="utf-8").read()
            said = re.findall(r"error: background save failed on rank\(s\) ([\d, ]+); every rank stopped at global "
                              rf"step (\d+): ({failed}(?:; {failed})*)\n", log)
            assert len(said) == 1, log[-3000:]
            lines[rank] = said[0][:2]
            stopped = int(said[0][1])
            steps = [(int(e) - 1) * 12 + int(s) for e, s in re.findall(r"epoch (\d+)/\d+ step (\d+)/12 ", log)]
            # The write began after step 20; the ranks stop together at the first stop check (about a second of
            # training) after it failed, or at the wait before the next save, whichever comes first.
            assert 20 < stopped <= last and max(steps) == stopped, (stopped, steps)
        assert lines[0] == lines[1], lines
        for rank in lines[0][0].split(", "):
            assert not glob.glob(os.path.join(job.output_dir, "ckpt", f".resnet_tiny_rank{rank}-*"))
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", path], check=False)
