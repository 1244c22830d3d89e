"""Where the time goes, in real runs: MindSpore's profiler on a window of steps (tiny model, CPU), the slow rank
named under `mpirun -n 2` (rank 1's input delayed by tests/slow_input.py) and nobody named when the ranks are
alike, and TFLOP/s on the step line and in result.json."""
import csv
import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import _records, run_msdist, tiny_args
from msdist import report
from msdist.run import stragglers

WINDOW = (3, 5)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, data_dir):
    """name -> (output_dir, process) of the two profiled one-rank runs, started at once (start-ups overlap): the
    window inside the run, and a run that ends inside its window."""
    root = tmp_path_factory.mktemp("profiled")
    runs = {"inside": ("--max_steps", 7, "--log_every", 2, "--profile_steps", f"{WINDOW[0]}:{WINDOW[1]}"),
            "cut": ("--max_steps", 4, "--profile_steps", "3:9")}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        procs = pool.map(lambda name: run_msdist("train", tiny_args(data_dir, root / name, *runs[name])), runs)
        return {name: (root / name, proc) for name, proc in zip(runs, procs)}


@pytest.mark.slow
def test_the_profile_holds_the_windows_steps_and_the_run_says_where(profiled):
    out, proc = profiled["inside"]
    rank_dir = out / "profile" / "rank_0"
    assert f"profile of global steps 3-5 written to {rank_dir}" in proc.stdout
    assert "trace_view.json in chrome://tracing" in proc.stdout
    [run_dir] = glob.glob(str(rank_dir / "*_ascend_ms"))
    with open(os.path.join(run_dir, "ASCEND_PROFILER_OUTPUT", "trace_view.json"), encoding="utf-8") as f:
        events = [e for e in json.load(f) if e.get("ph") == "X"]
    with open(os.path.join(run_dir, "FRAMEWORK", "cpu_op_detail_info_0.csv"), encoding="utf-8") as f:
        kernels = list(csv.DictReader(f))
    # Every kernel of the training step ran once per step of the window, no more (the steps before and after
    # were not recorded) and no fewer.
    step_kernels = [k for k in kernels if "net_with_loss" in k["full_op_name"]]
    assert len(step_kernels) > 20
    assert {k["op_occurrences"] for k in step_kernels} == {str(WINDOW[1] - WINDOW[0] + 1)}
    convolutions = [e for e in events if e["name"].endswith("Conv2D-op0") and "net_with_loss" in e["name"]]
    assert convolutions and len(convolutions) % 3 == 0
    # FLOP/s: on the step line and in result.json, against this host's measured CPU peak.
    assert "TFLOP/s/device" in proc.stdout and "% of peak" in proc.stdout
    with open(out / "result.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["train_gflops_per_image"] > 0 and result["tflops_job"] == result["tflops_per_device"] > 0
    assert 0 < result["flops_utilisation"] < 1


@pytest.mark.slow
def test_a_run_that_ends_inside_the_window_still_writes_its_steps(profiled):
    out, proc = profiled["cut"]
    assert "profile of global steps 3-4 (the run ended inside the window)" in proc.stdout
    [detail] = glob.glob(str(out / "profile" / "rank_0" / "*_ascend_ms" / "FRAMEWORK" / "cpu_op_detail_info_0.csv"))
    with open(detail, encoding="utf-8") as f:
        assert {k["op_occurrences"] for k in csv.DictReader(f) if "net_with_loss" in k["full_op_name"]} == {"2"}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_whose_input_is_late_is_named_within_two_log_windows_and_alike_ranks_are_not(data_dir, tmp_path):
    slowed, alike = tmp_path / "slowed", tmp_path / "alike"
    every = 3
    args = ("--max_steps", 4 * every, "--epochs", 2, "--log_every", every, "--batch_size", 8)
    # Rank 1's batches arrive 1 s late from its 4th on (a step takes 0.1-0.5 s on a quiet or loaded host): the
    # second log window is the first slow one.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda job: run_msdist("train_with_test_models", tiny_args(data_dir, job[0], *args), ranks=2,
                                             env=job[1]),
                      [(slowed, {"MSDIST_TEST_SLOW_INPUT": f"1:1.0:{every + 1}"}), (alike, {})]))
    named, windows = _records(slowed, "straggler"), _records(slowed, "step")
    figures = [(r["global_step"], r["rank_step_s"], r["rank_input_wait"], r["rank_core_wait"]) for r in windows]
    assert [(r["rank"], r["verdict"]) for r in named] == [(1, stragglers.INPUT_BOUND)], (named, figures)
    assert named[0]["global_step"] <= 3 * every, figures  # slow from window 2, named by the end of window 3
    assert named[0]["input_wait_share"] > 0.3 and named[0]["host"]
    marked = [r["global_step"] for r in windows if r.get("slow_ranks") == [1]]
    assert marked and marked[0] == named[0]["global_step"]
    assert report.main([str(slowed)]) == 0 and os.path.getsize(slowed / report.RANKS_PNG) > 0
    assert _records(alike, "straggler") == []
    steps = _records(alike, "step")
    assert all(len(r["rank_core_wait"]) == 2 and "slow_ranks" not in r for r in steps)
    assert not os.path.exists(alike / "profile")          # no profiler without --profile_steps
