"""`python -m msdist.check` (standalone or under mpirun / msdist.launch / msrun / srun): is the environment sane?

Every rank AllGathers its rank id and prints what it received, with device target, backend and
versions: the tutorial's first test, with a verdict. Before that, a GPU pre-flight: MindSpore's
GPU plugin load error if any, the device id each rank would use against the GPUs it sees, host
names that several hosts share, and NCCL_SOCKET_IFNAME.

`python -m msdist.check --plan [training options]` loads no MindSpore and touches no GPU: each rank
prints what msdist will do in this environment (launcher, rank, device and why, device id and the
call that sets it, backend, MS_* variables, this rank's files), or refuses a set-up known to fail
with one line and exit status 2. Run it under the same launcher and with the same options as the
training command.

`python -m msdist.check --gpu_bench --data_dir DIR --output_dir OUT`: the first GPU node's acceptance run
(msdist/gpu_bench.py).
"""
import dataclasses
import os
import platform
import socket
import sys
import tempfile

from msdist.base import launch_env
from msdist.base.cli import cli_main
from msdist.base.errors import UserError, alike_on_every_rank
from msdist.base.files import rank_log_path
from msdist.cluster import heartbeat, job
from msdist.rank import device, distributed, runtime
from msdist.run import checkpoint, config, gpu_kernels, recipe, run_plan, startup


PLAN_FLAG = "--plan"
GPU_BENCH_FLAG = "--gpu_bench"
# --plan takes the training command's options, and where to read the host's GPU facts.
PLAN_OPTIONS = config.TRAIN_OPTIONS + [
    config.Option("host_root", str, "/", "--plan: read NVIDIA's /dev/nvidia* and /proc/driver/nvidia under this root "
                  "(default /, this host); e.g. a copy of a GPU node's /dev listing, to plan for it from elsewhere",
                  hashed=False)]


@cli_main
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if PLAN_FLAG in argv:
        return plan_main([a for a in argv if a != PLAN_FLAG])
    if GPU_BENCH_FLAG in argv:  # a controller of training runs, MindSpore-free until it compares their weights
        from msdist import gpu_bench
        return gpu_bench.main([a for a in argv if a != GPU_BENCH_FLAG])
    # The runtime options training reads too, so check runs exactly as training would.
    started = startup.start(argv, options=startup.RUNTIME_OPTIONS, prog="msdist.check", checks=())
    problems = device.gpu_preflight(distributed.probe_gpu(), started.launch.local_rank, os.environ)
    # The scheduler log (mpirun on CPU) goes to the temp dir: a check must not litter the working directory.
    dist, collectives = startup.join(started, os.path.join(tempfile.gettempdir(), "msdist-check"), log_name="check")
    import mindspore as ms
    import numpy as np

    rt, launch = started.rt, started.launch
    gathered = collectives.gather([float(dist.rank), job.host_name_key(socket.gethostname()),
                                   float(launch.local_world_size)])
    received = gathered[:, 0].astype(int).tolist()
    shared = job.shared_host_names(gathered[:, 1].tolist(), gathered[:, 2].astype(int).tolist())
    if dist.rank in shared:
        problems.append(f"host name {socket.gethostname()!r} is shared by ranks {shared} from more than one host")
    ok = received == list(range(dist.world_size)) and not problems
    print(f"rank {dist.rank}/{dist.world_size}: all_gather(rank) -> {received} [{'ok' if ok else 'MISMATCH'}] | "
          f"device {dist.device_target} | backend {dist.backend or 'none (standalone)'} | launch {launch.kind} | "
          f"mindspore {ms.__version__} | numpy {np.__version__} | python {platform.python_version()} | "
          f"oneDNN ISA {rt.cpu_isa} | threads/rank {rt.threads_per_rank} | "
          f"cores {','.join(map(str, rt.cores)) or 'not bound'}", flush=True)
    for problem in problems:
        print(f"rank {dist.rank}: GPU pre-flight: {problem}", flush=True)
    distributed.finish(launch, dist, collectives)
    return runtime.exit_without_teardown(0 if ok else 1)


