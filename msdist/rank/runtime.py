"""Process environment and MindSpore runtime settings that make a rank run at the machine's limit.

Two phases, because MindSpore and oneDNN read some settings once, when their libraries load:

* `prepare()` runs before `import mindspore`: log level, oneDNN ISA cap, OpenMP threads, the cores
  this rank will be bound to, where the compile cache lives. It never imports mindspore.
* `prepare_to_join()` and `bind_to_cores()` wrap the rank's cluster join: unbound and without wake-up
  preemption during it (MindSpore's registration race, issue #34), bound after it.
* `configure_mindspore()` runs right after the device context is set: MindSpore's own CPU kernel
  thread pool, sized to this rank's share of the cores. `compile_cache_scope()` wraps the one
  compile whose graph is cached.

Every entry point calls `prepare()` first, under mpirun, msdist.launch and standalone alike.
"""
import contextlib
import ctypes
import gc
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from msdist.rank import local_exchange

_logger = logging.getLogger(__name__)

# GLOG_v: 0 DEBUG, 1 INFO, 2 WARNING, 3 ERROR. MindSpore's Python logger reads it too.
_QUIET_LOG_LEVEL = "3"
_VERBOSE_LOG_LEVEL = "1"
# oneDNN's values for ONEDNN_MAX_CPU_ISA (x86), plus our "auto" (probe) and "default" (no cap).
CPU_ISA_CHOICES = ("auto", "default", "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                   "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX")


@dataclass(frozen=True)
class RuntimeInfo:
    cpu_isa: str                 # value given to ONEDNN_MAX_CPU_ISA ("default" = oneDNN's own choice)
    isa_source: str              # where the choice came from: env, option, probe
    threads_per_rank: int
    cores: Tuple[int, ...] = ()  # cores this rank is bound to; () = not bound
    cores_bound_by: str = ""     # "launcher" or "msdist" when bound
    compile_cache: str = ""      # MindSpore compile-cache directory; "" = off
    compile_cache_warm: bool = False  # this rank's cache already held a compiled graph at start

    def summary(self) -> str:
        """One log-line fragment with every choice made here."""
        cores = f"{','.join(map(str, self.cores))} (bound by {self.cores_bound_by})" if self.cores else "not bound"
        if not self.compile_cache:
            cache = "off"
        else:
            cache = f"{'reused' if self.compile_cache_warm else 'cold'} ({self.compile_cache})"
        return (f"oneDNN ISA {self.cpu_isa} ({self.isa_source}) | {self.threads_per_rank} threads/rank | "
                f"cores {cores} | compile cache {cache}")


def usable_cores() -> Tuple[int, ...]:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def host_cores() -> int:
    """Cores online on this host, whatever this process's affinity."""
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Placement:
    threads: int                 # kernel threads for this rank
    cores: Tuple[int, ...] = ()  # cores this rank runs on; () = not bound
    bound_by: str = ""           # "launcher", "msdist" or "" (not bound)


def split_shared_mask(local_rank: int, masks: Sequence[Tuple[int, ...]], bind: bool = True) -> Placement:
    """This rank's cores: the ranks whose affinity mask equals its own split THAT mask among themselves only.

    Launchers leave a group of local ranks one mask: mpirun's --bind-to socket (its default above 2
    ranks) gives each socket's ranks that socket; a Slurm or container cpuset, or no binding, gives all
    of them the same cores. Splitting each group's mask over the group alone leaves no core idle and
    none shared: 8 ranks on 2 sockets x 32 cores get 8 cores each, not 4 (half the host idle) as a split
    of one socket over all 8 ranks would. A rank alone with its mask (--bind-to core, srun --cpu-bind)
    was placed by its launcher and keeps it. Cores that do not divide evenly go one each to the
    group's first ranks.

    Args:
        local_rank: this rank's index on the host.
        masks: every local rank's affinity mask (sorted core ids), by local rank (`local_masks`).
        bind: bind this rank to its slice (else only size its threads).
    """
    mine = masks[local_rank]
    if len(masks) <= 1:
        return Placement(len(mine))
    group = [rank for rank, mask in enumerate(masks) if mask == mine]
    if len(group) == 1:
        return Placement(len(mine), mine, "launcher")
    per_rank, extra = divmod(len(mine), len(group))
    if per_rank == 0:  # more ranks than cores in the mask: nothing to split
        return Placement(1)
    index = group.index(local_rank)
    start = index * per_rank + min(index, extra)
    cores = mine[start:start + per_rank + (index < extra)]
    return Placement(len(cores), cores, "msdist") if bind else Placement(len(cores))


def assumed_masks(mine: Tuple[int, ...], local_rank: int, local_world_size: int, host: int) -> List[Tuple[int, ...]]:
    """The local ranks' masks as one rank guesses them when it cannot learn them (no job key, a peer that did
    not arrive): a mask at most its share of the host was the launcher's per-rank binding (the others have
    their own); a wider one is shared by every local rank."""
    if len(mine) * local_world_size <= host:
        return [mine if rank == local_rank else (-1 - rank,) for rank in range(local_world_size)]  # distinct
    return [mine] * local_world_size


def local_masks(mine: Tuple[int, ...], local_rank: int, local_world_size: int,
                exchange_key: str) -> List[Tuple[int, ...]]:
    """Every local rank's affinity mask, learnt before MindSpore loads through the per-host file exchange keyed
    by the job (`local_exchange`); `assumed_masks` when there is no key or a rank does not arrive."""
    exchanged = None
    if exchange_key:
        folder = local_exchange.folder_for("cores", exchange_key)
        exchanged = local_exchange.exchange(folder, local_rank, local_world_size, ",".join(map(str, mine)))
    if exchanged is None:
        return assumed_masks(mine, local_rank, local_world_size, host_cores())
    return [tuple(int(c) for c in text.split(",") if c) for text in exchanged]


def place_rank(local_rank: int, local_world_size: int, bind: bool = True, exchange_key: str = "") -> Placement:
    """This rank's threads and cores, so the ranks on a host neither oversubscribe nor leave cores idle.

    Args:
        exchange_key: `local_exchange.job_key` of this job ("" = the others' masks are guessed).
    """
    cores = usable_cores()
    if local_world_size <= 1:
        return Placement(len(cores))
    return split_shared_mask(local_rank, local_masks(cores, local_rank, local_world_size, exchange_key), bind)


def needs_cpu_isa(device_target: str) -> bool:
    """Whether the oneDNN ISA choice (and its probe) matters: not when the model runs on a GPU.

    `auto` may still turn out to be a CPU, so it keeps the CPU set-up.
    """
    return device_target != "GPU"


def choose_cpu_isa(requested: str) -> tuple:
    """Pick the oneDNN ISA cap: explicit environment, then the option, then the cached probe."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return os.environ["ONEDNN_MAX_CPU_ISA"], "env"
    if requested and requested != "auto":
        return ("" if requested == "default" else requested), "option"
    from msdist.rank import isa_probe  # imported late: the probe spawns subprocesses
    return isa_probe.best_isa(), "probe"


def _source_fingerprint() -> str:
    """Hash of the Python sources that define the compiled graphs (msdist and models)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for package in ("msdist", "models"):
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()


def compile_cache_dir(output_dir: str, config_hash: str, world_size: int, num_classes: int,
                      device_target: str = "CPU", amp_level: str = "O0", batch_slots: int = 0) -> str:
    """Where MindSpore keeps this run's compiled graphs.

    The folder name hashes everything a compiled graph depends on: the config (model, image size,
    batch, the amp level as given...), the world size and the batch layout (`batch_slots`, 0 = one slot per
    rank: micro-batches per step and their size), the class count (the classifier's shape, which
    comes from the data unless set), the resolved device target and amp level (a CPU graph is no GPU
    graph, and `auto` means O0 on one and O2 on the other), the MindSpore version and msdist's own
    sources. Changing any of them selects a fresh folder, so a stale graph is never loaded.
    """
    from importlib.metadata import PackageNotFoundError, version
    try:
        ms_version = version("mindspore")
    except PackageNotFoundError:
        ms_version = "none"
    key = (f"{config_hash}|world {world_size}|slots {batch_slots or world_size}|classes {num_classes}|"
           f"device {device_target}|amp {amp_level}|mindspore {ms_version}|{_source_fingerprint()}")
    return os.path.join(output_dir, "compile_cache", hashlib.sha256(key.encode()).hexdigest()[:16])


def compile_cache_rank_dir(cache_dir: str, rank: int) -> str:
    """The folder MindSpore keeps one rank's compiled graphs in, inside the run's compile cache."""
    return os.path.join(cache_dir, f"rank_{rank}")


def _cache_is_warm(cache_dir: str, rank: int) -> bool:
    rank_dir = compile_cache_rank_dir(cache_dir, rank)
    return os.path.isdir(rank_dir) and any(files for _, _, files in os.walk(rank_dir))


def prepare(verbose: bool = False, cpu_isa: str = "auto", local_world_size: int = 1, *, local_rank: int = 0,
            rank: int = 0, bind_cores: bool = True, compile_cache: str = "", device_target: str = "auto",
            exchange_key: str = "") -> RuntimeInfo:
    """Set logging, kernel ISA, threads, core binding and compile cache for this process.

    Call before importing mindspore.

    Args:
        verbose: let MindSpore's C++ INFO lines through.
        cpu_isa: one of CPU_ISA_CHOICES; the ONEDNN_MAX_CPU_ISA environment variable wins over it.
        local_world_size: ranks on this host; they share its cores evenly.
        local_rank: this rank's index on the host (which slice of cores it binds to).
        rank: global rank (MindSpore keeps one compile-cache folder per rank).
        bind_cores: pin this process to its slice of cores when several ranks share the host (done by
            `bind_to_cores` once the rank has joined the cluster).
        compile_cache: directory for MindSpore's compile cache (see `compile_cache_dir`); "" = off.
        device_target: the device decision ("CPU", "GPU" or "auto"); on GPU the oneDNN ISA is left alone
            and never probed (the probe times CPU convolutions in subprocesses).
        exchange_key: `local_exchange.job_key` of this job: the local ranks learn each other's affinity
            masks through it ("" = guessed, `assumed_masks`).
    """
    if "mindspore" in sys.modules:
        _logger.warning("runtime.prepare() called after mindspore was imported; ISA and thread settings may not apply")
    level = _VERBOSE_LOG_LEVEL if verbose else _QUIET_LOG_LEVEL
    os.environ["GLOG_v"] = level
    # Some of MindSpore's communication libraries log through plain glog, which reads this instead.
    os.environ["GLOG_minloglevel"] = "0" if verbose else "2"
    isa, source = choose_cpu_isa(cpu_isa) if needs_cpu_isa(device_target) else ("", "not used on GPU")
    if isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = isa
    place = place_rank(local_rank, local_world_size, bind_cores, exchange_key)
    os.environ["OMP_NUM_THREADS"] = str(place.threads)
    return RuntimeInfo(cpu_isa=isa or "default", isa_source=source, threads_per_rank=place.threads,
                       cores=place.cores, cores_bound_by=place.bound_by,
                       compile_cache=compile_cache,
                       compile_cache_warm=bool(compile_cache) and _cache_is_warm(compile_cache, rank))


def prepare_to_join(rt: RuntimeInfo) -> None:
    """Right before this rank joins the cluster: run on any of the host's cores, without wake-up preemption,
    until it has joined (`bind_to_cores` then binds it and gives the threads their normal policy back).

    Pinned to one core from the start, a rank missed its registration one launch in four on a busy 2-core
    host and joined 3 to 300 s late (issue #34). The cause is a race in MindSpore 2.10's TCPComm
    (public source: mindspore_test@003f8fd, mindspore/ccsrc/cluster/rpc/tcp/tcp_comm.cc):
    `TCPComm::DoConnect` adds the new socket to the event loop's epoll (`SetConnectedHandler`) and only
    then sets `conn->state = kConnecting`. A loopback connect is writable at once, so the event-loop
    thread may run `ConnectedEventHandler` first (its ConnEstablishedEventHandler sets kConnected) and have
    that overwritten by kConnecting;
    `TCPComm::Connect` then waits 3 x 10 ms for kConnected in vain (tcp_comm.cc:496 in 2.10's log) and
    `ComputeGraphNode::Register` fails (compute_graph_node.cc:193) before any message reaches the
    scheduler; `ReconnectWithTimeoutWindow` (compute_graph_node.cc:392) tries again every 0.5 s until
    MS_TOPO_TIMEOUT. Every connect whose handler ran first failed (MS_SUBMODULE_LOG_v="{DISTRIBUTED:1}"
    shows it as "Connection from  to  is successfully created", addresses not yet set). The event thread
    wins when it runs at once on the connecting thread's own core, the only core a rank bound to one
    core has: bound ranks lost that race more often than unbound ones (docs/performance.md, "Start-up"),
    and a rank that loses it try after try is the one that joined minutes late. Unbinding removes that
    bias, not the race (the kernel may still wake a thread on its waker's core); SCHED_BATCH (below) all
    but closes it, and the registration watch (msdist.cluster.registration, --stall_register_timeout)
    bounds what is left. A launcher's binding
    (mpirun --bind-to core, msrun --bind_core) is widened the same way and given back after the join;
    the kernel keeps the result inside the process's cgroup cpuset.
    """
    if rt.cores:
        os.sched_setaffinity(0, range(host_cores()))
    # And no wake-up preemption until then: the threads MindSpore starts in init() inherit SCHED_BATCH, and
    # a SCHED_BATCH thread that wakes does not preempt the running one ("Batch and idle tasks do not preempt
    # non-idle tasks", Linux kernel/sched/fair.c, check_preempt_wakeup), so the connecting thread sets
    # kConnecting before the event thread runs on its core. Measured: failed registration tries per rank
    # 2.00 pinned, 1.75 unbound, 0.05 unbound in SCHED_BATCH (docs/performance.md, "Start-up").
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def bind_to_cores(rt: RuntimeInfo) -> None:
    """Pin every thread of this process to the rank's cores, with the normal scheduling policy, once its rank
    has joined the cluster (undoing `prepare_to_join`).

    Every thread MindSpore started so far (event loops, actor and kernel pools) is moved through
    /proc/self/task; threads started later inherit the mask and policy of the thread that starts them.
    """
    done = set()
    while True:  # a thread started while we pin the others is caught on the next pass
        todo = {int(t) for t in os.listdir("/proc/self/task")} - done
        if not todo:
            return
        for tid in todo:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                if rt.cores:
                    os.sched_setaffinity(tid, rt.cores)
            except ProcessLookupError:  # the thread has ended meanwhile
                pass
        done |= todo


def prepare_tool(local_world_size: int = 1) -> RuntimeInfo:
    """`prepare` for a tool that only reads images through MindSpore's dataset engine (`msdist.data
    check|bench`, pipeline benchmarks): the environment its decoders and threads read when MindSpore loads.

    Args:
        local_world_size: the ranks this process stands in for, which share the host's cores.
    """
    rt = prepare(False, "auto", local_world_size)
    bind_to_cores(rt)  # no cluster to join
    return rt


def configure_mindspore(rt: RuntimeInfo) -> None:
    """Size MindSpore's CPU kernel thread pool to this rank's cores (its default assumes the whole host)."""
    from mindspore import device_context
    from mindspore._c_expression import RuntimeConf
    if not RuntimeConf.get_instance().is_op_threads_num_configured():  # it may be set only once per process
        device_context.cpu.op_tuning.threads_num(rt.threads_per_rank)


@contextlib.contextmanager
def compile_cache_scope(rt: RuntimeInfo):
    """Cache the graphs compiled inside this block, and only those.

    MindSpore names cached graphs by the order in which they compile (compile_cache_0, _1, ...) and
    does not check that a cached graph belongs to the cell asking for it. Left on for the whole
    process, a restart that compiles in another order (a resume that evaluates first, a collective
    that runs only on resume) loads the wrong graph and crashes. Inside this block the order is fixed.
    """
    if not rt.compile_cache:
        yield
        return
    import mindspore as ms
    ms.set_context(enable_compile_cache=True, compile_cache_path=rt.compile_cache)
    try:
        yield
    finally:
        ms.set_context(enable_compile_cache=False)


def release_compile_memory() -> None:
    """Give the memory MindSpore's compiler freed back to the OS before training allocates its own.

    glibc keeps freed heap pages, so without this the compiler's transient peak stays resident and
    the step's activations come on top of it (ResNet-50 with sync_bn, 100 px: 120 MB per rank).
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def exit_without_teardown(code: int) -> int:
    """End a finished MindSpore process now, skipping MindSpore's C++ teardown.

    MindSpore 2.10 on CPU sometimes segfaults in its exit-time teardown after the work is done
    (seen on non-zero ranks under mpirun), which would turn a finished job into a failed one. Every
    file msdist writes is complete and fsynced before this is called, so only interpreter clean-up
    is skipped; the dynamic-cluster scheduler is reaped by its watchdog or by msdist.launch.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def end_process(main) -> None:
    """Run a face's `main()` as the whole life of this process and end it with main's exit status.

    Once MindSpore has loaded, every end skips its C++ teardown (`exit_without_teardown`), a refusal
    (exit 2) or a reported crash (exit 1) as much as a finished run: a segfault in that teardown would
    turn a rank's one-line error into mpirun's "exited on signal 11" (seen on rank 1 after a data check
    that every rank refused).
    """
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
    if isinstance(status, str):  # SystemExit("message") prints the message and exits 1
        print(status, file=sys.stderr, flush=True)
        status = 1
    status = status or 0
    if "mindspore" in sys.modules:
        exit_without_teardown(status)
    raise SystemExit(status)
