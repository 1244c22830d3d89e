"""msdist.base.launch_env, msdist.cluster.job and .rendezvous: launch detection, backend decisions, addresses, for every launcher (devices: test_device.py).

These are pure functions (environment in, decision out): the GPU and Slurm paths cannot run here,
so their logic is checked against the variables each launcher really sets (MindSpore 2.10's msrun:
mindspore/parallel/cluster/process_entity/_api.py; OpenMPI; Slurm's srun).
"""
import ctypes
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, base_env
from msdist.base import launch_env
from msdist.base.errors import ConfigError
from msdist.cluster import job, rendezvous

MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
       "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "77", "OMPI_COMMAND": "python", "PMIX_RANK": "3"}
# What srun gives task 5 of `srun -N2 --ntasks-per-node=4` (a job step; SLURM_STEP_ID marks it).
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
# What msrun exports to worker 1 of `msrun --worker_num 4 --local_worker_num 2 --node_rank 0`.
MSRUN_WORKER = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_NODE_ID": "1", "MS_SCHED_HOST": "127.0.0.1",
                "MS_SCHED_PORT": "8118", "RANK_ID": "1", "RANK_SIZE": "4", "DEVICE_ID": "1"}
MSRUN_ARGV = ["python", "/usr/bin/msrun", "--worker_num", "4", "--local_worker_num=2", "msdist/train.py"]


def fields(launch):
    return (launch.kind, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size)


# ---------------------------------------------------------------- detect_launch, one test per launcher

def test_standalone():
    assert fields(launch_env.detect_launch({})) == ("standalone", 0, 1, 0, 1)


def test_mpirun():
    mpi = launch_env.detect_launch(MPI)
    assert fields(mpi) + (mpi.job_id,) == ("mpirun", 3, 4, 1, 2, "77")


def test_msdist_launch_worker():
    env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_NODE_ID": "3", "MSDIST_LOCAL_RANK": "1",
           "MSDIST_LOCAL_WORLD_SIZE": "2"}
    launch = launch_env.detect_launch(env)
    assert fields(launch) == ("cluster", 3, 4, 1, 2) and launch.launcher == "msdist.launch"


def test_msrun_worker_takes_local_rank_from_device_id_and_local_size_from_msrun():
    launch = launch_env.detect_launch(MSRUN_WORKER, parent=MSRUN_ARGV)
    assert fields(launch) == ("cluster", 1, 4, 1, 2) and launch.launcher == "msrun"
    # One node (msrun's default --local_worker_num equals --worker_num): every rank is local.
    assert launch_env.detect_launch(MSRUN_WORKER, parent=["msrun", "--worker_num", "4"]).local_world_size == 4
    assert launch_env.msrun_local_worker_num(["msrun", "--local_worker_num", "8"]) == 8


def test_msrun_scheduler_role_is_not_standalone():
    env = {"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118",
           "RANK_ID": "0", "RANK_SIZE": "2"}
    launch = launch_env.detect_launch(env)
    assert (launch.kind, launch.world_size, launch.launcher) == ("scheduler", 2, "msrun")


