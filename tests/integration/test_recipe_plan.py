"""The recipe review (msdist/run/recipe.py): refusals and warnings, as tables; and `--plan` saying the same."""
import os
import subprocess
import sys

import pytest

from conftest import REAL_DATA, REPO, base_env, fake_gpu_node, plan_on, run_msdist, tiny_args
from msdist.run import config, recipe


SEED_CONFIG = os.path.join(REPO, "configs", "resnet50_fruits360.yaml")


def _plan(*args, **env):
    return subprocess.run([sys.executable, "-m", "msdist.check", "--plan", "--config", SEED_CONFIG, "--data_dir",
                           REAL_DATA, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in base_env().items() if not k.startswith(("OMPI_", "PMIX_", "MS_"))},
                               **env})


def _gpu_host(tmp_path):
    return fake_gpu_node(tmp_path / "gpu-node", 8)


def test_plan_prints_the_start_up_warnings_on_rank_0_only(tmp_path):
    """Rank 0 of an 8-rank mpirun job (OpenMPI's variables) on an 8-GPU node, the seed recipe with its 1024 scale."""
    ompi = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_COMMAND": "python",
            "OMPI_MCA_ess_base_jobid": "77"}
    for rank in (0, 3):
        proc = _plan("--loss_scale", "1024", "--host_root", _gpu_host(tmp_path), "--output_dir", str(tmp_path / "o"),
                     **ompi, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank), PMIX_RANK=str(rank))
        assert proc.returncode == 0, proc.stderr[-2000:]
        warnings = [line for line in proc.stdout.splitlines() if line.startswith(f"[rank {rank}] warning: ")]
        assert [w.split("warning: ")[1] for w in warnings] == (recipe.review(plan_on(
            config.parse(["--config", SEED_CONFIG, "--loss_scale", "1024"]), 8, "GPU")) if rank == 0 else [])


def test_plan_gives_the_measured_gap_between_16_and_64_images_per_rank(tmp_path):
    """The seed recipe's batch of 32 on 2 CPU ranks: 16 images per rank, inside the range where a gap to one card
    was measured; with --sync_bn true the line is gone."""
    ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMMAND": "python",
            "OMPI_MCA_ess_base_jobid": "78", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "PMIX_RANK": "0"}
    proc = _plan("--output_dir", str(tmp_path / "o"), **ompi)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"[rank 0] warning: BatchNorm sees 16 images per rank (batch_size 32 / 2 ranks): " \
           f"{recipe.MEASURED_BN_COST}" in proc.stdout.splitlines()
    proc = _plan("--output_dir", str(tmp_path / "o"), "--sync_bn", "true", **ompi)
    assert proc.returncode == 0 and "BatchNorm sees" not in proc.stdout, proc.stderr[-2000:]


def test_plan_refuses_bfloat16_on_gpu_in_one_line(tmp_path):
    proc = _plan("--amp_dtype", "bfloat16", "--host_root", _gpu_host(tmp_path))
    assert proc.returncode == 2 and not proc.stdout.strip()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("msdist: error: --amp_dtype bfloat16 with amp O2 on GPU"), line


@pytest.mark.multiprocess
def test_training_warns_once_from_rank_0(tmp_path):
    """A real 2-rank mpirun: configs/tiny_test.yaml's 16 images leave BatchNorm 8 per rank; the warning is one
    line of the job's console (rank 0's), with the numbers and the fix, and it is in every rank's log."""
    proc = run_msdist("train", tiny_args(REAL_DATA, tmp_path, "--max_steps", 1), ranks=2,
                      timeout=600)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "BatchNorm sees" in line]
    assert lines == ["warning: BatchNorm sees 8 images per rank (batch_size 16 / 2 ranks), under 16: its statistics "
                     f"are noise ({recipe.NOISY_BN_COST}); raise --batch_size to at least 32 or pass --sync_bn "
                     "true"], lines
    for rank in (0, 1):
        assert "BatchNorm sees 8 images per rank" in (tmp_path / "logs" / f"rank_{rank}.log").read_text()
