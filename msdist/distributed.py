"""Everything about ranks: who started us, device and backend choice, cluster init, small collectives.

Three ways a process can be started:

* standalone: `python -m msdist.train` -> world size 1, no communication at all;
* mpirun: OpenMPI sets `OMPI_COMM_WORLD_*`. On GPU MindSpore's own OpenMPI path works and is used
  as is. On CPU it does not ("Failed to initialize communication library on device side"), so we
  bridge to MindSpore's dynamic cluster: rank 0 starts the scheduler on a free port, publishes the
  port to the other local ranks through a file keyed by the mpirun job id, and every rank joins as
  a worker;
* cluster: `msdist.launch`, `msrun` or a user set `MS_ROLE=MS_WORKER` and friends already.

The training loop never sees any of this: it gets a frozen `DistInfo`.
"""
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from msdist.errors import ConfigError

_logger = logging.getLogger(__name__)

_RENDEZVOUS_TIMEOUT_S = 120
_SCHEDULER_EXIT_GRACE_S = 15


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process, read before MindSpore loads."""
    kind: str              # "standalone" | "mpirun" | "cluster"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    job_id: str = ""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device_target: str
    backend: str           # "" when standalone

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(env, name, default):
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else default


def detect_launch(env=None) -> LaunchEnv:
    """Classify how this process was started, from environment variables only."""
    env = os.environ if env is None else env
    if env.get("MS_ROLE") == "MS_WORKER" and _int_env(env, "MS_WORKER_NUM", 1) > 1:
        world = _int_env(env, "MS_WORKER_NUM", 1)
        rank = _int_env(env, "MS_NODE_ID", 0)
        local_world = _int_env(env, "MSDIST_LOCAL_WORLD_SIZE", world)
        return LaunchEnv("cluster", rank, world, _int_env(env, "MSDIST_LOCAL_RANK", rank % local_world), local_world)
    if _int_env(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
        return LaunchEnv("mpirun", _int_env(env, "OMPI_COMM_WORLD_RANK", 0), _int_env(env, "OMPI_COMM_WORLD_SIZE", 1),
                         _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
                         env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or str(os.getppid()))
    return LaunchEnv("standalone", 0, 1, 0, 1)


def gpu_available() -> bool:
    """True when this MindSpore build has a working GPU backend and a visible device."""
    logging.getLogger("mindspore").setLevel(logging.ERROR)  # it warns loudly when the plugin is absent
    try:
        from mindspore.device_context.gpu import is_available
        return bool(is_available())
    except Exception:  # noqa: BLE001 - any failure to load the plugin means "no GPU"
        return False


def choose_device_target(requested: str, has_gpu: bool) -> str:
    """`auto` means GPU when usable, else CPU; an explicit GPU request without a GPU is an error."""
    if requested == "auto":
        return "GPU" if has_gpu else "CPU"
    if requested == "GPU" and not has_gpu:
        raise ConfigError("--device_target GPU was requested but MindSpore's GPU backend is not usable here; "
                           "install the GPU build of MindSpore or use --device_target CPU")
    return requested


def backend_for(device_target: str) -> str:
    return {"GPU": "nccl", "CPU": "mccl"}[device_target]


def needs_cluster_bridge(launch: LaunchEnv, device_target: str) -> bool:
    """mpirun on CPU: MindSpore's MPI path needs a GPU, so join its dynamic cluster instead."""
    return launch.kind == "mpirun" and device_target == "CPU"


# ---------------------------------------------------------------- scheduler

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


