"""msdist.rank.device: the device, device id and MindSpore call of every rank, without a GPU.

The decisions are pure functions (probe in, plan out), so the GPU cases run here on invented probes."""
import multiprocessing
import os

import pytest

from msdist.base.errors import ConfigError
from msdist.rank import device
from msdist.rank.device import GpuProbe


NO_GPU = GpuProbe(plugin_loaded=False, visible_devices=0, nvidia_present=False)
GPU_PLUGIN_ERROR = "Load dynamic library: libmindspore_gpu.so.11.6 failed. libcudnn.so.8: cannot open shared object file"


def test_one_visible_gpu_per_rank_is_device_0_set_by_set_device():
    """srun --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: every rank sees one GPU, index 0 (CUDA
    renumbers the visible devices; the plugin's CudaDriver::SetDevice says "SetDevice for id:N ... If the
    environment variable 'CUDA_VISIBLE_DEVICES' is set, the total number of GPU will be the number set").
    Without set_device, communication init would pick local rank 3 for the fourth rank: "SetDevice for id:3"."""
    plan = device.plan_device("auto", 3, GpuProbe(True, 1, True))
    assert (plan.target, plan.device_id, plan.call()) == ("GPU", 0, "mindspore.set_device('GPU', 0)")
    assert "only GPU visible" in plan.why


def test_all_gpus_per_rank_use_the_local_rank():
    """srun with all of the node's GPUs per task, mpirun, msrun, msdist.launch: device = local rank
    (msrun does the same itself: mindspore/parallel/cluster/process_entity/_api.py
    `_ProcessManager._start_single_worker` exports DEVICE_ID=local_rank)."""
    plan = device.plan_device("GPU", 3, GpuProbe(True, 4, True))
    assert (plan.device_id, plan.call()) == (3, "mindspore.set_device('GPU', 3)")
    with pytest.raises(ConfigError, match="local rank 3 would use GPU 3 but only 2 GPU"):
        device.plan_device("GPU", 3, GpuProbe(True, 2, True))


def test_auto_refuses_nvidia_hardware_without_a_visible_gpu():
    """No silent CPU fallback: an empty CUDA_VISIBLE_DEVICES or a Slurm step without GPUs on a GPU host
    (MindSpore's plugin loads - MSContext.is_pkg_support_device("GPU") - but CUDA counts no device)."""
    for probe in (GpuProbe(True, 0, True), GpuProbe(False, 0, True, GPU_PLUGIN_ERROR)):
        with pytest.raises(ConfigError) as e:
            device.plan_device("auto", 0, probe)
        assert "NVIDIA hardware" in str(e.value) and "--device_target CPU" in str(e.value)
        assert "\n" not in str(e.value)
    assert "libcudnn.so.8" in str(e.value)  # MindSpore's own load error (MSContext.load_plugin_error)
    # No NVIDIA hardware at all: CPU, and the reason says so.
    plan = device.plan_device("auto", 0, NO_GPU)
    assert (plan.target, plan.device_id, plan.call()) == ("CPU", None, "mindspore.set_device('CPU')")
    assert "no NVIDIA hardware" in plan.why
    assert device.plan_device("CPU", 0, GpuProbe(True, 2, True)).target == "CPU"  # asked for
    with pytest.raises(ConfigError, match="--device_target GPU but"):
        device.plan_device("GPU", 0, NO_GPU)


