"""python -m msdist.train and msdist.eval as real processes, single-card and under `mpirun -n 2`: one
evaluation result, per-rank checkpoints, resume, the scheduler and ranks gone at the end."""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from conftest import REPO, TEST_SIZE, base_env, checkpoints, load_params, mpirun, run_msdist, tiny_args
from msdist.engine import optim
from msdist.run import checkpoint
from msdist.run.best_checkpoint import Best


def _assert_class_metrics_consistent(metrics: dict, classes=("apple", "lemon", "mango", "raspberry")) -> None:
    """The confusion-matrix, top-5 and per-class counts agree with each other and with top-1."""
    confusion = np.array(metrics["confusion_matrix"])
    assert confusion.shape == (len(classes), len(classes)) and confusion.dtype.kind == "i"
    assert confusion.sum() == metrics["num_samples"] == TEST_SIZE
    assert np.trace(confusion) == metrics["correct"]
    assert metrics["num_samples"] >= metrics["top5_correct"] >= metrics["correct"]
    assert metrics["per_class_total"] == confusion.sum(axis=1).tolist()
    assert metrics["per_class_correct"] == np.diag(confusion).tolist()
    assert sum(metrics["per_class_correct"]) == metrics["correct"]
    for acc, right, total in zip(metrics["per_class_accuracy"], metrics["per_class_correct"],
                                 metrics["per_class_total"]):
        assert acc == right / total
    assert metrics["classes"] == list(classes)


@pytest.mark.multiprocess
def test_standalone_run_learns_and_reports(standalone_run):
    out, proc = standalone_run
    result = json.loads((out / "result.json").read_text())
    assert result["accuracy"] > 0.7, result  # 4 classes: chance is 0.25
    assert result["num_samples"] == TEST_SIZE and result["world_size"] == 1
    assert result["images_per_sec"] > 0 and result["train_seconds"] > 0 and result["epochs"] == 5
    _assert_class_metrics_consistent(result)
    assert proc.stdout.count("eval result: {'accuracy': ") == 1
    assert "global batch 16 = 16 per rank" in proc.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["model"] == "resnet_tiny"
    assert (out / "logs" / "rank_0.log").exists()
    assert [os.path.basename(p) for p in checkpoints(out, 0)] == ["resnet_tiny_rank0-5_12.ckpt"]
    assert "[INFO]" not in proc.stderr and "[WARNING]" not in proc.stderr  # MindSpore's C++ logs are off


