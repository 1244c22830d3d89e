"""docs/launchers.md's launch matrix, one test per row: `python -m msdist.check --plan` as a real process under
each launcher's real variables, and its answer.

mpirun, msrun and msdist.launch run for real on this host (for "2 nodes", as node 1 of a 2-node job:
msrun --node_rank 1, msdist.launch --nnodes 2 --node_rank 1; plain mpirun cannot, so its node-1 rank
gets the variables OpenMPI 4.1 gives one, recorded from a real `mpirun` here). Slurm and the Kubeflow MPI
Operator are not installed: their rows get the variables srun / the operator document and set.

This host has no GPU. A GPU node's hardware facts come in through --plan's documented --host_root
option: a directory holding what a node with 4 GPUs shows under /dev and /proc/driver. The GPU plugin is
the one in the installed MindSpore wheel; CUDA_VISIBLE_DEVICES is the launcher's.
"""
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import MPI_ENV, REPO, base_env, fake_gpu_node, mpirun

PLAN_ARGS = ["--config", os.path.join(REPO, "configs", "tiny_test.yaml"), "--data_dir",
             os.path.join(REPO, "tests", "data", "fruits360-mini")]
LIMIT_S = 240
_LINE = re.compile(r"^\[rank (\d+)\] ([a-z ]+): (.*)$")


@pytest.fixture
def gpu_node(tmp_path):
    """/dev and /proc/driver as a node with 4 NVIDIA GPUs and its driver shows them, with CUDA 11 and cuDNN 8."""
    return fake_gpu_node(tmp_path / "gpu-node", 4)


def _clean_env(**extra) -> dict:
    """This test process's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in base_env().items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "MS_", "MSDIST_", "CUDA_VISIBLE")) and k != "RANK_ID"}
    return {**env, **MPI_ENV, **extra}


def plans(text: str) -> dict:
    """{rank: {field: value}} from --plan output."""
    found = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = match.group(3)
    return found


def run_plan(env: dict, *args, launcher=()) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, sys.executable, "-m", "msdist.check", "--plan", *PLAN_ARGS, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)


def one_plan(env: dict, *args) -> dict:
    proc = run_plan(env, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan,) = plans(proc.stdout).values()
    return plan


def refused(env: dict, *args) -> str:
    proc = run_plan(env, *args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not proc.stdout.strip()
    (line,) = proc.stderr.strip().splitlines()
    return line


def assert_gpu(plan: dict, device_id: int, backend: str):
    assert plan["device"].startswith("GPU (")
    assert plan["device id"] == f"{device_id}, set by mindspore.set_device('GPU', {device_id})"
    assert plan["backend"].startswith(backend), plan["backend"]


# ---------------------------------------------------------------- mpirun (OpenMPI 4.1)

@pytest.mark.multiprocess
def test_mpirun_one_node(gpu_node):
    """Rank source OMPI_COMM_WORLD_*; GPU: MindSpore's OpenMPI path (communication/management.py
    `_set_rank_from_mpi` reads the same variables), device = local rank; CPU: msdist's bridge."""
    proc = run_plan(_clean_env(MS_SCHED_HOST="127.0.0.1"), "--host_root", gpu_node, launcher=mpirun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = plans(proc.stdout)
    for rank in (0, 1):
        plan = ranks[rank]
        assert "launcher" in plan, proc.stdout   # each rank's plan is one write: no line of it joins another's
        assert plan["launcher"].startswith("mpirun (mpirun); rank source: OMPI_COMM_WORLD_RANK")
        assert plan["rank"].startswith(f"{rank} of 2, local rank {rank} of 2, node ")
        assert_gpu(plan, rank, "nccl through MindSpore's OpenMPI path")
        assert plan["clears"] == "MS_SCHED_HOST" and plan["sets"] == "nothing"
        assert plan["heartbeat"].endswith(f"logs/rank_{rank}.heartbeat")
    cpu = run_plan(_clean_env(), launcher=mpirun(2))  # this host: no NVIDIA hardware
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    plan = plans(cpu.stdout)[1]
    assert plan["device"] == "CPU (auto: no NVIDIA hardware on this host)" and plan["backend"].startswith(
        "mccl through MindSpore's dynamic cluster; msdist joins")
    assert "MS_ROLE=MS_WORKER MS_NODE_ID=1" in plan["sets"] and "chosen by rank 0" in plan["sets"]


# What OpenMPI 4.1's mpirun gives rank 5 of 8 on the second of two nodes (4 ranks per node).
MPIRUN_NODE_1 = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "8",
                 "OMPI_MCA_ess_base_jobid": "1500184577", "OMPI_MCA_ess_base_vpid": "5",
                 "OMPI_MCA_orte_num_nodes": "2", "OMPI_MCA_orte_ess_num_procs": "8", "PMIX_RANK": "5",
                 "PMIX_NAMESPACE": "1500184577", "PMIX_HOSTNAME": "node-1", "OMPI_COMMAND": "python"}