def test_visible_gpus_follow_cuda_visible_devices_as_cuda_reads_it():
    """CUDA (and so MindSpore's plugin, whose SetDevice message cites CUDA_VISIBLE_DEVICES) hides every
    device from the first invalid entry on; Slurm writes NoDevFiles for a step without GPUs."""
    count = device.visible_gpu_count
    assert count({}, 8) == 8
    assert count({"CUDA_VISIBLE_DEVICES": ""}, 8) == 0
    assert count({"CUDA_VISIBLE_DEVICES": "-1"}, 8) == 0
    assert count({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 8) == 0
    assert count({"CUDA_VISIBLE_DEVICES": "2"}, 8) == 1
    assert count({"CUDA_VISIBLE_DEVICES": "0,1,-1,3"}, 8) == 2
    assert count({"CUDA_VISIBLE_DEVICES": "GPU-8f6c1a2e-1b3d-4c5e-9f7a-0a1b2c3d4e5f,1"}, 8) == 2


def test_host_probe_reads_dev_and_proc_under_a_root(tmp_path):
    """The files --plan reads instead of MindSpore (which reads the same driver through CUDA): /dev/nvidiaN,
    /proc/driver/nvidia, and the GPU plugin the wheel ships (mindspore/lib/plugin/libmindspore_gpu.so.*)."""
    (tmp_path / "dev").mkdir()
    empty = device.host_probe({"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path))
    assert (empty.nvidia_present, empty.visible_devices) == (False, 0)  # no driver: CUDA sees nothing
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev" / name).touch()
    probe = device.host_probe({}, str(tmp_path))
    assert (probe.nvidia_present, probe.visible_devices) == (True, 2)
    assert device.host_probe({"CUDA_VISIBLE_DEVICES": "1"}, str(tmp_path)).visible_devices == 1
    # the wheel ships GPU plugins, but this root has no CUDA libraries: by MindSpore's rules none loads
    assert not probe.plugin_loaded and "libcudnn.so.8 (cuDNN 8)" in probe.load_error
    assert probe.plugin.startswith("will not load: libmindspore_gpu.so.")


def test_gpu_preflight_judges_the_device_id_training_uses():
    """msdist.check's pre-flight asks plan_device, so it accepts one GPU per rank (device 0 through
    set_device) and refuses a local rank past the visible GPUs."""
    assert device.gpu_preflight(NO_GPU, 1, {}) == []
    [line] = device.gpu_preflight(GpuProbe(False, 0, True, GPU_PLUGIN_ERROR), 1, {})
    assert "libcudnn.so.8" in line
    assert device.gpu_preflight(GpuProbe(True, 1, True), 3, {}) == []  # one GPU per task: device 0
    assert "local rank 3 would use GPU 3 but only 2" in device.gpu_preflight(GpuProbe(True, 2, True), 3, {})[0]
    assert "no GPU is visible" in device.gpu_preflight(GpuProbe(True, 0, True), 0, {})[0]
    [nccl] = device.gpu_preflight(GpuProbe(True, 4, True), 3, {"NCCL_SOCKET_IFNAME": "nosuchif0"})
    assert "NCCL_SOCKET_IFNAME=nosuchif0 matches no interface" in nccl
    assert device.gpu_preflight(GpuProbe(True, 4, True), 3, {"NCCL_SOCKET_IFNAME": "lo"}) == []


# ---------------------------------------------------------------- one GPU per rank (issue 32 item 2)

BUS = ("0000:1b:00.0", "0000:3d:00.0", "0000:89:00.0", "0000:b1:00.0")  # a 4-GPU node's GPUs
SLURM_PER_TASK = {"SLURM_GPUS_PER_TASK": "1"}


@pytest.mark.parametrize("launcher, local_world, probe, env, verdict", [
    # refused before MindSpore loads: more local GPU ranks than the host (a pod: its own) has GPUs
    ("mpirun", 2, GpuProbe(True, 1, True, host_devices=1), {}, "refused"),                 # mpirun -n 2, one GPU
    ("mpirun", 4, GpuProbe(True, 1, True, host_devices=1), {}, "refused"),                 # MPIJob 4 slots, 1 GPU
    # the ranks each see one GPU of a 4-GPU node: exported alike (shared) or per rank (own) look the same here
    ("mpirun", 4, GpuProbe(True, 1, True, host_devices=4), {"CUDA_VISIBLE_DEVICES": "0"}, "unverified"),
    # settled by the launcher's variables
    ("srun", 4, GpuProbe(True, 1, True, host_devices=4), {**SLURM_PER_TASK, "CUDA_VISIBLE_DEVICES": "2"}, "own"),
    ("mpirun", 1, GpuProbe(True, 1, True, host_devices=1), {}, "own"),                     # one-GPU pods
    ("msdist.launch", 4, GpuProbe(True, 4, True, host_devices=4), {}, "own"),              # all GPUs: device = rank
    # MIG: several instances behind one device node; the bus ids decide at start-up
    ("mpirun", 2, GpuProbe(True, 1, True, host_devices=1), {"CUDA_VISIBLE_DEVICES": "MIG-GPU-1/1/0"}, "unverified"),
])
def test_gpu_sharing_before_mindspore_loads(launcher, local_world, probe, env, verdict):
    if verdict == "refused":
        refusal = rf"^{local_world} GPU ranks on this host but it has 1 GPU\(s\), so ranks would share one: NCCL " \
                  r"stops in init\(\) with \"Duplicate GPU detected\""
        with pytest.raises(ConfigError, match=refusal):
            device.gpu_sharing(launcher, local_world, probe, env)
        return
    line = device.gpu_sharing(launcher, local_world, probe, env)
    assert line.startswith("own GPU" if verdict == "own" else "unverified: "), line


@pytest.mark.parametrize("bus_ids, refused_ranks", [
    ([BUS[0]] * 4, "0, 1, 2, 3"),            # CUDA_VISIBLE_DEVICES=0 exported to every rank of a 4-GPU node
    ([BUS[0]] * 2, "0, 1"),                  # mpirun -n 2 on a one-GPU host
    ([BUS[0].upper(), BUS[0]], "0, 1"),      # CUDA prints hex digits in either case
    (list(BUS), ""),                         # srun --gpus-per-task=1 / a per-rank CUDA_VISIBLE_DEVICES: own GPUs
    ([BUS[2]], ""),                          # a one-GPU pod
    (["", ""], ""),                          # bus ids unknown (no libcuda): no evidence, NCCL's own check remains
    ([], ""),                                # the exchange timed out
])
def test_shared_gpu_from_the_local_ranks_bus_ids(bus_ids, refused_ranks):
    problem = device.shared_gpu(bus_ids)
    if not refused_ranks:
        assert problem == ""
        return
    assert problem.startswith(f"local ranks {refused_ranks} would all use the GPU at bus id {BUS[0]}: NCCL stops in "
                              "init() with \"Duplicate GPU detected\""), problem


def test_cuda_bus_id_is_empty_without_a_cuda_driver():
    """This host has no libcuda.so.1: the bus id is unknown, which `shared_gpu` takes as no evidence."""
    assert device.cuda_bus_id(0) == ""


def _refuse_shared_gpu_in_rank(local_rank, bus_id, out):
    from msdist.base import launch_env
    from msdist.rank import distributed
    device.cuda_bus_id = lambda ordinal: bus_id  # what CUDA would answer on a GPU node (none here)
    launch = launch_env.LaunchEnv("mpirun", local_rank, 2, local_rank, 2, f"test-{os.getppid()}", "mpirun")
    try:
        distributed.refuse_shared_gpu(launch, 0)
        out.put((local_rank, ""))
    except ConfigError as e:
        out.put((local_rank, str(e)))


@pytest.mark.parametrize("bus_ids, refused", [((BUS[0], BUS[0]), True), ((BUS[0], BUS[1]), False)],
                         ids=["one GPU exported to both ranks", "one GPU each"])
def test_local_ranks_compare_their_gpus_before_nccl_init(bus_ids, refused):
    """distributed.init's check, in two real processes meeting through the per-host exchange; only the CUDA answer
    (the bus id of device 0) is given, since this host has no GPU."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_refuse_shared_gpu_in_rank, args=(r, bus_ids[r], out)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    verdicts = dict(out.get(timeout=60) for _ in ranks)
    for proc in ranks:
        proc.join(timeout=60)
    assert all(("would all use the GPU" in v) == refused for v in verdicts.values()), verdicts