@pytest.mark.multiprocess
def test_verbose_lets_mindspores_own_log_lines_through(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--max_steps", 1, "--verbose", "true"))
    assert "[INFO]" in proc.stderr or "[WARNING]" in proc.stderr


@pytest.mark.multiprocess
def test_eval_cli_standalone_and_mpirun_agree(standalone_run, data_dir, tmp_path):
    out, _ = standalone_run
    expected = json.loads((out / "result.json").read_text())["accuracy"]
    ckpt = checkpoints(out, 0)[0]
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent runs: their start-ups and exits overlap
        procs = list(pool.map(lambda ranks: run_msdist("eval", tiny_args(data_dir, tmp_path / f"eval{ranks}",
                                                                          "--ckpt", ckpt), ranks=ranks), (1, 2)))
    for ranks, proc in zip((1, 2), procs):
        eval_out = tmp_path / f"eval{ranks}"
        assert proc.stdout.count("eval result:") == 1
        got = json.loads((eval_out / "eval_result.json").read_text())
        assert got["num_samples"] == TEST_SIZE and got["world_size"] == ranks
        assert got["accuracy"] == pytest.approx(expected, abs=1e-12)
        _assert_class_metrics_consistent(got)
        assert got["confusion_matrix"] == json.loads((out / "result.json").read_text())["confusion_matrix"]


def _schedulers_of(output_dir) -> set:
    """Scheduler processes (watchdog and MindSpore scheduler) of one job: the watchdog's stdout is its
    scheduler.log, the scheduler proper writes to the watchdog through a pipe."""
    found = set()
    for pid in _pids_of("msdist.cluster.scheduler"):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            if any(os.readlink(f"/proc/{p}/fd/1").startswith(str(output_dir)) for p in (pid, parent)):
                found.add(pid)
        except OSError:
            pass
    return found


def _wait_until_no_scheduler(output_dir, timeout_s: float) -> set:
    deadline = time.time() + timeout_s
    while _schedulers_of(output_dir) and time.time() < deadline:
        time.sleep(0.5)
    return _schedulers_of(output_dir)


@pytest.fixture(scope="module")
def mpirun_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("mpirun2")
    proc = run_msdist("train", tiny_args(data_dir, out, "--epochs", 1, "--ema_decay", 0.9), ranks=2)
    return out, proc


@pytest.mark.multiprocess
def test_mpirun_two_ranks_one_result(mpirun_run):
    out, proc = mpirun_run
    assert proc.stdout.count("eval result: {'accuracy': ") == 1
    result = json.loads((out / "result.json").read_text())
    assert result["num_samples"] == TEST_SIZE and result["world_size"] == 2
    assert result["accuracy"] > 0.7 and result["per_rank_batch"] == 8
    _assert_class_metrics_consistent(result)  # counts summed over both ranks: every Test image exactly once
    assert "global batch 16 = 8 per rank" in proc.stdout
    assert (out / "logs" / "rank_0.log").exists() and (out / "logs" / "rank_1.log").exists()
    assert "rank1" not in proc.stdout  # only rank 0 speaks on the console


@pytest.mark.multiprocess
def test_scale_lr_multiplies_the_lr_by_the_world_size(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--max_steps", 1, "--log_every", 1, "--lr", 0.03,
                                         "--lr_schedule", "constant", "--warmup_epochs", 0, "--scale_lr", "true"),
                      ranks=2)
    assert "| lr 0.060000 |" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_mpirun_checkpoints_are_per_rank_and_identical(mpirun_run):
    out, _ = mpirun_run
    (rank0,), (rank1,) = checkpoints(out, 0), checkpoints(out, 1)
    assert os.path.basename(rank0) == "resnet_tiny_rank0-1_12.ckpt"
    assert os.path.basename(rank1) == "resnet_tiny_rank1-1_12.ckpt"
    a, b = load_params(rank0), load_params(rank1)
    trained = [n for n in a if "moving_" not in n]  # without sync_bn, BN running stats are per rank by design
    assert trained and all(np.array_equal(a[n], b[n]) for n in trained)
    accuracy = json.loads((out / "result.json").read_text())["accuracy"]
    for rank in (0, 1):  # the final evaluation is the only one, so it is each rank's best
        best = Best(str(out / "ckpt"), "resnet_tiny", rank).read()
        assert best is not None and (best["epoch"], best["accuracy"]) == (1, accuracy)
    # The EMA (BatchNorm statistics included, averaged over ranks) is one model on every rank.
    ema0, ema1 = (load_params(checkpoint.tagged_path(str(out / "ckpt"), "resnet_tiny", r, "ema")) for r in (0, 1))
    model = {n for n in a if not n.startswith(("ema.", "msdist_state."))}
    assert model <= ema0.keys() and all(np.array_equal(ema0[n], ema1[n]) for n in model)
    assert not np.array_equal(ema0["stem.1.moving_mean"], a["stem.1.moving_mean"])  # an average, not a copy
    # Identical files are stored once: rank 1's names are hard links to rank 0's files, and the best, taken
    # right after the last save of the same model, is that checkpoint.
    best0, best1 = (checkpoint.best_path(str(out / "ckpt"), "resnet_tiny", r) for r in (0, 1))
    ema_paths = [checkpoint.tagged_path(str(out / "ckpt"), "resnet_tiny", r, "ema") for r in (0, 1)]
    assert os.path.samefile(rank0, rank1) and os.path.samefile(*ema_paths) and os.path.samefile(best1, rank0)
    assert all(name.endswith((".ckpt", ".ckpt.json")) and not name.startswith(".") for name in os.listdir(out / "ckpt"))