def test_mpirun_two_nodes(gpu_node):
    plan = one_plan(_clean_env(**MPIRUN_NODE_1, MS_SCHED_HOST="node-0", MS_SCHED_PORT="29500"), "--host_root",
                    gpu_node)
    assert plan["rank"].startswith("5 of 8, local rank 1 of 4, node ") and plan["rank"].endswith("(one of 2)")
    assert_gpu(plan, 1, "nccl through MindSpore's OpenMPI path")
    assert plan["clears"] == "MS_SCHED_HOST MS_SCHED_PORT"  # they would switch init("nccl") to the dynamic cluster
    # CPU across hosts: the bridge's port file is on rank 0's host only, so the scheduler address is required.
    assert "MS_SCHED_HOST" in refused(_clean_env(**MPIRUN_NODE_1))
    cpu = one_plan(_clean_env(**MPIRUN_NODE_1, MS_SCHED_HOST="10.0.0.1", MS_SCHED_PORT="29500"))
    assert "MS_SCHED_HOST=10.0.0.1 MS_SCHED_PORT=29500 MS_WORKER_NUM=8 MS_ROLE=MS_WORKER MS_NODE_ID=5" in cpu["sets"]


# ---------------------------------------------------------------- msrun (MindSpore 2.10)

def _msrun(tmp_path, gpu_node, *msrun_args) -> subprocess.CompletedProcess:
    """Real msrun: its scheduler and workers all run the plan (process_entity/_api.py `_ProcessManager`)."""
    if shutil.which("msrun") is None:
        pytest.skip("msrun (MindSpore's launcher) is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _clean_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    # msrun runs a binary only when it is named python, python3 or pytest: this interpreter comes first on PATH
    return subprocess.run(["msrun", *msrun_args, "--master_port", str(port), "--join", "True", "--log_dir",
                           str(tmp_path / "msrun"), "python3", "-m", "msdist.check", "--plan", *PLAN_ARGS,
                           "--host_root", gpu_node], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=LIMIT_S)


def _worker_logs(tmp_path) -> str:
    return "".join((tmp_path / "msrun" / name).read_text() for name in sorted(os.listdir(tmp_path / "msrun"))
                   if name.startswith("worker_"))


@pytest.mark.multiprocess
def test_msrun_one_node(tmp_path, gpu_node):
    """Rank source MS_NODE_ID (+ DEVICE_ID = local rank, _api.py `_start_single_worker`); the dynamic cluster."""
    proc = _msrun(tmp_path, gpu_node, "--worker_num", "2", "--local_worker_num", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ranks = plans(_worker_logs(tmp_path))
    for rank in (0, 1):
        assert ranks[rank]["launcher"].startswith("msrun (cluster); rank source: MS_NODE_ID")
        assert ranks[rank]["rank"].startswith(f"{rank} of 2, local rank {rank} of 2")
        assert_gpu(ranks[rank], rank, "nccl through MindSpore's dynamic cluster, as msrun set it up")


@pytest.mark.multiprocess
def test_msrun_two_nodes_needs_node_rank(tmp_path, gpu_node):
    """Node 1 of 2 with --node_rank 1: ranks 2 and 3 (_api.py `_get_node_id_and_log_path`). Without it msrun
    exports no MS_NODE_ID (rank ids come only from init()): refused in one line per worker."""
    proc = _msrun(tmp_path / "with", gpu_node, "--worker_num", "4", "--local_worker_num", "2", "--node_rank", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ranks = plans(_worker_logs(tmp_path / "with"))
    assert sorted(ranks) == [2, 3]
    for rank in (2, 3):
        assert ranks[rank]["rank"].startswith(f"{rank} of 4, local rank {rank - 2} of 2")
        assert_gpu(ranks[rank], rank - 2, "nccl through MindSpore's dynamic cluster")
    proc = _msrun(tmp_path / "without", gpu_node, "--worker_num", "4", "--local_worker_num", "2")
    assert proc.returncode != 0
    lines = [line for line in _worker_logs(tmp_path / "without").splitlines() if line.startswith("msdist:")]
    assert len(lines) == 2 and all("msrun across nodes needs --node_rank N" in line for line in lines), lines


# ---------------------------------------------------------------- msdist.launch

def _launch_plans(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "msdist.launch", *args, "--plan", *PLAN_ARGS], cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return plans(proc.stdout)


def test_msdist_launch_one_node(gpu_node):
    """Rank source MS_NODE_ID + MSDIST_LOCAL_RANK (launcher/supervisor.py `worker_env`): the dynamic cluster."""
    ranks = _launch_plans("-n", "2", "--host_root", gpu_node)
    for rank in (0, 1):
        assert ranks[rank]["launcher"].startswith("msdist.launch (cluster)")
        assert_gpu(ranks[rank], rank, "nccl through MindSpore's dynamic cluster, as msdist.launch set it up")


def test_msdist_launch_two_nodes(gpu_node):
    ranks = _launch_plans("-n", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                          "--master_port", "29500", "--host_root", gpu_node)
    assert sorted(ranks) == [2, 3]
    assert ranks[3]["rank"].startswith("3 of 4, local rank 1 of 2") and ranks[3]["rank"].endswith("(one of 2)")
    assert_gpu(ranks[3], 1, "nccl through MindSpore's dynamic cluster")


# ---------------------------------------------------------------- srun (Slurm)

def srun_env(procid: int, ntasks: int, nnodes: int, visible: str) -> dict:
    """What srun gives task `procid` of `srun -N nnodes -n ntasks` (block distribution), with the step's
    CUDA_VISIBLE_DEVICES (Slurm's gres plugin sets it per task for --gpus-per-task, per node otherwise)."""
    per_node = ntasks // nnodes
    node = procid // per_node
    return {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % per_node), "SLURM_NODEID": str(node),
            "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_NNODES": str(nnodes),
            "SLURM_JOB_NUM_NODES": str(nnodes), "SLURM_STEP_NUM_NODES": str(nnodes),
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})", "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nnodes})",
            "SLURM_JOB_NODELIST": f"gpu-[0-{nnodes - 1}]", "SLURM_STEP_NODELIST": f"gpu-[0-{nnodes - 1}]",
            "SLURMD_NODENAME": f"gpu-{node}", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1", "SLURM_SRUN_COMM_HOST": "10.0.0.1",
            "CUDA_VISIBLE_DEVICES": visible, "GPU_DEVICE_ORDINAL": visible}


