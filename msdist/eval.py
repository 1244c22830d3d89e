"""Exact distributed evaluation, and `python -m msdist.eval --config ... --ckpt PATH`.

Each rank evaluates its own shard of Test/ (every image exactly once over all ranks, no padding
samples, nothing dropped) and the integer counts are summed across ranks, so the job reports one
accuracy over exactly the Test set, whatever the world size.
"""
import json
import logging
import os

import numpy as np

from msdist import config, distributed, runtime
from msdist.errors import ConfigError, cli_main

_logger = logging.getLogger("msdist.eval")

# Checkpoints written by msdist.train also hold optimizer state and gradient-compression residuals,
# which evaluation does not need.
OPTIMIZER_STATE_PREFIXES = ("moments.", "global_step", "residual.", "loss_scale.")


def cross_entropy_sum(logits: np.ndarray, labels: np.ndarray) -> float:
    """Summed softmax cross-entropy on the host, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].sum())


def evaluate(net, dataset, batch_size: int, collectives) -> dict:
    """Accuracy and mean loss over the whole Test set from every rank's shard.

    A short last batch is zero-padded up to `batch_size` so the graph compiles once; the padded
    rows are never counted.
    """
    import mindspore as ms

    net.set_train(False)
    correct = seen = 0
    loss_sum = 0.0
    for images, labels in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True):
        n = len(labels)
        if n < batch_size:
            images = np.concatenate([images, np.zeros((batch_size - n,) + images.shape[1:], images.dtype)])
        logits = net(ms.Tensor(images)).asnumpy()[:n]
        correct += int((logits.argmax(axis=1) == labels).sum())
        seen += n
        loss_sum += cross_entropy_sum(logits, labels)
    net.set_train(True)
    correct, seen, loss_sum = collectives.sum([correct, seen, loss_sum])
    return {"accuracy": correct / seen if seen else 0.0, "num_samples": int(seen), "correct": int(correct),
            "loss": loss_sum / seen if seen else float("nan")}


def evaluate_split(net, split, *, batch_size: int, image_size: int, dist, workers: int, collectives) -> dict:
    """Build this rank's shard of `split` and evaluate `net` on it."""
    from msdist.data import pipeline

    data = pipeline.build_eval_dataset(split, batch_size=batch_size, image_size=image_size,
                                       world_size=dist.world_size, rank=dist.rank, workers=workers)
    return evaluate(net, data, batch_size, collectives)


@cli_main
def main(argv=None) -> int:
    cfg = config.parse(argv, config.EVAL_OPTIONS, prog="msdist.eval")
    if not cfg.ckpt:
        raise ConfigError("--ckpt is required: the checkpoint to evaluate")
    launch = distributed.detect_launch()
    rt = runtime.prepare(cfg.verbose, cfg.cpu_isa, launch.local_world_size, local_rank=launch.local_rank,
                         rank=launch.rank, bind_cores=cfg.bind_cores, device_target=cfg.device_target)
    from msdist import checkpoint, engine, monitor
    from msdist.data import check as data_check
    from msdist.data import pipeline

    pipeline.check_data_dir(cfg.data_dir)
    log_dir = os.path.join(cfg.output_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    dist = distributed.init(launch, cfg.device_target, log_dir, cfg.deterministic)
    runtime.configure_mindspore(rt)
    monitor.setup_logging(log_dir, dist.rank, console=dist.is_main)
    collectives = distributed.Collectives(dist.world_size)
    # The same data check as training: a corrupt Test image is named, never a C++ decoder trace.
    excluded = data_check.shared_exclusions(cfg.data_dir, cfg.bad_images == "skip", dist.is_main, collectives)
    classes = pipeline.class_map(cfg.data_dir)
    test_split = pipeline.list_split(cfg.data_dir, pipeline.TEST_SPLIT, classes, exclude=excluded)
    net = engine.build_network(cfg.model, cfg.num_classes or len(classes), cfg.zero_init_last_bn, cfg.sync_bn,
                               dist.world_size)
    params = checkpoint.load(cfg.ckpt, {p.name: (tuple(p.shape), str(p.dtype)) for p in net.get_parameters()},
                             optional_prefixes=OPTIMIZER_STATE_PREFIXES)["params"]
    import mindspore as ms
    ms.load_param_into_net(net, params, strict_load=True)
    batch = cfg.eval_batch_size or pipeline.per_rank_batch(cfg.batch_size, dist.world_size)
    metrics = evaluate_split(net, test_split, batch_size=batch, image_size=cfg.image_size, dist=dist,
                             workers=cfg.num_workers or rt.threads_per_rank,
                             collectives=collectives)
    if dist.is_main:
        print(f"eval result: {{'accuracy': {metrics['accuracy']:.4f}}}", flush=True)
        with open(os.path.join(cfg.output_dir, "eval_result.json"), "w", encoding="utf-8") as f:
            json.dump({**metrics, "world_size": dist.world_size, "ckpt": cfg.ckpt}, f, indent=2)
    return runtime.exit_without_teardown(0)


if __name__ == "__main__":
    raise SystemExit(main())
