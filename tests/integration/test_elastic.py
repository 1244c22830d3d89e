"""Elastic msdist.launch (`--nnodes 1:2`) on two network-namespace hosts: a node lost, a node started late.

The hosts are test_two_hosts.py's (two namespaces joined by a veth pair; names contain "elastic", removed
afterwards even when a test fails). Every run starts at once in one module fixture, the uninterrupted
reference among them, so the file costs about one run's wall time. A lost node is its launcher and every
process it started killed with SIGKILL, at the first step of epoch 2 (12 steps per epoch): the survivor
re-forms alone and resumes from the epoch-1 checkpoint (global step 12) with world size 1. A node whose
network is gone is its host's link taken down, on a pair of hosts of its own; then it comes back. The shorter
runs on the same hosts (a lost node beyond --max_reforms, a node whose NFS cache hides the claim, a node with
another output dir) start together in a second module fixture, `side_runs`, once the first ones ended.
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from msdist.launcher.peers import MEMBER_TIMEOUT_S
from test_launch import TINY_CONFIG, DATA_DIR, Job, _tagged_pids, stop_all
from test_two_hosts import _create_namespaces, _delete_namespaces

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_TINY = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--batch_size", "16"]
# resnet_tiny, the tiny test config, deterministic kernels: the equivalence of issue #33.
ARGS = _TINY + ["--epochs", "3", "--deterministic", "true", "--log_every", "4"]
# The runs a node joins need the job still going when it comes: more epochs (no equivalence asked there).
LATE_ARGS = _TINY + ["--epochs", "12", "--log_every", "12"]
KILL_AT_STEP = 13          # the first step of epoch 2, which the heartbeat writes at once
EPOCH1_STEP = 12
EQUIVALENCE = 1e-4         # max |delta weight| against the uninterrupted run
AGREE_BOUND_S = MEMBER_TIMEOUT_S + 10   # kill -> the next view claimed (docs/elastic.md: the bound is 10 s + ~2 s)
RUN_LIMIT_S = 420


def _host_pair(prefix):
    try:
        namespaces = _create_namespaces(prefix)
    except OSError as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    yield namespaces
    _delete_namespaces([ns for ns, _ in namespaces])


@pytest.fixture(scope="module")
def hosts():
    yield from _host_pair(f"elastic{os.getpid() % 100000}")


CUT_PREFIX = f"elasticn{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def cut_hosts():
    """A pair of its own for the run whose network is cut (the link between the others stays up)."""
    yield from _host_pair(CUT_PREFIX)


def _node(tmp, name, hosts, node, port, args=ARGS, wait_for_nodes=30, back=False, launcher=(), env=None,
          launch=("-m", "msdist.launch"), output_name=None):
    """One `msdist.launch -n 1 --nnodes 1:2` in host `node`'s namespace, on its own core. `back`: the host comes
    back to a job that runs on the other host: it asks that host (and is not node_rank 0, which forms a job)."""
    ns, master = hosts[node][0], hosts[1 - node if back else 0][1]
    return Job(tmp, f"{name}_node{node}{'_back' if back else ''}",
               ["-n", "1", "--nnodes", "1:2", "--node_rank", str(1 if back else node), "--master_addr", master,
                "--master_port", str(port), "--wait_for_nodes", str(wait_for_nodes), *launcher], args,
               output_name=output_name or name, env=env,
               command=["ip", "netns", "exec", ns, "taskset", "-c", str(node % os.cpu_count()), sys.executable,
                        *launch])


def _lose_node(jobs, node) -> dict:
    """From a thread: once rank `node` reports KILL_AT_STEP, SIGKILL that node's launcher and all it started."""
    record = {}

    def watch():
        jobs[node].wait_for_beat(node, at_least_step=KILL_AT_STEP)
        for pid in [jobs[node].proc.pid, *_tagged_pids(jobs[node].tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        record["at"] = time.time()

    record["thread"] = threading.Thread(target=watch, daemon=True)
    record["thread"].start()
    return record


def _cut_network(tmp, jobs, hosts, node, port) -> dict:
    """From a thread: once rank `node` reports KILL_AT_STEP, take its host's network link down (all else runs).
    Once one side went on alone (the other ended), the link comes back up and the ended side's launcher is
    started again: it comes back (`jobs["back"]`)."""
    record = {}

    def link(state):
        subprocess.run(["ip", "-n", hosts[node][0], "link", "set", f"{CUT_PREFIX}v{'ab'[node]}", state], check=True)

    def watch():
        jobs[node].wait_for_beat(node, at_least_step=KILL_AT_STEP)
        link("down")
        record["at"] = time.time()
        deadline = time.monotonic() + RUN_LIMIT_S
        while all(jobs[n].proc.poll() is None for n in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        loser = 0 if jobs[0].proc.poll() is not None else 1
        jobs[1 - loser].wait_for_text("msdist.launch: membership 2:")
        link("up")
        jobs["back"] = _node(tmp, "cut", hosts, loser, port, LATE_ARGS, back=True)

    record["thread"] = threading.Thread(target=watch, daemon=True)
    record["thread"].start()
    return record


def _start_late(tmp, hosts, jobs, port) -> threading.Thread:
    """From a thread: start node 1 once node 0's rank trains (global step >= 1)."""
    def start():
        jobs[0].wait_for_beat(0, at_least_step=1)
        jobs[1] = _node(tmp, "late", hosts, 1, port, LATE_ARGS)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def runs(hosts, cut_hosts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    port = 21000 + os.getpid() % 500 * 10     # inside fresh namespaces: each run its own port and port + 1
    started = {name: {node: _node(tmp, name, hosts, node, port + 2 * i) for node in (1, 0)}
               for i, name in enumerate(("reference", "lose1", "lose0"))}
    started["cut"] = {node: _node(tmp, "cut", cut_hosts, node, port, LATE_ARGS) for node in (1, 0)}
    started["late"] = {0: _node(tmp, "late", hosts, 0, port + 6, LATE_ARGS, wait_for_nodes=0)}
    started["kills"] = {"lose1": _lose_node(started["lose1"], 1), "lose0": _lose_node(started["lose0"], 0),
                        "cut": _cut_network(tmp, started["cut"], cut_hosts, 1, port)}
    started["late_start"] = _start_late(tmp, hosts, started["late"], port + 6)
    yield started
    for name in ("reference", "lose1", "lose0", "cut", "late"):
        for job in started[name].values():
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()


def _weights(job, rank=0) -> dict:
    import mindspore as ms
    from msdist.run import checkpoint
    info = checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank)
    assert info is not None, f"no checkpoint for rank {rank} in {job.output_dir}"
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(info.path).items() if hasattr(v, "asnumpy")}


def _records(job) -> list:
    with open(os.path.join(job.output_dir, "logs", "membership.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _changes(job) -> list:
    """The launcher's membership lines after the first formation."""
    return [line for line in job.stderr().splitlines() if re.match(r"msdist\.launch: membership [2-9]", line)]


def _result(job) -> dict:
    with open(os.path.join(job.output_dir, "result.json"), encoding="utf-8") as f:
        return json.load(f)


def _agreed_at(job, generation) -> float:
    """When the view of `generation` was claimed (its claim file's time, on the shared log dir)."""
    claims = glob.glob(os.path.join(job.output_dir, "logs", "membership", f"*-{generation}.json"))
    assert len(claims) == 1, claims
    return os.path.getmtime(claims[0])


def _assert_lost_node(runs, name, lost, hosts):
    survivor = runs[name][1 - lost]
    kill = runs["kills"][name]
    kill["thread"].join(timeout=RUN_LIMIT_S)
    assert "at" in kill, f"node {lost} was never killed:\n{runs[name][lost].stderr()}"
    assert survivor.wait(limit_s=RUN_LIMIT_S) == 0, survivor.stderr()
    lost_addr, survivor_addr = hosts[lost][1], hosts[1 - lost][1]
    lines = _changes(survivor)
    # One line: who left, the new world size, the new scheduler host (the survivor), the step resumed from.
    assert len(lines) == 1, survivor.stderr()
    assert re.fullmatch(rf"msdist\.launch: membership 2: node {re.escape(lost_addr)} left \(lost: no answer for "
                        rf"\d+ s\); 1 node\(s\), world size 2 -> 1; node 0 \(scheduler\) {re.escape(survivor_addr)}; "
                        rf"resumed from global step {EPOCH1_STEP}", lines[0]), lines[0]
    [record] = _records(survivor)
    assert record["left"][0]["node"] == lost_addr and record["joined"] == []
    assert (record["world_size_before"], record["world_size"]) == (2, 1)
    assert record["scheduler_host"] == survivor_addr and record["resumed_from_step"] == EPOCH1_STEP
    agreed_s = _agreed_at(survivor, 2) - kill["at"]
    print(f"{name}: node {lost} killed -> membership 2 agreed in {agreed_s:.1f} s")
    assert 0 < agreed_s <= AGREE_BOUND_S
    assert _result(survivor)["world_size"] == 1
    reference = runs["reference"][0]
    assert reference.wait(limit_s=RUN_LIMIT_S) == 0, reference.stderr()
    got, want = _weights(survivor), _weights(reference)
    assert sorted(got) == sorted(want)
    delta = max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want if want[k].size)
    print(f"{name}: max |delta weight| against the uninterrupted 2-host run: {delta:.3g}")
    assert delta <= EQUIVALENCE
    assert survivor.leftovers() == [] and runs[name][lost].leftovers() == []


@pytest.mark.multiprocess
def test_lost_node_1_the_other_finishes_alone_like_the_uninterrupted_run(runs, hosts):
    _assert_lost_node(runs, "lose1", 1, hosts)


@pytest.mark.multiprocess
def test_lost_node_0_the_survivor_hosts_the_scheduler_and_finishes_alike(runs, hosts):
    _assert_lost_node(runs, "lose0", 0, hosts)


@pytest.mark.multiprocess
def test_network_gone_one_side_goes_on_and_the_host_coming_back_is_admitted(runs, cut_hosts):
    """Node 1's link down: each side finds the other lost, both try to go on alone, and the claim in the shared
    log dir lets exactly one of them (never two jobs writing the same checkpoints); the other names why it
    stopped. The link back up, that host's launcher started again is admitted at a checkpoint boundary."""
    jobs, cut = runs["cut"], runs["kills"]["cut"]
    cut["thread"].join(timeout=RUN_LIMIT_S)
    assert "back" in jobs, f"the network was never cut, or nobody went on:\n{jobs[0].stderr()}\n{jobs[1].stderr()}"
    codes = {node: jobs[node].wait(limit_s=RUN_LIMIT_S) for node in (0, 1)}
    assert sorted(codes.values()) == [0, 1], (jobs[0].stderr(), jobs[1].stderr())
    winner = 0 if codes[0] == 0 else 1
    assert jobs["back"].wait(limit_s=RUN_LIMIT_S) == 0, jobs["back"].stderr()
    went_on, back = cut_hosts[winner][1], cut_hosts[1 - winner][1]
    assert "msdist.launch: FAILED: the job went on as membership 2 without this node" in jobs[1 - winner].stderr()
    lines = _changes(jobs[winner])
    assert len(lines) == 2, jobs[winner].stderr()
    assert re.fullmatch(rf"msdist\.launch: membership 2: node {re.escape(back)} left \(lost: no answer for \d+ s\); "
                        rf"1 node\(s\), world size 2 -> 1; node 0 \(scheduler\) {re.escape(went_on)}; resumed from "
                        rf"global step {EPOCH1_STEP}", lines[0]), lines[0]
    assert re.fullmatch(rf"msdist\.launch: membership 3: node {re.escape(back)} joined; 2 node\(s\), world size 1 -> "
                        rf"2; node 0 \(scheduler\) {re.escape(went_on)}; resumed from global step \d+",
                        lines[1]), lines[1]
    assert _changes(jobs["back"]) == [lines[1]]
    assert [(r["generation"], r["world_size"]) for r in _records(jobs[winner])] == [(2, 1), (3, 2)]
    assert _result(jobs[winner])["world_size"] == 2
    print(f"network cut: node {winner} went on; membership 2 agreed {_agreed_at(jobs[0], 2) - cut['at']:.1f} s "
          "after the cut")
    assert all(job.leftovers() == [] for job in (jobs[0], jobs[1], jobs["back"]))


@pytest.mark.multiprocess
def test_late_node_joins_at_a_checkpoint_boundary(runs, hosts):
    runs["late_start"].join(timeout=RUN_LIMIT_S)
    jobs = runs["late"]
    assert 1 in jobs, f"node 0 never trained:\n{jobs[0].stderr()}"
    assert jobs[0].wait(limit_s=RUN_LIMIT_S) == 0, jobs[0].stderr()
    assert jobs[1].wait(limit_s=RUN_LIMIT_S) == 0, jobs[1].stderr()
    addr0, addr1 = hosts[0][1], hosts[1][1]
    assert "a node asks to join" in jobs[0].stderr()
    pattern = (rf"msdist\.launch: membership 2: node {re.escape(addr1)} joined; 2 node\(s\), world size 1 -> 2; "
               rf"node 0 \(scheduler\) {re.escape(addr0)}; resumed from global step (\d+)")
    for job in (jobs[0], jobs[1]):
        lines = _changes(job)
        assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), job.stderr()
    step = int(re.fullmatch(pattern, _changes(jobs[0])[0]).group(1))
    assert step > 0   # joined mid-run, at the step every rank saved on the admission
    [record] = _records(jobs[0])
    assert record["joined"] == [addr1] and record["left"] == [] and record["world_size"] == 2
    assert record["resumed_from_step"] == step
    # The admission's checkpoint: saved at that very step through the preemption path, so nothing is lost.
    with open(os.path.join(jobs[0].output_dir, "logs", "rank_0.log"), encoding="utf-8") as f:
        assert f"preempted: the ranks agreed on global step {step};" in f.read()
    assert _result(jobs[0])["world_size"] == 2
    assert jobs[0].leftovers() == [] and jobs[1].leftovers() == []


@pytest.mark.multiprocess
def test_fewer_than_min_nodes_is_a_named_failure_not_a_hang(tmp_path):
    """Node 0 of `--nnodes 2:4` alone: one line naming the shortfall, exit 1, within the start-up limit."""
    from msdist.cluster.rendezvous import free_port
    job = Job(tmp_path, "too_few", ["-n", "1", "--nnodes", "2:4", "--master_addr", "127.0.0.1", "--master_port",
                                    str(free_port())], ARGS + ["--stall_startup_timeout", "3"])
    assert job.wait(limit_s=60) == 1, job.stderr()
    lines = [line for line in job.stderr().splitlines() if line.startswith("msdist.launch:")]
    assert lines == ["msdist.launch: FAILED: 1 node(s) joined within --stall_startup_timeout 3 s, fewer than the "
                     "minimum 2 (--nnodes 2:4)"], job.stderr()
    assert not os.path.exists(os.path.join(job.output_dir, "logs", "rank_0.heartbeat"))   # no rank started
    assert job.leftovers() == []


def _beyond_max_reforms(tmp, hosts) -> tuple:
    """--max_reforms 0 --membership_timeout 3, node 1 lost: (node 0's exit status, its stderr, its leftovers)."""
    port = 23000 + os.getpid() % 500 * 10
    launcher = ["--max_reforms", "0", "--membership_timeout", "3"]
    jobs = {node: _node(tmp, "budget", hosts, node, port, launcher=launcher) for node in (1, 0)}
    try:
        kill = _lose_node(jobs, 1)
        kill["thread"].join(timeout=RUN_LIMIT_S)
        assert "at" in kill, jobs[1].stderr()
        return jobs[0].wait(limit_s=120), jobs[0].stderr(), jobs[0].leftovers()
    finally:
        stop_all(jobs)


NFS_DELAY_S = 35   # above NFS's acdirmin (30 s), and above the 10 s the claim once had to show within
NFS_LAUNCH = (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch_with_nfs_delay.py"),)


def _behind_an_nfs_cache(tmp, hosts) -> dict:
    """Node 1 sees node 0's claim files NFS_DELAY_S late: both launchers, once ended."""
    port = 26000 + os.getpid() % 500 * 10
    jobs = {1: _node(tmp, "nfs", hosts, 1, port, env={"MSDIST_TEST_NFS_DELAY": str(NFS_DELAY_S)}, launch=NFS_LAUNCH),
            0: _node(tmp, "nfs", hosts, 0, port)}
    try:
        for node in (0, 1):
            assert jobs[node].wait(limit_s=RUN_LIMIT_S) == 0, jobs[node].stderr()
        return {node: (job, job.leftovers()) for node, job in jobs.items()}
    finally:
        stop_all(jobs)


def _with_another_output_dir(tmp, hosts) -> tuple:
    """Node 1 writes elsewhere than node 0: (node 1's exit status, its stderr, its output dir)."""
    port = 27000 + os.getpid() % 500 * 10
    jobs = {1: _node(tmp, "unshared", hosts, 1, port, output_name="elsewhere"),
            0: _node(tmp, "unshared", hosts, 0, port)}
    try:
        return jobs[1].wait(limit_s=120), jobs[1].stderr(), jobs[1].output_dir
    finally:
        stop_all(jobs)


@pytest.fixture(scope="module")
def side_runs(hosts, tmp_path_factory):
    """The shorter runs on `hosts`, started at once (each mostly waits: a membership timeout, an admission, a
    refusal) and all ended before a test looks."""
    runs = {"budget": _beyond_max_reforms, "nfs": _behind_an_nfs_cache, "unshared": _with_another_output_dir}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        ended = {name: pool.submit(run, tmp_path_factory.mktemp(name), hosts) for name, run in runs.items()}
    return ended


@pytest.mark.multiprocess
def test_a_reform_after_a_lost_node_beyond_max_reforms_is_one_line_and_a_failure(side_runs, hosts):
    """--max_reforms 0: the first lost node spends the budget; the survivor says so in one line and exits 1 instead
    of re-forming (a flapping link would loop the job back to its checkpoint forever). --membership_timeout 3 s:
    the loss is seen after 3 s of silence, not the default 10."""
    code, err, leftovers = side_runs["budget"].result()
    assert code == 1, err
    lines = [line for line in err.splitlines() if "FAILED" in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"msdist\.launch: FAILED: node {re.escape(hosts[1][1])} lost: no answer for [3-9] s; the job re-formed "
        r"after a lost node 0 time\(s\) already \(--max_reforms 0\): a flapping host or link would take it back "
        r"to its checkpoint forever", lines[0]), err
    # never went on as membership 2
    assert [line for line in err.splitlines() if re.match(r"msdist\.launch: membership [2-9]", line)] == []
    assert leftovers == []


@pytest.mark.multiprocess
def test_a_node_whose_nfs_cache_hides_the_claim_for_35_s_is_admitted_at_once(side_runs):
    """Node 1 sees node 0's claim files only 35 s after they were written (tests/nfs_delay.py: stat and open, as an
    NFS client's attribute cache may). The claim is checked by an exclusive create, which the server answers, so
    node 1 joins membership 1 at once and the job runs on both hosts (no re-form)."""
    ended = side_runs["nfs"].result()
    assert _changes(ended[0][0]) == [] and _result(ended[0][0])["world_size"] == 2
    assert ended[0][1] == [] and ended[1][1] == []


@pytest.mark.multiprocess
def test_a_node_with_another_output_dir_is_named_at_once(side_runs, hosts):
    """Node 1's --output_dir is not node 0's: its exclusive create of the claim succeeds, so it names the directory
    in one line and exits 2 at once, and leaves no claim file behind."""
    code, err, output_dir = side_runs["unshared"].result()
    assert code == 2, err
    assert f"msdist: error: --output_dir {output_dir} is not the one node 0 ({hosts[0][1]}) writes to: " \
           "an elastic job needs storage every node sees" in err
    assert glob.glob(os.path.join(output_dir, "logs", "membership", "*")) == []
