"""Accuracy parity: 1, 2 and 4 data-parallel processes, with and without sync_bn, one global batch.

    python benchmarks/accuracy_parity.py [--data_dir ../shared/data/fruits360-4] [--epochs 2] [--model resnet18]
    python benchmarks/accuracy_parity.py --image_size 32 --epochs 1 --warmup_epochs 0 --lr 0.02 --batch_size 8 \
        --ranks 4 --seeds 1,2,3

Every run trains the same model on the same data for the same number of epochs at the same global
batch; only the process count and sync_bn change. With several seeds it prints the mean and the
spread (min..max) per row. The second command is the task that does not saturate: at global batch 8
and 4 ranks each rank normalizes over 2 images, so per-rank BatchNorm visibly trains a worse model.
Prints a table (accuracy, test loss, wall time) and JSON.
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


def run(ranks: int, sync_bn: bool, seed: int, args, out_root: str) -> dict:
    out = os.path.join(out_root, f"{ranks}p_{'sync' if sync_bn else 'plain'}_seed{seed}")
    cmd = [sys.executable, "-m", "msdist.train", "--config", os.path.join(REPO, "configs", "resnet18_fruits360.yaml"),
           "--data_dir", args.data_dir, "--output_dir", out, "--model", args.model, "--image_size",
           str(args.image_size), "--epochs", str(args.epochs), "--batch_size", str(args.batch_size),
           "--sync_bn", str(sync_bn).lower(), "--log_every", "1000", "--seed", str(seed)]
    for name in ("warmup_epochs", "lr"):  # the config's unless given
        if getattr(args, name) is not None:
            cmd += [f"--{name}", str(getattr(args, name))]
    if ranks > 1:
        cmd = ["mpirun", "-n", str(ranks), "--oversubscribe"] + cmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        result = json.load(f)
    return {"ranks": ranks, "sync_bn": sync_bn, "accuracy": result["accuracy"], "test_loss": result["loss"],
            "wall_seconds": round(wall, 1),
            "images_per_sec": result["images_per_sec"]}


def _summary(runs: list) -> dict:
    """Mean and spread (min, max) of accuracy and test loss over the seeds of one configuration."""
    out = {"ranks": runs[0]["ranks"], "sync_bn": runs[0]["sync_bn"], "seeds": len(runs),
           "wall_seconds": statistics.mean(r["wall_seconds"] for r in runs)}
    for key in ("accuracy", "test_loss"):
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.mean(values), "min": min(values), "max": max(values),
                    "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="global batch")
    parser.add_argument("--ranks", default="2,4", help="process counts compared with 1, e.g. 4")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds; each configuration runs once per seed")
    parser.add_argument("--warmup_epochs", type=int, default=None,
                        help="default: the config's (1); with --epochs 1 pass 0, or the run ends at the peak lr")
    parser.add_argument("--lr", type=float, default=None, help="default: the config's (0.05, for global batch 32)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = [(1, False)] + [(int(n), sync) for n in args.ranks.split(",") for sync in (False, True)]
    print(f"data: {os.path.abspath(args.data_dir)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="msdist-parity-") as root:
        for ranks, sync_bn in configs:  # 1 process: sync_bn would be plain BatchNorm anyway
            runs = [run(ranks, sync_bn, seed, args, root) for seed in seeds]
            rows.append(_summary(runs))
            print(f"done {ranks}p sync_bn={sync_bn}: {[r['accuracy'] for r in runs]}", file=sys.stderr, flush=True)
    base = rows[0]["accuracy"]["mean"]
    print(f"\n{args.model} {args.image_size}x{args.image_size}, {args.epochs} epochs, global batch {args.batch_size}, "
          f"seeds {args.seeds} (mean, min..max)")
    print("| processes | per-rank batch | sync_bn | accuracy | vs 1p (points) | test loss | wall time |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc, loss = r["accuracy"], r["test_loss"]
        print(f"| {r['ranks']} | {args.batch_size // r['ranks']} | {'yes' if r['sync_bn'] else 'no'} | "
              f"{acc['mean']:.4f} ({acc['min']:.4f}..{acc['max']:.4f}) | {100 * (acc['mean'] - base):+.1f} | "
              f"{loss['mean']:.3g} ({loss['min']:.3g}..{loss['max']:.3g}) | {r['wall_seconds']:.0f} s |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