def cluster_env(host: str, port: int, world_size: int) -> dict:
    """The variables MindSpore's dynamic cluster reads, shared by scheduler and workers."""
    return {"MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world_size)}


def start_scheduler(host: str, port: int, world_size: int, log_path: str) -> subprocess.Popen:
    """Start MindSpore's scheduler as a child that dies with this process (see msdist.scheduler)."""
    env = dict(os.environ, **cluster_env(host, port, world_size), MS_ROLE="MS_SCHED",
               MSDIST_PARENT_PID=str(os.getpid()))
    for name in ("MS_NODE_ID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)  # the scheduler is not an MPI rank nor a worker
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "msdist.scheduler"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop_scheduler(proc: Optional[subprocess.Popen], grace_s: float = _SCHEDULER_EXIT_GRACE_S) -> None:
    """For a supervisor whose workers have exited: let the scheduler finish, then make sure it is gone."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_listening(host: str, port: int, timeout_s: float = _RENDEZVOUS_TIMEOUT_S) -> None:
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


def _rendezvous_path(job_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"msdist-mpirun-{job_id}.port")


def _publish_port(job_id: str, port: int) -> None:
    path = _rendezvous_path(job_id)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(port))
    os.replace(tmp, path)  # readers never see a half-written port


def _wait_for_port(job_id: str, timeout_s: float = _RENDEZVOUS_TIMEOUT_S) -> int:
    path = _rendezvous_path(job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as f:
                return int(f.read())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise RuntimeError(f"rank 0 did not publish the scheduler port in {path} within {timeout_s:.0f} s; "
                       "for mpirun across several hosts export MS_SCHED_HOST and MS_SCHED_PORT (mpirun -x)")


class _MpirunBridge:
    """Join MindSpore's dynamic cluster from an mpirun rank; rank 0 starts the scheduler.

    Rank 0 does not wait for the scheduler when it exits: workers unregister in MindSpore's own exit
    path, after any code of ours has run, and the scheduler leaves by itself after the last of them
    (msdist.scheduler makes sure it cannot outlive rank 0 by more than a short grace period).
    """

    def __init__(self, launch: LaunchEnv, log_dir: str):
        self.launch = launch
        self.scheduler = None
        self.published = False
        host = os.environ.get("MS_SCHED_HOST", "127.0.0.1")
        port = os.environ.get("MS_SCHED_PORT")
        if port is None:
            if launch.rank == 0:
                port = free_port(host)
                _publish_port(launch.job_id, port)
                self.published = True
            else:
                port = _wait_for_port(launch.job_id)
        if launch.rank == 0:
            self.scheduler = start_scheduler(host, int(port), launch.world_size,
                                             os.path.join(log_dir, "scheduler.log"))
        os.environ.update(cluster_env(host, int(port), launch.world_size), MS_ROLE="MS_WORKER",
                          MS_NODE_ID=str(launch.rank))
        wait_until_listening(host, int(port))

    def joined(self) -> None:
        """Every worker has registered, so nobody needs the rendezvous file any more."""
        if self.published:
            try:
                os.remove(_rendezvous_path(self.launch.job_id))
            except FileNotFoundError:
                pass


_BRIDGE: Optional[_MpirunBridge] = None


def init(launch: LaunchEnv, device_target: str, log_dir: str, deterministic: bool = False) -> DistInfo:
    """Set GRAPH_MODE and the device, join the job's communication group, set DATA_PARALLEL.

    Args:
        launch: from `detect_launch()`.
        device_target: "auto", "CPU" or "GPU".
        log_dir: where the scheduler's own log goes when this rank starts it.
        deterministic: ask MindSpore for deterministic kernels.
    """
    global _BRIDGE
    import mindspore as ms

    device = choose_device_target(device_target, device_target != "CPU" and gpu_available())
    ms.set_context(mode=ms.GRAPH_MODE, device_target=device, deterministic="ON" if deterministic else "OFF")
    if launch.kind == "standalone":
        return DistInfo(0, 1, 0, device, "")
    from mindspore.communication import get_group_size, get_rank
    from mindspore.communication import init as comm_init

    backend = backend_for(device)
    if needs_cluster_bridge(launch, device):
        _BRIDGE = _MpirunBridge(launch, log_dir)
    comm_init(backend)
    if _BRIDGE is not None:
        _BRIDGE.joined()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    return DistInfo(rank, world, launch.local_rank, device, backend)


# ---------------------------------------------------------------- collectives

def _all_gather_cell():
    import mindspore as ms
    from mindspore import nn, ops

    class AllGather(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gather = ops.AllGather()

        def construct(self, x):
            return self.gather(x)

    return AllGather(), ms.Tensor


class Collectives:
    """Host-side collectives for counts, losses and checks (not for gradients).

    Values travel as float64 split into float32 halves through AllGather, which copies bytes and
    does no arithmetic, so integers and checksums arrive exactly. Identity when world_size == 1.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._gather, self._tensor = _all_gather_cell() if world_size > 1 else (None, None)

    def gather(self, values) -> np.ndarray:
        """Stack every rank's vector: result[r] is rank r's `values`."""
        values = np.atleast_1d(np.asarray(values, dtype=np.float64))
        if self._gather is None:
            return values[None]
        out = self._gather(self._tensor(values.view(np.float32))).asnumpy()
        return out.reshape(self.world_size, -1).view(np.float64).reshape(self.world_size, *values.shape)

    def sum(self, values) -> np.ndarray:
        """Elementwise sum over ranks, exact for integer counts."""
        return self.gather(values).sum(axis=0)


def params_checksum(net) -> float:
    """A float64 fingerprint of the trainable parameters, equal on ranks that hold identical weights.

    BatchNorm running statistics are left out: without sync_bn each rank keeps its own, by design.
    """
    import hashlib
    digest = hashlib.sha256()
    for param in net.trainable_params():
        digest.update(param.name.encode())
        digest.update(np.ascontiguousarray(param.asnumpy()).tobytes())
    return float(int.from_bytes(digest.digest()[:6], "little"))  # 48 bits: exact in float64


def check_replicas_identical(collectives: Collectives, net, when: str) -> None:
    """Fail loudly when the ranks' parameters differ (diverged replicas)."""
    sums = collectives.gather([params_checksum(net)])[:, 0]
    if not np.all(sums == sums[0]):
        bad = [r for r, s in enumerate(sums) if s != sums[0]]
        raise RuntimeError(f"parameters differ across ranks {when} (ranks {bad} disagree with rank 0); "
                           "replicas have diverged - check that every rank runs the same config and seed")


def unify_bn_stats(net, collectives: Collectives, mode: str) -> None:
    """Make the ranks' BatchNorm running statistics one model (`--dist_bn`), in place.

    Without sync_bn every rank's running mean/variance follow its own shard. Before an evaluation
    or a checkpoint they become one model: "reduce" = the mean over ranks, "broadcast" = rank 0's,
    "none" = left per rank. The values travel exactly (float64 through `Collectives.gather`) and
    every rank computes the same float64 mean in the same order, so the result is bitwise equal on
    every rank.
    """
    if mode == "none" or collectives.world_size == 1:
        return
    import mindspore as ms
    stats = [p for p in net.get_parameters() if p.name.rsplit(".", 1)[-1] in ("moving_mean", "moving_variance")]
    if not stats:
        return
    local = np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in stats])
    ranks = collectives.gather(local)
    unified = ranks.mean(axis=0) if mode == "reduce" else ranks[0]
    offset = 0
    for p in stats:
        p.set_data(ms.Tensor(unified[offset:offset + p.size].reshape(p.shape).astype(np.float32)))
        offset += p.size
