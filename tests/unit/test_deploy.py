"""The cluster specs in deploy/: they parse, they are internally consistent, and their commands are the
ones docs/cluster.md documents, with options msdist.train and msdist.launch accept (no drift)."""
import glob
import os
import re
import shlex
import signal
import subprocess
import time

import pytest
import yaml

from conftest import REPO, plan_on, processes_below
from msdist import check, launch
from msdist.cluster import preemption
from msdist.launcher import relay as relay_module
from msdist.run import config, recipe

DEPLOY = os.path.join(REPO, "deploy")
CLUSTER_DOC = os.path.join(REPO, "docs", "cluster.md")
YAML_FILES = sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True))
SBATCH = os.path.join(DEPLOY, "slurm", "train.sbatch")
# A `python -m msdist.X ...` command runs to the end of its line or shell statement.
_COMMAND = re.compile(r"python -m (msdist\.\w+)([^'\n;|&#)]*)")
# What the variables in the commands stand for at run time (a 2-node job, seen from node 1).
SAMPLE_ENV = {"JOB_COMPLETION_INDEX": "1", "RANKS_PER_NODE": "4", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
              "MASTER_ADDR": "node-0", "MASTER_PORT": "29500", "DATA_DIR": "/data/fruits360", "RUN_DIR": "/runs/r50",
              "CONFIG": "configs/resnet50_fruits360_gpu.yaml", "FORWARD": "-x NCCL_DEBUG"}  # the sbatch's GPU modes


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _documents(path):
    return [d for d in yaml.safe_load_all(_read(path)) if d is not None]


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def commands(text):
    """Every `python -m msdist.*` command in a text, shell line continuations joined, whitespace normalized."""
    text = text.replace("\\\n", " ")
    return [" ".join(f"python -m {m.group(1)}{m.group(2)}".split()) for m in _COMMAND.finditer(text)]


