"""MindSpore's device calls in a fresh process: `set_device` is the call whose device id communication init
keeps, and msdist's distributed init makes it."""
import subprocess
import sys

import pytest

from conftest import REPO, base_env, fake_gpu_node


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout.strip().splitlines()[-1]


def test_set_device_is_the_only_device_id_communication_init_keeps():
    """mindspore/device_manager.py `set_device`: DeviceManagerConf.set_device(target, id, is_default) enables
    the id that communication init keeps; context.py `set_context(device_id=...)` (deprecated for
    'api mindspore.set_device()' in `_check_context_deprecated`) writes only the old context field."""
    probe = ("import mindspore as ms; from mindspore._c_expression import DeviceManagerConf as C; {call}; "
             "conf = C.get_instance(); print(conf.is_device_enable(), tuple(ms.get_current_device()))")
    assert _run(probe.format(call="ms.set_context(device_target='CPU', device_id=1)")) == "False ('CPU', 0)"
    assert _run(probe.format(call="ms.set_device('CPU', 1)")) == "True ('CPU', 1)"


def test_distributed_init_sets_the_device_through_set_device():
    """msdist.rank.distributed.init calls mindspore.set_device (mindspore/device_manager.py `set_device`)."""
    code = ("from msdist.base import launch_env; from msdist.rank import device, distributed; "
            "distributed.init(launch_env.detect_launch({}), device.DevicePlan('CPU', 'CPU', 'test'), ''); "
            "from mindspore._c_expression import DeviceManagerConf as C; print(C.get_instance().is_device_enable())")
    assert _run(code) == "True"


def _ompi(rank, local_size, **extra):
    return {"OMPI_COMM_WORLD_SIZE": str(local_size), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_COMMAND": "python", "PMIX_RANK": str(rank), "OMPI_MCA_ess_base_jobid": "5", **extra}


def _plan(root, env):
    clean = {k: v for k, v in base_env().items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "MS_", "CUDA_VIS"))}
    return subprocess.run([sys.executable, "-m", "msdist.check", "--plan", "--config", f"{REPO}/configs/tiny_test.yaml",
                           "--data_dir", f"{REPO}/tests/data/fruits360-mini", "--host_root", root], cwd=REPO,
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gpus, env, answer", [
    (1, _ompi(1, 2), "refused"),                                        # mpirun -n 2 on a one-GPU host
    (1, _ompi(3, 4), "refused"),                                        # an MPIJob pod: 4 slots, 1 GPU
    (4, _ompi(2, 4, CUDA_VISIBLE_DEVICES="0"), "unverified: "),          # CUDA_VISIBLE_DEVICES=0 to every rank
    (4, {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "2",
         "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "2"},
     "own GPU: srun --gpus-per-task=1"),                                 # srun --gpus-per-task=1
    (1, {**_ompi(0, 1), "OMPI_COMM_WORLD_SIZE": "2"}, "own GPU: one rank on this host"),  # one-GPU pods, 1 slot each
])
def test_plan_on_gpu_sharing_set_ups(tmp_path, gpus, env, answer):
    proc = _plan(fake_gpu_node(tmp_path / f"node-{gpus}-gpus", gpus), env)
    if answer == "refused":
        assert proc.returncode == 2 and not proc.stdout.strip(), proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "GPU ranks on this host but it has 1 GPU(s)" in line and "Duplicate GPU detected" in line, line
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if "] gpu per rank: " in ln]
    assert line.split("] gpu per rank: ")[1].startswith(answer), line
