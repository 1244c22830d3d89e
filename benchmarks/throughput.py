"""Training throughput on this machine, side by side: `python benchmarks/throughput.py [--quick]`.

For ResNet-50 and ResNet-18 (100x100 images, global batch 32, Fruits-360 4-class subset) it runs,
one after another in child processes of this one:

  (a) a plain MindSpore loop as the tutorial writes it: ImageFolderDataset, `Model.train`, no
      environment tuning (oneDNN picks its own ISA);
  (b) msdist, 1 rank;
  (c) msdist, 2 ranks on this host (mpirun), also with `--sync_bn true` (the cost of cross-rank BN;
      `--sync_bn_pairs N` repeats the (plain, sync_bn) pair and reports the median ratio);
  and, if `torch` is installed, PyTorch CPU eager ResNet-50 in channels_last on the same shapes.

Each row gives img/s, the per-step breakdown (data wait, compute, all-reduce), cold and warm
time-to-first-step, peak RSS per rank and achieved GFLOP/s as a fraction of the CPU's fp32 peak.
The all-reduce share of (c) comes from a separately timed AllReduce of the model's gradient size,
since MindSpore runs it inside the compiled step; it is timed with MindSpore's fused buffer (what
training uses) and with one AllReduce per parameter (fusion off). It also times the input pipeline alone.

The last line is the JSON of everything; `--json PATH` also writes it to a file.
"""
import argparse
import glob
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
IMAGE_SIZE, GLOBAL_BATCH, NUM_CLASSES = 100, 32, 4
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# The variables msdist sets; the tutorial run must start without them.
TUNING_ENV = ("ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH")
RESNET_LAYOUT = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}
TARGETS = {"b/a": (">=", 1.2), "b/torch": (">=", 1.0), "c/b": (">=", 0.9), "pipeline/training": (">=", 3.0),
           "warm/cold start": ("<=", 0.5), "sync_bn/c": (">=", 0.9), "sync_bn/c peak RSS": ("<=", 1.3)}


# ---------------------------------------------------------------- the machine

def cpu_info() -> dict:
    """Cores, clock and vector width from /proc/cpuinfo, and the fp32 peak they imply.

    Peak = cores x clock x fp32 lanes x 2 (FMA) x 2 FMA pipes. AMD Zen 4 runs AVX-512 on 256-bit
    units (two passes), so on AMD the vector width counts as 256 bits even with avx512f.
    """
    fields = {}
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    amd = fields.get("vendor_id") == "AuthenticAMD"
    bits = 512 if "avx512f" in flags and not amd else 256 if "avx2" in flags else 128
    cores = len(os.sched_getaffinity(0))
    ghz = float(fields.get("cpu MHz", "0")) / 1000
    lanes = bits // 32
    return {"model": fields.get("model name", "?"), "cores": cores, "ghz": round(ghz, 3), "vector_bits": bits,
            "avx512_bf16": "avx512_bf16" in flags,
            "peak_gflops_fp32": round(cores * ghz * lanes * 2 * 2, 1)}


def load_average() -> float:
    return os.getloadavg()[0]


def train_gflop_per_image(model: str, size: int = IMAGE_SIZE) -> float:
    """Forward + backward GFLOPs of one image: msdist's own count (msdist/run/flops.py, the one msdist.train
    reports), on the network msdist trains."""
    from models import create_model
    from msdist.run import flops
    return flops.training_flops_per_image(create_model(model, NUM_CLASSES), size) / 1e9


# ---------------------------------------------------------------- child processes

def _descendants(root: int) -> list:
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _peak_rss_mb(pid: int):
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            status = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
    except OSError:
        return None, ""
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return (int(match.group(1)) / 1024 if match else None), cmdline


