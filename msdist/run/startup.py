"""One start-up for every entry point: the same steps, in the same order.

1. parse the options (`config.parse`);
2. read how this process was launched, from the environment only;
3. check everything that can be checked without MindSpore: model name, batch and accumulation splits,
   paths; the device (`device.plan_device` from the host's files) and the launch (`job.check_launch`).
   A mistake here is one line and exit status 2 within a second, before MindSpore loads or a
   cluster forms, so `msdist.launch` (which never restarts on exit 2) does not retry a typo;
4. set the process environment MindSpore reads when it loads (`runtime.prepare`);
5. `join()`: distributed init (unbound and without wake-up preemption: `runtime.prepare_to_join`), then
   the rank's core binding (`runtime.bind_to_cores`), MindSpore's thread pool, this rank's log file.

6. training on GPU with `--sink_size auto`: the ranks agree on K and the step line's period from their forecasts
   of one sunk step (`agree_sink_size`, one small gather).

Steps 1-4 are `start()`. Step 5 is separate because training must claim its output folder and start
its heartbeat between them. train, eval and check run all five (so do benchmark workers that join a
job). A process outside any job takes the same steps without a config: `start_standalone` (predict,
export, in-process benchmarks: steps 4-5 for one process); `msdist.data check|bench` and pipeline
benchmarks, which use MindSpore's dataset engine without a context, take step 4 alone from
`runtime.prepare_tool`, below run/ so that the data face imports nothing above data/.
"""
import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

from msdist.base import launch_env
from msdist.base.errors import ConfigError, alike_on_every_rank
from msdist.cluster import job, stall
from msdist.data import pipeline, plan
from msdist.engine import precision
from msdist.rank import device, distributed, local_exchange, runtime
from msdist.run import chunks, config, options, recipe, run_plan

_logger = logging.getLogger(__name__)

Check = Callable[[argparse.Namespace, int], None]  # (config, world size) -> raises a UserError
# (config, world size, device) -> the face's plan (`run_plan.resolve`, `run_plan.resolve_eval`)
Resolver = Callable[[argparse.Namespace, int, device.DevicePlan], Union[run_plan.RunPlan, run_plan.EvalPlan]]


# The runtime options every start-up reads (`start`/`join`), for entry points without training options
# (msdist.check, benchmark workers), so they run exactly as training would.
RUNTIME_OPTIONS = tuple(o for o in config.TRAIN_OPTIONS
                        if o.name in ("device_target", "cpu_isa", "bind_cores", "verbose", "deterministic"))


@dataclass(frozen=True)
class Started:
    """What start-up hands on: no config namespace (the face's plan holds what the face reads)."""
    launch: launch_env.LaunchEnv
    rt: runtime.RuntimeInfo
    device: device.DevicePlan   # decided once, from the host's files; distributed.init verifies a GPU with MindSpore
    deterministic: bool         # --deterministic, which the join gives MindSpore
    stall: stall.StallPolicy    # the --stall_* options: the join's scheduler, the rank's watchdog
    warnings: Tuple[str, ...] = ()  # the recipe review's (`recipe.review`), logged by rank 0 once logging is up
    plan: Union[run_plan.RunPlan, run_plan.EvalPlan, None] = None  # the face's, resolved once here (`resolve`)


def check_model(cfg, world_size: int) -> None:
    from models.registry import unknown_model_message  # MindSpore-free: model code loads on first use
    problem = unknown_model_message(cfg.model)
    if problem:
        raise ConfigError(f"--model: {problem}")


def check_batch_split(cfg, world_size: int) -> None:
    """The global batch cut into the job's slots (the checkpoint resumed, or the launcher's: `options.slots_for`)
    and each slot into --grad_accum_steps micro-batches, which the ranks can share: for a face without a run plan
    (msdist.launch, `msdist.check --plan`); training's start-up resolves the same batch once, in its plan."""
    run_plan.resolve_batch(cfg, world_size, os.environ)


def check_frozen_backbone(cfg, world_size: int) -> None:
    """sync_bn swaps in cross-rank BatchNorm on more than one rank, which has no frozen mode."""
    if cfg.freeze_backbone and cfg.sync_bn and world_size > 1:
        raise ConfigError("--freeze_backbone true and --sync_bn true: a frozen backbone has no batch statistics "
                          "to synchronize; drop --sync_bn")


def check_per_rank_batch(cfg, world_size: int) -> None:
    """Evaluation's share of the global batch (its per-rank batch unless --eval_batch_size)."""
    plan.per_rank_batch(cfg.batch_size, world_size)


def check_data_dir(cfg, world_size: int) -> None:
    pipeline.check_data_dir(cfg.data_dir)


