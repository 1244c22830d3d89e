"""Elastic msdist.launch on three network-namespace hosts (issue 41 items 3 and 8): two nodes lost at once, nodes
of two ranks, a node lost leaving fewer than MIN, and stop signals pending while the job re-forms (to every
survivor: the job stops; to one: it drains).

Three namespaces hang off a bridge in a fourth (test_elastic_drain.py's `hosts`), so every host reaches every
other; removed afterwards even when a test fails. A lost node is its launcher and every
process it started killed with SIGKILL at the first step of epoch 2, as in test_elastic.py. The runs start
together in one module fixture (`runs`, different ports on the same hosts), each its loss from a thread of its own.
"""
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from msdist.cluster.preemption import REQUEUE_EXIT
from msdist.launcher.drain import DRAINED_EXIT
from msdist.run import checkpoint
from test_launch import DATA_DIR, TINY_CONFIG, Job, _tagged_pids, stop_all
from test_elastic_drain import _agreed_steps, hosts  # noqa: F401  (hosts: three on a bridge, removed afterwards)

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


def _two_nodes_lost(tmp, hosts) -> tuple:
    """--nnodes 1:3 -n 2, nodes 1 and 2 lost together: (the survivor's exit status, its stderr, each of its ranks'
    newest good step, its leftovers)."""
    port = 24000 + os.getpid() % 500 * 10
    jobs = _start(tmp, "two_lost", hosts, "1:3", 2, port, _TINY + ["--batch_size", "24"])
    try:
        _lose(jobs, (1, 2), at_step=9)
        survivor = jobs[0]
        code = survivor.wait(limit_s=RUN_LIMIT_S)
        steps = [checkpoint.latest_good(os.path.join(survivor.output_dir, "ckpt"), "resnet_tiny", rank)
                 for rank in (0, 1)]
        return code, survivor.stderr(), [s.position.global_step if s else None for s in steps], survivor.leftovers()
    finally:
        stop_all(jobs)


def _one_lost_below_min(tmp, hosts) -> tuple:
    """--nnodes 3:4 on three hosts, node 2 lost: ({node: (exit status, stderr, leftovers)} of nodes 0 and 1, each
    rank's newest good step)."""
    port = 25000 + os.getpid() % 500 * 10
    jobs = _start(tmp, "below_min", hosts, "3:4", 1, port, _TINY + ["--batch_size", "16"])
    try:
        _lose(jobs, (2,), at_step=13)
        ended = {node: (jobs[node].wait(limit_s=RUN_LIMIT_S), jobs[node].stderr(), jobs[node].leftovers())
                 for node in (0, 1)}
        ckpt = os.path.join(jobs[0].output_dir, "ckpt")
        return ended, [checkpoint.latest_good(ckpt, "resnet_tiny", rank).position.global_step for rank in (0, 1, 2)]
    finally:
        stop_all(jobs)


def _signalled_while_reforming(tmp, hosts, name: str, port: int, signalled: tuple) -> tuple:
    """--nnodes 1:3 -n 1, node 2 lost in epoch 2 (the epoch-1 checkpoint is step 8), and SIGTERM at once to the
    launchers of `signalled`: their ranks' stop check waits for the lost rank, so the signal is still pending when
    the job re-forms. ({node: (exit status, stderr, leftovers)} of nodes 0 and 1, the survivors' agreed steps, rank
    0's newest good step, the steps rank 0 resumed from)."""
    jobs = _start(tmp, name, hosts, "1:3", 1, port, _TINY + ["--batch_size", "24"])
    try:
        _lose(jobs, (2,), at_step=9)
        for node in signalled:
            jobs[node].proc.send_signal(signal.SIGTERM)
        ended = {node: (jobs[node].wait(limit_s=RUN_LIMIT_S), jobs[node].stderr(), jobs[node].leftovers())
                 for node in (0, 1)}
        step = checkpoint.latest_good(os.path.join(jobs[0].output_dir, "ckpt"), "resnet_tiny", 0).position.global_step
        with open(os.path.join(jobs[0].output_dir, "logs", "rank_0.log"), encoding="utf-8") as f:
            resumed = [int(s) for s in re.findall(r"resumed from .*global step (\d+)", f.read())]
        return ended, _agreed_steps(jobs[0], [0, 1]), step, resumed
    finally:
        stop_all(jobs)


def _stopped_while_reforming(tmp, hosts) -> tuple:
    """Both survivors signalled: a stop of the whole job."""
    return _signalled_while_reforming(tmp, hosts, "reform_stop", 26000 + os.getpid() % 500 * 10, (1, 0))


def _drained_while_reforming(tmp, hosts) -> tuple:
    """Node 1 signalled, node 0 not: a drain."""
    return _signalled_while_reforming(tmp, hosts, "reform_drain", 27000 + os.getpid() % 500 * 10, (1,))