class RssWatch(threading.Thread):
    """Peak RSS (VmHWM) of every training process under a child, sampled until it exits."""

    def __init__(self, proc: subprocess.Popen, marker: str):
        super().__init__(daemon=True)
        self.proc, self.marker, self.peaks = proc, marker, {}

    def run(self):
        while self.proc.poll() is None:
            for pid in _descendants(self.proc.pid):
                rss, cmdline = _peak_rss_mb(pid)
                if rss and self.marker in cmdline and "python" in cmdline.split(" ", 1)[0]:  # not mpirun
                    self.peaks[pid] = max(rss, self.peaks.get(pid, 0))
            time.sleep(0.5)

    def per_rank(self) -> list:
        return [round(v) for _, v in sorted(self.peaks.items())]


def run_child(cmd: list, env: dict, marker: str, timeout: int) -> tuple:
    """Run a child to completion; returns (stdout, wall seconds, peak RSS MB of each `marker` process)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = RssWatch(proc, marker)
    watch.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout} s:\n{out[-2000:]}") from None
    watch.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    return out, time.perf_counter() - start, watch.per_rank()


def _env(tuned: bool = True) -> dict:
    env = dict(os.environ, **MPI_ENV, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not tuned:
        for name in TUNING_ENV:
            env.pop(name, None)
    return env


def _worker(kind: str, *args, ranks: int = 1, tuned: bool = True, timeout: int = 1800) -> dict:
    """Run one of this file's workers in a child (under mpirun for ranks > 1); its RESULT line as a dict."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, *map(str, args)]
    if ranks > 1:
        cmd = ["mpirun", "-n", str(ranks), "--oversubscribe"] + cmd
    out, _, rss = run_child(cmd, _env(tuned), "--worker", timeout)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    result.setdefault("peak_rss_mb", rss)
    return result


def _step_lines(output_dir: str, rank: int) -> list:
    """(compute s, data wait s) of every logged step of a rank's newest run, first (warm-up) step dropped."""
    with open(os.path.join(output_dir, "logs", f"rank_{rank}.log"), encoding="utf-8") as f:
        text = f.read()
    run = text.rsplit("world size", 1)[-1]
    steps = [(float(s), float(d)) for s, d in re.findall(r"\| ([\d.]+) s/step \|.*?\| data ([\d.]+) s", run)]
    return steps[1:]


def run_msdist(model: str, ranks: int, steps: int, root: str, extra: tuple = (), tag: str = "") -> dict:
    """A cold run, then a restart (--resume auto) that trains `steps` more with the compile cache warm.

    `extra` options go to msdist.train; `tag` keeps the run's output_dir apart.
    """
    output_dir = os.path.join(root, f"{model}_{ranks}rank{tag}")
    base = [sys.executable, "-m", "msdist.train", "--model", model, "--image_size", IMAGE_SIZE,
            "--batch_size", GLOBAL_BATCH, "--data_dir", DATA_DIR, "--output_dir", output_dir, "--log_every", 1,
            "--lr", 0.01, "--epochs", 1, *extra]
    launcher = ["mpirun", "-n", str(ranks), "--oversubscribe"] if ranks > 1 else []
    cmd = launcher + [str(a) for a in base]
    _, wall, rss = run_child(cmd + ["--max_steps", str(steps)], _env(), "msdist.train", 1800)
    with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as f:
        cold = json.load(f)
    per_rank = [_step_lines(output_dir, r) for r in range(ranks)]
    run_child(cmd + ["--max_steps", str(2 * steps), "--resume", "auto"], _env(), "msdist.train", 1800)
    with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as f:
        warm = json.load(f)
    compute = sum(s for rank in per_rank for s, _ in rank) / max(1, sum(map(len, per_rank)))
    data = sum(d for rank in per_rank for _, d in rank) / max(1, sum(map(len, per_rank)))
    return {"img_s": cold["images_per_sec"], "data_wait_s": data, "compute_s": compute,
            "cold_start_s": cold["start_to_first_step_seconds"], "warm_start_s": warm["start_to_first_step_seconds"],
            "cold_compile_s": cold["compile_seconds"], "warm_compile_s": warm["compile_seconds"],
            "peak_rss_mb": rss, "wall_s": round(wall, 1)}


AMP_SETTINGS = (("O0", "float16"), ("O2", "float16"), ("O3", "float16"), ("O2", "bfloat16"))