def documented_commands():
    """Commands in docs/cluster.md's fenced code blocks (prose mentions like `python -m msdist.launch` are not)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", _read(CLUSTER_DOC), re.M | re.S)
    return [cmd for block in blocks for cmd in commands(block)]


def deploy_commands():
    found = [(os.path.relpath(path, REPO), cmd) for path in YAML_FILES
             for doc in _documents(path) for s in _strings(doc) for cmd in commands(s)]
    return found + [(os.path.relpath(SBATCH, REPO), cmd) for cmd in commands(_read(SBATCH))]


def _container(doc, replica=None):
    spec = doc["spec"]["mpiReplicaSpecs"][replica]["template"] if replica else doc["spec"]["template"]
    (container,) = spec["spec"]["containers"]
    return spec["spec"], container


def _option(cmd, name):
    tokens = shlex.split(cmd)
    return tokens[tokens.index(name) + 1]


def _shm_is_memory(pod_spec, container):
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    return any(path == "/dev/shm" and volumes[name].get("emptyDir", {}).get("medium") == "Memory"
               for name, path in mounts.items())


def _mounted_at(container, path):
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in container["volumeMounts"])


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: os.path.relpath(p, DEPLOY))
def test_every_manifest_parses(path):
    docs = _documents(path)
    assert docs and all("apiVersion" in d and "kind" in d for d in docs)


def test_mpijob_has_launcher_workers_gpus_data_and_shm():
    (job,) = _documents(os.path.join(DEPLOY, "k8s", "mpijob.yaml"))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    replicas = job["spec"]["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"} and replicas["Launcher"]["replicas"] == 1
    _, launcher = _container(job, "Launcher")
    pod, worker = _container(job, "Worker")
    slots, workers = job["spec"]["slotsPerWorker"], replicas["Worker"]["replicas"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == slots  # one rank per GPU
    script = " ".join(launcher["args"])
    assert [int(n) for n in re.findall(r"mpirun -n (\d+) ", script)] == [workers * slots] * 2
    plan, cmd = commands(script)  # the plan first, under the same mpirun
    assert plan.startswith("python -m msdist.check --plan ") and cmd.startswith("python -m msdist.train ")
    assert all(_option(plan, o) == _option(cmd, o) for o in ("--config", "--data_dir", "--output_dir"))
    assert _shm_is_memory(pod, worker)
    assert _mounted_at(worker, _option(cmd, "--data_dir")) and _mounted_at(worker, _option(cmd, "--output_dir"))


def test_mpijob_passes_a_pods_sigterm_on_to_the_ranks_and_restarts_the_launcher_on_the_requeue_status():
    """Kubernetes signals PID 1 only: mpirun would kill its ranks, sshd would not tell them. The relay is PID 1
    of both pods; the ranks take SIGUSR2, which mpirun forwards; exit 200 is retryable under ExitCode."""
    (job,) = _documents(os.path.join(DEPLOY, "k8s", "mpijob.yaml"))
    relay = ["python", "-m", "msdist.launcher.relay", "--preempt_signal", "SIGUSR2", "--"]
    for replica in ("Launcher", "Worker"):
        pod, container = _container(job, replica)
        assert container["command"][:len(relay)] == relay
        assert pod["terminationGracePeriodSeconds"] >= 60
    assert job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["restartPolicy"] == "ExitCode"
    _, cmd = commands(" ".join(_container(job, "Launcher")[1]["args"]))
    assert _option(cmd, "--preempt_signal") == "SIGUSR2" and _option(cmd, "--resume") == "auto"
    assert preemption.REQUEUE_EXIT >= 128 and signal.SIGUSR2 in relay_module.MPIRUN_FORWARDS


def test_launch_job_runs_one_launcher_per_node_indexed_by_pod():
    service, job = _documents(os.path.join(DEPLOY, "k8s", "launch-job.yaml"))
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec = job["spec"]
    pod, container = _container(job)
    plan, cmd = commands(" ".join(container["command"] + container["args"]))
    assert plan.startswith("python -m msdist.launch ") and cmd.startswith("python -m msdist.launch ")
    assert "--plan" in plan.split() and "--plan" not in cmd.split()
    assert all(_option(plan, o) == _option(cmd, o) for o in ("-n", "--nnodes", "--node_rank", "--output_dir"))
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(_option(cmd, "--nnodes"))
    assert _option(cmd, "--node_rank") == "${JOB_COMPLETION_INDEX}"
    assert int(_option(cmd, "-n")) == container["resources"]["limits"]["nvidia.com/gpu"]
    # node 0's stable DNS name: <job>-0.<subdomain>, the subdomain being the headless Service
    assert pod["subdomain"] == service["metadata"]["name"]
    assert _option(cmd, "--master_addr") == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(_option(cmd, "--master_port")) == service["spec"]["ports"][0]["port"]
    assert _shm_is_memory(pod, container)
    assert _mounted_at(container, _option(cmd, "--data_dir")) and _mounted_at(container, _option(cmd, "--output_dir"))
    # Preemption: the launcher is PID 1 (exec) so it gets the pod's SIGTERM; 200 is no failure; resumed on rerun.
    assert "&& exec python -m msdist.launch " in " ".join(container["args"]) and _option(cmd, "--resume") == "auto"
    ignored = [r["onExitCodes"]["values"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    assert ignored == [[preemption.REQUEUE_EXIT]] and pod["terminationGracePeriodSeconds"] >= 60


@pytest.mark.multiprocess
def test_sbatch_is_valid_bash_with_mpirun_and_srun_paths():
    subprocess.run(["bash", "-n", SBATCH], check=True)
    text = _read(SBATCH)
    assert re.search(r"^#SBATCH --nodes=\d+$", text, re.M) and re.search(r"^#SBATCH --ntasks-per-node=\d+$", text, re.M)
    assert re.search(r"^\s*(run_step )?(relayed )?mpirun .*\\\n\s*python -m msdist\.train ", text, re.M)
    assert re.search(r"^\s*(run_step )?srun .*\n\s*bash -c 'python -m msdist\.launch ", text, re.M)


def test_sbatch_expands_no_array_that_bash_before_4_4_calls_unbound():
    """Under `set -u`, bash < 4.4 (RHEL/CentOS 7) stops at "${a[@]}" of an empty array; the sbatch uses none
    (or only the ${a[@]+"${a[@]}"} form, which is safe on every bash)."""
    text = _read(SBATCH)
    assert "set -euo pipefail" in text
    assert not re.search(r'(?<!\+)"\$\{\w+\[[@*]\]\}"', text), "unguarded array expansion under set -u"


_STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
[ "$(basename "$0")" = scontrol ] && printf 'node-0\\nnode-1\\n'
exit 0
"""