@pytest.mark.parametrize("nnodes, procid", [(1, 3), (2, 5)], ids=["1 node", "2 nodes"])
def test_srun_one_gpu_per_task(gpu_node, nnodes, procid):
    """srun --gpus-per-task=1: every task sees one GPU, its device 0 (set by mindspore.set_device: 2.10's
    communication init would take the local rank, "SetDevice for id:N"); the bridge on the launch node."""
    plan = one_plan(_clean_env(**srun_env(procid, 4 * nnodes, nnodes, str(procid % 4))), "--host_root", gpu_node)
    assert plan["launcher"].startswith("srun (slurm); rank source: SLURM_PROCID")
    assert plan["rank"].startswith(f"{procid} of {4 * nnodes}, local rank {procid % 4} of 4")
    assert_gpu(plan, 0, "nccl through MindSpore's dynamic cluster; msdist joins")
    assert "the only GPU visible to this rank" in plan["device"]
    assert "MS_SCHED_HOST=10.0.0.1 MS_SCHED_PORT=2" in plan["sets"] and f"MS_NODE_ID={procid}" in plan["sets"]


@pytest.mark.parametrize("nnodes, procid", [(1, 3), (2, 6)], ids=["1 node", "2 nodes"])
def test_srun_all_gpus_per_task(gpu_node, nnodes, procid):
    """srun with --gpus-per-node=4 and no per-task binding: every task sees 0,1,2,3 and takes its local rank."""
    plan = one_plan(_clean_env(**srun_env(procid, 4 * nnodes, nnodes, "0,1,2,3")), "--host_root", gpu_node)
    assert_gpu(plan, procid % 4, "nccl through MindSpore's dynamic cluster; msdist joins")