def run_amp(root: str, model: str = "resnet18", image_size: int = 32, epochs: int = 1) -> list:
    """Speed and Test accuracy of each mixed-precision setting (1 rank, short real training)."""
    rows = []
    for level, dtype in AMP_SETTINGS:
        output_dir = os.path.join(root, f"amp_{level}_{dtype}")
        cmd = [sys.executable, "-m", "msdist.train", "--model", model, "--image_size", str(image_size),
               "--batch_size", str(GLOBAL_BATCH), "--epochs", str(epochs), "--lr", "0.05", "--data_dir", DATA_DIR,
               "--output_dir", output_dir, "--amp_level", level, "--amp_dtype", dtype, "--log_every", "20"]
        row = {"amp_level": level, "amp_dtype": dtype}
        try:
            run_child(cmd, _env(), "msdist.train", 1800)
            with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as f:
                result = json.load(f)
            row.update(img_s=result["images_per_sec"], accuracy=result["accuracy"])
        except RuntimeError as e:
            row["error"] = _first_cause(os.path.join(output_dir, "logs", "rank_0.log")) or str(e).splitlines()[-1]
        rows.append(row)
    return rows


def _first_cause(log_path: str) -> str:
    """The line of a failed run's log that names what MindSpore could not do."""
    try:
        with open(log_path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError:
        return ""
    return next((line[:200] for line in lines if "fail!" in line or "Unsupported" in line), "")


# ---------------------------------------------------------------- workers (run inside the children)

def worker_plain(model: str, steps: str) -> dict:
    """The tutorial's loop: ImageFolderDataset, Model.train, defaults everywhere."""
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.dataset import transforms, vision
    from mindspore.train import Callback, Model

    from models import create_model

    class Clock(Callback):
        def __init__(self, limit):
            super().__init__()
            self.limit, self.begins, self.ends = limit, [], []

        def on_train_step_begin(self, run_context):
            self.begins.append(time.perf_counter())

        def on_train_step_end(self, run_context):
            self.ends.append(time.perf_counter())
            if len(self.ends) >= self.limit:
                run_context.request_stop()

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    data = ds.ImageFolderDataset(os.path.join(DATA_DIR, "Training"), shuffle=True, decode=True)
    data = data.map([vision.Resize((IMAGE_SIZE, IMAGE_SIZE)), vision.Rescale(1 / 255.0, 0),
                     vision.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), vision.HWC2CHW()], "image")
    data = data.map(transforms.TypeCast(ms.int32), "label").batch(GLOBAL_BATCH, drop_remainder=True)
    net = create_model(model, NUM_CLASSES)
    trainer = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                    nn.Momentum(net.trainable_params(), 0.01, 0.9), metrics={"accuracy"})
    clock = Clock(int(steps))
    trainer.train(1, data, callbacks=[clock], dataset_sink_mode=False)
    compute = [e - b for b, e in zip(clock.begins, clock.ends)]
    waits = [b - e for e, b in zip(clock.ends, clock.begins[1:])]
    steady = compute[1:]
    return {"img_s": GLOBAL_BATCH * len(steady) / (sum(steady) + sum(waits)), "compute_s": sum(steady) / len(steady),
            "data_wait_s": sum(waits) / len(waits), "cold_start_s": clock.ends[0] - _START,
            "peak_rss_mb": [round(_own_peak_rss_mb())]}