def _run_sbatch(tmp_path, **env):
    """Run the sbatch under set -u through stub scontrol/srun/mpirun that record their command lines."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name in ("scontrol", "srun", "mpirun"):
        (stubs / name).write_text(_STUB)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    slurm = {"SLURM_JOB_NODELIST": "node-[0-1]", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2",
             "SLURM_NTASKS": "8", "SLURM_CPUS_PER_TASK": "8"}
    subprocess.run(["bash", SBATCH], cwd=REPO, check=True, capture_output=True, text=True, timeout=60,
                   env={"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log), **slurm, **env})
    return [line for line in log.read_text().splitlines() if not line.startswith("scontrol")]


def test_sbatch_runs_the_plan_first_under_each_launcher(tmp_path):
    gpu = _run_sbatch(tmp_path)
    assert [line.split()[0] for line in gpu] == ["mpirun", "mpirun"]
    assert "python -m msdist.check --plan " in gpu[0] and "python -m msdist.train " in gpu[1]
    assert not any("MS_SCHED" in line for line in gpu)  # MindSpore's OpenMPI path must not see them
    cpu = _run_sbatch(tmp_path, DEVICE="CPU")
    assert all(" -x MS_SCHED_HOST -x MS_SCHED_PORT " in line for line in cpu) and len(cpu) == 2
    srun = _run_sbatch(tmp_path, LAUNCHER="srun")
    assert [line.split()[:2] for line in srun] == [["srun", "--gpus-per-task=1"]] * 2
    assert "msdist.check --plan" in srun[0] and "msdist.train" in srun[1]
    (per_node,) = _run_sbatch(tmp_path, LAUNCHER="msdist")
    assert re.search(r"python -m msdist\.launch .* --plan .* && exec python -m msdist\.launch .* --max_restarts", per_node)
    # GPU modes train the GPU recipe, DEVICE=CPU the CPU one (the srun'd shell of LAUNCHER=msdist expands ${CONFIG})
    assert all("--config configs/resnet50_fruits360_gpu.yaml " in line for line in gpu + srun)
    assert all("--config configs/resnet50_fruits360.yaml " in line for line in cpu)


_STEP_UNTIL_SIGNALLED = """#!/bin/bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$*" in *msdist.train*|*--max_restarts*)
    # The training step: saves on SIGUSR2 (the ranks' --preempt_signal) or SIGTERM and exits with the requeue
    # status. Under the relay it stands for mpirun, which the relay starts with SIGTERM blocked (bash, unlike
    # dash, keeps the mask it inherits, as mpirun does).
    # A repeat (Slurm signals the step, the batch shell passes it on) is the same request, as in srun and msdist.
    trap 'trap "" TERM USR2; echo "step got USR2" >> "$STUB_LOG"; exit 200' USR2
    trap 'trap "" TERM USR2; echo "step got TERM" >> "$STUB_LOG"; exit 200' TERM
    touch "$STUB_LOG.running"
    while :; do sleep 0.1; done;;
