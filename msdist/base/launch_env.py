"""Who this process is and which launcher started it, from environment variables alone.

Ways a process can be started (`LaunchEnv.kind`):

* standalone: `python -m msdist.train` -> world size 1, no communication at all;
* mpirun: OpenMPI sets `OMPI_COMM_WORLD_*`;
* slurm: `srun` sets `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`;
* cluster: `msdist.launch`, `msrun` or the user set `MS_ROLE=MS_WORKER` and friends already;
* scheduler: `msrun` starts the training command itself once more with `MS_ROLE=MS_SCHED`; that
  process must serve as MindSpore's scheduler, not train.

A leaf of msdist.base (it imports nothing of msdist) because the lowest plumbing needs it:
`cli.cli_main` reports an error once per host and labels a crash with its rank. What each kind of
launch then needs (the bridge to MindSpore's cluster, its variables, refusals) is msdist.cluster.job.
"""
import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process, read before MindSpore loads."""
    kind: str              # "standalone" | "mpirun" | "slurm" | "cluster" | "scheduler"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    job_id: str = ""
    launcher: str = ""     # who set the variables: msdist.launch, msrun, mpirun, srun, env


# The batch layout of a fresh job (run/options.py `slots_for`): how many ranks its global batch is cut for. A
# launcher that may run the job on fewer ranks later sets it to the most it will have (msdist.launch --nnodes MIN:MAX:
# MAX nodes x ranks per node); a resumed job keeps its checkpoint's layout whatever this says.
BATCH_SLOTS_VAR = "MSDIST_BATCH_SLOTS"
# Set by msdist.launch in every rank of an elastic job: `--resume auto` restores rank 0's newest good checkpoint on
# every rank (run/options.py `resume_from_rank0`). A rank's own files may be from an older membership (a node that
# comes back finds its rank's files from before it was lost), and "the newest step all ranks have" would go back.
RESUME_FROM_RANK0_VAR = "MSDIST_RESUME_FROM_RANK0"

# Where `detect_launch` reads each launcher's rank, world size and local rank (msdist.check --plan says it).
RANK_SOURCES = {
    "": "none: one process",
    "mpirun": "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE",
    "srun": "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE",
    "msrun": "MS_NODE_ID, MS_WORKER_NUM, DEVICE_ID (msrun's local rank), msrun's --local_worker_num",
    "msdist.launch": "MS_NODE_ID, MS_WORKER_NUM, MSDIST_LOCAL_RANK, MSDIST_LOCAL_WORLD_SIZE",
    "env": "MS_NODE_ID, MS_WORKER_NUM (set by hand; every rank counts as local)",
}


def int_env(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else default


def _leading_int(value: str, default: int) -> int:
    """Slurm writes per-node task counts like "4(x2),3"; the first node's count is enough here."""
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) if match else default


def msrun_local_worker_num(argv: Sequence[str]) -> Optional[int]:
    """`--local_worker_num` from msrun's command line (msrun exports no local world size), else None."""
    for i, arg in enumerate(argv):
        if arg.startswith("--local_worker_num="):
            value = arg.split("=", 1)[1]
        elif arg == "--local_worker_num" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        return int(value) if value.isdigit() else None
    return None


def parent_argv() -> List[str]:
    """The command line of the process that started this one ([] when unreadable)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _cluster_worker(env: Mapping[str, str], parent: Sequence[str]) -> LaunchEnv:
    world = int_env(env, "MS_WORKER_NUM", 1)
    rank = int_env(env, "MS_NODE_ID", 0)
    if "MSDIST_LOCAL_RANK" in env:  # msdist.launch
        local_world = int_env(env, "MSDIST_LOCAL_WORLD_SIZE", world)
        return LaunchEnv("cluster", rank, world, int_env(env, "MSDIST_LOCAL_RANK", 0), local_world,
                         launcher="msdist.launch")
    if "DEVICE_ID" in env and "RANK_SIZE" in env:  # msrun: DEVICE_ID is the local rank
        local_world = msrun_local_worker_num(parent) or world
        return LaunchEnv("cluster", rank, world, int_env(env, "DEVICE_ID", 0), local_world, launcher="msrun")
    return LaunchEnv("cluster", rank, world, rank, world, launcher="env")


def detect_launch(env: Optional[Mapping[str, str]] = None, parent: Optional[Sequence[str]] = None) -> LaunchEnv:
    """Classify how this process was started, from environment variables only.

    Args:
        env: the environment (default: os.environ).
        parent: the parent's command line, read only under msrun (default: from /proc).
    """
    env = os.environ if env is None else env
    role = env.get("MS_ROLE", "")
    if role == "MS_SCHED":
        return LaunchEnv("scheduler", 0, int_env(env, "MS_WORKER_NUM", 1), 0, 1,
                         launcher="msrun" if "RANK_SIZE" in env else "env")
    if role == "MS_WORKER" and int_env(env, "MS_WORKER_NUM", 1) > 1:
        return _cluster_worker(env, parent_argv() if parent is None and "DEVICE_ID" in env else (parent or []))
    if int_env(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
        return LaunchEnv("mpirun", int_env(env, "OMPI_COMM_WORLD_RANK", 0), int_env(env, "OMPI_COMM_WORLD_SIZE", 1),
                         int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
                         env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or str(os.getppid()),
                         launcher="mpirun")
    # SLURM_STEP_ID: only srun's tasks have it; a command run directly in the batch script also sees
    # SLURM_NTASKS and SLURM_PROCID=0, and must stay standalone.
    if "SLURM_STEP_ID" in env and int_env(env, "SLURM_NTASKS", 1) > 1:
        local_world = int_env(env, "SLURM_NTASKS_PER_NODE", 0) or \
            _leading_int(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""), 1)
        return LaunchEnv("slurm", int_env(env, "SLURM_PROCID", 0), int_env(env, "SLURM_NTASKS", 1),
                         int_env(env, "SLURM_LOCALID", 0), local_world,
                         f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}", launcher="srun")
    return LaunchEnv("standalone", 0, 1, 0, 1)



def rank_label(env: Mapping[str, str]) -> str:
    """" (rank N)" for a process of a multi-rank job, from its launcher's variables, else ""."""
    launch = detect_launch(env, parent=[])
    return f" (rank {launch.rank})" if launch.world_size > 1 else ""