def worker_allreduce(model: str, reps: str, fusion: str = "fused") -> dict:
    """Seconds of the data-parallel gradient all-reduce alone: the model's gradient shapes through the
    same `DistributedGradReducer` that training uses, 2 ranks.

    fusion: "fused" = MindSpore's default, every gradient in one fused buffer (what training uses);
    "unfused" = one AllReduce per parameter (a distinct fusion id each).
    """
    from msdist.run import startup
    started = startup.start(["--device_target", "CPU"], options=startup.RUNTIME_OPTIONS, prog="throughput.py",
                            checks=())
    import numpy as np
    import mindspore as ms

    from models import create_model
    from msdist.engine import reducers

    dist, _ = startup.join(started, tempfile.mkdtemp(prefix="msdist-bench-"))
    params = create_model(model, NUM_CLASSES).trainable_params()
    if fusion == "unfused":
        for i, param in enumerate(params):
            param.comm_fusion = i + 1
    reducer = reducers.default_reducer(params, dist.world_size)
    grads = tuple(ms.Tensor(np.ones(p.shape, np.float32)) for p in params)
    reducer(grads)[0].asnumpy()
    start = time.perf_counter()
    for _ in range(int(reps)):
        reducer(grads)[0].asnumpy()
    seconds = (time.perf_counter() - start) / int(reps)
    return {"allreduce_s": seconds, "megabytes": sum(p.size for p in params) * 4 / 1e6, "rank": dist.rank}


def worker_pipeline(ranks: str, batches: str) -> dict:
    """Images/s of one rank's decode + augment + batch, alone, with the workers training would give it."""
    from msdist.rank import runtime
    rt = runtime.prepare_tool(int(ranks))
    from msdist.data import pipeline, plan
    classes = pipeline.class_map(DATA_DIR)
    split = pipeline.list_split(DATA_DIR, pipeline.TRAIN_SPLIT, classes)
    spec = pipeline.TrainInput(image_size=IMAGE_SIZE, global_batch=GLOBAL_BATCH, seed=1, shuffle=True, augment=True,
                               padding=4, workers=rt.threads_per_rank,
                               layout=plan.BatchLayout(int(ranks), int(ranks)))
    data = pipeline.build_train_dataset(split, spec, epoch=0)
    it = data.create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(it)
    start, seen = time.perf_counter(), 0
    for _ in range(int(batches)):
        seen += len(next(it)[1])
    return {"img_s": seen / (time.perf_counter() - start), "workers": rt.threads_per_rank}


