"""Rank set-up that needs MindSpore: device choice, cluster init, the mpirun/srun bridge, collectives.

How the process was started is decided MindSpore-free in msdist.base.launch_env and msdist.cluster.job;
this module acts on it:

* standalone: world size 1, no communication at all;
* mpirun on GPU: MindSpore's own OpenMPI path (init("nccl")), with MPI finalized before leaving;
* mpirun on CPU, and srun: msdist bridges to MindSpore's dynamic cluster (rank 0 starts the scheduler);
* cluster (msdist.launch, msrun): MindSpore's dynamic cluster, variables already set;
* scheduler (msrun's MS_ROLE=MS_SCHED): serve as the scheduler, see `run_scheduler_role`.

The training loop never sees any of this: it gets a frozen `DistInfo`.
"""
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from msdist.base import cli
from msdist.base.errors import ConfigError, alike_on_every_rank
from msdist.base.launch_env import LaunchEnv
from msdist.cluster import job, registration, rendezvous
from msdist.cluster.stall import StallPolicy
from msdist.rank import device, local_exchange

_logger = logging.getLogger(__name__)
# What a rank's exception says when a collective could not complete because a peer is gone or stopped.
_COLLECTIVE_FAILURE = re.compile(r"AllReduce|AllGather|ReduceScatter|Broadcast|[Cc]ollective|timed out")
_VERDICT_GRACE_S = 5.0
_SIGTERM_VERDICT_S = 8.0  # SIGTERM on rank 0: how long the scheduler may take to name a timed-out rank
_LINGER_S = 2.0


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


def probe_gpu() -> device.GpuProbe:
    """Ask MindSpore whether its GPU plugin loaded (it tries at import) and how many GPUs it sees."""
    logging.getLogger("mindspore").setLevel(logging.ERROR)  # it warns loudly when the plugin is absent
    from mindspore._c_expression import MSContext
    context = MSContext.get_instance()
    loaded = bool(context.is_pkg_support_device("GPU"))
    visible = 0
    if loaded:
        from mindspore._c_expression import gpu_get_device_count  # only in GPU builds
        visible = int(gpu_get_device_count())  # CUDA applies CUDA_VISIBLE_DEVICES itself
    error = device.gpu_load_error(context.load_plugin_error())
    return device.GpuProbe(loaded, visible, device.nvidia_present(), error, device.host_gpu_count(),
                           "loaded by MindSpore" if loaded else f"not loaded: {error}")


class _ClusterBridge:
    """Join MindSpore's dynamic cluster from an mpirun or srun rank; rank 0 starts the scheduler.

    Rank 0 does not wait for the scheduler when it exits: workers unregister in MindSpore's own exit
    path, after any code of ours has run, and the scheduler leaves by itself after the last of them
    (msdist.cluster.scheduler makes sure it cannot outlive rank 0 by more than a short grace period).
    """

    def __init__(self, launch: LaunchEnv, log_dir: str, stall: StallPolicy):
        self.launch = launch
        os.environ.update(rendezvous.topo_timeout_env(stall.stall_startup_timeout))  # the scheduler's too
        self.scheduler = None
        self.heartbeat_timeout_s = rendezvous.node_timeout_s(os.environ)  # before init() raises it for collectives
        self.published = False
        host, port = job.bridge_address(launch, os.environ)
        host = rendezvous.resolve_host(host, "MS_SCHED_HOST" if "MS_SCHED_HOST" in os.environ else "the scheduler host")
        if port is None:
            if launch.rank == 0:
                port = rendezvous.free_port(host)
                rendezvous.publish_port(launch.job_id, port)
                self.published = True
            else:
                port = rendezvous.wait_for_port(launch.job_id)
        if launch.rank == 0:
            if not rendezvous.is_local_address(host):
                raise RuntimeError(f"rank 0 must host MindSpore's scheduler at {host}, but that is not an address of "
                                   "this node; set MS_SCHED_HOST to rank 0's node address")
            log_path = os.path.join(log_dir, "scheduler.log")
            self.scheduler = rendezvous.start_scheduler(host, port, launch.world_size, log_path,
                                                        stall.stall_register_timeout)
            threading.Thread(target=_fail_with_scheduler, args=(self.scheduler, log_path), name="msdist-scheduler-watch",
                             daemon=True).start()
            cli.add_crash_hook(self._await_scheduler_verdict)
            # MindSpore ends a worker with SIGTERM once its cluster fails, often before the scheduler has
            # said which rank it timed out; without this handler that SIGTERM kills rank 0 silently.
            signal.signal(signal.SIGTERM, self._verdict_then_exit)
        os.environ.update(job.bridge_worker_env(launch, host, str(port)))
        rendezvous.wait_until_listening(host, port)

    def _await_scheduler_verdict(self, error: Exception) -> None:
        """A collective failed on rank 0: MindSpore's scheduler is about to name the rank it timed out
        (then _fail_with_scheduler reports it and ends this process), so give it that long."""
        if _COLLECTIVE_FAILURE.search(str(error)):
            self._wait_for_verdict(self.heartbeat_timeout_s + _VERDICT_GRACE_S, _VERDICT_GRACE_S)

    def _wait_for_verdict(self, timeout_s: float, linger_s: float) -> None:
        try:
            self.scheduler.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return
        time.sleep(linger_s)  # the watcher thread prints and exits the process meanwhile

    def _verdict_then_exit(self, signum, _frame) -> None:
        """SIGTERM on rank 0 (from MindSpore's failing cluster, or from mpirun): if the scheduler is about to
        name a timed-out rank, let the watcher thread print that first; then end as SIGTERM would."""
        if self.scheduler.poll() is None or self.scheduler.returncode != 0:
            # Bounded: the scheduler gives its verdict within seconds of a timeout; a SIGTERM from mpirun
            # for another reason must still end this rank promptly.
            self._wait_for_verdict(_SIGTERM_VERDICT_S, linger_s=1.0)
        os._exit(128 + signum)  # pylint: disable=protected-access

    def joined(self) -> None:
        """Every worker has registered, so nobody needs the rendezvous file any more."""
        if self.published:
            rendezvous.remove_rendezvous(self.launch.job_id)


