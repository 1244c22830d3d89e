"""What each kind of launch needs before MindSpore loads: the collective backend, the bridge from mpirun
and srun to MindSpore's dynamic cluster, the MS_* variables set and cleared, and the launches refused.

Who this process is comes from msdist.base.launch_env (`detect_launch`); how the ranks meet, from
msdist.cluster.rendezvous. Every decision here is a pure function of the environment, so each
launcher's logic is unit-tested even where the launcher (or a GPU) is not available.
"""
import zlib
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from msdist.base.errors import ConfigError
from msdist.base.launch_env import LaunchEnv
from msdist.cluster.rendezvous import cluster_env, collective_wait_env, is_ip, rendezvous_path, slurm_port

# Variables that switch MindSpore's init() into its dynamic cluster (UseDynamicCluster() reads
# MS_ROLE and MS_SCHED_HOST), which MindSpore's own OpenMPI path on GPU must not see.
DYNAMIC_CLUSTER_VARS = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT")


def backend_for(device_target: str) -> str:
    return {"GPU": "nccl", "CPU": "mccl"}[device_target]


def needs_cluster_bridge(launch: LaunchEnv, device_target: str) -> bool:
    """Whether msdist must start/join MindSpore's dynamic cluster for this rank.

    mpirun on CPU (MindSpore's MPI path needs a GPU), and srun on any device (no MPI to lean on).
    """
    return launch.kind == "slurm" or (launch.kind == "mpirun" and device_target == "CPU")


def vars_to_clear(launch: LaunchEnv, device_target: str, env: Mapping[str, str]) -> List[str]:
    """Dynamic-cluster variables to remove before init() on MindSpore's own OpenMPI path (GPU mpirun).

    MS_SCHED_HOST alone switches init() into the dynamic cluster, and a job spec that exports it for
    the CPU bridge (deploy/slurm/train.sbatch did) would otherwise make init("nccl") fail on every rank.
    """
    if launch.kind != "mpirun" or needs_cluster_bridge(launch, device_target):
        return []
    return [name for name in DYNAMIC_CLUSTER_VARS if name in env]


def should_finalize_mpi(launch: LaunchEnv, device_target: str) -> bool:
    """Whether MindSpore called MPI_Init in this process, so it must call MPI_Finalize before leaving.

    Only on MindSpore's own OpenMPI path: GPU under mpirun (libmpi_collective.so). Skipping it makes
    OpenMPI report an improper exit and mpirun exit non-zero after a finished job.
    """
    return launch.kind == "mpirun" and not needs_cluster_bridge(launch, device_target)


def mpi_variables_mindspore_misses(env: Mapping[str, str]) -> List[str]:
    """The variables MindSpore 2.10 needs to see mpirun that this environment lacks ([] = it sees mpirun).

    MindSpore does not read OMPI_COMM_WORLD_* to decide: OMPI_COMMAND and PMIX_RANK both set, and no
    MS_ROLE (communication/_comm_helper.py:138-148 `_check_mpi_envs`, management.py:63-65 `_host_distribute`;
    in C++ mindspore/core/utils/ms_utils.h `UseMPI`). msdist clears MS_ROLE itself on that path.
    """
    return [name for name in ("OMPI_COMMAND", "PMIX_RANK") if not env.get(name)]


