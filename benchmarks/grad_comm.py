"""Gradient communication options: bytes each rank sends, step time and images/sec, 2 ranks.

    python benchmarks/grad_comm.py [--data_dir ../shared/data/fruits360-4] [--models resnet18,resnet50]
                                   [--steps 10] [--image_size 32] [--batch_size 16] [--topk_ratio 0.01]

For every model and option it trains a few steps under `mpirun -n 2` and reads the steady-state
throughput from result.json (the compiling first step is left out). The bytes are computed from the
trainable tensors' sizes and the option (msdist.comm.bytes_sent_per_step), not measured on the wire.
Prints a markdown table and JSON. On one host the "link" is shared memory, so this shows the
compute cost of each option; the bytes column is what a bandwidth-bound multi-node link would carry.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the models registry and msdist.comm, when run from a checkout

OPTIONS = {  # label -> extra train arguments
    "none": [],
    "fp16": ["--grad_compression", "fp16"],
    "topk": ["--grad_compression", "topk"],
    "threshold": ["--grad_compression", "threshold", "--threshold", "1e-3"],
    "none, accum 2": ["--grad_accum_steps", "2"],
}


def trainable_sizes(model: str) -> list:
    from models import create_model
    return [int(p.size) for p in create_model(model, num_classes=4).trainable_params()]


def train(model: str, extra: list, args, out: str) -> dict:
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "msdist.train",
           "--config", os.path.join(REPO, "configs", "tiny_test.yaml"), "--data_dir", args.data_dir,
           "--output_dir", out, "--model", model, "--image_size", str(args.image_size),
           "--batch_size", str(args.batch_size), "--max_steps", str(args.steps), "--topk_ratio", str(args.topk_ratio),
           "--compile_cache", "false", "--log_every", "1000", *extra]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (the first compiles)")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=16, help="global batch")
    parser.add_argument("--topk_ratio", type=float, default=0.01)
    args = parser.parse_args()
    from msdist.comm import bytes_sent_per_step

    rows = []
    with tempfile.TemporaryDirectory(prefix="msdist-gradcomm-") as root:
        for model in args.models.split(","):
            sizes = trainable_sizes(model)
            for label, extra in OPTIONS.items():
                result = train(model, extra, args, os.path.join(root, f"{model}-{len(rows)}"))
                kind = label.split(",")[0]
                img_s = result["images_per_sec"]
                rows.append({"model": model, "option": label, "params": sum(sizes),
                             "bytes_per_step": bytes_sent_per_step(sizes, kind, args.topk_ratio),
                             "step_seconds": round(args.batch_size / img_s, 4), "images_per_sec": img_s})
                print(f"done {model} {label}: {img_s:.1f} img/s", file=sys.stderr, flush=True)
    print(f"\n2 ranks, global batch {args.batch_size}, {args.image_size}x{args.image_size}, "
          f"topk_ratio {args.topk_ratio}, {args.steps} steps per run")
    print("| model | option | MB sent per rank per step | vs none | step time | img/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["option"] == "none")
        print(f"| {r['model']} | {r['option']} | {r['bytes_per_step'] / 1e6:.2f} | "
              f"{r['bytes_per_step'] / base['bytes_per_step']:.3f}x | {1000 * r['step_seconds']:.0f} ms | "
              f"{r['images_per_sec']:.1f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
