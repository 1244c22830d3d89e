"""Gradient communication options under real `mpirun -n 2`: fp16 all-reduce, top-K / threshold
sparsification with error feedback, gradient accumulation (msdist/engine/reducers.py, msdist/engine/step.py, docs/grad_comm.md).

Set-up: the equivalence tests' deterministic run (same seed, `--deterministic true --augment false`,
shuffling on, global batch 16, lr 0.01 constant) on the real fruits360-4 images.

- Convergence (40 optimizer steps of resnet_tiny): uncompressed vs top-0.1% with and without error
  feedback.
- Exactness (12 steps of convnet_tiny, weight decay off): a model without BatchNorm, because
  BatchNorm makes training chaotic enough here that one float32 rounding difference grows to ~10%
  in the running statistics within 40 steps, which would hide what the reduction itself does; and
  it is the only way k micro-batches can equal one batch (BatchNorm's statistics cover the
  micro-batch). Weight decay is off because MindSpore compiles the optimizer's decay arithmetic
  around its own fused all-reduce differently (last-bit differences), while the gradients of
  topk 1.0 and of the all-reduce are bit-identical.

All runs start at once; most of a 2-rank run is cluster start-up and exit, which overlap.
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import checkpoints, load_params, run_msdist, tiny_args, worst_relative_gap
from msdist.run import checkpoint_model


SETUP = ("--epochs", 4, "--max_steps", 40, "--augment", "false", "--shuffle", "true", "--deterministic", "true",
         "--lr", 0.01, "--lr_schedule", "constant", "--warmup_epochs", 0, "--batch_size", 16)
EXACT = SETUP + ("--max_steps", 12, "--model", "convnet_tiny", "--weight_decay", 0)  # later values win
SPARSE = ("--grad_compression", "topk", "--topk_ratio", 0.001)
RUNS = {
    "none": SETUP,
    "topk_ef": SETUP + SPARSE,
    "topk_no_ef": SETUP + SPARSE + ("--error_feedback", "false"),
    "threshold": SETUP + ("--max_steps", 12, "--grad_compression", "threshold", "--topk_ratio", 0.05,
                          "--threshold", 0.01),
    "exact_none": EXACT,
    "exact_fp16": EXACT + ("--grad_compression", "fp16"),
    "exact_topk_full": EXACT + ("--grad_compression", "topk", "--topk_ratio", 1.0),
    "exact_accum_2": EXACT + ("--grad_accum_steps", 2),
}
# max |fp16 - fp32| of each tensor over that tensor's max |value|, after 12 steps: about one float16
# rounding step (2^-10 = 9.8e-4); measured 2.0e-4 (float16 buckets).
FP16_TOLERANCE = 1e-3
ACCUM_TOLERANCE = 1e-6  # float32 summation order only; measured 3e-8


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("grad_comm")

    def run(name):
        module = "train_with_test_models" if "convnet_tiny" in RUNS[name] else "train"
        run_msdist(module, tiny_args(data_dir, root / name, *RUNS[name]), ranks=2, timeout=600)

    with ThreadPoolExecutor(max_workers=len(RUNS)) as pool:
        list(pool.map(run, RUNS))
    return root


def _final(root, name, rank=0, include_state=False) -> dict:
    return load_params(checkpoints(root / name, rank)[-1], include_state=include_state)


def _model_params(params: dict) -> dict:
    return {n: v for n, v in params.items() if not n.startswith(("residual.", "loss_scale."))}


def _result(root, name) -> dict:
    with open(os.path.join(root / name, "result.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.multiprocess
def test_topk_with_ratio_one_equals_plain_all_reduce_exactly(runs):
    """Every element is sent: scatter-adding two ranks' values and halving rounds exactly like the
    fused all-reduce's sum times 1/2, so weights, momenta and step counter match bit for bit."""
    for rank in (0, 1):
        plain = _model_params(_final(runs, "exact_none", rank, include_state=True))
        full = _final(runs, "exact_topk_full", rank, include_state=True)
        residuals = {n: v for n, v in full.items() if n.startswith("residual.")}
        assert residuals and all(not v.any() for v in residuals.values())  # nothing left behind
        full = _model_params(full)
        assert full.keys() == plain.keys()
        different = [n for n in plain if not np.array_equal(plain[n], full[n])]
        assert not different, f"rank {rank}: topk 1.0 differs from none in {different[:5]}"


@pytest.mark.multiprocess
def test_fp16_all_reduce_stays_close_to_float32(runs):
    for rank in (0, 1):
        gap = worst_relative_gap(_final(runs, "exact_none", rank), _final(runs, "exact_fp16", rank))
        assert 0 < gap < FP16_TOLERANCE, f"rank {rank}: fp16 reduction is {gap:.2e} from float32 after 12 steps"