def test_slurm_step_without_gpus_on_a_gpu_node_is_refused(gpu_node):
    """No silent CPU fallback: a step that got no GPUs (Slurm's NoDevFiles, or an empty list) on a GPU node."""
    for visible in ("NoDevFiles", ""):
        line = refused(_clean_env(**srun_env(1, 2, 1, visible)), "--host_root", gpu_node)
        assert line.startswith("msdist: error: --device_target auto on a host with NVIDIA hardware, but no GPU is "
                               "visible"), line


# ---------------------------------------------------------------- Kubernetes MPIJob (Kubeflow MPI Operator v2beta1)

def mpijob_env(rank: int, workers: int, slots: int = 4) -> dict:
    """A rank on worker pod rank // slots: mpirun's OpenMPI variables, the operator's OMPI_MCA_* (its constants
    OpenMPIEnvHostFileLocation, OpenMPIEnvKeyRSHArgs, OpenMPIEnvKeepFQDNHostNames, OpenMPIEnvDefaultSlots),
    the pod's. The NVIDIA device plugin mounts the pod's GPUs as /dev/nvidia*; CUDA_VISIBLE_DEVICES stays unset."""
    pod = rank // slots
    return {"OMPI_COMM_WORLD_SIZE": str(workers * slots), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % slots), "OMPI_COMM_WORLD_LOCAL_SIZE": str(slots),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank % slots), "OMPI_MCA_orte_num_nodes": str(workers),
            "OMPI_MCA_ess_base_jobid": "2113601537", "PMIX_NAMESPACE": "2113601537", "PMIX_RANK": str(rank),
            "OMPI_COMMAND": "python",
            "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile", "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
            "OMPI_MCA_orte_keep_fqdn_hostnames": "true", "OMPI_MCA_orte_set_default_slots": str(slots),
            "HOSTNAME": f"msdist-resnet50-worker-{pod}", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443", "NVIDIA_VISIBLE_DEVICES": "all"}


@pytest.mark.parametrize("workers, rank", [(1, 3), (2, 5)], ids=["1 node", "2 nodes"])
def test_kubernetes_mpijob(gpu_node, workers, rank):
    plan = one_plan(_clean_env(**mpijob_env(rank, workers)), "--host_root", gpu_node)
    assert plan["rank"].startswith(f"{rank} of {4 * workers}, local rank {rank % 4} of 4")
    assert_gpu(plan, rank % 4, "nccl through MindSpore's OpenMPI path")


# ---------------------------------------------------------------- the plan loads no MindSpore; training refuses alike

def test_plan_loads_no_mindspore(gpu_node):
    code = ("import sys; from msdist import check\n"
            "try:\n    check.main(['--plan', *sys.argv[1:]])\nexcept SystemExit:\n    pass\n"
            "print('mindspore loaded' if 'mindspore' in sys.modules else 'mindspore not loaded')")
    proc = subprocess.run([sys.executable, "-c", code, *PLAN_ARGS, "--host_root", gpu_node], cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.stdout.strip().splitlines()[-1] == "mindspore not loaded", proc.stdout + proc.stderr


def test_training_refuses_what_the_plan_refuses(tmp_path):
    """msdist.train runs the same decisions at start-up: one line, exit 2, before MindSpore loads."""
    no_node_rank = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_SCHED_HOST": "127.0.0.1",
                    "MS_SCHED_PORT": "8118", "RANK_ID": "0", "RANK_SIZE": "4", "DEVICE_ID": "1"}
    proc = subprocess.run([sys.executable, "-m", "msdist.train", *PLAN_ARGS, "--output_dir", str(tmp_path)],
                          cwd=REPO, env=_clean_env(**no_node_rank), capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 2 and "--node_rank" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "logs")  # no heartbeat, no log: nothing of rank 0's was touched
