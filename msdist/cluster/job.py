"""Who started this process and how the ranks of a job find each other: everything that needs no MindSpore.

Ways a process can be started (`LaunchEnv.kind`):

* standalone: `python -m msdist.train` -> world size 1, no communication at all;
* mpirun: OpenMPI sets `OMPI_COMM_WORLD_*`. On GPU MindSpore's own OpenMPI path is used as is. On
  CPU it does not work, so msdist bridges to MindSpore's dynamic cluster: rank 0 starts the
  scheduler on a free port and publishes it to the other local ranks through a file keyed by the
  mpirun job id (or every rank reads MS_SCHED_HOST/MS_SCHED_PORT when set);
* slurm: `srun` sets `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`. The same bridge, with the
  scheduler on the node srun was called from and a port derived from the job and step ids;
* cluster: `msdist.launch`, `msrun` or the user set `MS_ROLE=MS_WORKER` and friends already;
* scheduler: `msrun` starts the training command itself once more with `MS_ROLE=MS_SCHED`; that
  process must serve as MindSpore's scheduler, not train.

Every decision here is a pure function of the environment, so each launcher's logic is unit-tested
even where the launcher (or a GPU) is not available.
"""
import ctypes
import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from msdist.cluster.errors import ConfigError
from msdist.cluster.files import atomic_write_text

_logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 120
# Variables that switch MindSpore's init() into its dynamic cluster (UseDynamicCluster() reads
# MS_ROLE and MS_SCHED_HOST), which MindSpore's own OpenMPI path on GPU must not see.
DYNAMIC_CLUSTER_VARS = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT")
# Ports derived from a Slurm job id fall in this range (above the usual ephemeral ports' start
# would collide with outgoing connections; below 20000 many services listen).
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


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


# Where `detect_launch` reads each launcher's rank, world size and local rank (msdist.check --plan says it).
RANK_SOURCES = {
    "": "none: one process",
    "mpirun": "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE",
    "srun": "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE",
    "msrun": "MS_NODE_ID, MS_WORKER_NUM, DEVICE_ID (msrun's local rank), msrun's --local_worker_num",
    "msdist.launch": "MS_NODE_ID, MS_WORKER_NUM, MSDIST_LOCAL_RANK, MSDIST_LOCAL_WORLD_SIZE",
    "env": "MS_NODE_ID, MS_WORKER_NUM (set by hand; every rank counts as local)",
}


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
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
    world = _int_env(env, "MS_WORKER_NUM", 1)
    rank = _int_env(env, "MS_NODE_ID", 0)
    if "MSDIST_LOCAL_RANK" in env:  # msdist.launch
        local_world = _int_env(env, "MSDIST_LOCAL_WORLD_SIZE", world)
        return LaunchEnv("cluster", rank, world, _int_env(env, "MSDIST_LOCAL_RANK", 0), local_world,
                         launcher="msdist.launch")
    if "DEVICE_ID" in env and "RANK_SIZE" in env:  # msrun: DEVICE_ID is the local rank
        local_world = msrun_local_worker_num(parent) or world
        return LaunchEnv("cluster", rank, world, _int_env(env, "DEVICE_ID", 0), local_world, launcher="msrun")
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
        return LaunchEnv("scheduler", 0, _int_env(env, "MS_WORKER_NUM", 1), 0, 1,
                         launcher="msrun" if "RANK_SIZE" in env else "env")
    if role == "MS_WORKER" and _int_env(env, "MS_WORKER_NUM", 1) > 1:
        return _cluster_worker(env, parent_argv() if parent is None and "DEVICE_ID" in env else (parent or []))
    if _int_env(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
        return LaunchEnv("mpirun", _int_env(env, "OMPI_COMM_WORLD_RANK", 0), _int_env(env, "OMPI_COMM_WORLD_SIZE", 1),
                         _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
                         env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or str(os.getppid()),
                         launcher="mpirun")
    # SLURM_STEP_ID: only srun's tasks have it; a command run directly in the batch script also sees
    # SLURM_NTASKS and SLURM_PROCID=0, and must stay standalone.
    if "SLURM_STEP_ID" in env and _int_env(env, "SLURM_NTASKS", 1) > 1:
        local_world = _int_env(env, "SLURM_NTASKS_PER_NODE", 0) or \
            _leading_int(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""), 1)
        return LaunchEnv("slurm", _int_env(env, "SLURM_PROCID", 0), _int_env(env, "SLURM_NTASKS", 1),
                         _int_env(env, "SLURM_LOCALID", 0), local_world,
                         f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}", launcher="srun")
    return LaunchEnv("standalone", 0, 1, 0, 1)


# ---------------------------------------------------------------- backend and MindSpore variables

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
            not _is_ip(env["MS_SCHED_HOST"]):
        sets["MS_SCHED_HOST"] = f"<IP address of {env['MS_SCHED_HOST']}>"
    if launch.world_size > 1:
        sets.update(collective_wait_env({**env, **sets}, device_target))
    return sets, clears


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- addresses and ports

def resolve_host(name: str, what: str, retry_s: float = 0.0) -> str:
    """A literal IP for `name` (MindSpore's cluster accepts nothing else), resolved once.

    Args:
        name: an IP address or a host name.
        what: where the name came from, for messages (e.g. "--master_addr").
        retry_s: keep trying this long (a peer's name may not be in DNS yet).

    Raises:
        ConfigError: the name does not resolve.
    """
    if _is_ip(name):
        return str(ipaddress.ip_address(name.strip("[]")))
    deadline = time.monotonic() + retry_s
    while True:
        try:
            ip = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            break
        except (socket.gaierror, UnicodeError, IndexError, OSError) as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{what} {name!r} does not resolve to an address ({e}); give an IP address or a "
                                  "host name every node can resolve") from None
            time.sleep(1.0)
    _logger.info("%s %s resolves to %s", what, name, ip)
    print(f"msdist: {what} {name} resolves to {ip}", file=sys.stderr, flush=True)
    return ip


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def slurm_port(job_id: str) -> int:
    """A scheduler port every task of one srun step computes alike, without talking to each other."""
    return _SLURM_PORT_BASE + zlib.crc32(job_id.encode()) % _SLURM_PORT_SPAN


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


