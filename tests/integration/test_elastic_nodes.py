"""Elastic msdist.launch on three network-namespace hosts (issue 41 item 8): two nodes lost at once, nodes of two
ranks, and a node lost leaving fewer than MIN.

Three namespaces hang off a bridge in a fourth (test_elastic_drain.py's `hosts`), so every host reaches every
other; removed afterwards even when a test fails. A lost node is its launcher and every
process it started killed with SIGKILL at the first step of epoch 2, as in test_elastic.py.
"""
import os
import re
import signal
import sys

import pytest

from msdist.run import checkpoint
from test_launch import DATA_DIR, TINY_CONFIG, Job, _tagged_pids
from test_elastic_drain import hosts  # noqa: F401  (the fixture: three hosts on a bridge, removed afterwards)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RUN_LIMIT_S = 420
# Six ranks starting at once on a small shared machine take longer than 30 s to import and register.
_TINY = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--epochs", "3", "--log_every", "4",
         "--stall_register_timeout", "180"]


def _start(tmp, name, hosts, nodes: str, nproc: int, port: int, train_args) -> dict:
    """One `msdist.launch -n nproc --nnodes nodes` per host, node i in host i's namespace; the job forms once all
    three asked (MAX, or MIN with no wait for more)."""
    return {node: Job(tmp, f"{name}_node{node}", ["-n", str(nproc), "--nnodes", nodes, "--node_rank", str(node),
                                                   "--master_addr", hosts[0][1], "--master_port", str(port),
                                                   "--wait_for_nodes", "0" if nodes.startswith("3:") else "300"],
                      train_args, output_name=name,
                      command=["ip", "netns", "exec", hosts[node][0], sys.executable, "-m", "msdist.launch"])
            for node in (2, 1, 0)}


def _lose(jobs, nodes, at_step: int) -> None:
    """Once rank 0 reports `at_step`, SIGKILL the launchers of `nodes` and every process they started, together."""
    jobs[0].wait_for_beat(0, at_least_step=at_step)
    for node in nodes:
        for pid in [jobs[node].proc.pid, *_tagged_pids(jobs[node].tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_all(jobs) -> None:
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def _membership_lines(job) -> list:
    return [line for line in job.stderr().splitlines() if re.match(r"msdist\.launch: membership [2-9]", line)]


def test_two_nodes_of_two_ranks_lost_at_once_the_third_goes_on_with_its_two(hosts, tmp_path):
    """--nnodes 1:3, -n 2 (world size 6; the global batch of 24 is cut into 6 slots at any world size): nodes 1
    and 2 are killed together in epoch 2; node 0 re-forms alone once, world size 6 -> 2, from the epoch-1
    checkpoint (8 steps per epoch), and finishes."""
    port = 24000 + os.getpid() % 500 * 10
    jobs = _start(tmp_path, "two_lost", hosts, "1:3", 2, port, _TINY + ["--batch_size", "24"])
    try:
        _lose(jobs, (1, 2), at_step=9)
        survivor = jobs[0]
        assert survivor.wait(limit_s=RUN_LIMIT_S) == 0, survivor.stderr()
        lines = _membership_lines(survivor)
        a, b = (re.escape(hosts[n][1]) for n in (1, 2))
        assert len(lines) == 1 and re.fullmatch(
            rf"msdist\.launch: membership 2: node {a} left \(lost: no answer for \d+ s\), node {b} left \(lost: no "
            rf"answer for \d+ s\); 1 node\(s\), world size 6 -> 2; node 0 \(scheduler\) {re.escape(hosts[0][1])}; "
            r"resumed from global step 8", lines[0]), survivor.stderr()
        for rank in (0, 1):   # both local ranks of the survivor trained to the end
            assert checkpoint.latest_good(os.path.join(survivor.output_dir, "ckpt"), "resnet_tiny",
                                          rank).position.global_step == 24
        assert survivor.leftovers() == []
    finally:
        _stop_all(jobs)


def test_a_node_lost_leaving_fewer_than_min_ends_every_survivor_with_one_line_and_the_checkpoint_kept(hosts,
                                                                                                     tmp_path):
    """--nnodes 3:4 on three hosts: node 2 lost in epoch 2 leaves 2 < MIN. Each survivor says so in one line and
    exits 1 (docs/elastic.md, "Fewer than MIN nodes"); the epoch-1 checkpoint, complete on all three ranks, is
    where a --resume auto of the job on enough nodes continues."""
    port = 25000 + os.getpid() % 500 * 10
    jobs = _start(tmp_path, "below_min", hosts, "3:4", 1, port, _TINY + ["--batch_size", "16"])
    try:
        _lose(jobs, (2,), at_step=13)
        for node in (0, 1):
            assert jobs[node].wait(limit_s=RUN_LIMIT_S) == 1, jobs[node].stderr()
            failed = [line for line in jobs[node].stderr().splitlines() if "FAILED" in line]
            # Node 0 decides (2 left); node 1 may hear node 0's end first and count itself alone.
            left = "2" if node == 0 else "[12]"
            assert len(failed) == 1 and re.fullmatch(rf"msdist\.launch: FAILED: {left} node\(s\) left, fewer than the "
                                                     r"minimum 3 \(--nnodes 3:4\)", failed[0]), jobs[node].stderr()
            assert jobs[node].leftovers() == []
        ckpt = os.path.join(jobs[0].output_dir, "ckpt")
        assert [checkpoint.latest_good(ckpt, "resnet_tiny", rank).position.global_step for rank in (0, 1, 2)] == \
            [12, 12, 12]
    finally:
        _stop_all(jobs)