@pytest.fixture(scope="module")
def runs(hosts, tmp_path_factory):
    """Every run, started at once (each mostly waits: start-up, --membership_timeout) and ended before a test looks."""
    started = {"two_lost": _two_nodes_lost, "below_min": _one_lost_below_min,
               "reform_stop": _stopped_while_reforming, "reform_drain": _drained_while_reforming}
    with ThreadPoolExecutor(max_workers=len(started)) as pool:
        ended = {name: pool.submit(run, tmp_path_factory.mktemp(name), hosts) for name, run in started.items()}
    return ended


def test_two_nodes_of_two_ranks_lost_at_once_the_third_goes_on_with_its_two(runs, hosts):
    """--nnodes 1:3, -n 2 (world size 6; the global batch of 24 is cut into 6 slots at any world size): nodes 1
    and 2 are killed together in epoch 2; node 0 re-forms alone once, world size 6 -> 2, from the epoch-1
    checkpoint (8 steps per epoch), and finishes."""
    code, err, steps, leftovers = runs["two_lost"].result()
    assert code == 0, err
    lines = [line for line in err.splitlines() if re.match(r"msdist\.launch: membership [2-9]", line)]
    a, b = (re.escape(hosts[n][1]) for n in (1, 2))
    assert len(lines) == 1 and re.fullmatch(
        rf"msdist\.launch: membership 2: node {a} left \(lost: no answer for \d+ s\), node {b} left \(lost: no "
        rf"answer for \d+ s\); 1 node\(s\), world size 6 -> 2; node 0 \(scheduler\) {re.escape(hosts[0][1])}; "
        r"resumed from global step 8", lines[0]), err
    assert steps == [24, 24]   # both local ranks of the survivor trained to the end
    assert leftovers == []


def test_a_node_lost_leaving_fewer_than_min_ends_every_survivor_with_one_line_and_the_checkpoint_kept(runs):
    """--nnodes 3:4 on three hosts: node 2 lost in epoch 2 leaves 2 < MIN. Each survivor says so in one line and
    exits 1 (docs/elastic.md, "Fewer than MIN nodes"); the epoch-1 checkpoint, complete on all three ranks, is
    where a --resume auto of the job on enough nodes continues."""
    ended, steps = runs["below_min"].result()
    for node in (0, 1):
        code, err, leftovers = ended[node]
        assert code == 1, err
        failed = [line for line in err.splitlines() if "FAILED" in line]
        # Node 0 decides (2 left); node 1 may hear node 0's end first and count itself alone.
        left = "2" if node == 0 else "[12]"
        assert len(failed) == 1 and re.fullmatch(rf"msdist\.launch: FAILED: {left} node\(s\) left, fewer than the "
                                                 r"minimum 3 \(--nnodes 3:4\)", failed[0]), err
        assert leftovers == []
    assert steps == [12, 12, 12]


def test_a_stop_signal_to_every_node_while_the_job_re_forms_ends_it_at_once_with_the_checkpoint_and_200(runs):
    """--nnodes 1:3, node 2 lost in epoch 2, both survivors signalled right after: both drain from the re-form,
    with nothing more to save (its epoch-1 checkpoint is complete): no new ranks start, no node goes on, and both
    exit 200 with nothing left behind."""
    ended, agreed, step, resumed = runs["reform_stop"].result()
    for node in (0, 1):
        code, err, leftovers = ended[node]
        assert code == REQUEUE_EXIT, err
        assert "msdist.launch: re-forming: node " in err and "attempt 2" not in err and leftovers == []
        assert "msdist.launch: the job stops (no node goes on): this node was signalled as it re-formed" in err, err
    assert resumed == [] and agreed == [[], []] and step == 8


def test_a_node_signalled_while_the_job_re_forms_drains_and_the_other_goes_on(runs, hosts):
    """--nnodes 1:3, node 2 lost in epoch 2, node 1 signalled right after: in the re-form node 1 leaves at once
    with the drained status; node 0 holds the re-form for the drain window, goes on alone (both lost and drained
    named), resumes from the epoch-1 checkpoint and finishes."""
    ended, agreed, step, resumed = runs["reform_drain"].result()
    (code0, err0, left0), (code1, err1, left1) = ended[0], ended[1]
    assert (code0, code1) == (0, DRAINED_EXIT), err0 + err1
    assert "msdist.launch: drained: the job goes on as membership 2 on 1 node(s) without this node" in err1
    assert "attempt 2" not in err1
    drained, lost = (re.escape(hosts[n][1]) for n in (1, 2))
    assert re.search(rf"membership 2: node {drained} left \(drained\), node {lost} left \(lost: no answer for \d+ s\); "
                     r"1 node\(s\), world size 3 -> 1; .*resumed from global step 8", err0), err0
    assert resumed == [8] and agreed == [[], []] and step == 24
    assert left0 == [] and left1 == []
