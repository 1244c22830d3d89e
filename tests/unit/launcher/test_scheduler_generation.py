"""The scheduler's generation token (launcher/scheduler_generation.py, launcher/restarts.py): a restarting node waits for node 0's next
scheduler, and ends at once when node 0's launcher has ended instead."""
import os
import threading
import time

import pytest

from msdist import launch
from msdist.cluster.rendezvous import free_port
from msdist.launcher import restarts, scheduler_generation, supervisor
from conftest import REAL_DATA as DATA_DIR


def test_a_restarting_node_waits_for_a_newer_scheduler_and_gives_up_after_the_timeout(tmp_path):
    log_dir = str(tmp_path)
    scheduler_generation.new_generation(log_dir)
    joined = scheduler_generation.read_generation(log_dir)
    later = threading.Timer(0.5, scheduler_generation.new_generation, [log_dir])
    later.start()
    began = time.monotonic()
    scheduler_generation.wait_for_new_generation(log_dir, joined, timeout_s=30)
    assert 0.4 < time.monotonic() - began < 10
    assert scheduler_generation.read_generation(log_dir) not in ("", joined)
    with pytest.raises(RuntimeError, match="node 0 did not start a new scheduler within 1 s"):
        scheduler_generation.wait_for_new_generation(log_dir, scheduler_generation.read_generation(log_dir), 1)


@pytest.mark.parametrize("code", [0, 1])
def test_node_0_ending_ends_the_wait_with_its_exit_status(tmp_path, code):
    scheduler_generation.new_generation(str(tmp_path))
    joined = scheduler_generation.read_generation(str(tmp_path))
    scheduler_generation.mark_ended(str(tmp_path), code)
    with pytest.raises(scheduler_generation.NodeZeroEnded) as ended:
        scheduler_generation.wait_for_new_generation(str(tmp_path), joined, timeout_s=30)
    assert ended.value.code == code
    assert ("finished the job" in str(ended.value)) == (code == 0)


def test_a_node_restarting_after_node_0_finished_the_job_exits_0_at_once(tmp_path, capsys):
    """Node 1's first attempt fails (no scheduler listens), and node 0 has already finished: node 1 neither
    waits --stall_startup_timeout for a scheduler that never comes nor fails the job."""
    out = tmp_path / "out"
    plan = launch.parse_args(["-n", "1", "--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1",
                              "--master_port", str(free_port()), "--max_restarts", "1",
                              "--stall_startup_timeout", "2", "--data_dir", DATA_DIR, "--output_dir", str(out)])
    os.makedirs(plan.log_dir)
    scheduler_generation.mark_ended(plan.log_dir, 0)
    began = time.monotonic()
    assert restarts.supervise(plan, supervisor.Forwarder(plan.preempt_signal)) == 0
    assert time.monotonic() - began < 30
    err = capsys.readouterr().err
    assert "restart 1 of 1" in err and "node 0's launcher finished the job (exit 0)" in err