esac
exit 0
"""


# How Slurm stops a job, as the batch script sees it: (signals, to whom, whether the script requeues the job).
_SLURM_STOPS = {
    "time_limit": ([signal.SIGUSR2], "shell", True),                      # --signal=B:USR2@120
    "preemption": ([signal.SIGTERM], "job", False),                      # PreemptMode decides the requeue
    "scancel": ([signal.SIGCONT, signal.SIGTERM], "job", False),         # a cancelled job stays cancelled
    "shell_only_sigterm": ([signal.SIGTERM], "shell", False),            # scancel --batch: passed on by the trap
}


@pytest.mark.slow  # bash, the stand-ins and the relay: a dozen process trees (pytest.ini: slow starts processes)
@pytest.mark.parametrize("launcher", ["mpirun", "srun", "msdist"])
@pytest.mark.parametrize("stop", list(_SLURM_STOPS))
def test_sbatch_saves_on_every_slurm_stop_and_requeues_only_after_the_time_limit(tmp_path, launcher, stop):
    """Slurm's --signal=B:USR2@120 reaches the batch shell only: the sbatch traps it, passes it on to the training
    step and requeues the job on its 200. A preemption or scancel sends SIGTERM to every process of the job: the
    step saves (200) and the script does not requeue. Stub mpirun / srun: real processes that exit 200 when
    signalled; the mpirun step runs under the real relay, which blocks SIGTERM in mpirun and passes SIGUSR2 on."""
    text = _read(SBATCH)
    assert "#SBATCH --signal=B:USR2@120" in text and "#SBATCH --requeue" in text
    signals, whom, requeued = _SLURM_STOPS[stop]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, stub in (("scontrol", _STUB), ("srun", _STEP_UNTIL_SIGNALLED), ("mpirun", _STEP_UNTIL_SIGNALLED)):
        (stubs / name).write_text(stub)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.log"
    slurm = {"SLURM_JOB_NODELIST": "node-[0-1]", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2",
             "SLURM_NTASKS": "8", "SLURM_CPUS_PER_TASK": "8", "SLURM_JOB_ID": "1234"}
    batch = subprocess.Popen(["bash", SBATCH], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
                                  "LAUNCHER": launcher, "PYTHONPATH": REPO, **slurm})
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{log}.running") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)   # the step's traps are set right after it marks itself running
    for sig in signals:
        for pid in (processes_below(batch.pid) if whom == "job" else [batch.pid]):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    out, _ = batch.communicate(timeout=30)
    calls = log.read_text()
    assert batch.returncode == 200, out + calls
    assert "step got" in calls, calls
    assert ("scontrol requeue 1234" in calls) == requeued, calls
    assert "--preempt_signal SIGUSR2" in calls
    if launcher == "mpirun":   # SIGTERM never reached mpirun: the relay passed the request on as SIGUSR2
        assert "step got TERM" not in calls and "odls_base_sigkill_timeout" in calls, calls


def test_dockerfile_installs_openmpi_and_msdist_from_paths_that_exist():
    text = _read(os.path.join(DEPLOY, "Dockerfile"))
    instructions = [line.split()[0] for line in text.replace("\\\n", " ").splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "ARG" and "FROM" in instructions[:2]
    assert "openmpi-bin" in text and "openssh-server" in text
    assert re.search(r'pip install "?\.\[', text)
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert os.path.exists(os.path.join(REPO, src)), f"Dockerfile copies {src}, which the repository lacks"


def test_deploy_has_commands_for_every_engine():
    modules = [(path, cmd.split()[2]) for path, cmd in deploy_commands()]
    assert ("deploy/k8s/mpijob.yaml", "msdist.train") in modules
    assert ("deploy/k8s/launch-job.yaml", "msdist.launch") in modules
    assert {m for p, m in modules if p == "deploy/slurm/train.sbatch"} == {"msdist.check", "msdist.train", "msdist.launch",
                                                                          "msdist.launcher.relay"}


@pytest.mark.parametrize("where, cmd", deploy_commands(), ids=lambda v: v if "/" in v and " " not in v else None)
def test_deploy_commands_are_the_documented_ones(where, cmd):
    assert cmd in documented_commands(), f"{where} runs a command docs/cluster.md does not show:\n{cmd}"


def _expand(cmd):
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in SAMPLE_ENV, f"unknown variable ${name} in: {cmd}; add a sample value to SAMPLE_ENV"
        return SAMPLE_ENV[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, cmd)


@pytest.mark.parametrize("cmd", sorted(set(documented_commands() + [c for _, c in deploy_commands()])))
def test_commands_use_options_msdist_accepts(cmd, monkeypatch):
    monkeypatch.chdir(REPO)  # --config paths are relative to the repository root
    module, *args = shlex.split(_expand(cmd))[2:]
    if module == "msdist.launcher.relay":   # the sbatch's `relayed` wraps mpirun: its own options only
        assert relay_module._parse(args + ["mpirun"])[0] == signal.SIGUSR2  # pylint: disable=protected-access
        return
    if module == "msdist.train":
        cfg = config.parse(args)
    elif module == "msdist.check":
        assert args[0] == "--plan", f"deploy/ runs msdist.check only as --plan: {cmd}"
        cfg = config.parse(args[1:], check.PLAN_OPTIONS)
    else:
        assert module == "msdist.launch", f"unexpected entry point {module}"
        cfg = config.parse(launch.parse_args(args).train_args)
    assert cfg.data_dir and cfg.output_dir != config.parse([]).output_dir  # explicit paths, not defaults


def _training_config(cmd):
    """The training options a spec's command resolves to, as msdist.train, msdist.check --plan or msdist.launch
    parse them (run from the repository root: --config paths are relative to it)."""
    module, *args = shlex.split(_expand(cmd))[2:]
    if module == "msdist.check":
        return config.parse(args[1:], check.PLAN_OPTIONS)
    if module == "msdist.launch":
        return config.parse(launch.parse_args(args).train_args)
    return config.parse(args)


def gpu_script_commands():
    """The commands scripts/run_distribute_train*.sh name for a GPU host (their usage lines)."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "scripts", "run_distribute_train*.sh"))):
        for line in _read(path).splitlines():
            config_path = re.search(r"--config (configs/\S*gpu\S*\.yaml)", line)
            if line.startswith("#") and "GPU" in line and config_path:
                found.append((os.path.relpath(path, REPO), f"python -m msdist.train --config {config_path.group(1)} "
                                                           "--data_dir /data --output_dir /runs/x"))
    return found


