"""A/B of the compiled train step on this CPU: `python benchmarks/step_ab.py masked|jit_level [--rounds N]`.

- `masked` (issue 40 item 2): today's `--loss_scale dynamic` step, whose skipped update is masked on the device
  (engine/momentum.py), against the tree before that change (`git archive` of the commit before
  msdist/engine/momentum.py was added, or `--against REF`), whose step branched on the overflow flag (`if not
  overflow:`, a condition read back to the host).
- `jit_level` (item 4): the same step compiled at `--jit_level O0` (kernel by kernel) and `O1` (MindSpore 2.10's
  automatic kernel fusion), this tree.

Each measurement is its own process (a fresh MindSpore, one compile), the two variants alternate for `--rounds`
rounds, so a load change on the shared host hits both alike. A process builds ResNet-18 (the engine alone: no
data pipeline, random batches made once), SGD momentum 0.9 with weight decay, a dynamic loss scale, and times
`--steps` steps after 3 warm-up steps, waiting for the device once at the end. Two shapes: 32 px x 2 images,
where the update's share of the step is largest, and 32 px x 32 images. It prints ms per step (median over the
rounds) per variant and shape, and B/A - 1.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ((32, 2), (32, 32))   # (image size, batch)


def _worker(args) -> None:
    sys.path.insert(0, args.tree)
    import numpy as np
    import mindspore as ms
    from msdist.engine import loss_scale, optim, precision, step

    from mindspore import device_context
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    device_context.cpu.op_tuning.threads_num(os.cpu_count())   # its default (30) oversubscribes a small host
    ms.set_seed(1)
    net = step.build_network("resnet18", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(args.steps + 3, 0.001, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("dynamic", "O0", "float16", "none"), 1)
    extra = {"jit_level": args.jit_level} if args.jit_level else {}
    train = step.TrainStep(net, step.create_loss(False), optimizer, scaler, **extra)
    rng = np.random.default_rng(0)
    images = ms.Tensor(rng.random((args.batch, 3, args.size, args.size), dtype=np.float32))
    labels = ms.Tensor(rng.integers(0, 4, args.batch).astype(np.int32))
    for _ in range(3):
        train.train_on(images, labels)
    train.losses.read()
    start = time.perf_counter()
    for _ in range(args.steps):
        train.train_on(images, labels)
    train.losses.read()   # waits for the queued steps
    print(json.dumps({"ms": (time.perf_counter() - start) / args.steps * 1e3}))


def _measure(tree: str, size: int, batch: int, steps: int, jit_level: str = "") -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--size", str(size), "--batch",
           str(batch), "--steps", str(steps)] + (["--jit_level", jit_level] if jit_level else [])
    env = dict(os.environ, PYTHONPATH=tree, GLOG_v="3")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"]


def _tree_before_masking(ref: str, into: str) -> str:
    """`ref` (default: the parent of the commit that added engine/momentum.py) extracted into `into`."""
    if not ref:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "msdist/engine/momentum.py"],
                               cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
        ref = f"{added[-1]}^" if added else "HEAD"
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparison", nargs="?", choices=("masked", "jit_level"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--against", default="", help="masked: the git ref of the branching step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=REPO, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--jit_level", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    if args.comparison is None:
        parser.error("name a comparison: masked or jit_level")
    with tempfile.TemporaryDirectory() as before:
        if args.comparison == "masked":
            ref = _tree_before_masking(args.against, before)
            variants = {f"branch ({ref})": (before, ""), "masked (this tree)": (REPO, "")}
        else:
            variants = {"O0": (REPO, "O0"), "O1": (REPO, "O1")}
        print(f"{args.comparison}: {args.rounds} rounds x {args.steps} steps, ResNet-18, dynamic loss scale, CPU "
              f"({os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start)")
        for size, batch in SHAPES:
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, (tree, level) in variants.items():
                    times[name].append(_measure(tree, size, batch, args.steps, level))
            (name_a, a), (name_b, b) = ((name, statistics.median(t)) for name, t in times.items())
            print(f"  {size} px x {batch}: {name_a} {a:.2f} ms/step | {name_b} {b:.2f} ms/step | "
                  f"{name_b} / {name_a} - 1 = {b / a - 1:+.1%}  (rounds: "
                  + "; ".join(f"{n} " + ", ".join(f"{x:.1f}" for x in t) for n, t in times.items()) + ")")


if __name__ == "__main__":
    main()