def test_srun_tasks_form_one_job():
    launch = launch_env.detect_launch(SRUN)
    assert fields(launch) + (launch.job_id,) == ("slurm", 5, 8, 1, 4, "4242.0")
    # Without SLURM_NTASKS_PER_NODE, Slurm's compact per-node list gives the count.
    env = {k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert launch_env.detect_launch({**env, "SLURM_TASKS_PER_NODE": "4(x2)"}).local_world_size == 4


def test_batch_script_without_srun_stays_standalone():
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    batch["SLURM_PROCID"] = "0"
    assert launch_env.detect_launch(batch).kind == "standalone"


def test_mpirun_inside_a_slurm_allocation_is_mpirun():
    assert launch_env.detect_launch({**SRUN, **MPI}).kind == "mpirun"


def test_launcher_worker_inside_srun_is_the_launchers():
    env = {**SRUN, "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "8", "MS_NODE_ID": "6", "MSDIST_LOCAL_RANK": "2",
           "MSDIST_LOCAL_WORLD_SIZE": "4"}
    assert fields(launch_env.detect_launch(env)) == ("cluster", 6, 8, 2, 4)


# ---------------------------------------------------------------- bridge, backend, MPI path

def test_bridge_and_backend_per_launcher():
    mpi, srun, msrun = (launch_env.detect_launch(MPI), launch_env.detect_launch(SRUN),
                        launch_env.detect_launch(MSRUN_WORKER, parent=MSRUN_ARGV))
    assert job.backend_for("GPU") == "nccl" and job.backend_for("CPU") == "mccl"
    # mpirun: GPU keeps MindSpore's own OpenMPI path; CPU bridges to the dynamic cluster.
    assert job.needs_cluster_bridge(mpi, "CPU") and not job.needs_cluster_bridge(mpi, "GPU")
    # srun has no MPI to lean on: the bridge on every device.
    assert job.needs_cluster_bridge(srun, "GPU") and job.needs_cluster_bridge(srun, "CPU")
    assert not job.needs_cluster_bridge(msrun, "CPU") and not job.needs_cluster_bridge(msrun, "GPU")


def test_gpu_mpirun_path_clears_dynamic_cluster_variables():
    mpi = launch_env.detect_launch(MPI)
    exported = {**MPI, "MS_SCHED_HOST": "node0", "MS_SCHED_PORT": "29500"}
    assert job.vars_to_clear(mpi, "GPU", exported) == ["MS_SCHED_HOST", "MS_SCHED_PORT"]
    assert job.vars_to_clear(mpi, "CPU", exported) == []          # the CPU bridge needs them
    assert job.vars_to_clear(launch_env.detect_launch(SRUN), "GPU", {**SRUN, "MS_SCHED_HOST": "x"}) == []


def test_mpi_finalize_only_where_mindspore_initialized_mpi():
    assert job.should_finalize_mpi(launch_env.detect_launch(MPI), "GPU")
    assert not job.should_finalize_mpi(launch_env.detect_launch(MPI), "CPU")   # bridge: MPI never initialized
    for env in ({}, SRUN, MSRUN_WORKER):
        assert not job.should_finalize_mpi(launch_env.detect_launch(env, parent=MSRUN_ARGV), "GPU")


def test_bridge_address_per_launcher():
    srun = launch_env.detect_launch(SRUN)
    host, port = job.bridge_address(srun, SRUN)
    assert host == "10.1.2.3" and 20000 <= port < 30000
    assert port == job.bridge_address(srun, dict(SRUN))[1]  # every task computes the same port
    other_step = launch_env.detect_launch({**SRUN, "SLURM_STEP_ID": "1"})
    assert job.bridge_address(other_step, SRUN)[1] != port
    assert job.bridge_address(srun, {**SRUN, "MS_SCHED_HOST": "n0", "MS_SCHED_PORT": "29500"}) == ("n0", 29500)
    mpi = launch_env.detect_launch(MPI)
    assert job.bridge_address(mpi, MPI) == ("127.0.0.1", None)  # rank 0 picks and publishes a port
    assert job.bridge_address(mpi, {**MPI, "MS_SCHED_HOST": "n0", "MS_SCHED_PORT": "1"}) == ("n0", 1)


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


# ---------------------------------------------------------------- MPI finalize, for real

_MPI_PROGRAM = """
import ctypes, os, sys
from msdist.cluster import distributed
mpi = ctypes.CDLL("libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
mpi.MPI_Init(None, None)
if sys.argv[1] == "finalize":
    assert distributed.finalize_mpi()
os._exit(0)
"""


@pytest.mark.multiprocess
@pytest.mark.multiprocess
def test_finalize_mpi_lets_mpirun_exit_0_after_os_exit():
    """What MindSpore's GPU path does (MPI_Init in-process, then msdist's os._exit), with and without
    distributed.finalize_mpi(): only with it does mpirun count the exit as clean."""
    try:
        ctypes.CDLL("libmpi.so.40")
    except OSError:
        pytest.skip("OpenMPI's libmpi.so.40 is not installed")
    status = {}
    for mode in ("finalize", "skip"):
        proc = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", _MPI_PROGRAM, mode],
                              cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
        status[mode] = (proc.returncode, proc.stdout + proc.stderr)
    assert status["finalize"][0] == 0, status["finalize"][1]
    assert status["skip"][0] != 0, status["skip"][1]


# ---------------------------------------------------------------- failure reports

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


def test_crash_line_skips_mindspores_rulers_and_names_the_rank():
    from msdist.base.errors import first_line
    message = "\n----------------------------------------------------\n- Kernel error:\n" \
              "----------------------------------------------------\nLaunch kernel failed: Default/AllReduce-op0\n"
    assert first_line(message) == "Launch kernel failed: Default/AllReduce-op0"
    assert launch_env.rank_label(MPI) == " (rank 3)" and launch_env.rank_label({}) == ""
    assert rendezvous.node_timeout_s({}) == 30 and rendezvous.node_timeout_s({"MS_NODE_TIMEOUT": "10"}) == 10


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


# ---------------------------------------------------------------- refusals and the MS_* variables msdist sets

# Worker 1 of `msrun --worker_num 4 --local_worker_num 2` without --node_rank on the master node, as
# MindSpore 2.10's msrun exports it (recorded from a real msrun): no MS_NODE_ID, and RANK_ID=0 left over
# from the scheduler's start (process_entity/_api.py: `start_scheduler` sets RANK_ID=0, and
# `_get_node_id_and_log_path` returns node_id None when node_rank is -1 on several nodes).
MSRUN_NO_NODE_RANK = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_SCHED_HOST": "127.0.0.1",
                      "MS_SCHED_PORT": "8118", "MS_TOPO_TIMEOUT": "600", "RANK_ID": "0", "RANK_SIZE": "4",
                      "DEVICE_ID": "1"}


