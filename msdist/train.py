"""`python -m msdist.train --config configs/<x>.yaml [--key value ...]`

One entry point for every launch: standalone, `mpirun -n N`, `msdist.launch -n N`, msrun.
This file is wiring, readable top to bottom; each concern lives in its own module.
"""
import logging
import os
import tempfile
import time

from msdist.cluster import announce
from msdist.rank import preempt_stop

if __name__ == "__main__":  # first, before an import starts a thread (numpy's OpenBLAS pool): preempt_stop.Listener
    preempt_stop.hold_candidates()
    announce.this_rank()  # a relay above finds this rank by it, however it was started

from msdist.base.cli import cli_main  # noqa: E402 pylint: disable=wrong-import-position
from msdist.base.errors import ConfigError  # noqa: E402 pylint: disable=wrong-import-position
from msdist.base.files import rank_log_path  # noqa: E402 pylint: disable=wrong-import-position
from msdist.cluster import preemption  # noqa: E402 pylint: disable=wrong-import-position
from msdist.cluster.phases import Phase  # noqa: E402 pylint: disable=wrong-import-position
from msdist.rank import heartbeat_writer, runtime, watchdog  # noqa: E402 pylint: disable=wrong-import-position
from msdist.run import build, flops, run_plan, startup  # noqa: E402 pylint: disable=wrong-import-position
from msdist.run.result import write_result  # noqa: E402 pylint: disable=wrong-import-position

_logger = logging.getLogger("msdist.train")
_PROCESS_START = time.perf_counter()  # for result.json's start-to-first-step figure


@cli_main
def main(argv=None) -> int:
    return runtime.exit_without_teardown(train(startup.start(argv, resolve=run_plan.resolve)))


def _claim_output_dir(path: str, resume: str, overwrite: bool, is_main: bool):
    """Refuse to mix a new run into another run's checkpoints; with `overwrite`, move that run aside.

    Nothing is deleted: the old run's results (ckpt/, config.yaml, result.json, metrics...) move to
    `{path}/replaced-<time>/`, so the new run's checkpoints can neither collide with the old ones nor
    get them pruned. logs/ (files append) and compile_cache/ (keyed by config) stay. Every rank
    decides alike; only the main rank moves files.

    Returns:
        The folder the old run was moved to, or None.
    """
    ckpt_dir = os.path.join(path, "ckpt")
    old = [n for n in os.listdir(ckpt_dir) if not n.startswith(".")] if os.path.isdir(ckpt_dir) else []
    if not old or resume:
        return None
    if not overwrite:
        raise ConfigError(f"output_dir {path!r} holds another run's checkpoints ({len(old)} files in ckpt/); "
                          "pass --resume auto to continue that run, --overwrite true to start a new one (the old "
                          "run is moved aside, not deleted), or choose another --output_dir")
    if not is_main:
        return None
    archive = tempfile.mkdtemp(prefix=f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-", dir=path)
    for name in os.listdir(path):
        if not (name.startswith((".", "replaced-")) or name in ("logs", "compile_cache")):
            os.rename(os.path.join(path, name), os.path.join(archive, name))
    return archive


def train(started: startup.Started) -> int:
    """Start, build, fit, finish: the whole run of one rank. Returns the exit status."""
    run, launch = started.plan, started.launch
    output = run.output
    replaced = _claim_output_dir(output.directory, run.resume.path, output.overwrite, launch.rank == 0)
    log_dir = output.logs
    # Before any other thread starts: they inherit the blocked preemption signal.
    listener = preempt_stop.Listener(run.preempt_signal)
    # Beats from before cluster init, so a rank stuck there is seen too.
    beat = watchdog.watch_this_rank(log_dir, launch, started.stall)
    dist, collectives = startup.join(started, log_dir)
    run = startup.agree_sink_size(run, collectives)
    heartbeat_writer.dump_stacks_on_signal(rank_log_path(log_dir, dist.rank))
    from msdist.rank import distributed  # loads MindSpore
    from msdist.run.trainer import Trainer
    if replaced:
        _logger.warning("overwrite: moved the previous run in %s to %s", output.directory, replaced)
    build.seed_everything(run.seed)
    data = build.load_data(run, dist, collectives, started.rt)
    if dist.is_main:
        run_plan.write_settings(run, os.path.join(output.directory, "config.yaml"))
    beat.enter(Phase.COMPILE)
    model = build.build_model(run, dist, data, started.rt)
    rate = flops.rate_of(model.net, data.train_input.image_size, dist, run.model.amp_level,
                         started.rt.threads_per_rank)
    # Before any resume: result.json's pairing, which rank 0 alone writes.
    initial_weights = distributed.params_checksum(model.net) if dist.is_main else None
    beat.enter(Phase.START_UP)  # resume, and the first collectives wait for the ranks still compiling
    outcome = Trainer(run, dist, collectives, data, model, beat, launch.kind, listener, rate).fit()
    if outcome.preempted:  # complete on every rank: said now, as mpirun and msrun kill the others once one exits
        announce.record(preemption.REQUEUE_EXIT)
    beat.enter(Phase.FINISH)
    if dist.is_main and not outcome.preempted:
        result = {**_result(run, dist, data, model, outcome, initial_weights),
                  **rate.fields(outcome.meter.images_per_sec())}
        _write_result(output, result, outcome.newest)
    distributed.finish(launch, dist, collectives)
    return preemption.REQUEUE_EXIT if outcome.preempted else 0


def _result(run: run_plan.RunPlan, dist, data: "build.Data", model: "build.Model", outcome,
            initial_weights: float) -> dict:
    """result.json: the job's one evaluation and how the run went (`outcome`: trainer.Outcome).

    `pairing` says what two runs must share to be compared seed by seed (benchmarks/accuracy_parity.py): the
    weights they started from and every global batch in order, whatever their world sizes.
    """
    meter = outcome.meter
    first = meter.first_step_s or 0.0
    return {**outcome.metrics, "classes": sorted(data.classes, key=data.classes.get), "world_size": dist.world_size,
            "epochs": run.schedule.epochs, "global_steps": outcome.position.global_step,
            "global_batch": run.batch.global_batch,
            "per_rank_batch": data.per_rank_batch, "train_seconds": round(outcome.train_seconds, 3),
            "images_per_sec": round(meter.images_per_sec(), 3),
            "first_step_seconds": round(first, 3), "compile_seconds": round(model.compile_seconds, 3),
            "start_to_first_step_seconds": round(outcome.train_start - _PROCESS_START + first, 3),
            "model": run.model.name, "device_target": dist.device_target, "skipped_images": len(data.excluded),
            "pairing": {"initial_weights": initial_weights, "sample_order": data.sample_order(run.schedule.epochs)},
            **outcome.ranks}


def _write_result(output: run_plan.OutputPlan, result: dict, newest_checkpoint) -> None:
    files = [("checkpoint", newest_checkpoint.path if newest_checkpoint else ""),
             ("logs", os.path.join(output.logs, "")), ("tensorboard", os.path.join(output.directory, "tb", ""))]
    write_result(os.path.join(output.directory, "result.json"), result, "msdist.train done", files,
                 wall_seconds=time.perf_counter() - _PROCESS_START, images_per_sec=result["images_per_sec"])


if __name__ == "__main__":
    runtime.end_process(main)
