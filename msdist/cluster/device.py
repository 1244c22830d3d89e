"""Which device a rank trains on, which device id, and the MindSpore call that sets it: MindSpore-free.

Two views feed the same pure functions:

* before MindSpore loads (`host_probe`: `msdist.check --plan`, the start-up of every entry point), the
  host's files: NVIDIA's device nodes and driver (`/dev/nvidia*`, `/proc/driver/nvidia`), the GPU
  plugin inside the installed MindSpore wheel, and `CUDA_VISIBLE_DEVICES`;
* once MindSpore is loaded (`distributed.probe_gpu`), MindSpore's own word: whether its GPU plugin
  loaded and how many devices CUDA shows it. A GPU chosen from the files is confirmed that way
  before anything is compiled.

The device id is set with `mindspore.set_device(target, id)`: in MindSpore 2.10 that is the only
setting communication init keeps (mindspore/device_manager.py, `set_device` ->
DeviceManagerConf.set_device); `set_context(device_id=...)` only writes the old context field, and
init then gives each rank the device of its own local rank, which fails with "SetDevice for id:N"
where each rank sees one GPU.
"""
import importlib.util
import os
import re
import socket
from dataclasses import dataclass
from typing import List, Mapping, Optional

from msdist.base.errors import ConfigError

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


def gpu_plugin_in_wheel() -> str:
    """Path of the GPU plugin the installed MindSpore wheel ships ("" when none), found without importing it."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or spec.origin is None:
        return ""
    plugin_dir = os.path.join(os.path.dirname(spec.origin), "lib", "plugin")
    try:
        names = sorted(n for n in os.listdir(plugin_dir) if n.startswith("libmindspore_gpu.so"))
    except OSError:
        return ""
    return os.path.join(plugin_dir, names[-1]) if names else ""


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
        env: the environment (CUDA_VISIBLE_DEVICES).
        root: where /dev and /proc are (`msdist.check --plan --host_root`); "/" is this host.
    """
    present = nvidia_present(root)
    plugin = gpu_plugin_in_wheel()
    visible = visible_gpu_count(env, host_gpu_count(root)) if present else 0  # no driver: CUDA sees nothing
    return GpuProbe(bool(plugin), visible, present, "" if plugin else "this MindSpore wheel has no GPU plugin")


def gpu_load_error(load_plugin_error: str) -> str:
    """The GPU line of MindSpore's plugin-load report (it lists Ascend's failures too)."""
    lines = [line.strip() for line in load_plugin_error.splitlines() if "gpu" in line.lower()]
    return lines[0] if lines else ""


def gpu_device_id(visible_devices: int, local_rank: int) -> int:
    """The device index this rank uses: 0 when its launcher left it exactly one visible GPU (srun
    --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES, a one-GPU pod), else its local rank."""
    return 0 if visible_devices == 1 else local_rank


def _unusable(probe: GpuProbe) -> str:
    """Why this probe rules the GPU out ("" when a GPU is usable)."""
    if not probe.plugin_loaded:
        return f"MindSpore's GPU plugin did not load: {probe.load_error or 'this MindSpore build has no GPU plugin'}"
    if probe.visible_devices == 0:
        return "no GPU is visible to this process (an empty or invalid CUDA_VISIBLE_DEVICES, or a job step " \
               "without GPUs)"
    return ""


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
    problem = _unusable(probe)
    if problem and requested == "GPU":
        raise ConfigError(f"--device_target GPU but {problem}; fix the GPU set-up or pass --device_target CPU")
    if problem and probe.nvidia_present:
        raise ConfigError(f"--device_target auto on a host with NVIDIA hardware, but {problem}; give this process "
                          "its GPUs (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1) or pass --device_target CPU to "
                          "train on CPU deliberately")
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
