"""Which device a rank trains on, which device id, and the MindSpore call that sets it: MindSpore-free.

Two views feed the same pure functions:

* before MindSpore loads (`host_probe`: `msdist.check --plan`, the start-up of every entry point), the
  host's files: NVIDIA's device nodes and driver (`/dev/nvidia*`, `/proc/driver/nvidia`), whether the
  installed wheel's GPU plugin would load by MindSpore's own rules (`gpu_plugin`), and
  `CUDA_VISIBLE_DEVICES`;
* once MindSpore is loaded (`distributed.probe_gpu`), MindSpore's own word: whether its GPU plugin
  loaded and how many devices CUDA shows it. A GPU chosen from the files is confirmed that way
  before anything is compiled.

The device id is set with `mindspore.set_device(target, id)`: in MindSpore 2.10 that is the only
setting communication init keeps (mindspore/device_manager.py, `set_device` ->
DeviceManagerConf.set_device); `set_context(device_id=...)` only writes the old context field, and
init then gives each rank the device of its own local rank, which fails with "SetDevice for id:N"
where each rank sees one GPU.
"""
import ctypes
import importlib.util
import os
import re
import socket
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from msdist.base.errors import ConfigError
from msdist.rank import gpu_plugin

# A CUDA_VISIBLE_DEVICES entry CUDA accepts: an index or a GPU/MIG UUID. CUDA ignores every entry from
# the first invalid one on (Slurm writes "NoDevFiles" for a step without GPUs).
_CUDA_DEVICE = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)$")
_NVIDIA_DEVICE_NODE = re.compile(r"^nvidia\d+$")


@dataclass(frozen=True)
class GpuProbe:
    """What this host says about GPUs: from its files (`host_probe`) or from MindSpore (`distributed.probe_gpu`)."""
    plugin_loaded: bool    # MindSpore's GPU plugin loaded (from files: the wheel ships one)
    visible_devices: int   # GPUs this process may use
    nvidia_present: bool   # NVIDIA hardware or driver on the host (/dev/nvidia0, /proc/driver/nvidia)
    load_error: str = ""   # why the plugin is missing or failed to load
    host_devices: int = 0  # NVIDIA device nodes on the host (a pod: its own GPUs), whatever CUDA_VISIBLE_DEVICES says
    plugin: str = ""       # from files: the plugin MindSpore would load and what stays unverified, or why none


@dataclass(frozen=True)
class DevicePlan:
    """The device decision of one rank."""
    requested: str         # --device_target: auto, CPU or GPU
    target: str            # CPU or GPU
    why: str
    device_id: Optional[int] = None  # GPU only

    def call(self) -> str:
        """The MindSpore call that sets this device, as `distributed.init` makes it."""
        if self.device_id is None:
            return f"mindspore.set_device({self.target!r})"
        return f"mindspore.set_device({self.target!r}, {self.device_id})"


def nvidia_present(root: str = "/") -> bool:
    """True when the host has NVIDIA hardware with its driver loaded."""
    return os.path.exists(os.path.join(root, "dev", "nvidia0")) or \
        os.path.exists(os.path.join(root, "proc", "driver", "nvidia"))


def host_gpu_count(root: str = "/") -> int:
    """NVIDIA device nodes (/dev/nvidiaN) on this host: its GPUs when no CUDA_VISIBLE_DEVICES narrows them."""
    try:
        return sum(1 for name in os.listdir(os.path.join(root, "dev")) if _NVIDIA_DEVICE_NODE.match(name))
    except OSError:
        return 0