def _fail_with_scheduler(proc, log_path: str) -> None:
    """Rank 0 under mpirun/srun: when MindSpore's scheduler fails (it timed out a rank), say which rank
    and why in one line and end this rank, so the launcher ends the job with that line last.

    Without this the job ends ~MS_NODE_TIMEOUT later with only mpirun's "exited on signal 15" and
    the cause in scheduler.log.
    """
    code = proc.wait()
    if code == 0:
        return
    verdict = rendezvous.scheduler_verdict(log_path)
    cause = rendezvous.describe_timeout(verdict)
    if not cause:
        # Not a timed-out rank: a rank that failed says why itself, and so does this one if its collectives
        # fail; a second, vaguer line here would only bury that one.
        _logger.warning("MindSpore's scheduler exited with code %s: %s", code, verdict)
        return
    print(f"msdist: job failed: {cause} (scheduler log: {log_path})", file=sys.stderr, flush=True)
    os._exit(1)  # pylint: disable=protected-access


def verify_device(planned: device.DevicePlan, launch: LaunchEnv) -> device.DevicePlan:
    """Start-up's device decision (`startup.decide_device`, from the host's files), verified now that MindSpore is
    loaded: a planned GPU is one MindSpore itself can use, and its device count (cgroups, CUDA) has the last word on
    the id. Nothing is decided again: a CPU stays a CPU.

    Raises:
        ConfigError: MindSpore rules the planned GPU out (`device.plan_device` over its own probe).
    """
    if planned.target != "GPU":
        return planned
    return device.plan_device("GPU", launch.local_rank, probe_gpu())


def refuse_shared_gpu(launch: LaunchEnv, device_id: int) -> None:
    """Stop, before init("nccl"), local ranks that would share one GPU: each says which GPU its device id is
    (PCI bus id) through the per-host exchange, and every local rank judges all of them alike.

    Raises:
        ConfigError: `device.shared_gpu` found one GPU for two local ranks.
    """
    key = local_exchange.job_key(launch.launcher, launch.job_id, os.environ,
                                 launch.rank - launch.local_rank)
    if not key:  # ranks set up by hand: nothing to meet under; NCCL's own check remains
        return
    bus_ids = local_exchange.exchange(local_exchange.folder_for("gpus", key), launch.local_rank,
                                      launch.local_world_size, device.cuda_bus_id(device_id))
    problem = device.shared_gpu(bus_ids or [])
    if problem:
        with alike_on_every_rank():
            raise ConfigError(problem)


def init(launch: LaunchEnv, planned: device.DevicePlan, log_dir: str, deterministic: bool = False,
         stall: StallPolicy = StallPolicy.from_options({})) -> DistInfo:
    """Set the device and GRAPH_MODE, join the job's communication group, set DATA_PARALLEL.

    Args:
        launch: from `launch_env.detect_launch()`.
        planned: this rank's device as start-up decided it (`startup.decide_device`), verified here.
        log_dir: where the scheduler's own log goes when this rank starts it.
        deterministic: ask MindSpore for deterministic kernels.
        stall: the job's stall options; the scheduler rank 0 starts names an unregistered rank after
            their --stall_register_timeout, and MS_TOPO_TIMEOUT is their --stall_startup_timeout.
    """
    import mindspore as ms

    chosen = verify_device(planned, launch)
    target = chosen.target
    if target == "GPU" and launch.local_world_size > 1:
        refuse_shared_gpu(launch, chosen.device_id)
    for name in job.vars_to_clear(launch, target, os.environ):
        del os.environ[name]  # before init(): they would start the dynamic cluster instead of MPI
    # set_device, not set_context(device_id=...): communication init keeps only an id given this way
    # (mindspore/device_manager.py) and otherwise picks each rank's local rank, past its only GPU.
    ms.set_device(target, **({} if chosen.device_id is None else {"device_id": chosen.device_id}))
    ms.set_context(mode=ms.GRAPH_MODE, deterministic="ON" if deterministic else "OFF")
    if launch.kind == "standalone":
        return DistInfo(0, 1, 0, target, "")
    from mindspore.communication import get_group_size, get_rank
    from mindspore.communication import init as comm_init

    backend = job.backend_for(target)
    # The bridge outlives this call through what it registered (scheduler watcher thread, crash hook,
    # SIGTERM handler); after the join it is only told that the rendezvous file can go.
    bridge = _ClusterBridge(launch, log_dir, stall) if job.needs_cluster_bridge(launch, target) else None
    if bridge is None and "MS_SCHED_HOST" in os.environ:  # set by hand or by a job spec: MindSpore takes only an IP
        os.environ["MS_SCHED_HOST"] = rendezvous.resolve_host(os.environ["MS_SCHED_HOST"], "MS_SCHED_HOST")
    registration.exit_on_signal()  # the scheduler's watchdog ends a rank stuck in init() this way
    comm_init(backend)
    os.environ.update(rendezvous.collective_wait_env(os.environ, target))  # before the first collective reads it
    if bridge is not None:
        bridge.joined()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    dist = DistInfo(rank, world, launch.local_rank, target, backend)
    check_same_device(Collectives(world), dist)
    return dist


