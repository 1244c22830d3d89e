"""The first ten minutes: the demo script run again and again, the closing summary, one line per error."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, base_env, run_msdist, tiny_args

# The demo's own flow with a small model, so three runs fit in a test.
SMALL = ["--model", "resnet_tiny", "--image_size", "32", "--epochs", "1", "--batch_size", "16", "--log_every", "5"]


def _run_demo(data, root) -> subprocess.CompletedProcess:
    env = dict(base_env(), DATA=str(data), DEMO_ROOT=str(root))
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "run_demo.sh"), *SMALL], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def summary_paths(stdout: str) -> dict:
    """label -> path of the closing summary block's file lines."""
    block = stdout[stdout.index("== msdist."):]
    return dict(re.findall(r"^(result|checkpoint|logs|log|tensorboard)\s+(\S+)$", block, re.MULTILINE))


def _disk_bytes(root) -> int:
    """Bytes of the files under `root`, each hard-linked file counted once (as du does)."""
    seen = {}
    for folder, _, names in os.walk(root):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            seen[(info.st_dev, info.st_ino)] = info.st_size
    return sum(seen.values())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_runs_again_and_again_and_says_what_it_did(tmp_path):
    data, root = tmp_path / "synth", tmp_path / "demo"
    run_msdist("data", ["synth", str(data), "--classes", "4", "--per_class", "16"])

    first = _run_demo(data, root)
    assert first.stdout.splitlines()[0] == f"demo: starting a fresh run in {root}/run-1"
    paths = summary_paths(first.stdout)
    assert set(paths) >= {"result", "checkpoint", "logs"}
    assert all(os.path.exists(p) for p in paths.values()), paths
    assert paths["result"] == f"{root}/run-1/result.json"

    second = _run_demo(data, root)
    assert second.stdout.splitlines()[0] == (f"demo: starting a fresh run in {root}/run-2 (the previous demo run, "
                                             f"{root}/run-1, finished and is removed)")
    assert sorted(os.listdir(root)) == ["run-2"]
    assert all(os.path.exists(p) for p in summary_paths(second.stdout).values())
    # Disk after two runs: one checkpoint's bytes (both ranks' numbered and best files are that one file) plus
    # under 5 MB of logs and compile cache. With the demo's ResNet-18 that is 89 MB + 1 MB, within 100 MB.
    (numbered,) = (root / "run-2" / "ckpt").glob("resnet_tiny_rank0-*.ckpt")
    assert not list((root / "run-2" / "ckpt").glob(".*")), "a temporary file was left behind"
    assert _disk_bytes(root) - os.path.getsize(numbered) < 5e6, _disk_bytes(root)

    os.remove(root / "run-2" / "result.json")  # as if the run had died after its last checkpoint
    third = _run_demo(data, root)
    assert third.stdout.splitlines()[0] == f"demo: resuming the unfinished run in {root}/run-2"
    assert "resumed from" in third.stdout and (root / "run-2" / "result.json").exists()
    # One checkpoint file shared by both ranks (identical replicas), so the demo stays small on disk.
    ckpt = root / "run-2" / "ckpt"
    rank0, rank1 = (next(ckpt.glob(f"resnet_tiny_rank{r}-*.ckpt")) for r in (0, 1))
    assert os.path.samefile(rank0, rank1)


@pytest.mark.multiprocess
def test_an_error_every_rank_finds_is_printed_once_under_mpirun(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--model", "resnet5"), ranks=2, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("msdist: error: --model: unknown model 'resnet5'; did you mean resnet50?") == 1, proc.stderr


@pytest.mark.multiprocess
def test_a_mistake_found_before_mindspore_loads_is_quick_and_exit_2(data_dir, tmp_path):
    """Model names and batch splits are checked from the command line alone: exit 2 before MindSpore loads."""
    for extra, message in ((("--model", "resnet5"), "unknown model 'resnet5'"),
                           (("--batch_size", 16, "--grad_accum_steps", 3), "does not split into grad_accum_steps 3")):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "msdist.train",
                               *tiny_args(data_dir, tmp_path, *extra)], cwd=REPO, env=base_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr
        assert "| mindspore" not in proc.stderr  # -X importtime lists every module imported


@pytest.mark.multiprocess
def test_a_typo_is_not_restarted_by_the_launcher(data_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "msdist.launch", "-n", "2", "--max_restarts", "3",
                           *tiny_args(data_dir, tmp_path, "--model", "resnet5")], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unknown model 'resnet5'" in proc.stderr and "restart" not in proc.stderr.lower()