def is_local_address(ip: str) -> bool:
    """True when this host can listen on `ip`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (even by SIGKILL).

    Returns:
        False where that is not available (not glibc); callers then rely on their own polling.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        return False
    return True


def cluster_env(host: str, port: Union[int, str], world_size: int) -> Dict[str, str]:
    """The variables MindSpore's dynamic cluster reads, shared by scheduler and workers."""
    return {"MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world_size)}


def start_scheduler(host: str, port: int, world_size: int, log_path: str) -> subprocess.Popen:
    """Start MindSpore's scheduler as a child that dies with this process (see msdist.cluster.scheduler)."""
    env = dict(os.environ, **cluster_env(host, port, world_size), MS_ROLE="MS_SCHED",
               MSDIST_PARENT_PID=str(os.getpid()))
    for name in ("MS_NODE_ID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)  # the scheduler is not an MPI rank nor a worker
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "msdist.cluster.scheduler"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_until_listening(host: str, port: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
    """Block until the scheduler accepts connections.

    MindSpore workers that find no scheduler back off with a growing retry window (20-60 s lost at
    start-up on this 2-core machine), so they only call init() once it is reachable.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"MindSpore scheduler at {host}:{port} did not come up within {timeout_s:.0f} s")


def established_connections(port: int) -> int:
    """TCP connections accepted on local `port` that are still open, from /proc/net/tcp{,6}."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local "ADDR:PORT" in hex; state 01 = ESTABLISHED
            if len(fields) > 3 and fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


# ---------------------------------------------------------------- the mpirun rendezvous file

def rendezvous_path(job_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"msdist-mpirun-{job_id}.port")


def publish_port(job_id: str, port: int) -> None:
    atomic_write_text(rendezvous_path(job_id), str(port))  # readers never see a half-written port


def wait_for_port(job_id: str, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> int:
    path = rendezvous_path(job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as f:
                return int(f.read())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise RuntimeError(f"rank 0 did not publish the scheduler port in {path} within {timeout_s:.0f} s; "
                       "for mpirun across several hosts export MS_SCHED_HOST and MS_SCHED_PORT (mpirun -x)")


def remove_rendezvous(job_id: str) -> None:
    try:
        os.remove(rendezvous_path(job_id))
    except FileNotFoundError:
        pass


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


# ---------------------------------------------------------------- failure reports

SCHEDULER_PREFIX = "msdist.scheduler: "
_MS_NODE_TIMEOUT_DEFAULT_S = 30  # MindSpore's documented default for MS_NODE_TIMEOUT
_TIMED_OUT = re.compile(r"worker (\d+) is the first one timed out")


def scheduler_verdict(log_path: str) -> str:
    """The scheduler's one-line failure message from its log (see msdist.cluster.scheduler), or ""."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith(SCHEDULER_PREFIX)]
    except OSError:
        return ""
    return lines[-1][len(SCHEDULER_PREFIX):] if lines else ""


def describe_timeout(verdict: str) -> str:
    """Name the rank MindSpore's cluster timed out ("worker N is the first one timed out"), or ""."""
    match = _TIMED_OUT.search(verdict)
    if not match:
        return ""
    return (f"rank {match.group(1)} stopped responding: MindSpore's cluster heard no heartbeat from it within "
            f"MS_NODE_TIMEOUT (stopped, hung, or its host is gone)")


def node_timeout_s(env: Mapping[str, str]) -> float:
    """MindSpore's scheduler-worker heartbeat timeout: MS_NODE_TIMEOUT, 30 s by default."""
    return float(_int_env(env, "MS_NODE_TIMEOUT", _MS_NODE_TIMEOUT_DEFAULT_S))


# A rank reaches its first collective after compiling its step; the slowest rank may still be compiling
# minutes later (ResNet-50 with SyncBN: 95 s on a loaded 2-core host, more for bigger graphs).
COLLECTIVE_WAIT_S = 900


def collective_wait_env(env: Mapping[str, str], device: str) -> Dict[str, str]:
    """What a CPU worker sets in its own environment after joining the cluster, so that a collective
    waits for a peer that is still compiling instead of failing the job.

    MindSpore's CPU collectives (mccl) wait for a peer only MS_NODE_TIMEOUT seconds, read when the
    first collective runs; the same variable is the scheduler's heartbeat timeout, which must stay
    short to detect a dead rank. The scheduler is a separate process that keeps the user's value, so
    raising it in the worker after init() changes only the collective wait. NCCL ignores it.
    """
    unbounded = env.get("MS_NODE_TIMEOUT", "").strip().startswith("-")  # MindSpore: a negative value waits forever
    if device != "CPU" or unbounded or node_timeout_s(env) >= COLLECTIVE_WAIT_S:
        return {}
    return {"MS_NODE_TIMEOUT": str(COLLECTIVE_WAIT_S)}


def rank_label(env: Mapping[str, str]) -> str:
    """" (rank N)" for a process of a multi-rank job, from its launcher's variables, else ""."""
    launch = detect_launch(env, parent=[])
    return f" (rank {launch.rank})" if launch.world_size > 1 else ""
