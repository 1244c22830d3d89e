"""Loss scaling in real training runs: an overflow injected on one rank only under `mpirun -n 2`
(tests/overflow.py, through tests/train_with_test_models.py) is skipped by all, and a fixed scale that
overflows float16 stops the run with one line and no checkpoint."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import checkpoints, load_params, run_msdist, tiny_args
from msdist.engine import precision


SETUP = ("--augment", "false", "--deterministic", "true", "--loss_scale", "dynamic", "--log_every", 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_overflow_on_one_rank_is_skipped_by_all_and_the_scale_is_resumed(data_dir, tmp_path):
    poisoned, clean = tmp_path / "poisoned", tmp_path / "clean"
    # Rank 1's gradients of step 3 are infinite; rank 0's are fine.
    with ThreadPoolExecutor(max_workers=2) as pool:  # cluster start-up and exit overlap
        list(pool.map(lambda job: run_msdist("train_with_test_models", tiny_args(data_dir, *job[0]), ranks=2,
                                             env=job[1]), [
            ((poisoned, *SETUP, "--max_steps", 3), {"MSDIST_TEST_OVERFLOW": "1:3"}),
            ((clean, *SETUP, "--max_steps", 2), {})]))
    after_two = load_params(checkpoints(clean, 0)[-1], include_state=True)
    for rank in (0, 1):  # the job's own replica checksum also passed at the save
        params = load_params(checkpoints(poisoned, rank)[-1], include_state=True)
        # Weights and momenta; not BatchNorm's running statistics (the forward pass ran) nor counters.
        trained = [n for n in after_two if "moving_" not in n
                   and not n.startswith(("loss_scale.", "msdist_state.")) and n != "global_step"]
        different = [n for n in trained if not np.array_equal(params[n], after_two[n])]
        assert not different, f"rank {rank}: the skipped step changed {different[:5]}"
        assert params["loss_scale.value"] == precision.DYNAMIC_INITIAL_SCALE / 2
        assert params["loss_scale.last_overflow_iter"] == 3 and params["global_step"] == 3
    # Resume: the halved scale and its counters come back, and keep counting.
    run_msdist("train", tiny_args(data_dir, poisoned, *SETUP, "--max_steps", 4, "--resume", "auto"), ranks=2)
    resumed = load_params(checkpoints(poisoned, 1)[-1], include_state=True)
    assert resumed["loss_scale.value"] == precision.DYNAMIC_INITIAL_SCALE / 2
    assert (resumed["loss_scale.cur_iter"], resumed["loss_scale.last_overflow_iter"]) == (5, 3)


@pytest.mark.slow
def test_a_fixed_scale_that_overflows_float16_stops_the_run_with_one_line_and_no_checkpoint(data_dir, tmp_path):
    """End to end, no hook: under O2 a fixed scale of 1e30 makes every float16 gradient infinite at step 1."""
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--amp_level", "O2", "--loss_scale", "1e30",
                                         "--max_steps", 3, "--log_every", 2), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("msdist:")]
    assert line.startswith("msdist: error: step 1: the loss or gradients are not finite (inf/NaN) on rank 0 "), line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "result.json").exists()
