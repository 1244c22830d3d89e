"""Two hosts for real: two network namespaces joined by a veth pair, one msdist.launch in each.

Every byte between the "hosts" crosses a real network interface (10.231.x.0/24, an address range
that exists only inside these namespaces). The namespaces are removed afterwards, even when a test
fails (the fixture's finalizer). Where the OS refuses to create them (not root, no iproute2), the
tests skip and say why; CI runs as root and creates them.

MS_NODE_TIMEOUT (MindSpore's scheduler-worker heartbeat timeout, 30 s by default) is shortened (6 s
and 10 s), so that a rank killed on one host ends the other host's ranks within the 30 s bound.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from msdist.cluster.rendezvous import free_port
from test_launch import TINY_CONFIG, DATA_DIR, Job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

NODE_TIMEOUT = {"MS_NODE_TIMEOUT": "10"}
FAIL_BOUND_S = 30
RESTART_LIMIT_S = 420     # two attempts, the second after MS_NODE_TIMEOUT and a fresh start-up
# Two short epochs; deterministic kernels so a 2-host job can be compared bit for bit with 1 host.
ARGS = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--batch_size", "16", "--epochs", "2",
        "--deterministic", "true", "--log_every", "4"]


def _ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _create_namespaces(prefix: str):
    """[(name, address)] x 2 joined by a veth pair, loopback up in each; raises OSError with the reason."""
    if shutil.which("ip") is None:
        raise OSError("iproute2's `ip` is not installed (scripts/setup.sh installs it)")
    subnet = f"10.231.{os.getpid() % 250}"
    ends = [(f"{prefix}a", f"{subnet}.1", f"{prefix}va"), (f"{prefix}b", f"{subnet}.2", f"{prefix}vb")]
    commands = [["netns", "add", ns] for ns, _, _ in ends]
    commands.append(["link", "add", ends[0][2], "type", "veth", "peer", "name", ends[1][2]])
    for ns, addr, dev in ends:
        commands += [["link", "set", dev, "netns", ns], ["-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                     ["-n", ns, "link", "set", dev, "up"], ["-n", ns, "link", "set", "lo", "up"]]
    for command in commands:
        proc = _ip(*command)
        if proc.returncode != 0:
            _delete_namespaces([ns for ns, _, _ in ends])
            raise OSError(f"`ip {' '.join(command)}` failed: {proc.stderr.strip()}")
    return [(ns, addr) for ns, addr, _ in ends]


def _delete_namespaces(names):
    for ns in names:
        for pid in _pids_in(ns):  # nothing may outlive the test; deleting a namespace does not kill
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns)  # also deletes the veth end inside it


def _pids_in(ns) -> list:
    proc = _ip("netns", "pids", ns)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


@pytest.fixture(scope="module")
def hosts():
    try:
        namespaces = _create_namespaces(f"msd{os.getpid()}")
    except OSError as e:
        print(f"cannot create network namespaces: {e}")
        pytest.skip(f"cannot create network namespaces: {e}")
    yield namespaces
    _delete_namespaces([ns for ns, _ in namespaces])


def _pair(tmp, name, hosts, launcher_args, env=None):
    """One msdist.launch per namespace, `-n 1` each: global ranks 0 (host a) and 1 (host b)."""
    (ns0, addr0), (ns1, _) = hosts
    port = free_port()
    jobs = {}
    for node, ns in ((1, ns1), (0, ns0)):
        # One core per "host", as one rank of a 1-host, 2-rank job gets: same kernel threads, same sums.
        jobs[node] = Job(tmp, f"{name}_node{node}", ["-n", "1", "--nnodes", "2", "--node_rank", str(node),
                                                     "--master_addr", addr0, "--master_port", str(port),
                                                     *launcher_args], ARGS,
                         env=env, output_name=name,
                         command=["ip", "netns", "exec", ns, "taskset", "-c", str(node % os.cpu_count()),
                                  sys.executable, "-m", "msdist.launch"])
    return jobs


def _mpirun_across(tmp, hosts) -> Job:
    """`mpirun -n 2` from host a over both hosts: OpenMPI's rsh agent is `ip netns exec` instead of ssh."""
    agent = os.path.join(str(tmp), "netns-agent")
    cases = "\n".join(f"  {addr}) ns={ns};;" for ns, addr in hosts)
    with open(agent, "w", encoding="utf-8") as f:
        # OpenMPI calls the agent like ssh: host, then the remote command as words of one shell line.
        f.write(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n  *) exit 1;;\nesac\n'
                'exec ip netns exec "$ns" sh -c "$*"\n')
    os.chmod(agent, 0o755)
    hostfile = os.path.join(str(tmp), "hostfile")
    with open(hostfile, "w", encoding="utf-8") as f:
        f.write("".join(f"{addr} slots=1\n" for _, addr in hosts))
    (ns0, addr0), _ = hosts
    # The CPU bridge: rank 0 (host a) starts MindSpore's scheduler at MS_SCHED_HOST, the other host joins.
    env = {"MS_SCHED_HOST": addr0, "MS_SCHED_PORT": str(free_port()), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    forward = [a for name in ("PYTHONPATH", "PATH", "MS_SCHED_HOST", "MS_SCHED_PORT", "MSDIST_TEST_TAG")
               for a in ("-x", name)]
    command = ["ip", "netns", "exec", ns0, "mpirun", "-n", "2", "--hostfile", hostfile,
               "--mca", "plm_rsh_agent", agent, *forward, sys.executable, "-m", "msdist.train"]
    return Job(tmp, "mpirun", [], ARGS, env=env, command=command)


def _has_a_checkpoint(job, rank) -> bool:
    from msdist.run import checkpoint
    return checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank) is not None


