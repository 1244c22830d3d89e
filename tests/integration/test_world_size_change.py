"""A job resumed at another world size continues the same training (issue 33, item 3: the trainer's side).

The batch layout (data/plan.py `BatchLayout`) keeps the original job's global batch, sample order, learning-rate
schedule and per-micro-batch BatchNorm statistics: a rank owning several of the original ranks' slots runs them
as micro-batches of one step, with each slot's running statistics. Real msdist.launch jobs, the elastic test's
recipe (resnet_tiny, configs/tiny_test.yaml, `--deterministic true`), two epochs, the issue's bound: every
saved value (weights, BatchNorm statistics, optimizer moments) within 1e-4 of the uninterrupted 2-rank run.

* shrink: the 2-rank reference's own epoch-1 checkpoints (what a 2-rank job stopped after that save leaves
  behind), resumed with `-n 1`: one rank runs both slots;
* grow: a 1-rank job started with MSDIST_BATCH_SLOTS=2 (as `msdist.launch --nnodes 1:2` starts it), stopped
  after its epoch-1 save, resumed with `-n 2`: rank 1 has no checkpoint and resumes from rank 0's.

The one-rank jobs run on half the cores, so their kernels use as many threads as each rank of the reference.
A rank owning two slots computes exactly (g0 + g1) / 2 from the per-slot gradients one rank computes alone
(bitwise, measured in one process), yet the 2-rank job's mean all-reduce lands 1 ulp away from it in places,
and this recipe amplifies: a random 2e-7 nudge of the reference's own epoch-1 checkpoint ends 2.5e-3 away
after one more epoch, and a third epoch takes the grown job to 7e-4 (measured). Hence two epochs, and the
bound holds here with room (measured gaps ~1e-6).
"""
import glob
import json
import os
import shutil
import sys

import numpy as np
import pytest

from msdist.base import launch_env
from msdist.run import checkpoint
from test_launch import EXACT_ARGS, Job

ARGS = EXACT_ARGS + ["--epochs", "2"]   # tiny_test.yaml's own two epochs: one before the change, one after
EPOCH = 12            # steps per epoch: 192 images, global batch 16, whatever the world size
BOUND = 1e-4          # the elastic equivalence


def _on_half_the_cores() -> list:
    """A launcher command whose one rank gets as many kernel threads as each rank of a 2-rank job."""
    cores = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", ",".join(map(str, cores[:max(1, len(cores) // 2)])), sys.executable, "-m",
            "msdist.launch"]


def _copy_epoch_1(reference):
    def copy(output_dir):
        os.makedirs(os.path.join(output_dir, "ckpt"))
        for path in glob.glob(os.path.join(reference.output_dir, "ckpt", "resnet_tiny_rank*-1_12.ckpt*")):
            shutil.copy(path, os.path.join(output_dir, "ckpt"))
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resize")
    reference = Job(tmp, "reference", ["-n", "2"], ARGS)
    grow_start = Job(tmp, "grow_start", ["-n", "1"], ARGS + ["--max_steps", str(EPOCH)], output_name="grow",
                     env={launch_env.BATCH_SLOTS_VAR: "2"}, command=_on_half_the_cores())
    assert reference.wait() == 0, reference.stderr()
    assert grow_start.wait() == 0, grow_start.stderr()
    shrink = Job(tmp, "shrink", ["-n", "1"], ARGS + ["--resume", "auto"], command=_on_half_the_cores(),
                 before_start=_copy_epoch_1(reference))
    grow = Job(tmp, "grow", ["-n", "2"], ARGS + ["--resume", "auto"], output_name="grow")
    assert shrink.wait() == 0, shrink.stderr()
    assert grow.wait() == 0, grow.stderr()
    return {"reference": reference, "grow_start": grow_start, "shrink": shrink, "grow": grow}


def _largest_gap(job, reference, rank) -> float:
    got, want = job.final_params(rank), reference.final_params(rank)
    assert sorted(got) == sorted(want)
    return max(float(np.abs(got[n].astype(np.float64) - want[n].astype(np.float64)).max(initial=0.0)) for n in want)


def _log(job, rank=0) -> str:
    with open(os.path.join(job.output_dir, "logs", f"rank_{rank}.log"), encoding="utf-8") as f:
        return f.read()


def _newest_step(job, rank) -> int:
    return checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank).position.global_step


@pytest.mark.multiprocess
def test_shrunk_job_continues_the_same_training(runs):
    shrink, reference = runs["shrink"], runs["reference"]
    assert _newest_step(shrink, 0) == 2 * EPOCH
    log = _log(shrink)
    assert "batch layout: 2 slots of 8 images on 1 rank(s): 2 micro-batches per step, global batch 16" in log
    assert f"resumed from {os.path.join(shrink.output_dir, 'ckpt', 'resnet_tiny_rank0-1_12.ckpt')}: epoch 1, step 0 " \
           "of 12, global step 12 | batch layout 2 slots on 1 rank(s)" in log
    gap = _largest_gap(shrink, reference, 0)
    assert gap <= BOUND, f"1 rank resumed from the 2-rank job ends {gap:.2e} away from it"


@pytest.mark.multiprocess
def test_grown_job_resumes_from_rank_0s_checkpoint_and_continues_the_same_training(runs):
    grow, reference = runs["grow"], runs["reference"]
    sidecar = checkpoint.read_sidecar(os.path.join(grow.output_dir, "ckpt", "resnet_tiny_rank0-1_12.ckpt"))
    assert sidecar["meta"]["batch_slots"] == 2, json.dumps(sidecar)   # the layout the launcher asked for, recorded
    first = os.path.join(grow.output_dir, "ckpt", "resnet_tiny_rank0-1_12.ckpt")
    both = _log(grow, 0)   # the one-rank start's lines, then the grown job's
    assert both.count("batch layout: 2 slots of 8 images on 1 rank(s)") == 1   # the grown job: one slot per rank
    log = _log(grow, 1)    # the grown job's alone
    assert f"every rank resumes from rank 0's newest good checkpoint {first} (global step 12)" in log
    assert f"resumed from {first}: epoch 1, step 0 of 12, global step 12 | batch layout 2 slots on 2 rank(s)" in log
    for rank in (0, 1):
        assert _newest_step(grow, rank) == 2 * EPOCH
        gap = _largest_gap(grow, reference, rank)
        assert gap <= BOUND, f"rank {rank} of the grown job ends {gap:.2e} away from the 2-rank job"
