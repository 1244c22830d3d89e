"""A stop signal to an elastic msdist.launch: a drain shrinks the job, a stop of every node ends it (issue 41 item 5).

Three network-namespace hosts on one bridge (a namespace of its own holds it; names contain "drain", removed
afterwards even when a test fails), one `msdist.launch -n 1` per host and run. Every run starts at once in one
module fixture. A signal is a SIGTERM to a launcher alone (never to its ranks), sent once rank 0 trained
`SIGNAL_AT_STEP` steps (after the compile):

* drain: 3 nodes, `--nnodes 2:3`, node 0 signalled: every rank saves at one agreed step, node 0 leaves with
  the drained status, nodes 1 and 2 go on from that very step and finish;
* at MIN: 2 nodes, `--nnodes 2:3`, node 1 signalled: one node would stay, below MIN, so both exit 200;
* whole job: 2 nodes, `--nnodes 1:2`, both signalled 2 s apart: one checkpoint and 200 on both, although one
  node alone could go on (MIN 1): the window after the save (msdist.launcher.drain) tells the two apart;
* admission: 2 nodes, `--nnodes 2:3`, a third started late; node 1 signalled as the job saves to admit it:
  node 1 leaves, the newcomer joins, the job goes on with nodes 0 and 2.
"""
import glob
import json
import os
import re
import signal
import sys
import threading
import time

import pytest

from msdist.cluster.preemption import REQUEUE_EXIT
from msdist.launcher.drain import DRAINED_EXIT
from test_launch import TINY_CONFIG, DATA_DIR, Job, _newest_checkpoint_step
from test_two_hosts import _delete_namespaces, _ip

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# 192 images in batches of 12 (a multiple of MAX x -n = 3 and 2): 16 steps per epoch of 0.05-0.15 s. 160 steps:
# still training when the signal comes (sent once a heartbeat, every 2 s, says step 4) and its save is agreed.
_TINY = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--batch_size", "12"]
ARGS, STEPS = _TINY + ["--epochs", "10", "--log_every", "16"], 160
# A run a node joins must still be going when it comes (its start-up takes seconds): 12 epochs.
LATE_ARGS, LATE_STEPS = _TINY + ["--epochs", "12", "--log_every", "48"], 192
SIGNAL_AT_STEP = 4
WHOLE_JOB_SPREAD_S = 2.0
RUN_LIMIT_S = 420
_AGREED = re.compile(r"preempted: the ranks agreed on global step (\d+)")


def _create_hosts(prefix: str, count: int):
    """[(namespace, address)] x `count` whose veth ends meet on a bridge in namespace `<prefix>h`; raises
    OSError with the reason."""
    subnet, hub = f"10.232.{os.getpid() % 250}", f"{prefix}h"
    hosts = [(f"{prefix}{i}", f"{subnet}.{i + 1}") for i in range(count)]
    commands = [["netns", "add", hub], ["-n", hub, "link", "add", "br0", "type", "bridge"],
                ["-n", hub, "link", "set", "br0", "up"]]
    for i, (ns, addr) in enumerate(hosts):
        end, port = f"{prefix}v{i}", f"{prefix}p{i}"
        commands += [["netns", "add", ns], ["link", "add", end, "type", "veth", "peer", "name", port],
                     ["link", "set", end, "netns", ns], ["link", "set", port, "netns", hub],
                     ["-n", hub, "link", "set", port, "master", "br0"], ["-n", hub, "link", "set", port, "up"],
                     ["-n", ns, "addr", "add", f"{addr}/24", "dev", end], ["-n", ns, "link", "set", end, "up"],
                     ["-n", ns, "link", "set", "lo", "up"]]
    for command in commands:
        proc = _ip(*command)
        if proc.returncode != 0:
            _delete_namespaces([hub] + [ns for ns, _ in hosts])
            raise OSError(f"`ip {' '.join(command)}` failed: {proc.stderr.strip()}")
    return hosts


@pytest.fixture(scope="module")
def hosts():
    prefix = f"drain{os.getpid() % 100000}"
    try:
        created = _create_hosts(prefix, 3)
    except OSError as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    yield created
    _delete_namespaces([f"{prefix}h"] + [ns for ns, _ in created])


def _node(tmp, name, hosts, node, port, nnodes, wait_for_nodes, args=ARGS) -> Job:
    """One `msdist.launch -n 1 --nnodes <nnodes>` in host `node`'s namespace, on its own core. `wait_for_nodes`:
    long enough for every node of the run to be in the first formation (an admission is a save of its own)."""
    ns, master = hosts[node][0], hosts[0][1]
    return Job(tmp, f"{name}_node{node}", ["-n", "1", "--nnodes", nnodes, "--node_rank", str(node), "--master_addr",
                                            master, "--master_port", str(port), "--wait_for_nodes",
                                            str(wait_for_nodes)], args,
               output_name=name, command=["ip", "netns", "exec", ns, "taskset", "-c", str(node % os.cpu_count()),
                                          sys.executable, "-m", "msdist.launch"])