def worker_torch(model: str, steps: str) -> dict:
    """PyTorch CPU eager, channels_last, the same ResNet on the same shapes (synthetic tensors)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, width, stride, bottleneck):
            super().__init__()
            out = width * (4 if bottleneck else 1)
            if bottleneck:
                shapes = [(cin, width, 1, 1), (width, width, 3, stride), (width, out, 1, 1)]
            else:
                shapes = [(cin, width, 3, stride), (width, out, 3, 1)]
            layers = []
            for i, (a, b, k, s) in enumerate(shapes):
                layers += [nn.Conv2d(a, b, k, s, k // 2, bias=False), nn.BatchNorm2d(b)]
                if i < len(shapes) - 1:
                    layers.append(nn.ReLU(inplace=True))
            self.body = nn.Sequential(*layers)
            self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or cin != out else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.down(x))

    kind, layers = RESNET_LAYOUT[model]
    blocks, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for stage, (width, depth) in enumerate(zip((64, 128, 256, 512), layers)):
        for block in range(depth):
            blocks.append(Block(cin, width, 2 if stage > 0 and block == 0 else 1, kind == "bottleneck"))
            cin = width * (4 if kind == "bottleneck" else 1)
    net = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, NUM_CLASSES))
    net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.rand(GLOBAL_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE).to(memory_format=torch.channels_last)
    y = torch.arange(GLOBAL_BATCH) % NUM_CLASSES

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    step()
    cold = time.perf_counter() - _START
    start = time.perf_counter()
    for _ in range(int(steps)):
        step()
    seconds = (time.perf_counter() - start) / int(steps)
    return {"img_s": GLOBAL_BATCH / seconds, "compute_s": seconds, "data_wait_s": 0.0, "cold_start_s": cold,
            "threads": torch.get_num_threads(), "peak_rss_mb": [round(_own_peak_rss_mb())]}


def _own_peak_rss_mb() -> float:
    return _peak_rss_mb(os.getpid())[0] or 0.0


WORKERS = {"plain": worker_plain, "allreduce": worker_allreduce, "pipeline": worker_pipeline, "torch": worker_torch}
_START = time.perf_counter()


# ---------------------------------------------------------------- report

def _row(name: str, run: dict, gflop: float, peak: float) -> dict:
    run = dict(run, name=name)
    run["gflops"] = run["img_s"] * gflop
    run["fraction_of_peak"] = run["gflops"] / peak
    return run


def _fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list) -> None:
    head = (f"{'run':<28}{'img/s':>8}{'data s':>8}{'compute s':>10}{'allred s':>9}{'cold s':>8}{'warm s':>8}"
            f"{'RSS MB/rank':>14}{'GFLOP/s':>9}{'% peak':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        rss = "/".join(map(str, r.get("peak_rss_mb") or [])) or "-"
        print(f"{r['name']:<28}{r['img_s']:>8.2f}{_fmt(r.get('data_wait_s'), '.3f'):>8}"
              f"{_fmt(r.get('compute_s'), '.3f'):>10}{_fmt(r.get('allreduce_s'), '.3f'):>9}"
              f"{_fmt(r.get('cold_start_s'), '.1f'):>8}{_fmt(r.get('warm_start_s'), '.1f'):>8}{rss:>14}"
              f"{r['gflops']:>9.1f}{100 * r['fraction_of_peak']:>6.1f}%")


def ratios(runs: dict, pipeline: dict, model: str) -> dict:
    a, b, c = runs.get(f"{model} a"), runs[f"{model} b"], runs[f"{model} c"]
    out = {"c/b": c["img_s"] / b["img_s"],
           "pipeline/training": min(pipeline[1]["img_s"] / b["img_s"], pipeline[2]["img_s"] / (c["img_s"] / 2)),
           "warm/cold start": b["warm_start_s"] / b["cold_start_s"]}
    if a:
        out["b/a"] = b["img_s"] / a["img_s"]
    if f"{model} torch" in runs:
        out["b/torch"] = b["img_s"] / runs[f"{model} torch"]["img_s"]
    return out


def sync_bn_cost(pairs: list) -> dict:
    """sync_bn against plain BatchNorm on 2 ranks, from (plain, sync_bn) runs made back to back: the
    median of the pairs' throughput ratios (a shared 2-core VM drifts by +-10% between runs minutes
    apart, so one pair is one sample), and the peak RSS per rank of all sync_bn runs against all plain ones."""
    speed = statistics.median(synced["img_s"] / plain["img_s"] for plain, synced in pairs)
    peak = [max(max(run["peak_rss_mb"]) for run in side) for side in zip(*pairs)]
    return {"sync_bn/c": speed, "sync_bn/c peak RSS": peak[1] / peak[0]}


def _met(name: str, value: float) -> str:
    op, target = TARGETS[name]
    return "met" if (value >= target if op == ">=" else value <= target) else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet50,resnet18")
    parser.add_argument("--steps", type=int, default=8, help="msdist steps per run (the first is not timed)")
    parser.add_argument("--plain_steps", type=int, default=3, help="tutorial-loop steps (ResNet-50 takes ~1 min each)")
    parser.add_argument("--skip_plain", action="store_true", help="leave out the slow tutorial loop (a)")
    parser.add_argument("--sync_bn_pairs", type=int, default=1,
                        help="(plain, sync_bn) 2-rank run pairs behind the sync_bn ratio (median over pairs)")
    parser.add_argument("--amp", action="store_true", help="also compare amp levels (ResNet-18, 32x32, 1 epoch)")
    parser.add_argument("--json", default="", help="also write the JSON here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, REPO)
        result = WORKERS[args.worker[0]](*args.worker[1:])
        if result.get("rank", 0) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    machine = cpu_info()
    load_before = load_average()
    has_torch = importlib.util.find_spec("torch") is not None
    pipeline = {n: _worker("pipeline", n, 30, tuned=True) for n in (1, 2)}
    runs, pairs, root = {}, {}, tempfile.mkdtemp(prefix="msdist-throughput-")
    for model in args.models.split(","):
        gflop = train_gflop_per_image(model)
        if not args.skip_plain:
            runs[f"{model} a"] = _row(f"{model} (a) tutorial loop", _worker("plain", model, args.plain_steps,
                                                                             tuned=False), gflop,
                                      machine["peak_gflops_fp32"])
        runs[f"{model} b"] = _row(f"{model} (b) msdist 1 rank", run_msdist(model, 1, args.steps, root), gflop,
                                  machine["peak_gflops_fp32"])
        reduce = _worker("allreduce", model, 5, "fused", ranks=2)
        c = run_msdist(model, 2, args.steps, root)
        c["allreduce_s"] = reduce["allreduce_s"]
        c["allreduce_unfused_s"] = _worker("allreduce", model, 5, "unfused", ranks=2)["allreduce_s"]
        c["compute_s"] = max(0.0, c["compute_s"] - reduce["allreduce_s"])
        c["allreduce_mb"] = reduce["megabytes"]
        runs[f"{model} c"] = _row(f"{model} (c) msdist 2 ranks", c, gflop, machine["peak_gflops_fp32"])
        runs[f"{model} c sync_bn"] = _row(f"{model} (c) + sync_bn", run_msdist(model, 2, args.steps, root,
                                                                             ("--sync_bn", "true"), "_sync_bn"),
                                          gflop, machine["peak_gflops_fp32"])
        pairs[model] = [(c, runs[f"{model} c sync_bn"])] + [
            (run_msdist(model, 2, args.steps, root, tag=f"_pair{i}"),
             run_msdist(model, 2, args.steps, root, ("--sync_bn", "true"), f"_sync_bn_pair{i}"))
            for i in range(1, args.sync_bn_pairs)]
        if has_torch and model == "resnet50":
            runs[f"{model} torch"] = _row(f"{model} torch eager NHWC", _worker("torch", model, max(3, args.steps // 2)),
                                          gflop, machine["peak_gflops_fp32"])
    amp = run_amp(root) if args.amp else []
    report = {"machine": machine, "load_average": {"before": load_before, "after": load_average()},
              "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
              "image_size": IMAGE_SIZE, "global_batch": GLOBAL_BATCH, "pipeline": pipeline, "runs": runs, "amp": amp,
              "ratios": {m: ratios(runs, pipeline, m) for m in args.models.split(",")},
              "sync_bn": {m: sync_bn_cost(pairs[m]) for m in args.models.split(",")},
              "sync_bn_pairs_img_s": {m: [(plain["img_s"], synced["img_s"]) for plain, synced in pairs[m]]
                                      for m in args.models.split(",")}}
    print(f"\n{machine['model']}: {machine['cores']} cores @ {machine['ghz']} GHz, {machine['vector_bits']}-bit FMA, "
          f"fp32 peak {machine['peak_gflops_fp32']} GFLOP/s | load average {load_before:.2f} -> "
          f"{report['load_average']['after']:.2f}")
    print(f"input pipeline alone: {pipeline[1]['img_s']:.0f} img/s (1 rank, {pipeline[1]['workers']} workers), "
          f"{pipeline[2]['img_s']:.0f} img/s per rank (2 ranks, {pipeline[2]['workers']} worker)\n")
    print_table(list(runs.values()))
    print()
    for model in args.models.split(","):
        c = runs[f"{model} c"]
        per_pair = ", ".join(f"{synced['img_s']:.2f}/{plain['img_s']:.2f}" for plain, synced in pairs[model])
        print(f"{model:<10}all-reduce of {c['allreduce_mb']:.1f} MB: fused {c['allreduce_s']:.3f} s, one per "
              f"parameter {c['allreduce_unfused_s']:.3f} s | sync_bn vs plain img/s, per pair: {per_pair}")
    for model in args.models.split(","):
        for name, value in dict(report["ratios"][model], **report["sync_bn"][model]).items():
            op, target = TARGETS[name]
            print(f"{model:<10}{name:<20}{value:>7.2f}   target {op} {target:<5} {_met(name, value)}")
    for row in amp:
        outcome = row.get("error") or f"{row['img_s']:.1f} img/s, Test accuracy {row['accuracy']:.4f}"
        print(f"amp {row['amp_level']} {row['amp_dtype']:<9} {outcome}")
    text = json.dumps(report, default=float)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