def wheel_plugin_dir() -> str:
    """The installed MindSpore wheel's plugin folder (lib/plugin, where its loader looks), found without importing
    it; "" when MindSpore is not installed."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or spec.origin is None:
        return ""
    return os.path.join(os.path.dirname(spec.origin), "lib", "plugin")


def visible_gpu_count(env: Mapping[str, str], host_devices: int) -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set (its valid leading entries), else the host's."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return host_devices
    count = 0
    for entry in value.split(","):
        if not _CUDA_DEVICE.match(entry.strip()):
            break  # "", "-1", "NoDevFiles": CUDA hides this device and every later one
        count += 1
    return count


def host_probe(env: Mapping[str, str], root: str = "/") -> GpuProbe:
    """This host's GPUs as its files show them, before MindSpore loads.

    Args:
        env: the environment (CUDA_VISIBLE_DEVICES; CUDA_HOME and LD_LIBRARY_PATH for the plugin).
        root: where /dev, /proc and the CUDA libraries are (`msdist.check --plan --host_root`); "/" is this host.
    """
    present = nvidia_present(root)
    plugin = gpu_plugin.verdict(wheel_plugin_dir(), root, env)  # MindSpore's own loading rules, on files
    host = host_gpu_count(root)
    visible = visible_gpu_count(env, host) if present else 0  # no driver: CUDA sees nothing
    return GpuProbe(plugin.loads, visible, present, plugin.problem, host, plugin.describe())


def gpu_load_error(load_plugin_error: str) -> str:
    """The GPU line of MindSpore's plugin-load report (it lists Ascend's failures too)."""
    lines = [line.strip() for line in load_plugin_error.splitlines() if "gpu" in line.lower()]
    return lines[0] if lines else ""


def gpu_device_id(visible_devices: int, local_rank: int) -> int:
    """The device index this rank uses: 0 when its launcher left it exactly one visible GPU (srun
    --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES, a one-GPU pod), else its local rank."""
    return 0 if visible_devices == 1 else local_rank


_VISIBILITY_FIX = "give this process its GPUs (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)"


def _unusable(probe: GpuProbe) -> Tuple[str, str]:
    """Why this probe rules the GPU out and what fixes it (("", "") when a GPU is usable)."""
    if not probe.plugin_loaded:
        return (f"MindSpore's GPU plugin did not load: {probe.load_error or 'this MindSpore build has no GPU plugin'}",
                "install what it names (CUDA 11 with cuDNN 8, their folder on LD_LIBRARY_PATH) or a MindSpore GPU "
                "build for this host's CUDA")
    if probe.visible_devices == 0:
        return ("no GPU is visible to this process (an empty or invalid CUDA_VISIBLE_DEVICES, or a job step "
                "without GPUs)", _VISIBILITY_FIX)
    return "", ""


def plan_device(requested: str, local_rank: int, probe: GpuProbe) -> DevicePlan:
    """The device, device id and reason for one rank: `auto` is GPU when usable, CPU only where there is no
    NVIDIA hardware at all; never a silent fallback.

    Args:
        requested: --device_target (auto, CPU, GPU).
        local_rank: the rank's index on its host.
        probe: `host_probe` before MindSpore loads, `distributed.probe_gpu` after.

    Raises:
        ConfigError: GPU requested but not usable; NVIDIA hardware present but no usable GPU under `auto`
            (a CPU run there is a broken install or a job step without GPUs, and a multi-node job would
            take the CPU path and fail minutes later); a device id past the visible GPUs.
    """
    if requested == "CPU":
        return DevicePlan(requested, "CPU", "--device_target CPU")
    problem, fix = _unusable(probe)
    if problem and requested == "GPU":
        raise ConfigError(f"--device_target GPU but {problem}; {fix}, or pass --device_target CPU")
    if problem and probe.nvidia_present:
        raise ConfigError(f"--device_target auto on a host with NVIDIA hardware, but {problem}; {fix}, or pass "
                          "--device_target CPU to train on CPU deliberately")
    if problem:
        return DevicePlan(requested, "CPU", "auto: no NVIDIA hardware on this host")
    device_id = gpu_device_id(probe.visible_devices, local_rank)
    if device_id >= probe.visible_devices:
        raise ConfigError(f"local rank {local_rank} would use GPU {device_id} but only {probe.visible_devices} "
                          "GPU(s) are visible to it; give each rank one GPU (srun --gpus-per-task=1) or every rank "
                          "all of the node's GPUs")
    source = "the only GPU visible to this rank" if device_id == 0 and probe.visible_devices == 1 \
        else f"local rank {local_rank} of {probe.visible_devices} visible GPUs"
    why = "--device_target GPU" if requested == "GPU" else "auto: MindSpore's GPU plugin and a visible GPU"
    return DevicePlan(requested, "GPU", f"{why}; device {device_id} = {source}", device_id)


def gpu_preflight(probe: GpuProbe, local_rank: int, env: Mapping[str, str]) -> List[str]:
    """Problems a GPU job would hit on this rank, one line each ([] = none): `msdist.check`'s GPU pre-flight.

    Judged by `plan_device`, the decision training makes: one visible GPU per rank is fine (device 0),
    as are all of the node's GPUs for each rank (device = local rank).

    Args:
        probe: what MindSpore reports about its GPU plugin and devices.
        local_rank: this rank's index on its host.
        env: the environment (for NCCL_SOCKET_IFNAME).
    """
    if not probe.plugin_loaded and not probe.nvidia_present:
        return []  # a CPU host with a CPU build: nothing GPU-related to get wrong
    problems = []
    try:
        plan_device("GPU", local_rank, probe)
    except ConfigError as e:
        problems.append(str(e))
    ifname = env.get("NCCL_SOCKET_IFNAME", "")
    if ifname:
        wanted = [name.lstrip("^=") for name in ifname.split(",") if name.strip()]
        present = {name for _, name in socket.if_nameindex()}
        if not ifname.startswith("^") and not any(p.startswith(w) for w in wanted for p in present):
            problems.append(f"NCCL_SOCKET_IFNAME={ifname} matches no interface here ({', '.join(sorted(present))})")
    return problems


# ---------------------------------------------------------------- one GPU per rank

_DUPLICATE_GPU_FIX = "NCCL stops in init() with \"Duplicate GPU detected\"; give each rank its own GPU"


def gpu_sharing(launcher: str, local_world_size: int, probe: GpuProbe, env: Mapping[str, str]) -> str:
    """Whether the GPU ranks of this host each get their own GPU, as far as the launcher's variables and the
    host's device nodes settle it before MindSpore loads; one line for `msdist.check --plan`.

    A rank that sees exactly one GPU uses it as device 0 (`gpu_device_id`), so from inside one rank
    `CUDA_VISIBLE_DEVICES=0` exported to every rank looks like `srun --gpus-per-task=1`; what tells them
    apart are the GPUs' bus ids, compared at start-up (`shared_gpu`). Settled here: one rank on the
    host; several visible GPUs (device = local rank, distinct); more local ranks than the host's GPUs
    (`mpirun -n 2` on a one-GPU host, an MPIJob with 4 slots and 1 GPU per pod); srun's
    --gpus-per-task (SLURM_GPUS_PER_TASK; Slurm binds each task to its own GPUs with it, --gpu-bind=per_task).

    Args:
        launcher: `LaunchEnv.launcher`.
        probe: `host_probe` (host_devices counts /dev/nvidiaN: a pod's own GPUs in a container).

    Raises:
        ConfigError: more GPU ranks on this host than it has GPUs.
    """
    visible = probe.visible_devices
    if local_world_size <= 1:
        return "own GPU: one rank on this host"
    if visible > 1:
        return f"own GPU: device = local rank, each of the {local_world_size} local ranks a different one of " \
               f"the {visible} visible GPUs"
    mig = any(entry.strip().startswith("MIG-") for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(","))
    if not mig and 0 < probe.host_devices < local_world_size:  # MIG: several instances of one device node
        raise ConfigError(f"{local_world_size} GPU ranks on this host but it has {probe.host_devices} GPU(s), so "
                          f"ranks would share one: {_DUPLICATE_GPU_FIX} (start one rank per GPU: mpirun -n / "
                          "slotsPerWorker / -n = GPUs per node) or pass --device_target CPU")
    if launcher == "srun" and env.get("SLURM_GPUS_PER_TASK"):
        return f"own GPU: srun --gpus-per-task={env['SLURM_GPUS_PER_TASK']} binds each task to its own GPU"
    return ("unverified: each rank sees one GPU, its own under srun --gpus-per-task=1 or a per-rank "
            "CUDA_VISIBLE_DEVICES, a shared one if the same CUDA_VISIBLE_DEVICES reaches every rank; start-up "
            "compares the local ranks' GPU bus ids before init('nccl')")


def shared_gpu(bus_ids: Sequence[str]) -> str:
    """The refusal when two local ranks would use one GPU ("" when none does), from each local rank's GPU
    PCI bus id (`cuda_bus_id`, gathered through `local_exchange`); an unknown id ("") is no evidence."""
    ranks = {}
    for local_rank, bus_id in enumerate(bus_ids):
        if bus_id:
            ranks.setdefault(bus_id.lower(), []).append(local_rank)
    shared = [(bus_id, group) for bus_id, group in ranks.items() if len(group) > 1]
    if not shared:
        return ""
    bus_id, group = shared[0]
    return (f"local ranks {', '.join(map(str, group))} would all use the GPU at bus id {bus_id}: "
            f"{_DUPLICATE_GPU_FIX} (do not export one CUDA_VISIBLE_DEVICES to every rank; srun --gpus-per-task=1, "
            "or let each rank see all of the node's GPUs) or start fewer ranks per node")


def cuda_bus_id(ordinal: int) -> str:
    """PCI bus id of the GPU CUDA numbers `ordinal` in this process (after CUDA_VISIBLE_DEVICES), "" when unknown.

    From the CUDA driver API (cuInit, cuDeviceGet, cuDeviceGetPCIBusId in libcuda.so.1, which MindSpore's GPU
    plugin links too): MindSpore 2.10 reports device names and memory (hal.get_device_properties) but no
    bus id or UUID. cuInit creates no context, so it costs no GPU memory.
    """
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ""
    handle = ctypes.c_int()
    text = ctypes.create_string_buffer(64)
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(handle), ordinal) or \
            cuda.cuDeviceGetPCIBusId(text, len(text), handle):
        return ""
    return text.value.decode(errors="replace")
