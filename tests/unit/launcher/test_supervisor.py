"""The launcher's pieces in this process: option routing, the traceback tail of an attempt, the first cause
(launch.py, launcher/supervisor.py, launcher/failures.py)."""
import pytest

from msdist import launch
from msdist.base.errors import ConfigError
from msdist.launcher import elastic, failures
from conftest import REAL_DATA as DATA_DIR


def test_unknown_options_go_to_train(tmp_path):
    out = str(tmp_path / "x")
    plan = launch.parse_args(["-n", "2", "--max_restarts", "3", "--epochs", "4", "--output_dir", out,
                              "--data_dir", DATA_DIR])
    assert (plan.world_size, plan.max_restarts, plan.master_addr) == (2, 3, "127.0.0.1")
    assert plan.train_args == ["--epochs", "4", "--output_dir", out, "--data_dir", DATA_DIR]


def test_nnodes_min_max_is_an_elastic_plan_whose_batch_is_cut_for_max_nodes(tmp_path):
    plan = launch.parse_args(["-n", "2", "--nnodes", "1:3", "--node_rank", "2", "--master_addr", "10.0.0.1",
                              "--master_port", "29500", "--wait_for_nodes", "5", "--batch_size", "12",
                              "--data_dir", DATA_DIR, "--output_dir", str(tmp_path / "x")])
    assert (plan.nnodes, plan.max_nodes, plan.node_rank, plan.wait_for_nodes) == (1, 3, 2, 5.0)
    # Every rank: the batch cut for MAX x -n ranks at any world size, and resumed from rank 0's newest checkpoint.
    assert elastic.rank_environment(plan) == {"MSDIST_BATCH_SLOTS": "6", "MSDIST_RESUME_FROM_RANK0": "1"}
    fixed = launch.parse_args(["-n", "2", "--data_dir", DATA_DIR])
    assert (fixed.nnodes, fixed.max_nodes) == (1, 1)   # a fixed job: no elastic supervisor, the variables untouched
    with pytest.raises(ConfigError, match="--node_rank 3 must be in 0..2"):
        launch.parse_args(["-n", "1", "--nnodes", "1:3", "--node_rank", "3", "--master_addr", "h",
                           "--master_port", "1"])
    with pytest.raises(ConfigError, match="--nnodes > 1 needs --master_addr"):
        launch.parse_args(["-n", "1", "--nnodes", "1:2"])


def test_traceback_tail_reads_only_this_attempt(tmp_path):
    log = tmp_path / "rank_1.log"
    log.write_text("Traceback (most recent call last):\nOldError: from attempt 1\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("12:00 rank1 INFO training\nTraceback (most recent call last):\n  File x\nValueError: new\n")
    assert failures.traceback_tail({str(log): offset}) == ["Traceback (most recent call last):", "  File x",
                                                         "ValueError: new"]
    assert failures.traceback_tail({str(log): log.stat().st_size}) == []


def test_traceback_tail_ends_at_the_exception_line(tmp_path):
    log = tmp_path / "rank_0.log"
    log.write_text("Traceback (most recent call last):\n  File y\nRuntimeError: Miss argument\n\n"
                   "- The Traceback of Net Construct Code:\n# In file engine.py:17\n")
    assert failures.traceback_tail({str(log): 0})[-1] == "RuntimeError: Miss argument"


def test_traceback_tail_brings_up_a_message_mindspore_put_below_rulers(tmp_path):
    log = tmp_path / "rank_1.log"
    log.write_text("Traceback (most recent call last):\n  File z\nRuntimeError: \n" + "-" * 52 + "\n"
                   "- Framework Unexpected Exception Raised:\n" + "-" * 52 + "\n"
                   "Collective AllReduce failed: node 0 is down\n\n- C++ Call Stack: (For framework developers)\n")
    assert failures.traceback_tail({str(log): 0})[-1] == "RuntimeError: Collective AllReduce failed: node 0 is down"


def test_first_cause_prefers_a_dead_rank_then_the_longest_silent():
    beat = {"epoch": 1, "step": 3, "global_step": 3}
    stalled_late = failures.Failure(0, "stalled", dict(beat, time=200.0), stalled=True, silent_since=200.0)
    stalled_early = failures.Failure(1, "stalled", None, stalled=True, silent_since=100.0)  # never beat
    dead = failures.Failure(2, "killed by SIGKILL", beat)
    assert failures.first_cause([stalled_late, stalled_early]).rank == 1
    assert failures.first_cause([stalled_late, dead, stalled_early]).rank == 2