def plan_main(argv) -> int:
    """`--plan`: print this rank's plan, MindSpore-free; refuse (UserError, exit 2) what is known to fail."""
    launch = launch_env.detect_launch()
    if launch.kind == "scheduler":  # msrun starts the command once more as its scheduler
        print(f"[scheduler] {launch.launcher}'s scheduler process (MS_ROLE=MS_SCHED): msdist serves as MindSpore's "
              f"scheduler for {launch.world_size} workers; no device, no rank", flush=True)
        return 0
    with alike_on_every_rank():
        cfg = config.parse(argv, PLAN_OPTIONS, prog="msdist.check --plan")
    startup.run_checks(cfg, launch.world_size, startup.PLANNED_CHECKS)
    probe = device.host_probe(os.environ, cfg.host_root)
    chosen = startup.decide_device(cfg, launch, probe)  # what training decides at start-up, refusals included
    run = run_plan.resolve(cfg, launch.world_size, chosen)  # as training resolves it at start-up
    warnings = recipe.review(run)
    lines = [f"{name}: {value}" for name, value in plan_fields(cfg, launch, probe, run)]
    if launch.rank == 0:  # job-wide, so said once, as rank 0 says it at start-up
        lines += [f"warning: {warning}" for warning in warnings]
    # One write for the rank's whole plan, its last newline included (a pipe keeps up to 4 KiB whole): print's own
    # newline would be a write of its own, and under mpirun another rank's lines would land before it.
    print("".join(f"[rank {launch.rank}] {line}\n" for line in lines), end="", flush=True)
    return 0


def plan_fields(cfg, launch: launch_env.LaunchEnv, probe: device.GpuProbe, run: run_plan.RunPlan):
    """(name, value) pairs of one rank's plan, in the order they are printed."""
    chosen = run.device
    target = chosen.target
    nodes = -(-launch.world_size // max(launch.local_world_size, 1))
    sets, clears = job.ms_variables(launch, target, os.environ)
    yield "launcher", f"{launch.launcher or 'none'} ({launch.kind}); rank source: {launch_env.RANK_SOURCES[launch.launcher]}"
    yield "rank", f"{launch.rank} of {launch.world_size}, local rank {launch.local_rank} of " \
                  f"{launch.local_world_size}, node {socket.gethostname()} (one of {nodes})"
    yield "host", f"NVIDIA hardware {'yes' if probe.nvidia_present else 'no'}, {probe.visible_devices} GPU(s) visible " \
                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    if probe.nvidia_present:  # on a host without NVIDIA hardware the plugin's libraries are beside the point
        yield "gpu plugin", probe.plugin
    yield "device", f"{target} ({chosen.why})"
    yield "device id", f"{'-' if chosen.device_id is None else chosen.device_id}, set by {chosen.call()}"
    if target == "GPU":
        yield "gpu per rank", device.gpu_sharing(launch.launcher, launch.local_world_size, probe, os.environ)
        capabilities = gpu_kernels.query_compute_caps() if cfg.host_root == "/" else []
        yield "gpu kernels", gpu_kernels.kernel_advice(capabilities, os.environ,
                                                       os.path.join(cfg.output_dir, "cuda_cache"))
    yield "backend", _backend(launch, target)
    layout = run.batch.layout(launch.world_size, launch.rank)
    yield "input", dataclasses.replace(run.input.spec, layout=layout).describe_images()  # this rank's batch
    yield "sets", " ".join(f"{k}={v}" for k, v in sets.items()) or "nothing"
    yield "clears", " ".join(clears) or "nothing"
    yield from _paths(cfg, launch, run)


def _backend(launch: launch_env.LaunchEnv, target: str) -> str:
    if launch.world_size == 1:
        return "none (one process, no communication)"
    backend = job.backend_for(target)
    if job.should_finalize_mpi(launch, target):
        return f"{backend} through MindSpore's OpenMPI path (init('{backend}'); MPI_Finalize before exit)"
    if job.needs_cluster_bridge(launch, target):
        return f"{backend} through MindSpore's dynamic cluster; msdist joins the ranks, rank 0 starts the scheduler"
    return f"{backend} through MindSpore's dynamic cluster, as {launch.launcher} set it up"


def _paths(cfg, launch: launch_env.LaunchEnv, run: run_plan.RunPlan):
    log_dir = run.output.logs
    yield "output", run.output.directory
    yield "log", rank_log_path(log_dir, launch.rank)
    yield "heartbeat", heartbeat.path_for(log_dir, launch.rank)
    try:
        cache = startup.compile_cache_path(cfg, launch.world_size, run.device.target, run.batch.slots)
    except UserError as e:  # the class count comes from --data_dir unless --num_classes is given
        yield "compile cache", f"unknown here ({e})"
    else:
        yield "compile cache", runtime.compile_cache_rank_dir(cache, launch.rank) if cache else "off"
    yield "checkpoints", os.path.join(run.checkpoints.directory,
                                      checkpoint.file_name(run.checkpoints.prefix, launch.rank, "*", "*"))


if __name__ == "__main__":
    runtime.end_process(main)