@pytest.mark.multiprocess
def test_small_topk_with_error_feedback_converges_like_uncompressed(runs):
    plain, sparse = _result(runs, "none"), _result(runs, "topk_ef")
    assert plain["accuracy"] > 0.9, plain  # the uncompressed run learned the task
    # 64 Test images (tests/data/fruits360-mini): one image is 1.6 points, so allow 6 images.
    assert sparse["accuracy"] >= plain["accuracy"] - 0.1, (sparse, plain)


@pytest.mark.multiprocess
def test_without_residual_topk_does_measurably_worse(runs):
    with_ef, without = _result(runs, "topk_ef"), _result(runs, "topk_no_ef")
    assert without["accuracy"] <= with_ef["accuracy"] - 0.05, (without, with_ef)
    assert without["loss"] > 2 * with_ef["loss"], (without, with_ef)


@pytest.mark.multiprocess
def test_residuals_are_rank_local_state_in_every_checkpoint(runs):
    """Error feedback leaves what was not sent in `residual.<param>`: non-zero, different per rank
    (each rank's own leftovers), one per trainable parameter; without error feedback there are none."""
    ranks = [_final(runs, "topk_ef", r, include_state=True) for r in (0, 1)]
    model = {n: v for n, v in ranks[0].items() if not checkpoint_model.is_training_state(n)}
    residuals = [{n[len("residual."):]: v for n, v in params.items() if n.startswith("residual.")} for params in ranks]
    trainable = {n for n in model if "moving_" not in n and not n.startswith("msdist_state.")}
    assert set(residuals[0]) == set(residuals[1]) == trainable
    for name, value in residuals[0].items():
        assert value.shape == model[name].shape
    assert all(np.abs(res["fc.weight"]).sum() > 0 for res in residuals)
    assert not np.array_equal(residuals[0]["fc.weight"], residuals[1]["fc.weight"])
    assert not any(n.startswith("residual.") for n in _final(runs, "topk_no_ef", include_state=True))


@pytest.mark.multiprocess
def test_sparse_replicas_stay_bit_identical(runs):
    """topk and threshold add the ranks' chunks in rank order (no order-dependent collisions), so after
    40 and 12 steps both ranks hold the same weights, momenta and counters bit for bit (BatchNorm's
    running statistics are per rank by design). On CPU the scatter is sequential anyway; on GPU the
    one-scatter version added colliding indices with atomics."""
    for name in ("topk_ef", "threshold"):
        ranks = [{n: v for n, v in _model_params(_final(runs, name, r, include_state=True)).items()
                  if "moving_" not in n} for r in (0, 1)]
        different = [n for n in ranks[0] if not np.array_equal(ranks[0][n], ranks[1][n])]
        assert not different, f"{name}: replicas differ in {different[:5]}"


@pytest.mark.multiprocess
def test_threshold_trains_on_two_ranks_and_keeps_the_rest(runs):
    params = _final(runs, "threshold", include_state=True)
    residual = [v for n, v in params.items() if n.startswith("residual.")]
    assert residual and sum(np.abs(v).sum() for v in residual) > 0
    result = _result(runs, "threshold")
    assert result["global_steps"] == 12 and result["accuracy"] > 0.4, result  # 4 classes: chance is ~0.25


@pytest.mark.multiprocess
def test_accumulating_two_micro_batches_equals_one_batch(runs):
    """Per rank, 2 micro-batches of 4 then one all-reduce give the update of one batch of 8."""
    for rank in (0, 1):
        gap = worst_relative_gap(_final(runs, "exact_none", rank), _final(runs, "exact_accum_2", rank))
        assert gap < ACCUM_TOLERANCE, f"rank {rank}: accumulation differs from one batch by {gap:.2e}"
    one = _final(runs, "exact_none", include_state=True)
    two = _final(runs, "exact_accum_2", include_state=True)
    assert one["global_step"] == two["global_step"] == 12  # the LR schedule advanced once per optimizer step
    assert not any(n.startswith("accum.") for n in two)  # buffers are empty between steps: not saved
    assert _result(runs, "exact_accum_2")["global_steps"] == 12


@pytest.mark.multiprocess
def test_accumulation_that_does_not_split_the_batch_is_a_one_line_error(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--max_steps", 1, "--grad_accum_steps", 3),
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "msdist: error: the per-rank batch 16 does not split into grad_accum_steps 3" in proc.stderr