def check_output_dir(cfg, world_size: int) -> None:
    try:
        os.makedirs(cfg.output_dir, exist_ok=True)
        probe = os.path.join(cfg.output_dir, f".write-test-{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"output_dir {cfg.output_dir!r} is not writable ({e.strerror}); "
                          "choose another --output_dir") from None


def check_resume_path(cfg, world_size: int) -> None:
    if cfg.resume not in ("", "auto") and not os.path.isfile(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume!r}: no such checkpoint file; pass an existing .ckpt or 'auto'")


def check_pretrained_path(cfg, world_size: int) -> None:
    if cfg.pretrained and not os.path.isfile(cfg.pretrained):
        raise ConfigError(f"--pretrained {cfg.pretrained!r}: no such file; pass a .ckpt, .safetensors, .pth or .pt")


def check_ckpt(cfg, world_size: int) -> None:
    if not cfg.ckpt:
        raise ConfigError("--ckpt is required: the checkpoint to evaluate")
    if not os.path.isfile(cfg.ckpt):
        raise ConfigError(f"--ckpt {cfg.ckpt!r}: no such checkpoint file")


# What the options alone decide, and what needs this host's files (a launcher on node 0 cannot see node 1's).
OPTION_CHECKS: Tuple[Check, ...] = (check_model, check_batch_split, check_frozen_backbone)
PATH_CHECKS: Tuple[Check, ...] = (check_data_dir, check_output_dir, check_resume_path, check_pretrained_path)
# A face that resolves a run plan (training, `msdist.check --plan`) has its batch split refused by the plan
# (`run_plan.resolve_batch`), resolved once after these: the checkpoint resumed is read once.
PLANNED_CHECKS: Tuple[Check, ...] = tuple(c for c in OPTION_CHECKS if c is not check_batch_split)
TRAIN_CHECKS: Tuple[Check, ...] = PLANNED_CHECKS + PATH_CHECKS
EVAL_CHECKS: Tuple[Check, ...] = (check_ckpt, check_model, check_per_rank_batch, check_data_dir, check_output_dir)


def run_checks(cfg, world_size: int, checks: Sequence[Check] = TRAIN_CHECKS) -> None:
    """Step 3 alone, for a supervisor (msdist.launch) that checks a job's config once before starting ranks."""
    with alike_on_every_rank():
        for check in checks:
            check(cfg, world_size)


def compile_cache_path(cfg, world_size: int, device_target: str, slots: int) -> str:
    """This run's compile-cache folder (train only), keyed by what shapes the compiled train step.

    Args:
        device_target: the resolved device (CPU or GPU), never `auto`: a run directory started on CPU
            and resumed on GPU must not find the CPU graph, nor the amp level `auto` resolved there.
        slots: the job's batch layout (`run_plan.BatchPlan.slots`), which shapes the step as the world size does.
    """
    if not cfg.compile_cache:
        return ""
    # max_steps does not shape the graph: a resume that trains further must find the cache warm.
    graph_options = [o for o in config.TRAIN_OPTIONS if o.name != "max_steps"]
    classes = options.num_classes(cfg.num_classes, pipeline.class_map(cfg.data_dir))
    return runtime.compile_cache_dir(cfg.output_dir, config.config_hash(cfg, graph_options), world_size, classes,
                                     device_target, precision.resolve_amp_level(cfg.amp_level, device_target), slots)


def decide_device(cfg, launch: launch_env.LaunchEnv, probe: device.GpuProbe) -> device.DevicePlan:
    """This rank's device, from the host's GPU facts; the device or the launch known to fail is one line.

    Raises:
        ConfigError: `device.plan_device`, `device.gpu_sharing` or `job.check_launch` refuse.
    """
    chosen = device.plan_device(cfg.device_target, launch.local_rank, probe)
    if chosen.target == "GPU":
        device.gpu_sharing(launch.launcher, launch.local_world_size, probe, os.environ)
    job.check_launch(launch, os.environ, chosen.target)
    return chosen