def _signal(jobs, nodes, spread_s=0.0) -> dict:
    """From a thread: once rank 0 trained SIGNAL_AT_STEP steps, SIGTERM the launcher of each of `nodes`, `spread_s`
    apart (the launcher only: its ranks hear of it from it)."""
    record = {}

    def send():
        jobs[0].wait_for_beat(0, at_least_step=SIGNAL_AT_STEP)
        for i, node in enumerate(nodes):
            if i:
                time.sleep(spread_s)
            jobs[node].proc.send_signal(signal.SIGTERM)
            record[node] = time.time()

    record["thread"] = threading.Thread(target=send, daemon=True)
    record["thread"].start()
    return record


def _signal_on_admission(tmp, hosts, jobs, port) -> dict:
    """From a thread: start node 2 once node 0's rank trains; SIGTERM node 1's launcher once node 0 says the job
    saves to admit node 2."""
    record = {}

    def send():
        jobs[0].wait_for_beat(0, at_least_step=1)
        jobs[2] = _node(tmp, "admit", hosts, 2, port, "2:3", 0, LATE_ARGS)
        jobs[0].wait_for_text("a node asks to join")
        jobs[1].proc.send_signal(signal.SIGTERM)
        record[1] = time.time()

    record["thread"] = threading.Thread(target=send, daemon=True)
    record["thread"].start()
    return record


