"""N ranks vs 1 card where users train, next to the noise floor: `python benchmarks/equivalence.py`.

For ResNet-50 (default 64 px) on two subsets of Fruits-360, the plain photos and the same photos
with per-pixel noise (tie-free, PNG), it prints after one step (global batch 16, lr 0.005, no
augmentation):

  gap     max over tensors of max|a-b|/max|a|, 1 card vs N ranks with --sync_bn true (parameters and
          gradient moments, every rank);
  floor   the same measure between two single-card runs of the same step, MindSpore's fused
          BatchNorm vs msdist's BatchNorm (benchmarks/control.py), in this process;
  flips   ReLU decisions that differ between those two single-card forward passes (same weights,
          same batch), out of all ReLU inputs, and how many inputs sit within 1e-6 of 0 relative to
          their layer's scale.

Claim: gap <= 2 x floor. Per-step equality is ill-posed where the floor itself is large
(docs/equivalence.md). The last line is the JSON of everything.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from msdist.engine.optim import MOMENTS_PREFIX  # noqa: E402  (after the path insert)
from msdist.run.checkpoint_model import is_training_state  # noqa: E402
DATA_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
GLOBAL_BATCH, LR, SEED = 16, 0.005, 1


def _compared(name: str) -> bool:
    """Parameters and gradient moments (what control.py keeps); not the step count or loss scale."""
    return name.startswith(MOMENTS_PREFIX) or not (is_training_state(name) or name.startswith("msdist_state."))


def _gap(a: dict, b: dict) -> float:
    return max(np.abs(a[n] - b[n]).max() / max(np.abs(a[n]).max(), np.finfo(np.float32).tiny) for n in a)


def _train(data_dir, out, model, size, ranks) -> list:
    """One step of msdist.train; the state (parameters, moments) of every rank's checkpoint."""
    import mindspore as ms
    cmd = (["mpirun", "-n", str(ranks), "--oversubscribe"] if ranks > 1 else []) + [
        sys.executable, "-m", "msdist.train", "--model", model, "--image_size", str(size), "--data_dir", data_dir,
        "--output_dir", out, "--epochs", "1", "--max_steps", "1", "--batch_size", str(GLOBAL_BATCH), "--lr", str(LR),
        "--lr_schedule", "constant", "--warmup_epochs", "0", "--augment", "false", "--shuffle", "true",
        "--deterministic", "true", "--seed", str(SEED), "--sync_bn", "true"]
    env = dict(os.environ, **MPI_ENV, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    states = []
    for rank in range(ranks):
        raw = ms.load_checkpoint(glob.glob(os.path.join(out, "ckpt", f"*_rank{rank}-*.ckpt"))[0])
        states.append({n: v.asnumpy().astype(np.float64) for n, v in raw.items()
                       if hasattr(v, "asnumpy") and _compared(n)})
    return states


def relu_flips(data_dir: str, model: str, size: int) -> dict:
    """ReLU decisions of the first forward pass that differ between the two single-card BatchNorms."""
    import mindspore as ms
    from mindspore import nn, ops

    from msdist.engine import step
    from msdist.data import pipeline
    from msdist.engine.sync_bn import replace_batchnorm

    class Recorder(nn.Cell):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def construct(self, x):
            self.seen.append(x.asnumpy())
            return ops.relu(x)

    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, pipeline.class_map(data_dir))
    spec = pipeline.TrainInput(image_size=size, global_batch=GLOBAL_BATCH, seed=SEED, shuffle=True, augment=False,
                               padding=0, workers=1)
    images = next(pipeline.build_train_dataset(split, spec, epoch=0).create_tuple_iterator(num_epochs=1))[0]
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the recorder runs Python per call
    inputs = []
    for msdist_bn in (False, True):
        ms.set_seed(SEED)
        net = step.build_network(model, len(pipeline.class_map(data_dir)), False, False, 1)
        if msdist_bn:
            replace_batchnorm(net, world_size=1)
        seen = []
        for _, cell in net.cells_and_names():
            for name, child in list(cell.name_cells().items()):
                if isinstance(child, nn.ReLU):
                    cell._cells[name] = Recorder(seen)  # pylint: disable=protected-access
                    if hasattr(cell, "cell_list"):
                        cell.cell_list = list(cell._cells.values())  # pylint: disable=protected-access
        net.set_train(True)
        net(images)
        inputs.append(seen)
    ms.set_context(mode=ms.GRAPH_MODE)
    flips = sum(int(((a > 0) != (b > 0)).sum()) for a, b in zip(*inputs))
    near = sum(int((np.abs(a) <= 1e-6 * np.abs(a).max()).sum()) for a in inputs[0])
    exact_zero = sum(int((a == 0).sum()) for a in inputs[0])
    return {"relu_inputs": sum(a.size for a in inputs[0]), "flips": flips, "within_1e-6_of_0": near,
            "exactly_0": exact_zero}


