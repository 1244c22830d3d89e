"""How the ranks of a job find each other and wait for each other: addresses, ports, MindSpore's
scheduler process, the mpirun rendezvous file, and the scheduler's own account of a failure.

On CPU, MindSpore's OpenMPI path does not work, so msdist bridges mpirun and srun to MindSpore's dynamic
cluster: rank 0 starts the scheduler on a free port and publishes it to the other local ranks through a
file keyed by the mpirun job id (srun: a port derived from the job and step ids; or every rank reads
MS_SCHED_HOST/MS_SCHED_PORT when set). msdist.launch starts the scheduler the same way. MindSpore-free.
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
from typing import Dict, Mapping, Union

from msdist.base.errors import ConfigError
from msdist.base.files import atomic_write_text
from msdist.base.launch_env import int_env

_logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 120
# Ports derived from a Slurm job id fall in this range (above the usual ephemeral ports' start
# would collide with outgoing connections; below 20000 many services listen).
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


def is_ip(text: str) -> bool:
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
    if is_ip(name):
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


REGISTER_TIMEOUT_VAR = "MSDIST_REGISTER_TIMEOUT"  # for the scheduler's watchdog: --stall_register_timeout
LOG_DIR_VAR = "MSDIST_LOG_DIR"                     # for the scheduler's watchdog: where the ranks' heartbeats are


def topo_timeout_env(seconds: float) -> Dict[str, str]:
    """MS_TOPO_TIMEOUT, unless set already: how long MindSpore's workers try to register and its scheduler
    waits for them (1800 s by default). The backstop behind --stall_register_timeout's watch."""
    return {} if "MS_TOPO_TIMEOUT" in os.environ else {"MS_TOPO_TIMEOUT": str(int(seconds))}


def start_scheduler(host: str, port: int, world_size: int, log_path: str,
                    register_timeout_s: float = 0.0) -> subprocess.Popen:
    """Start MindSpore's scheduler as a child that dies with this process (see msdist.cluster.scheduler).

    Args:
        register_timeout_s: the scheduler's watchdog names a rank not registered this long after all the
            others and ends the job (mpirun, srun); 0: the launcher watches itself (msdist.launch).
    """
    # WARNING level whatever the rank starting it set for itself (runtime.prepare): the scheduler logs each
    # registration at WARNING (meta_server_node.cc:254), the one view of who has joined (msdist.cluster.registration).
    env = dict(os.environ, **cluster_env(host, port, world_size), MS_ROLE="MS_SCHED", GLOG_v="2", GLOG_minloglevel="1",
               MSDIST_PARENT_PID=str(os.getpid()), **{LOG_DIR_VAR: os.path.dirname(log_path)})
    if register_timeout_s:
        env[REGISTER_TIMEOUT_VAR] = str(register_timeout_s)
    for name in ("MS_NODE_ID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)  # the scheduler is not an MPI rank nor a worker
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "msdist.cluster.scheduler"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_until_listening(host: str, port: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
    """Block until the scheduler accepts connections.

    A worker that finds no scheduler is not slowed for long by it: MindSpore 2.10 retries registration
    every 0.5 s (ComputeGraphNode::ReconnectWithTimeoutWindow, compute_graph_node.cc:392 in its log; no
    growing window). Waiting here keeps those failed tries, which MindSpore logs only as warnings, out of
    the ranks' start-up. What did cost 3-300 s was a rank pinned to one core during init: see
    runtime.prepare_to_join.
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


# ---------------------------------------------------------------- the scheduler's account, and waiting for peers

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
    return float(int_env(env, "MS_NODE_TIMEOUT", _MS_NODE_TIMEOUT_DEFAULT_S))


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