@pytest.fixture(scope="module")
def runs(hosts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    port = 22000 + os.getpid() % 500 * 10     # inside fresh namespaces: each run its own port and port + 1
    # Node 0 forms the job once MAX nodes asked, or MIN nodes and --wait_for_nodes later.
    started = {"drain": {n: _node(tmp, "drain", hosts, n, port, "2:3", 120) for n in (2, 1, 0)},
               "at_min": {n: _node(tmp, "at_min", hosts, n, port + 2, "2:3", 0) for n in (1, 0)},
               "whole": {n: _node(tmp, "whole", hosts, n, port + 4, "1:2", 120) for n in (1, 0)},
               "admit": {n: _node(tmp, "admit", hosts, n, port + 6, "2:3", 0, LATE_ARGS) for n in (1, 0)}}
    started["signals"] = {"drain": _signal(started["drain"], [0]), "at_min": _signal(started["at_min"], [1]),
                          "whole": _signal(started["whole"], [0, 1], WHOLE_JOB_SPREAD_S),
                          "admit": _signal_on_admission(tmp, hosts, started["admit"], port + 6)}
    yield started
    for name in ("drain", "at_min", "whole", "admit"):
        for job in started[name].values():
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()


def _signalled(runs, name, nodes):
    record = runs["signals"][name]
    record["thread"].join(timeout=RUN_LIMIT_S)
    assert all(n in record for n in nodes), f"not every launcher was signalled:\n{runs[name][0].stderr()}"


def _agreed_steps(job, ranks) -> list:
    """Each rank's "agreed on global step" lines, in its log (every attempt's)."""
    steps = []
    for rank in ranks:
        with open(os.path.join(job.output_dir, "logs", f"rank_{rank}.log"), encoding="utf-8") as f:
            steps.append([int(s) for s in _AGREED.findall(f.read())])
    return steps


def _membership_lines(job) -> list:
    return [line for line in job.stderr().splitlines() if re.match(r"msdist\.launch: membership [2-9]", line)]


def test_a_drain_shrinks_the_job_and_the_others_resume_from_the_step_saved(runs, hosts):
    """3 nodes, MIN 2, node 0's launcher signalled: it leaves; nodes 1 and 2 go on as 2 nodes from the agreed step
    (node 1 now hosts the scheduler) and finish the run."""
    _signalled(runs, "drain", [0])
    jobs = runs["drain"]
    codes = {n: jobs[n].wait(limit_s=RUN_LIMIT_S) for n in (0, 1, 2)}
    assert codes == {0: DRAINED_EXIT, 1: 0, 2: 0}, "\n".join(jobs[n].stderr() for n in (0, 1, 2))
    assert "msdist.launch: drained: the job goes on as membership 2 on 2 node(s) without this node" in \
        jobs[0].stderr()
    [[step], *others] = _agreed_steps(jobs[0], [0, 1, 2])   # the one stop, in the first attempt's 3 ranks
    assert others == [[step], [step]] and 0 < step < STEPS
    drained, new_node0 = hosts[0][1], hosts[1][1]
    for n in (1, 2):
        lines = _membership_lines(jobs[n])
        assert len(lines) == 1, jobs[n].stderr()
        # Never rolled back: the job resumes from the very step every rank saved on the signal.
        assert lines[0] == (f"msdist.launch: membership 2: node {drained} left (drained); 2 node(s), world size "
                            f"3 -> 2; node 0 (scheduler) {new_node0}; resumed from global step {step}"), lines[0]
    with open(os.path.join(jobs[1].output_dir, "logs", "membership.jsonl"), encoding="utf-8") as f:
        [record] = [json.loads(line) for line in f]
    assert record["left"] == [{"node": drained, "why": "drained"}] and record["resumed_from_step"] == step
    [claim] = glob.glob(os.path.join(jobs[1].output_dir, "logs", "membership", "*-2.json"))
    print(f"drain: SIGTERM -> membership 2 claimed in {os.path.getmtime(claim) - runs['signals']['drain'][0]:.1f} s")
    with open(os.path.join(jobs[1].output_dir, "result.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert result["world_size"] == 2
    assert _newest_checkpoint_step(jobs[1], 0) == STEPS and _newest_checkpoint_step(jobs[1], 1) == STEPS
    assert all(job.leftovers() == [] for job in jobs.values())


def test_a_drain_that_would_leave_fewer_than_min_saves_and_stops_everywhere(runs):
    """2 nodes, MIN 2, node 1's launcher signalled: both save at one step and exit 200; nobody goes on."""
    _signalled(runs, "at_min", [1])
    jobs = runs["at_min"]
    codes = {n: jobs[n].wait(limit_s=RUN_LIMIT_S) for n in (0, 1)}
    assert codes == {0: REQUEUE_EXIT, 1: REQUEUE_EXIT}, jobs[0].stderr() + jobs[1].stderr()
    [[step], [step1]] = _agreed_steps(jobs[0], [0, 1])
    assert step == step1 and _newest_checkpoint_step(jobs[0], 0) == step == _newest_checkpoint_step(jobs[0], 1)
    assert "the job stops: 1 node(s) left, fewer than the minimum 2 (--nnodes 2:3)" in jobs[0].stderr()
    assert not _membership_lines(jobs[0]) and not _membership_lines(jobs[1])
    assert all(job.leftovers() == [] for job in jobs.values())


def test_a_stop_of_every_node_seconds_apart_ends_the_job_with_one_checkpoint(runs):
    """2 nodes, MIN 1 (one node could go on alone), both launchers signalled 2 s apart: one agreed step, one
    checkpoint, 200 on both; no node drained, no re-form."""
    _signalled(runs, "whole", [0, 1])
    jobs = runs["whole"]
    codes = {n: jobs[n].wait(limit_s=RUN_LIMIT_S) for n in (0, 1)}
    assert codes == {0: REQUEUE_EXIT, 1: REQUEUE_EXIT}, jobs[0].stderr() + jobs[1].stderr()
    [[step], [step1]] = _agreed_steps(jobs[0], [0, 1])
    assert step == step1 and _newest_checkpoint_step(jobs[0], 0) == step == _newest_checkpoint_step(jobs[0], 1)
    for job in jobs.values():
        assert not _membership_lines(job) and "drained:" not in job.stderr(), job.stderr()
    assert all(job.leftovers() == [] for job in jobs.values())


def test_a_node_signalled_while_the_job_saves_to_admit_another_drains(runs, hosts):
    """Node 1's launcher signalled during the admission's save: it leaves (at once, or from the next attempt if
    the signal came after its ranks' exit), node 2 joins, and nodes 0 and 2 finish. Every membership resumes
    at a step all ranks agreed on: never an older one."""
    _signalled(runs, "admit", [1])
    jobs = runs["admit"]
    codes = {n: jobs[n].wait(limit_s=RUN_LIMIT_S) for n in (0, 1, 2)}
    assert codes == {0: 0, 1: DRAINED_EXIT, 2: 0}, "\n".join(jobs[n].stderr() for n in (0, 1, 2))
    assert "msdist.launch: drained: the job goes on as membership" in jobs[1].stderr()
    with open(os.path.join(jobs[0].output_dir, "logs", "membership.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["nodes"] == [hosts[0][1], hosts[2][1]]
    assert {"node": hosts[1][1], "why": "drained"} in [left for r in records for left in r["left"]]
    [agreed] = _agreed_steps(jobs[0], [0])
    assert [r["resumed_from_step"] for r in records] == agreed, (records, agreed)
    with open(os.path.join(jobs[0].output_dir, "result.json"), encoding="utf-8") as f:
        assert json.load(f)["world_size"] == 2
    assert _newest_checkpoint_step(jobs[0], 0) == LATE_STEPS
    assert all(job.leftovers() == [] for job in jobs.values())