@pytest.mark.multiprocess
def test_scheduler_gone_after_run(mpirun_run):
    out, _ = mpirun_run
    assert (out / "logs" / "scheduler.log").exists()  # rank 0 did start one
    assert not _wait_until_no_scheduler(out, 10)  # its watchdog reaps it a few seconds after rank 0 exits


@pytest.mark.multiprocess
def test_indivisible_batch_under_mpirun_fails_fast_and_clearly(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--batch_size", 15), ranks=2, check=False, timeout=120)
    assert proc.returncode != 0
    assert "batch_size 15 is the global batch and must divide evenly over 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.multiprocess
def test_killed_rank_ends_job_and_scheduler(data_dir, tmp_path):
    cmd = mpirun(2) + [sys.executable, "-m", "msdist.train"] + tiny_args(data_dir, tmp_path, "--epochs", 20,
                                                                        "--log_every", 5)
    job = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        log1 = tmp_path / "logs" / "rank_1.log"
        deadline = time.time() + 120
        while time.time() < deadline and not (log1.exists() and "step 5/" in log1.read_text()):
            time.sleep(0.5)
        assert "step 5/" in log1.read_text(), "rank 1 never started training"
        rank1 = [p for p in _pids_of("msdist.train") if _env_of(p).get("OMPI_COMM_WORLD_RANK") == "1"
                 and str(tmp_path) in _cmdline_of(p)]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        assert job.wait(timeout=15) != 0  # the bound: a dead rank ends the job within 15 s
    finally:
        if job.poll() is None:
            job.kill()
    assert not _wait_until_no_scheduler(tmp_path, 10)
    assert not [p for p in _pids_of("msdist.train") if str(tmp_path) in _cmdline_of(p)]


def _pids_of(pattern: str) -> list:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _env_of(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


@pytest.mark.multiprocess
def test_resume_continues_at_the_right_epoch_and_lr(data_dir, tmp_path):
    """Stop mid-epoch 2, resume from that checkpoint's PATH: same final weights as one uninterrupted run.

    (`--resume auto` is what msdist.launch's restarts and the mpirun retry script use: integration/test_launch.py.)
    """
    common = ("--epochs", 2, "--deterministic", "true", "--log_every", 1)
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent runs: their start-ups and exits overlap
        list(pool.map(lambda args: run_msdist("train", tiny_args(data_dir, *args)),
                      [(tmp_path / "full", *common), (tmp_path / "cut", *common, "--max_steps", 18)]))
    [stopped] = [p for p in checkpoints(tmp_path / "cut", 0) if p.endswith("-2_6.ckpt")]
    resumed = run_msdist("train", tiny_args(data_dir, tmp_path / "cut", *common, "--resume", stopped))
    assert "resumed from" in resumed.stdout and "epoch 1, step 6 of 12, global step 18" in resumed.stdout
    lrs = optim.lr_schedule("cosine", 0.05, 2, 12, warmup_epochs=0.5)
    first = next(line for line in resumed.stdout.splitlines() if line.startswith("epoch 2/2 step 7/12"))
    assert f"lr {lrs[18]:.6f}" in first  # the LR schedule continues at step 19, not from the start
    full = load_params(checkpoints(tmp_path / "full", 0)[-1], include_state=True)
    final = [p for p in checkpoints(tmp_path / "cut", 0) if p.endswith("-2_12.ckpt")]
    cut = load_params(final[0], include_state=True)
    assert full.keys() == cut.keys()
    for name in full:
        np.testing.assert_allclose(cut[name], full[name], rtol=1e-6, atol=1e-7, err_msg=name)