def test_every_script_names_the_gpu_recipe_for_a_gpu_host():
    names = {path for path, _ in gpu_script_commands()}
    scripts = glob.glob(os.path.join(REPO, "scripts", "run_distribute_train*.sh"))
    assert names == {os.path.relpath(p, REPO) for p in scripts}


@pytest.mark.parametrize("nodes", [1, 2], ids=["8 GPUs on 1 node", "8 GPUs on 2 nodes"])
def test_every_shipped_gpu_spec_trains_a_recipe_without_warnings(nodes, monkeypatch):
    """sbatch (mpirun, srun, msdist.launch; DEVICE=CPU excepted), both manifests and the scripts' GPU usage lines,
    resolved at 8 GPUs: no BatchNorm starved of images, no fixed loss scale under float16, bfloat16 not refused."""
    monkeypatch.chdir(REPO)
    specs = [spec for spec in deploy_commands() if "msdist.launcher.relay" not in spec[1]] + gpu_script_commands()
    assert {path for path, _ in specs} >= {"deploy/slurm/train.sbatch", "deploy/k8s/mpijob.yaml",
                                            "deploy/k8s/launch-job.yaml", "scripts/run_distribute_train.sh"}
    for where, cmd in specs:
        cfg = _training_config(cmd)
        assert os.path.basename(cfg.config) == "resnet50_fruits360_gpu.yaml", f"{where}: {cmd}"
        assert recipe.review(plan_on(cfg, 8, "GPU")) == [], f"{where} at 8 GPUs on {nodes} node(s): {cmd}"


def test_the_seed_recipe_at_8_gpus_gets_both_warnings(monkeypatch):
    """The seed's config with its loss_scale 1024 (item 8 removed it from the file; --loss_scale restores it)."""
    monkeypatch.chdir(REPO)
    seed = config.parse(["--config", "configs/resnet50_fruits360.yaml", "--loss_scale", "1024"])
    bn, scale = recipe.review(plan_on(seed, 8, "GPU"))
    assert bn.startswith("BatchNorm sees 4 images per rank (batch_size 32 / 8 ranks)") and "--sync_bn true" in bn
    assert "at least 128" in bn
    assert scale.startswith("float16 gradients with the fixed loss scale 1024") and "--loss_scale auto" in scale
    assert recipe.review(plan_on(seed, 1, "GPU")) == [scale]  # one rank: BatchNorm sees the whole batch
    assert recipe.review(plan_on(seed, 8, "CPU")) == [bn]  # float32 on CPU: the scale cannot overflow anything


def _launcher_script(job):
    _, launcher = _container(job, "Launcher")
    return " ".join(launcher["args"]), {e["name"]: e["value"] for e in launcher.get("env", [])}