def start(argv=None, *, options: Sequence[config.Option] = config.TRAIN_OPTIONS, prog: str = "msdist.train",
          checks: Sequence[Check] = TRAIN_CHECKS, resolve: Optional[Resolver] = None) -> Started:
    """Steps 1-4: parse, check without MindSpore, set the runtime environment. MindSpore is not loaded yet.

    Args:
        resolve: the face's options into its plan, once (`run_plan.resolve`, `run_plan.resolve_eval`). A training
            plan is reviewed (a recipe the device cannot run refused, its warnings kept: `recipe.review`) and keys
            the compile cache (`compile_cache_path`).

    A process that msrun started as MindSpore's scheduler (MS_ROLE=MS_SCHED) serves as the scheduler
    here and exits with the job.

    Raises:
        UserError: any mistake `checks` find (reported as one line, exit status 2, by `cli.cli_main`).
    """
    launch = launch_env.detect_launch()
    with alike_on_every_rank():  # the same options and files on every rank: one rank per host reports
        cfg = config.parse(argv, options, prog=prog)
    if launch.kind == "scheduler":  # msrun starts this same command as MindSpore's scheduler too
        log_dir = os.path.join(cfg.output_dir, "logs") if "output_dir" in cfg else ""
        raise SystemExit(distributed.run_scheduler_role(launch, stall.StallPolicy.from_options(vars(cfg)), log_dir))
    run_checks(cfg, launch.world_size, checks)
    chosen = decide_device(cfg, launch, device.host_probe(os.environ))
    with alike_on_every_rank():  # resolved from the same options and files on every rank
        face_plan = resolve(cfg, launch.world_size, chosen) if resolve else None
    run = face_plan if isinstance(face_plan, run_plan.RunPlan) else None
    warnings = tuple(recipe.review(run)) if run else ()
    rt = runtime.prepare(cfg.verbose, cfg.cpu_isa, launch.local_world_size, local_rank=launch.local_rank,
                         rank=launch.rank, bind_cores=cfg.bind_cores,
                         exchange_key=local_exchange.job_key(launch.launcher, launch.job_id, os.environ,
                                                             launch.rank - launch.local_rank),
                         compile_cache=compile_cache_path(cfg, launch.world_size, chosen.target, run.batch.slots)
                         if run else "",
                         device_target=chosen.target)
    return Started(launch, rt, chosen, cfg.deterministic, stall.StallPolicy.from_options(vars(cfg)), warnings,
                   face_plan)


def join(started: Started, log_dir: str, log_name: str = "rank") -> Tuple[distributed.DistInfo,
                                                                        distributed.Collectives]:
    """Step 5: join the job's communication group, size MindSpore's threads, open this rank's log.

    Args:
        log_dir: the rank's log goes to `{log_dir}/{log_name}_{rank}.log`; under mpirun on CPU the
            scheduler's log goes there too.
    """
    from msdist.run.logs import setup_logging
    runtime.prepare_to_join(started.rt)  # bound during the join, a rank can miss its registration (issue #34)
    dist = distributed.init(started.launch, started.device, log_dir, started.deterministic, started.stall)
    runtime.bind_to_cores(started.rt)
    runtime.configure_mindspore(started.rt)
    setup_logging(log_dir, dist.rank, console=dist.is_main, name=log_name)
    for warning in started.warnings:  # the console is rank 0's only: one line per warning for the job
        _logger.warning("warning: %s", warning)
    return dist, distributed.Collectives(dist.world_size)


def agree_sink_size(run: run_plan.RunPlan, collectives) -> run_plan.RunPlan:
    """Step 6, GPU `--sink_size auto`: every rank's forecast of its sunk step gathered once, and the plan with the K
    and the step line's period they all take (`chunks.agreed_size`: a chunk of about 0.5-1 s on the slowest). Chunk
    ends are the job's collectives, so a rank may not decide K from its own GPU alone. Elsewhere `run` as it is."""
    schedule = run.schedule
    if schedule.sunk_step_s is None:
        return run
    step_s = [float(s) for s in collectives.gather([schedule.sunk_step_s])[:, 0]]
    k, log_every = chunks.agreed_size(step_s, schedule.sink_size, schedule.log_every, schedule.save_every_steps)
    if (k, log_every) != (schedule.sink_size, schedule.log_every):
        _logger.info("sink_size auto: %d steps a sunk call (forecast %.1f ms a step on the slowest GPU: chunks of "
                     "~%.2f s); the step line every %d steps", k, 1000 * max(step_s), k * max(step_s), log_every)
    return dataclasses.replace(run, schedule=dataclasses.replace(schedule, sink_size=k, log_every=log_every,
                                                                 sunk_step_s=None))


def start_standalone(device_target: str = "auto", verbose: bool = False, cpu_isa: str = "auto",
                     deterministic: bool = False) -> runtime.RuntimeInfo:
    """Steps 4-5 for one process outside any job (predict, export, in-process benchmarks): the environment
    first, then MindSpore's context (graph mode, device) and thread pool. No log file."""
    rt = runtime.prepare(verbose, cpu_isa, 1, bind_cores=False)
    launch = launch_env.detect_launch({})
    chosen = device.plan_device(device_target, launch.local_rank, device.host_probe(os.environ))
    distributed.init(launch, chosen, log_dir="", deterministic=deterministic)
    runtime.configure_mindspore(rt)
    return rt
