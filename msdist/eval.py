"""`python -m msdist.eval --config ... --ckpt PATH`: exact distributed evaluation of a checkpoint.

The same start-up, data check and evaluation (`run.evaluation`) as training: each rank evaluates its
own shard of Test/ and the integer counts are summed across ranks, so the job reports one accuracy
over exactly the Test set, whatever the world size.
"""
import os
import time

from msdist.base.cli import cli_main
from msdist.base.files import rank_log_path
from msdist.data import pipeline
from msdist.rank import runtime
from msdist.run import build, config, evaluation, options, run_plan, startup
from msdist.run.result import write_result

_PROCESS_START = time.perf_counter()  # for the wall time in the closing summary
_LOG_NAME = "eval_rank"  # its own log file: evaluating a run's checkpoint must not append to that run's training logs


@cli_main
def main(argv=None) -> int:
    started = startup.start(argv, options=config.EVAL_OPTIONS, prog="msdist.eval", checks=startup.EVAL_CHECKS,
                            resolve=run_plan.resolve_eval)
    run = started.plan
    dist, collectives = startup.join(started, run.output.logs, log_name=_LOG_NAME)
    from msdist.engine import step
    from msdist.rank import distributed
    from msdist.run import checkpoint_model

    # The same data check as training: a corrupt Test image is named, never a C++ decoder trace.
    classes, excluded = build.checked_classes(run.data_dir, run.skip_bad_images, dist, collectives)
    test_split = pipeline.list_split(run.data_dir, pipeline.TEST_SPLIT, classes, exclude=excluded)
    num_classes = options.num_classes(run.num_classes, classes)
    trained_as = checkpoint_model.meta_convention(checkpoint_model.stored_meta(run.ckpt))  # padded as it was trained
    net = step.build_network(run.model.name, num_classes, run.model.zero_init_last_bn, run.model.sync_bn,
                             dist.world_size, trained_as)
    checkpoint_model.load_weights(run.ckpt, net)
    metrics = evaluation.evaluate_split(net, test_split, batch_size=run.batch, image_size=run.image_size, dist=dist,
                                        workers=options.workers(run.num_workers, started.rt.threads_per_rank),
                                        collectives=collectives, num_classes=num_classes)
    if dist.is_main:
        result = {**metrics, "classes": sorted(classes, key=classes.get), "world_size": dist.world_size,
                  "ckpt": run.ckpt}
        files = [("checkpoint", run.ckpt), ("log", rank_log_path(run.output.logs, 0, _LOG_NAME))]
        write_result(os.path.join(run.output.directory, "eval_result.json"), result, "msdist.eval done", files,
                     wall_seconds=time.perf_counter() - _PROCESS_START)
    distributed.finish(started.launch, dist, collectives)
    return runtime.exit_without_teardown(0)


if __name__ == "__main__":
    runtime.end_process(main)
