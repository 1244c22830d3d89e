"""Gradient communication options: bytes each rank sends (measured on loopback), step time, img/s; 2 ranks.

    python benchmarks/grad_comm.py [--data_dir ../shared/data/fruits360-4] [--models resnet18,resnet50]
                                   [--steps 8] [--image_size 32] [--batch_size 16] [--topk_ratio 0.01]

Bytes are measured, not computed: the two ranks of `mpirun -n 2` on one host talk over loopback, so the
transmit counter of `lo` in /proc/net/dev counts every byte they send. Each option is trained twice,
for 2 and for 2 + `--steps` optimizer steps; the difference between the two runs' counts, divided by
`--steps` and by the 2 ranks, is what one rank sends per optimizer step (start-up, compilation,
evaluation and the checkpoint are the same in both runs and cancel). When `unshare --net` works (root),
each run gets a network namespace of its own, so other processes' loopback traffic cannot count;
otherwise the host's `lo` is read and the table says so. Step time and img/s come from the longer
run's result.json (steady state, the compiling first step left out).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_STEPS = 2

OPTIONS = {  # label -> extra train arguments
    "none": [],
    "fp16": ["--grad_compression", "fp16"],
    "topk": ["--grad_compression", "topk"],
    "threshold": ["--grad_compression", "threshold", "--threshold", "1e-3"],
    "none, accum 2": ["--grad_accum_steps", "2"],
}
_LO_TX = "cat /proc/net/dev | awk '$1 == \"lo:\" {print $10}'"  # transmit bytes of lo


def isolated_netns_works() -> bool:
    """Whether `unshare --net` can give a run its own loopback (needs root or user namespaces)."""
    probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up"], capture_output=True, check=False)
    return probe.returncode == 0


def train(model: str, extra: list, args, out: str, steps: int, isolated: bool) -> tuple:
    """One 2-rank run; (result.json, loopback bytes sent during it)."""
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "msdist.train",
           "--config", os.path.join(REPO, "configs", "tiny_test.yaml"), "--data_dir", args.data_dir,
           "--output_dir", out, "--model", model, "--image_size", str(args.image_size),
           "--batch_size", str(args.batch_size), "--max_steps", str(steps), "--topk_ratio", str(args.topk_ratio),
           "--compile_cache", "false", "--log_every", "1000", *extra]
    script = f"{_LO_TX}; {shlex.join(cmd)} >/dev/null || exit 1; {_LO_TX}"
    if isolated:
        script = f"ip link set lo up && {script}"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shell = (["unshare", "--net"] if isolated else []) + ["sh", "-c", script]
    proc = subprocess.run(shell, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    before, after = (int(x) for x in proc.stdout.split())
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        return json.load(f), after - before


def measure(model: str, extra: list, args, root: str, isolated: bool) -> dict:
    """Bytes per rank per optimizer step from a short and a longer run; throughput of the longer one."""
    _, short = train(model, extra, args, tempfile.mkdtemp(dir=root), BASE_STEPS, isolated)
    result, long_ = train(model, extra, args, tempfile.mkdtemp(dir=root), BASE_STEPS + args.steps, isolated)
    img_s = result["images_per_sec"]
    return {"bytes_per_step": (long_ - short) / args.steps / 2, "step_seconds": round(args.batch_size / img_s, 4),
            "images_per_sec": img_s}


def print_table(rows: list, args, isolated: bool, data_dir: str) -> None:
    print(f"\ndata {data_dir}; 2 ranks, global batch {args.batch_size}, {args.image_size}x{args.image_size}, "
          f"topk_ratio {args.topk_ratio}; bytes: lo transmit counter, runs of {BASE_STEPS} vs "
          f"{BASE_STEPS + args.steps} steps, "
          f"{'own network namespace per run' if isolated else 'HOST loopback (other traffic counts too)'}")
    print("| model | option | MB sent per rank per step (measured) | vs none | step time | img/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = [b["bytes_per_step"] for b in rows if b["model"] == r["model"] and b["option"] == "none"]
        ratio = f"{r['bytes_per_step'] / base[0]:.3f}x" if base else "-"
        print(f"| {r['model']} | {r['option']} | {r['bytes_per_step'] / 1e6:.2f} | {ratio} | "
              f"{1000 * r['step_seconds']:.0f} ms | {r['images_per_sec']:.1f} |")
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated labels of OPTIONS")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps the two runs differ by")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=16, help="global batch")
    parser.add_argument("--topk_ratio", type=float, default=0.01)
    args = parser.parse_args()
    args.data_dir = os.path.abspath(args.data_dir)
    isolated = isolated_netns_works()
    rows = []
    with tempfile.TemporaryDirectory(prefix="msdist-gradcomm-") as root:
        for model in args.models.split(","):
            for label in args.options.split(","):
                row = {"model": model, "option": label, **measure(model, OPTIONS[label], args, root, isolated)}
                rows.append(row)
                print(f"done {model} {label}: {row['bytes_per_step'] / 1e6:.2f} MB/step, "
                      f"{row['images_per_sec']:.1f} img/s", file=sys.stderr, flush=True)
    print_table(rows, args, isolated, args.data_dir)


if __name__ == "__main__":
    main()
