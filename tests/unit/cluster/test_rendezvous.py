"""msdist.cluster.rendezvous: host names and addresses, the scheduler's verdict, connection counts, the
collective wait."""
import socket
import time

import pytest

from msdist.base.errors import ConfigError
from msdist.cluster import job, rendezvous


def test_shared_host_names_are_found():
    a, b = job.host_name_key("node-a"), job.host_name_key("node-b")
    assert a != b and a == float(int(a))
    assert job.shared_host_names([a, a, b, b], [2, 2, 2, 2]) == []
    assert job.shared_host_names([a, a, a, a], [2, 2, 2, 2]) == [0, 1, 2, 3]  # two hosts named node-a


# ---------------------------------------------------------------- addresses

def test_host_names_resolve_to_an_ip():
    assert rendezvous.resolve_host("127.0.0.1", "--master_addr") == "127.0.0.1"
    assert rendezvous.resolve_host("localhost", "--master_addr") == "127.0.0.1"
    assert rendezvous.resolve_host(socket.gethostname(), "MS_SCHED_HOST").count(".") == 3


def test_unresolvable_host_name_is_one_line_within_seconds():
    began = time.monotonic()
    with pytest.raises(ConfigError) as e:
        rendezvous.resolve_host("no-such-host.invalid", "--master_addr")
    assert time.monotonic() - began < 10
    assert "--master_addr 'no-such-host.invalid' does not resolve" in str(e.value) and "\n" not in str(e.value)


def test_scheduler_verdict_names_the_timed_out_rank(tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text("[WARNING] DISTRIBUTED ... Cluster currently has 2 alive nodes.\n"
                   "msdist.scheduler: MindSpore's scheduler failed: The total number of timed out node is 1. Timed "
                   "out node list is: [const vector]{1}, worker 1 is the first one timed out, please check its log.\n")
    verdict = rendezvous.scheduler_verdict(str(log))
    assert verdict.startswith("MindSpore's scheduler failed:")
    assert rendezvous.describe_timeout(verdict).startswith("rank 1 stopped responding")
    assert rendezvous.describe_timeout("exit code 1") == ""
    assert rendezvous.scheduler_verdict(str(tmp_path / "missing.log")) == ""


def test_cpu_workers_wait_in_collectives_longer_than_the_heartbeat_timeout():
    wait = {"MS_NODE_TIMEOUT": str(rendezvous.COLLECTIVE_WAIT_S)}
    assert rendezvous.collective_wait_env({}, "CPU") == wait
    assert rendezvous.collective_wait_env({"MS_NODE_TIMEOUT": "6"}, "CPU") == wait
    assert rendezvous.collective_wait_env({"MS_NODE_TIMEOUT": "3600"}, "CPU") == {}   # the user's longer wait stands
    assert rendezvous.collective_wait_env({"MS_NODE_TIMEOUT": "-1"}, "CPU") == {}     # MindSpore: wait forever
    assert rendezvous.collective_wait_env({}, "GPU") == {}                             # NCCL does not read it


def test_established_connections_counts_open_connections_to_a_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert rendezvous.established_connections(port) == 0
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = server.accept()
            assert rendezvous.established_connections(port) == 1
            accepted.close()
