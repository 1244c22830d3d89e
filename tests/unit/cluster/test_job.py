"""msdist.cluster.job: backend decisions, the mpirun bridge and its address, launch refusals and the MS_*
variables of each launch path.

These are pure functions (environment in, decision out): the GPU and Slurm paths cannot run here,
so their logic is checked against the variables each launcher really sets (MindSpore 2.10's msrun:
mindspore/parallel/cluster/process_entity/_api.py; OpenMPI; Slurm's srun; tests/launch_envs.py)."""
import pytest

from msdist.base import launch_env
from msdist.base.errors import ConfigError
from msdist.cluster import job, rendezvous
from launch_envs import MPI, SRUN, MSRUN_WORKER, MSRUN_ARGV


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