def measure(subset: str, model: str, size: int, ranks: int, root: str) -> dict:
    import control  # benchmarks/control.py, beside this file (sys.path[0])
    run = os.path.join(root, f"{os.path.basename(subset)}_{model}{size}")
    single = _train(subset, f"{run}_1p", model, size, 1)[0]
    gaps = [_gap(single, s) for s in _train(subset, f"{run}_{ranks}p", model, size, ranks)]
    states = control.single_card_states(subset, model, size, GLOBAL_BATCH, (1,), lr=LR, seed=SEED)
    floor = _gap(states["mindspore"][0], states["msdist"][0])
    return {"gap": max(gaps), "floor": floor, "gap_over_floor": max(gaps) / floor,
            "in_process_vs_1p": _gap(single, states["mindspore"][0]), **relu_flips(subset, model, size)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=DATA_DIR, help="ImageFolder tree (Training/, Test/) to subset")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", default="64", help="comma-separated image sizes, e.g. 64,96")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--subsets", default="plain,noise", help="plain (the photos) and/or noise (tie-free copies)")
    parser.add_argument("--per_class", type=int, default=0, help="training images per class (0 = one global "
                        "batch of 16 over the classes)")
    args = parser.parse_args()
    if not os.path.isdir(args.data_dir):
        parser.error(f"--data_dir {args.data_dir} not found; pass an ImageFolder tree")
    classes = sorted(os.listdir(os.path.join(args.data_dir, "Training")))
    per_class = args.per_class or GLOBAL_BATCH // len(classes)
    print(f"data: {args.data_dir} ({len(classes)} classes, {per_class} training images each), {args.model}, "
          f"{args.ranks} ranks vs 1 card, one step", flush=True)
    from msdist.data import synth
    from msdist.run import startup
    # This process compares checkpoints and trains the single-card floor: one standalone process, as deterministic
    # as the runs it is compared with.
    startup.start_standalone("CPU", deterministic=True)
    root = tempfile.mkdtemp(prefix="msdist-equivalence-")
    rows = {}
    for name, noise in (("plain", 0), ("noise", 8)):
        if name not in args.subsets.split(","):
            continue
        subset = os.path.join(root, name)
        synth.tie_free_copy(args.data_dir, subset, per_class={"Training": per_class, "Test": 1}, noise=noise)
        for size in map(int, args.sizes.split(",")):
            row = rows[f"{name} {size}px"] = measure(subset, args.model, size, args.ranks, root)
            print(f"{name:<6}{size:>4}px  gap {row['gap']:.2e}  floor {row['floor']:.2e}  gap/floor "
                  f"{row['gap_over_floor']:.2f} ({'<= 2: holds' if row['gap_over_floor'] <= 2 else '> 2: FAILS'}) | "
                  f"ReLU flips {row['flips']} of {row['relu_inputs']}, {row['within_1e-6_of_0']} within 1e-6 of 0, "
                  f"{row['exactly_0']} exactly 0", flush=True)
    print(json.dumps({"data_dir": args.data_dir, "model": args.model, "ranks": args.ranks, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
