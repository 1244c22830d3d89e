"""Accuracy parity: 1, 2 and 4 data-parallel processes, with and without sync_bn, one global batch.

    python benchmarks/accuracy_parity.py [--data_dir ../shared/data/fruits360-4] [--epochs 2] [--model resnet18]

Every run trains the same model on the same data for the same number of epochs at the same global
batch; only the process count and sync_bn change. Prints a table (accuracy, wall time) and JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(ranks: int, sync_bn: bool, args, out_root: str) -> dict:
    out = os.path.join(out_root, f"{ranks}p_{'sync' if sync_bn else 'plain'}")
    cmd = [sys.executable, "-m", "msdist.train", "--config", os.path.join(REPO, "configs", "resnet18_fruits360.yaml"),
           "--data_dir", args.data_dir, "--output_dir", out, "--model", args.model, "--image_size",
           str(args.image_size), "--epochs", str(args.epochs), "--batch_size", str(args.batch_size),
           "--sync_bn", str(sync_bn).lower(), "--log_every", "1000"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="msdist-parity-") as root:
        rows.append(run(1, False, args, root))  # 1 process: sync_bn would be plain BatchNorm anyway
        for ranks in (2, 4):
            for sync_bn in (False, True):
                rows.append(run(ranks, sync_bn, args, root))
                print(f"done {ranks}p sync_bn={sync_bn}", file=sys.stderr, flush=True)
    base = rows[0]["accuracy"]
    print(f"\n{args.model} {args.image_size}x{args.image_size}, {args.epochs} epochs, global batch {args.batch_size}")
    # Test loss shows differences that accuracy, saturated on an easy data set, hides.
    print("| processes | sync_bn | accuracy | vs 1p (points) | test loss | wall time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {'yes' if r['sync_bn'] else 'no'} | {r['accuracy']:.4f} | "
              f"{100 * (r['accuracy'] - base):+.1f} | {r['test_loss']:.1e} | {r['wall_seconds']:.0f} s |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
