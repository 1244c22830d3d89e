"""Old checkpoints (tests/data/old_checkpoint) resumed by real `python -m msdist.train` runs, by path and
`--resume auto` on two ranks."""
import os
import shutil

import numpy as np
import pytest

from conftest import OLD, OLD_OPTIONS, OLD_SINGLE, checkpoints, load_params, run_msdist, tiny_args
from msdist.engine import optim


@pytest.mark.multiprocess
def test_an_old_checkpoint_resumed_by_path_continues_at_its_step(tmp_path, data_dir):
    run = run_msdist("train", tiny_args(data_dir, tmp_path, *OLD_OPTIONS, "--max_steps", 19, "--resume", OLD_SINGLE))
    assert "epoch 1, step 6 of 12, global step 18" in run.stdout
    lrs = optim.lr_schedule("cosine", 0.05, 2, 12, warmup_epochs=0.5)
    first = next(line for line in run.stdout.splitlines() if line.startswith("epoch 2/2 step "))
    assert first.startswith("epoch 2/2 step 7/12") and f"lr {lrs[18]:.6f}" in first
    [after] = checkpoints(tmp_path, 0)
    assert after.endswith("-2_7.ckpt")
    state = load_params(after, include_state=True)
    assert state["global_step"] == 19 and state["loss_scale.cur_iter"] == 20  # both counters went on


@pytest.mark.multiprocess
@pytest.mark.slow
def test_old_two_rank_checkpoints_with_residuals_resume_auto(tmp_path, data_dir):
    shutil.copytree(os.path.join(OLD, "topk2"), tmp_path / "ckpt")
    run = run_msdist("train", tiny_args(data_dir, tmp_path, *OLD_OPTIONS, "--grad_compression", "topk",
                                        "--topk_ratio", 0.1, "--max_steps", 19, "--resume", "auto"), ranks=2)
    assert "epoch 1, step 6 of 12, global step 18" in run.stdout
    before = [load_params(os.path.join(OLD, "topk2", f"resnet_tiny_rank{r}-2_6.ckpt"), include_state=True)
              for r in (0, 1)]
    after = [load_params(checkpoints(tmp_path, r)[-1], include_state=True) for r in (0, 1)]
    residuals = [n for n in before[0] if n.startswith("residual.")]
    assert len(residuals) == 38
    for rank in (0, 1):
        assert checkpoints(tmp_path, rank)[-1].endswith("-2_7.ckpt") and after[rank]["global_step"] == 19
        assert after[rank]["loss_scale.cur_iter"] == before[rank]["loss_scale.cur_iter"] + 1
    # Rank-local: each rank resumed its own residuals and kept them apart.
    assert any(not np.array_equal(after[0][n], after[1][n]) for n in residuals)
