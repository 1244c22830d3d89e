"""`--sink_size K` changes how many steps a host call runs, never what is trained: real `python -m msdist.train` runs
with K = 1 and K = 8 under `--deterministic true` write bitwise-identical checkpoints (weights and every piece of
training state, the EMA's included) at the same steps, log the same losses at the same steps, and a run stopped in
the middle of a chunk resumes to the same weights. On CPU a chunk is K host-fed steps (run/feed.py); the GPU's sunk
call is the one primitive these runs cannot reach.

12 steps an epoch (192 images, global batch 16); with K = 8, log_every 10, save_every_steps 9 and max_steps 20 the
chunks are 8, 1, 1, 2 (the epoch's end) then 6, 2 (max_steps): full chunks, and tails at every kind of boundary.
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import checkpoints, load_params, run_msdist, tiny_args

pytestmark = pytest.mark.slow   # real training runs, several per case

SETUP = ("--epochs", 2, "--max_steps", 20, "--log_every", 10, "--save_every_steps", 9, "--ema_decay", 0.9,
         "--deterministic", "true", "--lr_schedule", "constant", "--warmup_epochs", 0)


def _train(data_dir, out, k, ranks=1, *extra):
    run_msdist("train", tiny_args(data_dir, out, *SETUP, "--sink_size", k, *extra), ranks=ranks)


def _step_losses(out):
    with open(os.path.join(str(out), "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [(r["global_step"], r["loss"]) for r in records if r.get("kind") == "step"]


def _assert_same_checkpoints(a, b, rank=0):
    names = [os.path.basename(p) for p in checkpoints(a, rank)]
    assert names == [os.path.basename(p) for p in checkpoints(b, rank)] and names
    for name in names:
        left = load_params(os.path.join(str(a), "ckpt", name), include_state=True)
        right = load_params(os.path.join(str(b), "ckpt", name), include_state=True)
        assert left.keys() == right.keys()
        for key in left:
            assert left[key].tobytes() == right[key].tobytes(), f"{name}: {key} differs"


def _train_at_once(data_dir, jobs):
    """`_train` each (output_dir, k, ranks, *extra) job, all started at once: their start-ups and exits overlap."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(lambda job: _train(data_dir, *job), jobs))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, data_dir):
    """k1 and k8 uninterrupted, and `stopped`: k8 stopped at step 4, inside the uninterrupted run's first chunk
    (1-8), for the resume test."""
    root = tmp_path_factory.mktemp("sink")
    _train_at_once(data_dir, [(root / "k1", 1), (root / "k8", 8), (root / "stopped", 8, 1, "--max_steps", 4)])
    return root


def test_k8_writes_the_checkpoints_of_k1_bitwise(one_rank):
    _assert_same_checkpoints(one_rank / "k1", one_rank / "k8")


def test_k8_logs_the_losses_of_k1_at_the_same_steps(one_rank):
    losses = _step_losses(one_rank / "k8")
    assert [step for step, _ in losses] == [10, 12, 20]     # log steps: 10, the epoch's end, max_steps
    assert losses == _step_losses(one_rank / "k1")


def test_a_run_stopped_mid_chunk_resumes_to_the_same_weights(one_rank, data_dir):
    resumed = one_rank / "stopped"
    _train(data_dir, resumed, 8, 1, "--resume", "auto")
    final = load_params(checkpoints(resumed, 0)[-1], include_state=True)
    want = load_params(checkpoints(one_rank / "k8", 0)[-1], include_state=True)
    assert os.path.basename(checkpoints(resumed, 0)[-1]) == os.path.basename(checkpoints(one_rank / "k8", 0)[-1])
    for key in want:
        assert np.array_equal(final[key], want[key]), key


@pytest.mark.multiprocess
def test_k8_equals_k1_on_two_ranks(data_dir, tmp_path):
    _train_at_once(data_dir, [(tmp_path / "k1", 1, 2), (tmp_path / "k8", 8, 2)])
    for rank in (0, 1):
        _assert_same_checkpoints(tmp_path / "k1", tmp_path / "k8", rank)
    assert _step_losses(tmp_path / "k8") == _step_losses(tmp_path / "k1")