def check_same_device(collectives: "Collectives", dist: DistInfo) -> None:
    """Fail when ranks picked different devices (`auto` decides per host)."""
    chosen = collectives.gather([1.0 if dist.device_target == "GPU" else 0.0])[:, 0]
    if not np.all(chosen == chosen[0]):
        names = ", ".join(f"rank {r}: {'GPU' if c else 'CPU'}" for r, c in enumerate(chosen))
        raise RuntimeError(f"ranks chose different devices ({names}); fix the hosts or pass --device_target")


def _loaded_library(stem: str) -> Optional[str]:
    """Path of an already loaded shared library whose file name starts with `stem` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def finalize_mpi() -> bool:
    """Call MPI_Finalize if MPI is initialized and not yet finalized; True when it was called.

    MindSpore's own MPI_Finalize sits in the destructor of its MPI collective library (libmpi_collective.so,
    ~MPICollectiveCommLib: MPI_Finalized, then MPI_Finalize), which runs only in the C++ teardown that
    runtime.exit_without_teardown skips. So it is called here, the same way.
    """
    path = _loaded_library("libmpi.so")
    if path is None:
        return False
    mpi = ctypes.CDLL(path)
    initialized, finalized = ctypes.c_int(0), ctypes.c_int(0)
    mpi.MPI_Initialized(ctypes.byref(initialized))
    mpi.MPI_Finalized(ctypes.byref(finalized))
    if not initialized.value or finalized.value:
        return False
    return mpi.MPI_Finalize() == 0


def finish(launch: LaunchEnv, dist: DistInfo, collectives: "Collectives") -> None:
    """End a finished rank's part in the job: on MindSpore's MPI path, a last barrier (so no rank leaves
    before rank 0's result.json is written), then MPI_Finalize, so mpirun counts a clean exit."""
    if job.should_finalize_mpi(launch, dist.device_target):
        collectives.gather([0.0])  # AllGather completes only when every rank reached it
        finalize_mpi()
    elif dist.world_size > 1:
        # MindSpore's CPU collectives send asynchronously: a rank whose last AllGather has completed may
        # still owe a peer its share, and os._exit (runtime.exit_without_teardown) would drop it, failing
        # that peer (seen: "RingAllGather CollectiveWait failed" on msdist.check's last gather under load).
        time.sleep(_LINGER_S)


def run_scheduler_role(launch: LaunchEnv, stall: StallPolicy, log_dir: str) -> int:
    """Serve as MindSpore's scheduler for msrun (MS_ROLE=MS_SCHED), until the job's workers are gone.

    Args:
        stall: a worker not registered --stall_register_timeout after the others is named, and the job ended.
        log_dir: the workers' heartbeats, which say on which host a missing rank runs.
    """
    from msdist.cluster import scheduler
    os.environ.update(rendezvous.topo_timeout_env(stall.stall_startup_timeout))
    os.environ.update({rendezvous.REGISTER_TIMEOUT_VAR: str(stall.stall_register_timeout),
                       rendezvous.LOG_DIR_VAR: log_dir})
    _logger.info("MS_ROLE=MS_SCHED (%s): serving as the scheduler for %d workers", launch.launcher, launch.world_size)
    return scheduler.serve_job(int(os.environ.get("MS_SCHED_PORT", "0")))


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

    def gather_text(self, text: str) -> list:
        """Every rank's `text`: result[r] is rank r's (UTF-8 bytes, one per value, padded to the longest)."""
        data = np.frombuffer(text.encode(), dtype=np.uint8)
        lengths = self.gather([len(data)])[:, 0].astype(np.int64)
        padded = np.zeros(max(int(lengths.max()), 1))
        padded[:len(data)] = data
        rows = self.gather(padded).astype(np.uint8)
        return [rows[r, :n].tobytes().decode() for r, n in enumerate(lengths)]


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


