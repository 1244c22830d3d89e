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
def test_kill9_during_a_background_write_leaves_the_previous_checkpoint_newest_and_resumes_exactly(tmp_path, reference):
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed")
    args = EXACT_ARGS + ["--save_every_steps", str(EVERY)]
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
    log = open(os.path.join(job.output_dir, "logs", "rank_0.log"), encoding="utf-8").read()
    assert re.search(rf"save by steps at global step {EVERY}: the loop waited [\d.]+ s", log)
    assert "in the background" in log

    resumed = Job(tmp_path, "resumed", [], args + ["--resume", "auto"], output_name="hung", command=MPIRUN_TRAIN,
                  env=MPI_ENV)
    assert resumed.wait() == 0, resumed.stderr()
    assert "global step 12" in open(os.path.join(job.output_dir, "logs", "rank_1.log"), encoding="utf-8").read()
    assert_same_final_params(resumed, reference)
