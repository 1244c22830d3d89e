"""Performance mechanisms in real ranks: one thread and one core per local rank, the ISA choice reaching
oneDNN (ONEDNN_VERBOSE=profile_create prints the ISA it dispatches to), the compiled step reused on restart."""
import glob
import os
import re

import pytest

from conftest import run_msdist, tiny_args
from msdist.rank import runtime


# oneDNN's start-up lines, printed by every process that creates a primitive.
ONEDNN_INFO = {"ONEDNN_VERBOSE": "profile_create"}


def _start_line(output_dir, rank: int) -> str:
    """The newest run's start line (rank logs append across restarts)."""
    with open(os.path.join(str(output_dir), "logs", f"rank_{rank}.log"), encoding="utf-8") as f:
        return [line for line in f if "world size" in line][-1]


@pytest.fixture(scope="module")
def mpirun_two_ranks(tmp_path_factory, data_dir):
    """A real 2-rank mpirun with oneDNN reporting what it got in each rank."""
    out = tmp_path_factory.mktemp("perf_mpirun")
    proc = run_msdist("train", tiny_args(data_dir, out, "--max_steps", 2, "--cpu_isa", "AVX2",
                                         "--compile_cache", "false"),
                      ranks=2, env={**ONEDNN_INFO, "ONEDNN_MAX_CPU_ISA": ""}, timeout=240)
    return out, proc.stdout


@pytest.mark.multiprocess
def test_two_local_ranks_get_one_thread_and_one_core_each(mpirun_two_ranks):
    out, stdout = mpirun_two_ranks
    if len(runtime.usable_cores()) != 2:
        pytest.skip("the expected split is written for a 2-core host")
    for rank in (0, 1):  # mpirun binds each rank to a core by default; msdist keeps that split
        assert f"1 threads/rank | cores {rank} (bound by launcher) |" in _start_line(out, rank)
    # MindSpore's kernel thread pool, as oneDNN sees it in both ranks: one thread each, not the host's two.
    assert re.findall(r"runtime:threadpool,nthr:(\d+)", stdout) == ["1", "1"]


@pytest.mark.multiprocess
def test_isa_choice_reaches_onednn_in_every_rank(mpirun_two_ranks):
    out, stdout = mpirun_two_ranks
    assert "oneDNN ISA AVX2 (option)" in _start_line(out, 1)
    assert stdout.count("info,cpu,isa:Intel AVX2\n") == 2


@pytest.mark.multiprocess
def test_restart_reuses_the_compiled_train_step(tmp_path, data_dir):
    args = tiny_args(data_dir, tmp_path, "--max_steps", 2)
    run_msdist("train", args)
    assert "compile cache cold" in _start_line(tmp_path, 0)
    pattern = os.path.join(str(tmp_path), "compile_cache", "*", "rank_0", "**", "*.mindir")
    cached = {path: os.stat(path).st_mtime_ns for path in glob.glob(pattern, recursive=True)}
    assert len(cached) == 1, cached  # only the train step: other graphs compile in varying order
    # A restart (its resume gathers across ranks before training: a different compile order) loads it.
    proc = run_msdist("train", args + ["--resume", "auto"])
    assert "compile cache reused" in _start_line(tmp_path, 0)
    assert "eval result" in proc.stdout
    assert {path: os.stat(path).st_mtime_ns for path in glob.glob(pattern, recursive=True)} == cached
