"""Host work per training step, outside the compiled graph: `python benchmarks/host_work.py [--steps N]`.

A GPU step of ResNet-50 at 100 px lasts a few milliseconds, so what the host does per step (take the
batch, launch the graph, keep the loss, beat the heartbeat, log) must stay well under it, or the GPU
waits for Python. This times each of those with msdist's own objects on this host, with a graph of
negligible compute (ResNet-18 at 32 px, 2 images per step), so what it measures is the host's work:

- batch fetch: `next()` on the real input pipeline (fruits360-4, 32 px, augmented, 1 worker) as the train
  loop takes it, through `feed.HostFeed` (DatasetHelper without sink, then `prefetch.one_ahead`): the
  pipeline's own `next()` runs in a helper thread during
  the previous step (here a 30 ms sleep standing for the device step, outside the timing, and the CPU step),
  so what is timed is collecting it and asking for the next one;
- dispatch: one launch of a compiled graph that takes the batch and does no work (the launch floor of
  the step; the step's own ~400 kernel launches run inside MindSpore's runtime, see docs/gpu.md#one-step-on-a-gpu-node), plus
  the real train step's pre-run compile check (`TrainStep.compile`, which walks every sub-cell unless the
  batch shape repeats), which the empty graph does not have;
- loss bookkeeping: none left per step (the step's own graph adds its loss to a device total); listed at 0;
- heartbeat: `Heartbeat.step_done` and `enter`;
- logging: `Progress.step` and the meter at a step that prints nothing, plus the log step's blocking loss
  read and `loss_scale.check_finite` (weights included, the unchecked float32 path) divided by log_every.

It prints microseconds per step for each (median over the steps), the launch floor again when launches
follow each other with no pause (MindSpore's runtime threads still awake), the sum, and the sum as a share of a
published A100 ResNet-50 step (NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, 1x A100 80GB, mixed
precision: 2470 img/s at 224 px), scaled to 100 px by the pixel count. Also the whole ResNet-18 32 px
step as run on this CPU, for scale. Target: host work <= 5% of the A100 step.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DATA_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
IMAGE_SIZE, BATCH, LOG_EVERY = 32, 2, 10
A100_IMG_S_224, PIXEL_SCALE = 2470.0, (224 / 100) ** 2   # published figure; FLOPs scale with pixels
TARGET_SHARE = 0.05


def a100_step_ms(per_gpu_batch: int) -> float:
    """A ResNet-50 step at 100 px on one A100 (mixed precision), from the published 224 px rate."""
    return per_gpu_batch / (A100_IMG_S_224 * PIXEL_SCALE) * 1e3


def _median_us(samples) -> float:
    return statistics.median(samples) * 1e6


def measure(steps: int, data_dir: str) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    from msdist.cluster.stall import StallPolicy
    from msdist.data import pipeline
    from msdist.engine import loss_scale, optim, precision, step
    from msdist.rank import heartbeat_writer
    from msdist.run.feed import HostFeed
    from msdist.run.meter import Meter
    from msdist.run.position import Position
    from msdist.run.progress import Progress

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    classes = pipeline.class_map(data_dir)
    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, classes)
    spec = pipeline.TrainInput(image_size=IMAGE_SIZE, global_batch=BATCH, seed=1, shuffle=True, augment=True, padding=4,
                               workers=1)
    batches = HostFeed(pipeline.build_train_dataset(split, spec, epoch=0))   # the train loop's feed on CPU
    net = step.build_network("resnet18", len(classes), False, False, 1)
    # A small rate: 2 images per BatchNorm batch make larger ones diverge now and then, and the check stops that.
    lrs = np.full(steps + 2, 0.001, np.float32)  # the two warm-up steps too
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("auto", "O0", "float16", "none"), 1)
    train = step.TrainStep(net, step.create_loss(False), optimizer, scaler)

    class NoWork(nn.Cell):
        def construct(self, images, labels):
            return ops.depend(labels, images)

    launch = NoWork()
    beat = heartbeat_writer.Heartbeat(tempfile.mkdtemp(prefix="host_work_"), 0, StallPolicy.from_options({}))
    meter = Meter(images_per_step=BATCH)
    progress = Progress(1, steps + 1, LOG_EVERY, meter)
    progress.start_epoch(Position())
    times = {k: [] for k in ("fetch", "dispatch", "loss", "heartbeat", "logging", "log_read", "log_weights",
                             "step_cpu", "warm_launch")}
    images, labels = batches.next_batch()
    train.train_on(images, labels)  # compile
    launch(images, labels)
    train.train_on(images, labels)
    loss_scale.check_finite(scaler, train.finite_weights, train.losses.read(), 0)  # compiles the weights check
    at = Position()
    for i in range(steps):
        time.sleep(0.03)  # the pipeline has the next batch ready, as when a GPU step is longer than decoding
        # The empty launch comes first, on the last batch: in the train loop the launch that follows taking a batch
        # is the step's own, whose graph run (GIL released) is when the helper fetches the next batch.
        t0 = time.perf_counter()
        launch(images, labels)
        train.compile(images, labels)  # the check Cell.__call__ runs before the real step's graph
        t1 = time.perf_counter()
        images, labels = batches.next_batch()
        t2 = time.perf_counter()
        loss = train.train_on(images, labels)
        float(loss.asnumpy())  # wait: the step on this CPU, for scale only
        t3 = t4 = time.perf_counter()
        beat.step_done(1, i + 1, i + 1)
        beat.enter("data wait")
        t5 = time.perf_counter()
        at = at.advanced(steps + 1)
        meter.data_ready()
        meter.step_done()
        progress.step(at, None, 0.001, 0.0, 0.0)
        t6 = time.perf_counter()
        times["dispatch"].append(t1 - t0)
        times["fetch"].append(t2 - t1)
        times["step_cpu"].append(t3 - t2)
        times["loss"].append(t4 - t3)
        times["heartbeat"].append(t5 - t4)
        times["logging"].append(t6 - t5)
        if (i + 1) % LOG_EVERY == 0:
            t7 = time.perf_counter()
            mean = train.losses.read()
            t8 = time.perf_counter()
            loss_scale.check_finite(scaler, train.finite_weights, mean, i + 1)
            times["log_read"].append(t8 - t7)
            times["log_weights"].append(time.perf_counter() - t8)
    for _ in range(steps):
        t0 = time.perf_counter()
        launch(images, labels)
        times["warm_launch"].append(time.perf_counter() - t0)
    result = {k: _median_us(v) for k, v in times.items()}
    result["logging"] += result.pop("log_read") / LOG_EVERY
    # The weights check is device work (one pass over the weights; on a GPU ~0.1 ms for ResNet-50), here on the CPU.
    result["log_weights"] /= LOG_EVERY
    result["host_total"] = sum(result[k] for k in ("fetch", "dispatch", "loss", "heartbeat", "logging"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data_dir", default=DATA_DIR, help="an ImageFolder tree (default: ../shared/data/fruits360-4)")
    args = parser.parse_args()
    from msdist.rank import runtime
    rt = runtime.prepare()  # as msdist.train: ISA, threads, before MindSpore loads
    runtime.configure_mindspore(rt)
    r = measure(args.steps, args.data_dir)
    print(f"host work per step, ResNet-18 {IMAGE_SIZE} px, batch {BATCH}, {args.steps} steps (median us); "
          f"load average {os.getloadavg()[0]:.1f}")
    for key in ("fetch", "dispatch", "loss", "heartbeat", "logging"):
        print(f"  {key:<10} {r[key]:8.1f} us")
    print(f"  {'total':<10} {r['host_total']:8.1f} us   (the whole step on this CPU: {r['step_cpu'] / 1e3:.1f} ms)")
    print(f"  the log step's weights check (device work, per step): {r['log_weights']:.1f} us")
    print(f"  the launch floor back to back, no pause between launches: {r['warm_launch']:.1f} us")
    for batch in (32, 128):
        share = r["host_total"] / (a100_step_ms(batch) * 1e3)
        print(f"  vs an A100 ResNet-50 100 px step of batch {batch} ({a100_step_ms(batch):.2f} ms): {share:.1%} "
              f"(target <= {TARGET_SHARE:.0%}: {'met' if share <= TARGET_SHARE else 'NOT met'})")


if __name__ == "__main__":
    main()