def _kill_when(job, rank, step, with_a_checkpoint=False) -> dict:
    """SIGKILL `rank` once it reports global step `step` (and, if asked, once it has a complete checkpoint to
    resume from), from a thread: other tests run meanwhile."""
    record = {}

    def watch():
        beat = job.wait_for_beat(rank, at_least_step=step)
        while with_a_checkpoint and not _has_a_checkpoint(job, rank):
            time.sleep(0.02)
        os.kill(beat["pid"], signal.SIGKILL)
        record.update(at=time.monotonic(), pid=beat["pid"])

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    record["thread"] = thread
    return record


@pytest.fixture(scope="module")
def runs(hosts, tmp_path_factory):
    """All runs start together so their waits overlap."""
    tmp = tmp_path_factory.mktemp("two_hosts")
    started = {"one_host": Job(tmp, "one_host", ["-n", "2"], ARGS),
               "pair": _pair(tmp, "pair", hosts, []),
               # 6 s: the 30 s bound must also hold on a loaded 2-core machine
               "killed": _pair(tmp, "killed", hosts, [], env={"MS_NODE_TIMEOUT": "6"}),
               "restarted": _pair(tmp, "restarted", hosts, ["--max_restarts", "1"], env=NODE_TIMEOUT)}
    if shutil.which("mpirun"):
        started["mpirun"] = _mpirun_across(tmp, hosts)
    started["kills"] = {"killed": _kill_when(started["killed"][1], 1, 3),
                        # In epoch 2 (12 steps per epoch), once the epoch-1 checkpoint is complete. Beats come every
                        # 2 s and at each epoch's first step, so step 13 is the one seen before epoch 2 ends.
                        "restarted": _kill_when(started["restarted"][1], 1, 13, with_a_checkpoint=True)}
    yield started
    for job in [started["one_host"], *(j for key in ("pair", "killed", "restarted") for j in started[key].values()),
                *([started["mpirun"]] if "mpirun" in started else [])]:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def _final(job, rank):
    import mindspore as ms
    from msdist.run import checkpoint
    info = checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank)
    assert info is not None, f"no checkpoint for rank {rank} in {job.output_dir}"
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(info.path).items() if hasattr(v, "asnumpy")}


@pytest.mark.multiprocess
def test_two_hosts_equal_one_host_with_two_ranks(runs):
    one, pair = runs["one_host"], runs["pair"]
    for job in (one, pair[0], pair[1]):
        assert job.wait() == 0, job.stderr()
    for rank in (0, 1):
        got, want = _final(pair[0], rank), _final(one, rank)
        assert sorted(got) == sorted(want)
        different = [n for n in want if not np.array_equal(got[n], want[n])]
        assert not different, f"rank {rank}: {len(different)} tensors differ, e.g. {different[:3]}"
    results = [json.load(open(os.path.join(j.output_dir, "result.json"), encoding="utf-8")) for j in (one, pair[0])]
    assert results[0]["world_size"] == results[1]["world_size"] == 2
    assert results[0]["accuracy"] == results[1]["accuracy"] and results[0]["loss"] == results[1]["loss"]


@pytest.mark.multiprocess
def test_kill9_on_one_host_ends_both_launchers_naming_it(runs):
    job_a, job_b = runs["killed"][0], runs["killed"][1]
    kill = runs["kills"]["killed"]
    kill["thread"].join(timeout=300)
    assert "pid" in kill, "rank 1 was never killed"
    codes = [job.wait(limit_s=kill["at"] - job.started + FAIL_BOUND_S) for job in (job_a, job_b)]
    assert time.monotonic() - kill["at"] < FAIL_BOUND_S, (job_a.stderr(), job_b.stderr())
    assert codes == [1, 1], (job_a.stderr(), job_b.stderr())
    assert "rank 1 failed: killed by SIGKILL" in job_b.stderr()
    # Host a's launcher names the rank on host b: MindSpore's scheduler (on host a) timed it out.
    last_a = [line for line in job_a.stderr().splitlines() if line.startswith("msdist.launch: FAILED")][-1]
    assert "rank 1 stopped responding" in last_a, job_a.stderr()
    assert job_a.leftovers() == [] and job_b.leftovers() == []   # in either namespace


@pytest.mark.multiprocess
def test_max_restarts_recovers_across_both_hosts(runs):
    job_a, job_b = runs["restarted"][0], runs["restarted"][1]
    runs["kills"]["restarted"]["thread"].join(timeout=300)
    assert "pid" in runs["kills"]["restarted"], "rank 1 was never killed"
    assert job_b.wait(limit_s=RESTART_LIMIT_S) == 0, (job_a.stderr(), job_b.stderr())
    assert job_a.wait(limit_s=RESTART_LIMIT_S) == 0, job_a.stderr()
    assert "restart 1 of 1" in job_a.stderr() and "restart 1 of 1" in job_b.stderr()
    with open(os.path.join(job_a.output_dir, "result.json"), encoding="utf-8") as f:
        assert json.load(f)["world_size"] == 2
    with open(os.path.join(job_a.output_dir, "logs", "rank_1.log"), encoding="utf-8") as f:
        assert "resumed from" in f.read()


@pytest.mark.multiprocess
def test_mpirun_across_both_hosts_with_an_ip_netns_rsh_agent(runs):
    if "mpirun" not in runs:
        pytest.skip("mpirun is not installed")
    job = runs["mpirun"]
    assert job.wait() == 0, job.stderr()
    with open(os.path.join(job.output_dir, "result.json"), encoding="utf-8") as f:
        assert json.load(f)["world_size"] == 2
    assert job.leftovers() == []