def check_launch(launch: LaunchEnv, env: Mapping[str, str], device_target: str) -> None:
    """Refuse, before anything starts, the launches known to fail or to mix up ranks.

    Raises:
        ConfigError: a cluster worker without MS_NODE_ID (msrun across nodes without --node_rank: MindSpore
            numbers the ranks only inside init(), so until then every process takes itself for rank 0 and
            their --overwrite, heartbeat files and compile-cache folders collide); mpirun across hosts on CPU
            without MS_SCHED_HOST/MS_SCHED_PORT (the other hosts' ranks wait for a port file that only rank
            0's host has, and fail after RENDEZVOUS_TIMEOUT_S); mpirun on GPU where MindSpore would not see
            mpirun (`mpi_variables_mindspore_misses`: init("nccl") would not take its OpenMPI path).
    """
    missing = mpi_variables_mindspore_misses(env) if should_finalize_mpi(launch, device_target) else []
    if missing:
        raise ConfigError(f"mpirun's OMPI_COMM_WORLD_* are set but {' and '.join(missing)} not, so MindSpore 2.10 "
                          "would not see mpirun (it needs OMPI_COMMAND and PMIX_RANK) and init('nccl') would not "
                          "join the ranks; launch with OpenMPI 4+'s mpirun without filtering its variables, or "
                          "use python -m msdist.launch")
    if launch.kind == "cluster" and launch.world_size > 1 and "MS_NODE_ID" not in env:
        raise ConfigError(f"{launch.launcher} started this worker without a rank (no MS_NODE_ID): msrun across "
                          "nodes needs --node_rank N on node N (msrun numbers the ranks only inside init(), and "
                          "until then every process would write rank 0's files); or use python -m msdist.launch")
    if launch.kind == "mpirun" and needs_cluster_bridge(launch, device_target) and \
            launch.local_world_size < launch.world_size and not ("MS_SCHED_HOST" in env and "MS_SCHED_PORT" in env):
        raise ConfigError("mpirun across hosts on CPU needs rank 0's scheduler address on every host: export "
                          "MS_SCHED_HOST (rank 0's node) and MS_SCHED_PORT and pass them with mpirun -x")


def bridge_worker_env(launch: LaunchEnv, host: str, port: str) -> Dict[str, str]:
    """What an mpirun/srun rank sets to join MindSpore's dynamic cluster as a worker."""
    return {**cluster_env(host, port, launch.world_size), "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(launch.rank)}


def ms_variables(launch: LaunchEnv, device_target: str, env: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """The MS_* variables msdist sets (name -> value, or what decides it) and clears in this rank.

    As `distributed.init` does it: the bridge's worker variables, MS_SCHED_HOST resolved to an IP,
    MindSpore's OpenMPI path cleared of dynamic-cluster variables, and CPU collectives' wait.
    """
    sets, clears = {}, vars_to_clear(launch, device_target, env)
    if needs_cluster_bridge(launch, device_target):
        host, port = bridge_address(launch, env)
        sets.update(bridge_worker_env(launch, host, str(port) if port else
                                      f"<free port chosen by rank 0, read from {rendezvous_path(launch.job_id)}>"))
    elif launch.world_size > 1 and "MS_SCHED_HOST" in env and "MS_SCHED_HOST" not in clears and \
            not is_ip(env["MS_SCHED_HOST"]):
        sets["MS_SCHED_HOST"] = f"<IP address of {env['MS_SCHED_HOST']}>"
    if launch.world_size > 1:
        sets.update(collective_wait_env({**env, **sets}, device_target))
    return sets, clears



def bridge_address(launch: LaunchEnv, env: Mapping[str, str]) -> Tuple[str, Optional[int]]:
    """Where this job's scheduler listens: (host, port), port None when rank 0 picks and publishes it.

    MS_SCHED_HOST/MS_SCHED_PORT win when set. Otherwise: mpirun uses loopback (one host) and a port
    published through a file; srun uses the node it was called from and a port from the step id.
    """
    port = env.get("MS_SCHED_PORT")
    if launch.kind == "slurm":
        host = env.get("MS_SCHED_HOST") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
        return host, int(port) if port else slurm_port(launch.job_id)
    return env.get("MS_SCHED_HOST", "127.0.0.1"), int(port) if port else None



# ---------------------------------------------------------------- environment check (msdist.check)

def host_name_key(name: str) -> float:
    """A host name as a float that survives an exact AllGather (48 bits of its CRC-extended hash)."""
    return float(zlib.crc32(name.encode()) | (zlib.adler32(name.encode()) & 0xFFFF) << 32)


def shared_host_names(keys: Sequence[float], local_world_sizes: Sequence[int]) -> List[int]:
    """Ranks whose host name is claimed by more ranks than their host runs: two hosts share a name,
    which breaks the per-host rank numbering NCCL and MindSpore derive from host names."""
    counts = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return [rank for rank, (key, local) in enumerate(zip(keys, local_world_sizes)) if counts[key] > local]