def test_mpijob_forwards_nccl_ms_and_msdist_variables_to_every_rank(tmp_path):
    """mpirun's ranks start over ssh without the launcher pod's environment: the launcher's script, run by bash
    with a stub mpirun, passes each NCCL_*, MS_*, MSDIST_* and CUDA_CACHE_* variable of its container by name
    (-x NAME)."""
    (job,) = _documents(os.path.join(DEPLOY, "k8s", "mpijob.yaml"))
    script, container_env = _launcher_script(job)
    assert container_env.get("NCCL_DEBUG") == "WARN"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "mpirun").write_text(_STUB)
    (stubs / "mpirun").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log), **container_env,
           "NCCL_SOCKET_IFNAME": "eth0", "MS_NODE_TIMEOUT": "60", "MSDIST_EXAMPLE": "1", "UNRELATED": "x",
           "XNCCL_NOT_THIS": "1"}
    subprocess.run(["bash", "-c", script], check=True, env=env, timeout=60)
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("mpirun -n 8 --bind-to none ") for c in calls)
    for call in calls:
        forwarded = re.findall(r"-x (\S+)", call)
        assert sorted(forwarded) == ["CUDA_CACHE_MAXSIZE", "CUDA_CACHE_PATH", "MSDIST_EXAMPLE", "MS_NODE_TIMEOUT",
                                     "NCCL_DEBUG", "NCCL_SOCKET_IFNAME"], call


# ---------------------------------------------------------------- GPU images (issue 40 item 6)

GPU_IMAGE = "msdist:gpu-cuda11.8"


def _gpu_containers():
    """(file, container) of every container in deploy/k8s that asks for NVIDIA GPUs, or runs beside those that do."""
    for path in YAML_FILES:
        for doc in _documents(path):
            text = yaml.safe_dump(doc)
            if "nvidia.com/gpu" not in text:
                continue
            for match in re.finditer(r"image: (\S+)", text):
                yield os.path.basename(path), match.group(1)


def test_every_gpu_spec_pulls_the_cuda11_image_the_dockerfile_builds_by_name():
    """MindSpore 2.10's GPU plugins link the CUDA 11 runtime and cuDNN 8: the CPU image (msdist:latest) cannot start
    a GPU rank, so every GPU pod pulls the Dockerfile's GPU build, whose base is a CUDA 11.6-11.8 + cuDNN 8 runtime."""
    images = list(_gpu_containers())
    assert {name for name, _ in images} == {"mpijob.yaml", "launch-job.yaml"}
    assert {image for _, image in images} == {GPU_IMAGE}
    dockerfile = _read(os.path.join(DEPLOY, "Dockerfile"))
    build = re.search(r"--build-arg BASE_IMAGE=(\S+) -t (\S+) \.", dockerfile.replace("\\\n#", " "))
    assert build and build.group(2) == GPU_IMAGE, "the Dockerfile names the GPU build's tag"
    assert re.fullmatch(r"nvidia/cuda:11\.[678]\.\d+-cudnn8-runtime-\S+", build.group(1)), build.group(1)
    sbatch = _read(SBATCH)
    assert f"IMAGE={GPU_IMAGE}" in sbatch and "--container-image=$IMAGE" in sbatch


def test_every_gpu_spec_keeps_the_cuda_jit_cache_on_persistent_storage(tmp_path):
    """An H100 compiles MindSpore's kernels at its first start: the cache of that compile lives on the run volume,
    large enough to keep it, in every GPU spec (and mpirun forwards it to the ranks, tested above)."""
    from msdist.run import gpu_kernels
    for path in YAML_FILES:
        text = _read(path)
        if "nvidia.com/gpu" in text:
            assert re.search(r"name: CUDA_CACHE_PATH\n\s+value: /runs/", text), path
            assert re.search(rf'name: CUDA_CACHE_MAXSIZE\n\s+value: "{gpu_kernels.CACHE_MAXSIZE}"', text), path
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    (line,) = [line for line in _run_sbatch(tmp_path, LAUNCHER="srun", IMAGE=GPU_IMAGE, DATA_DIR=data, RUN_DIR=run)
               if "msdist.check" in line]
    assert f"--container-image={GPU_IMAGE} --container-mounts={data},{run}" in line
    sbatch = _read(SBATCH)
    assert "CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$RUN_DIR/cuda_cache}" in sbatch
    assert f"CUDA_CACHE_MAXSIZE=${{CUDA_CACHE_MAXSIZE:-{gpu_kernels.CACHE_MAXSIZE}}}" in sbatch