def test_msrun_across_nodes_without_node_rank_is_refused():
    launch = launch_env.detect_launch(MSRUN_NO_NODE_RANK, parent=MSRUN_ARGV)
    assert launch.rank == 0  # what every such worker would believe until init()
    with pytest.raises(ConfigError, match="--node_rank"):
        job.check_launch(launch, MSRUN_NO_NODE_RANK, "GPU")
    job.check_launch(launch_env.detect_launch(MSRUN_WORKER, parent=MSRUN_ARGV), MSRUN_WORKER, "GPU")  # with it: fine


def test_mpirun_across_hosts_on_cpu_needs_the_scheduler_address():
    two_hosts = launch_env.detect_launch(MPI)  # local size 2 of 4
    with pytest.raises(ConfigError, match="MS_SCHED_HOST"):
        job.check_launch(two_hosts, MPI, "CPU")
    job.check_launch(two_hosts, {**MPI, "MS_SCHED_HOST": "n0", "MS_SCHED_PORT": "29500"}, "CPU")
    job.check_launch(two_hosts, MPI, "GPU")  # MindSpore's own OpenMPI path needs no scheduler
    one_host = {**MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    job.check_launch(launch_env.detect_launch(one_host), one_host, "CPU")  # the port file is on the one host


@pytest.mark.parametrize("drop, extra, refused", [
    ((), {}, ""),                                           # OpenMPI 4's mpirun: MindSpore sees it too
    (("OMPI_COMMAND",), {}, "OMPI_COMMAND not"),            # a wrapper that filtered the environment
    (("PMIX_RANK",), {}, "PMIX_RANK not"),                  # OpenMPI without PMIx
    (("OMPI_COMMAND", "PMIX_RANK"), {}, "OMPI_COMMAND and PMIX_RANK not"),
    ((), {"MS_ROLE": "MS_WORKER"}, ""),                     # msdist clears MS_ROLE on MindSpore's OpenMPI path
])
def test_gpu_mpirun_is_refused_where_mindspore_would_not_see_mpirun(drop, extra, refused):
    """MindSpore 2.10 detects mpirun by OMPI_COMMAND + PMIX_RANK (and no MS_ROLE), not by OMPI_COMM_WORLD_*."""
    one_host = {**MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    env = {**{k: v for k, v in one_host.items() if k not in drop}, **extra}
    launch = launch_env.detect_launch(env)
    assert launch.kind == "mpirun"
    job.check_launch(launch, env, "CPU")  # the CPU bridge joins MindSpore's dynamic cluster, not its MPI path
    if not refused:
        job.check_launch(launch, env, "GPU")
        return
    with pytest.raises(ConfigError, match=f"but {refused}, so MindSpore 2.10 would not see mpirun"):
        job.check_launch(launch, env, "GPU")


def test_ms_variables_per_path():
    """What each path sets or clears, as distributed.init does it (communication/management.py `_host_distribute`:
    MS_ROLE switches init() into the dynamic cluster)."""
    sets, clears = job.ms_variables(launch_env.detect_launch(SRUN), "GPU", SRUN)
    assert sets["MS_ROLE"] == "MS_WORKER" and sets["MS_NODE_ID"] == "5" and sets["MS_WORKER_NUM"] == "8"
    assert sets["MS_SCHED_HOST"] == "10.1.2.3" and 20000 <= int(sets["MS_SCHED_PORT"]) < 30000 and clears == []
    assert "MS_NODE_TIMEOUT" not in sets  # NCCL ignores it
    mpi_gpu = {**MPI, "MS_SCHED_HOST": "n0", "MS_SCHED_PORT": "1"}
    assert job.ms_variables(launch_env.detect_launch(MPI), "GPU", mpi_gpu) == ({}, ["MS_SCHED_HOST", "MS_SCHED_PORT"])
    sets, _ = job.ms_variables(launch_env.detect_launch(MPI), "CPU", MPI)
    assert "chosen by rank 0" in sets["MS_SCHED_PORT"] and sets["MS_NODE_TIMEOUT"] == str(rendezvous.COLLECTIVE_WAIT_S)
    assert job.ms_variables(launch_env.detect_launch({}), "CPU", {}) == ({}, [])
    named = {**MSRUN_WORKER, "MS_SCHED_HOST": "node-0"}
    assert job.ms_variables(launch_env.detect_launch(named, parent=MSRUN_ARGV), "GPU", named)[0] == \
        {"MS_SCHED_HOST": "<IP address of node-0>"}
