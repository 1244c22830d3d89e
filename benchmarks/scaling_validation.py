"""docs/scaling.md's tables: `python benchmarks/scaling_validation.py [--part published|local|all]`.

published: msdist.plan_scale's model (msdist/run/forecast.py, the constants of msdist/run/hardware.py, the real
  buckets of ResNet-50 / ResNet-101 at 224 px, 1000 classes) against published multi-GPU runs, with the
  relative error. First MindSpore's own GPU runs (DLPerf's and the model zoo's ResNet-50, all in sink mode): the
  rows that validate a model of a MindSpore step, each within BOUND or its miss explained by a cause sized from
  another published figure (`mindspore_rows`). Then other frameworks' runs, as context only: they overlap
  communication and run their hosts in their own ways. No constant is fitted to these points.
local: the same model on what this host runs. mccl's all-reduce over loopback is timed for 64 KB..128 MB at 2
  and 4 ranks (mpirun; each timed all-reduce on a tensor out of the CPU's cache, as training's gradients are)
  and one alpha-beta "link" is fitted to all points; each rank's compute is measured as R concurrent 1-rank
  msdist.train runs, each pinned to one core as mpirun pins ranks (so at the per-rank thread count, sharing the
  cores as the ranks do); the forecast of the R-rank step (compute + every AllReduce op MindSpore compiles, none
  hidden: a CPU rank runs its all-reduce on its own cores) is compared with a real `mpirun -n R python -m
  msdist.train` of the same shapes. The host may be shared: compute-alone and real runs alternate, back to back,
  every figure is a median within its round (of steps, of all-reduces) and the lowest of those over the rounds
  (other jobs' load only adds), and `uptime` is printed with every sweep and run.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import throughput  # noqa: E402  (benchmarks/ is this script's directory: one child runner, one log parser)
from msdist.run import forecast, hardware  # noqa: E402
from msdist.run.forecast import Compute, Network  # noqa: E402

SIZES = tuple(64 * 1024 * 2 ** i for i in range(12))  # 64 KB .. 128 MB
LOCAL_MODELS = ("resnet18", "resnet50")
LOCAL_IMAGE_SIZE, LOCAL_PER_RANK_BATCH, LOCAL_CLASSES = 64, 8, 4
COLD_BYTES = 128 * 2**20  # 4x this host's L3 cache (32 MB): each timed all-reduce reads memory, not cache


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------------------ published runs

BOUND = 0.15  # every MindSpore row within 15%, or its miss explained


@dataclasses.dataclass(frozen=True)
class InputCap:
    """A node's input pipeline as the ceiling of its images/s, from another published run of the same step."""
    per_node: float
    source: str


@dataclasses.dataclass(frozen=True)
class MindSporeRun:
    """A published MindSpore GPU run: `gpus` V100s at `published` img/s in all, compute from a 1-GPU run."""
    name: str
    batch: int
    gpus: int
    published: float
    one_gpu: float
    cap: Optional[InputCap] = None


# DLPerf's MindSpore ResNet-50 v1.5 (github.com/Oneflow-Inc/DLPerf, MindSpore/resnet50v1.5/README.md): MindSpore
# r1.1's model zoo train.py, Model.train in sink mode (scripts: --data_sink_steps 10), ImageNet JPEGs, median of 5
# runs; FP32 at batch 128 per GPU, FP16 (amp O2, dynamic loss scale) at 256. Servers: 8 V100-SXM2-16GB on NVLink,
# one 100 Gb/s EDR InfiniBand port, 2 x Xeon Gold 5118 (24 cores) (DLPerf's NVIDIADeepLearningExamples/README.md).
# The model zoo's ResNet-50 README (gitee.com/mindspore/models, official/cv/ResNet, "ResNet50 on ImageNet2012",
# GPU column): MindSpore 1.3, 8 x V100 SXM2, "CPU 2.1GHz 24cores", batch 256, amp O2 with a fixed loss scale,
# 270 ms/step on 8 GPUs: 948 img/s per GPU, 7,585 in all. It has no 1-GPU row: its compute is DLPerf's FP16 one.
_ZOO_NODE = InputCap(8 * 256 / 0.270, "the model zoo's 8-GPU FP16 node (24 cores), 7,585 img/s")
_DLPERF_NODE = InputCap(6867.34, "DLPerf's 8-GPU FP16 node, 6,867 img/s")
MINDSPORE_RUNS = (
    MindSporeRun("DLPerf FP32", 128, 2, 710.68, 369.81),
    MindSporeRun("DLPerf FP32", 128, 4, 1418.66, 369.81),
    MindSporeRun("DLPerf FP32", 128, 8, 2773.82, 369.81),
    MindSporeRun("DLPerf FP32", 128, 16, 5483.22, 369.81),
    MindSporeRun("DLPerf FP32", 128, 32, 10731.78, 369.81),
    MindSporeRun("DLPerf FP16", 256, 2, 2061.08, 1116),
    MindSporeRun("DLPerf FP16", 256, 4, 4067.95, 1116),
    MindSporeRun("DLPerf FP16", 256, 8, 6867.34, 1116, _ZOO_NODE),
    MindSporeRun("DLPerf FP16", 256, 16, 12057.38, 1116, _DLPERF_NODE),
    MindSporeRun("DLPerf FP16", 256, 32, 24183.95, 1116, _DLPERF_NODE),
    MindSporeRun("model zoo FP16", 256, 8, 8 * 256 / 0.270, 1116, _DLPERF_NODE),
)
MINDSPORE_NETWORK = ("nvlink-v100,ib100", 8)
# The model zoo's GPU config cuts the gradients after parameters 85 and 160 (all_reduce_fusion_config); msdist's
# `--allreduce_fusion 85,160` is the same cut in network order.
MINDSPORE_FUSION = "85,160"


def mindspore_rows(grads=None) -> list:
    """Each published MindSpore run against the forecast `plan_scale --step_ms` makes from its 1-GPU run (the
    sink-mode step's host terms taken out of that step and added back per step), with the verdict: within BOUND,
    explained (capped at the published input ceiling of `cap`, it is within BOUND), or a miss."""
    if grads is None:
        from msdist.run.network_cost import network_gradients
        grads = network_gradients("resnet50", 1000, hardware.REFERENCE_SIZE, MINDSPORE_FUSION)
    links, per_node = MINDSPORE_NETWORK
    net = Network(*hardware.links(links, "V100"), per_node)
    rows = []
    for run in MINDSPORE_RUNS:
        step_ms = 1000 * run.batch / run.one_gpu
        compute = Compute((step_ms - hardware.SINK_STEP_HOST_MS) / run.batch, hardware.SINK_STEP_HOST_MS,
                          call_ms=hardware.HOST_OVERHEAD_MS)
        row = forecast.forecast("none", grads, compute, net, run.batch, run.batch, 0.0, scales=(run.gpus,)).rows[0]
        error = row.images_per_sec / run.published - 1
        capped = min(row.images_per_sec, forecast.nodes(run.gpus, per_node) * run.cap.per_node) if run.cap else None
        capped_error = capped / run.published - 1 if capped else None
        verdict = ("within" if abs(error) <= BOUND else
                   "explained" if capped_error is not None and abs(capped_error) <= BOUND else "miss")
        rows.append({"run": run.name, "N": run.gpus, "batch": run.batch, "published": run.published,
                     "predicted": row.images_per_sec, "error": error, "step_ms": row.step_ms,
                     "exposed_ms": row.exposed_ms, "host_ms": row.host_ms, "capped": capped,
                     "capped_error": capped_error, "cause": run.cap.source if run.cap else "", "verdict": verdict})
    return rows


def print_mindspore(rows: list) -> None:
    print("| run | N | batch/GPU | published img/s | predicted | error | step ms (exposed, host) | verdict |")
    print("|---" * 8 + "|")
    for r in rows:
        verdict = (f"within {BOUND:.0%}" if r["verdict"] == "within" else "**miss**" if r["verdict"] == "miss" else
                   f"input-bound: at {r['cause']} a node, {r['capped']:.0f} ({r['capped_error']:+.1%})")
        print(f"| {r['run']} | {r['N']} | {r['batch']} | {r['published']:.0f} | {r['predicted']:.0f} | "
              f"{r['error']:+.1%} | {r['step_ms']:.1f} ({r['exposed_ms']:.2f}, {r['host_ms']:.3f}) | {verdict} |")


# Other frameworks' runs, as context (they overlap communication in their own ways):
# name, model, gpu, precision, batch per GPU, GPUs per node, links, N, published img/s at N (or efficiency), note
PUBLISHED = (
    ("DLE RN50 8xA100 TF32", "resnet50", "A100", "fp32", 256, 8, "nvlink-a100", 8, 7248, "img/s"),
    ("DLE RN50 8xA100 AMP", "resnet50", "A100", "amp", 256, 8, "nvlink-a100", 8, 16621, "img/s"),
    ("DLE RN50 8xV100 FP32", "resnet50", "V100", "fp32", 112, 8, "nvlink-v100", 8, 2855, "img/s"),
    ("DLE RN50 8xV100 AMP", "resnet50", "V100", "amp", 256, 8, "nvlink-v100", 8, 8322, "img/s"),
    ("TF 2017 RN50 8xK80 (1 node)", "resnet50", "K80", "fp32", 64, 8, "pcie,eth10", 8, 378, "img/s"),
    ("TF 2017 RN50 16xK80", "resnet50", "K80", "fp32", 64, 8, "pcie,eth10", 16, 751, "img/s"),
    ("TF 2017 RN50 32xK80", "resnet50", "K80", "fp32", 64, 8, "pcie,eth10", 32, 1388, "img/s"),
    ("TF 2017 RN50 64xK80", "resnet50", "K80", "fp32", 64, 8, "pcie,eth10", 64, 2744, "img/s"),
    ("Goyal 2017 RN50 8->256 P100", "resnet50", "P100", "fp32", 32, 8, "pcie,eth50", 256, 0.90, "efficiency vs 8"),
    ("Horovod RN101 512 P100 25GbE", "resnet101", "P100", "fp32", 64, 4, "pcie,eth25", 512, 0.90, "efficiency vs 1"),
)


def _weak_rows(grads, gpu: str, model: str, prec: str, batch: int, per_node: int, links: str, scales) -> list:
    rate = hardware.gpu_throughput(gpu, model, prec)
    intra, inter = hardware.links(links, gpu)
    compute = Compute(1000 / rate.images_per_sec, hardware.SINK_STEP_HOST_MS, call_ms=hardware.HOST_OVERHEAD_MS)
    return forecast.forecast("none", grads, compute, Network(intra, inter, per_node), batch, batch, 0.0,
                             scales=scales).rows


def published_rows() -> list:
    from msdist.run.network_cost import network_gradients
    grads = {m: network_gradients(m, 1000, hardware.REFERENCE_SIZE, "auto") for m in ("resnet50", "resnet101")}
    rows = []
    for name, model, gpu, prec, batch, per_node, links, n, published, unit in PUBLISHED:
        base = 8 if unit == "efficiency vs 8" else 1
        last = _weak_rows(grads[model], gpu, model, prec, batch, per_node, links, (base, n))[-1]
        predicted = last.images_per_sec if unit == "img/s" else last.efficiency
        rows.append({"run": name, "N": n, "unit": unit, "published": published, "predicted": predicted,
                     "error": predicted / published - 1, "exposed_ms": last.exposed_ms, "step_ms": last.step_ms})
    return rows


def print_published(rows: list) -> None:
    print("| run | N | published | predicted | error |")
    print("|---" * 5 + "|")
    for r in rows:
        fmt = ".0f" if r["unit"] == "img/s" else ".3f"
        what = "img/s" if r["unit"] == "img/s" else r["unit"]
        print(f"| {r['run']} | {r['N']} | {r['published']:{fmt}} {what} | {r['predicted']:{fmt}} | "
              f"{r['error']:+.1%} |")


# ---------------------------------------------------------------------------------------------- this host

def worker_allreduce(sizes: str, reps: str) -> None:
    """Seconds of one mccl AllReduce of each size (float32), median of `reps` after a warm-up; run under mpirun.

    Each timed all-reduce reads a tensor not used since COLD_BYTES of others: training reduces gradients
    backward has just written among its activations, not a buffer the last all-reduce left in the CPU's cache
    (reusing one tensor, a 24 MB all-reduce ran 2.5x faster than a 32 MB one: this host's L3 is 32 MB).
    Rank 0 prints them; every rank then leaves the job as msdist.train does (distributed.finish, no teardown).
    """
    from msdist.rank import distributed, runtime
    from msdist.run import startup
    started = startup.start(["--device_target", "CPU"], options=startup.RUNTIME_OPTIONS, prog="scaling_validation",
                            checks=())
    import numpy as np
    import mindspore as ms
    from mindspore import nn, ops

    class Reduce(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = ops.AllReduce()

        def construct(self, x):
            return self.op(x)

    dist, collectives = startup.join(started, tempfile.mkdtemp(prefix="msdist-scaling-"))
    reduce, seconds = Reduce(), {}
    for nbytes in map(int, sizes.split(",")):
        tensors = [ms.Tensor(np.ones(nbytes // 4, np.float32)) for _ in range(max(2, -(-COLD_BYTES // nbytes)))]
        reduce(tensors[-1]).asnumpy()
        times = []
        for i in range(int(reps)):
            x = tensors[i % len(tensors)]
            start = time.perf_counter()
            reduce(x).asnumpy()
            times.append(time.perf_counter() - start)
        seconds[nbytes] = statistics.median(times)
        del tensors
    if dist.is_main:
        print("RESULT " + json.dumps({"world": dist.world_size, "seconds": seconds}), flush=True)
    distributed.finish(started.launch, dist, collectives)
    runtime.exit_without_teardown(0)


def sweep(ranks: int, reps: int) -> dict:
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, os.path.abspath(__file__), "--worker",
           "allreduce", ",".join(map(str, SIZES)), str(reps)]
    out, _, _ = throughput.run_child(cmd, throughput._env(), "--worker", 1800)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    return {int(k): v for k, v in result["seconds"].items()}


def core_share(ranks: int, cores: int) -> float:
    """The share of a core each rank's ring work gets: mccl's copies and sums run on the rank's own pinned cores
    (docs/scaling.md, "Nothing hides on a CPU"), so R ranks on C < R cores move bytes C/R as fast."""
    return min(1.0, cores / ranks)


def _local_link(link: hardware.Link, ranks: int, cores: int) -> hardware.Link:
    return dataclasses.replace(link, busbw_gbs=link.busbw_gbs * core_share(ranks, cores))


def fit_link(points: list, cores: int) -> hardware.Link:
    """t = latency + x / busbw over (ranks, bytes, seconds), x = 2(n-1)/n * bytes / core_share, by least squares
    of the RELATIVE residuals (weights 1/t^2): sizes span 2000x, so plain least squares would hear only the
    largest ones, and one loaded 128 MB point could set the latency. busbw is that of ranks with a core each."""
    xs = [2 * (n - 1) / n * b / core_share(n, cores) for n, b, _ in points]
    ws = [1 / t ** 2 for _, _, t in points]
    ts = [t for _, _, t in points]
    sw, sx, sxx = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * x * x for w, x in zip(ws, xs))
    st, sxt = sum(w * t for w, t in zip(ws, ts)), sum(w * x * t for w, x, t in zip(ws, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    latency = max(0.0, (st - slope * sx) / sw)
    return hardware.Link("loopback (fitted)", 1 / slope / 1e9, latency * 1e6, "fitted to mccl over loopback, here")


def _train_cmd(model: str, ranks_batch: int, out: str, data_dir: str, steps: int) -> list:
    return [sys.executable, "-m", "msdist.train", "--model", model, "--image_size", str(LOCAL_IMAGE_SIZE),
            "--batch_size", str(ranks_batch), "--data_dir", data_dir, "--output_dir", out, "--log_every", "1",
            "--epochs", "1", "--max_steps", str(steps), "--eval_every_epochs", "0"]


def _step_times(out: str, ranks: int) -> tuple:
    """(median, fastest) s/step of a run after its first two steps, each the slowest rank's (the others wait for it).

    The median is the figure; the fastest is kept for a shared host, where other jobs' load only ever adds.
    """
    steps = [[s for s, _ in throughput._step_lines(out, r)[1:]] for r in range(ranks)]
    return max(statistics.median(s) for s in steps), max(min(s) for s in steps)


def concurrent_compute(model: str, ranks: int, data_dir: str, steps: int, root: str) -> tuple:
    """s/step of `ranks` simultaneous 1-rank runs at the per-rank batch, each pinned to one core (the slowest run's:
    a rank of the real job waits for the slowest)."""
    cores = sorted(os.sched_getaffinity(0))
    procs, outs = [], []
    for i in range(ranks):
        out = os.path.join(root, f"{model}_alone{ranks}_{i}")
        cmd = ["taskset", "-c", str(cores[i % len(cores)])] + _train_cmd(model, LOCAL_PER_RANK_BATCH, out, data_dir,
                                                                         steps)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=throughput._env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        outs.append(out)
    if any(p.wait(timeout=3600) for p in procs):
        raise RuntimeError(f"a concurrent {model} run failed; see {root}")
    times = [_step_times(out, 1) for out in outs]
    return max(m for m, _ in times), max(f for _, f in times)


def measured_step(model: str, ranks: int, data_dir: str, steps: int, root: str) -> tuple:
    out = os.path.join(root, f"{model}_mpirun{ranks}")
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe"] + _train_cmd(model, LOCAL_PER_RANK_BATCH * ranks, out,
                                                                         data_dir, steps)
    throughput.run_child(cmd, throughput._env(), "msdist.train", 3600)
    return _step_times(out, ranks)


def _load(text: str) -> str:
    """The 1-minute load average of an `uptime` line."""
    return text.split("load average:")[-1].split(",")[0].strip()


def measure_local(data_dir: str, steps: int, reps: int, rounds: int, models, rank_counts) -> dict:
    """`rounds` rounds of: mccl's all-reduce at each rank count, then for every (model, ranks) a compute-alone run
    and the real mpirun job back to back. Load comes and goes, so each pair sees nearly the same, the sweeps and
    the runs alternate; `predict_local` keeps each figure's lowest round."""
    from msdist.run import config
    sweeps = {ranks: {"seconds_rounds": [], "uptimes": []} for ranks in rank_counts}
    runs = [{"model": m, "ranks": n, "compute_rounds_s": [], "measured_rounds_s": [], "compute_fastest_s": [],
             "measured_fastest_s": [], "uptimes": []} for m in models for n in rank_counts]
    root = tempfile.mkdtemp(prefix="msdist-scaling-")
    for r in range(rounds):
        for ranks, record in sweeps.items():
            record["seconds_rounds"].append(sweep(ranks, reps))
            record["uptimes"].append(uptime())
            print(f"round {r}: mccl all-reduce, {ranks} ranks (load {_load(record['uptimes'][-1])}):", ", ".join(
                f"{b / 2**20:g} MB {t * 1000:.1f} ms" for b, t in record["seconds_rounds"][-1].items()), flush=True)
        for run in runs:
            where = os.path.join(root, f"round{r}")
            for kind, measure in (("compute", concurrent_compute), ("measured", measured_step)):
                median, fastest = measure(run["model"], run["ranks"], data_dir, steps, where)
                run[f"{kind}_rounds_s"].append(median)
                run[f"{kind}_fastest_s"].append(fastest)
                run["uptimes"].append(uptime())
            print(f"round {r}: {run['model']} {run['ranks']} ranks: compute alone {run['compute_rounds_s'][-1]:.3f}, "
                  f"real job {run['measured_rounds_s'][-1]:.3f} s/step (load {_load(run['uptimes'][-2])}, "
                  f"{_load(run['uptimes'][-1])})", flush=True)
    fusion = next(o.default for o in config.TRAIN_OPTIONS if o.name == "allreduce_fusion")  # what training ran
    return {"sweeps": sweeps, "runs": runs, "allreduce_fusion": fusion, "cores": len(os.sched_getaffinity(0))}


def _predict(grads, link: hardware.Link, ranks: int, compute_s: float, hides: bool = False) -> tuple:
    """(exposed all-reduce s, step s) of one rank: its compute-alone step (which already holds msdist's host
    work) plus the exchange over `link` (the rank count's own: `_local_link`); a CPU rank hides none of it
    (`hides` = the GPU rule, for contrast)."""
    compute = Compute(compute_s * 1000 / LOCAL_PER_RANK_BATCH, 0.0, hides_exchange=hides)
    row = forecast.forecast("none", grads, compute, Network(link, link, ranks), 0, LOCAL_PER_RANK_BATCH, 0.0,
                            scales=(ranks,)).rows[0]
    return row.exposed_ms / 1000, row.step_ms / 1000


def predict_local(measured: dict) -> dict:
    """The fitted loopback link and, per run, compute + every AllReduce op (none hidden) against the real job:
    each figure the lowest of its rounds' medians (a loaded round only adds), and again from the fastest steps."""
    from msdist.run.network_cost import network_gradients
    sweeps = {int(n): {int(b): min(r[b] for r in s["seconds_rounds"]) for b in s["seconds_rounds"][0]}
              for n, s in measured["sweeps"].items()}
    cores = measured.get("cores", len(os.sched_getaffinity(0)))
    link = fit_link([(n, b, t) for n, s in sweeps.items() for b, t in s.items()], cores)
    rows, grads = [], {}
    for run in measured["runs"]:
        model, ranks = run["model"], run["ranks"]
        if model not in grads:
            grads[model] = network_gradients(model, LOCAL_CLASSES, LOCAL_IMAGE_SIZE, measured["allreduce_fusion"])
        g = grads[model]
        alone, real = min(run["compute_rounds_s"]), min(run["measured_rounds_s"])
        ranks_link = _local_link(link, ranks, cores)
        exposed, predicted = _predict(g, ranks_link, ranks, alone)
        _, if_hidden = _predict(g, ranks_link, ranks, alone, hides=True)
        fast_alone, fast_real = min(run["compute_fastest_s"]), min(run["measured_fastest_s"])
        _, fast_predicted = _predict(g, ranks_link, ranks, fast_alone)
        rows.append({**run, "compute_s": alone, "allreduce_ops": len(g.buckets), "exposed_s": exposed,
                     "predicted_s": predicted, "measured_s": real, "error": predicted / real - 1,
                     "if_hidden_predicted_s": if_hidden, "if_hidden_error": if_hidden / real - 1,
                     "fastest_predicted_s": fast_predicted, "fastest_measured_s": fast_real,
                     "fastest_error": fast_predicted / fast_real - 1, "loads": [_load(u) for u in run["uptimes"]]})
    print_local(sweeps, link, cores, rows)
    return {"link": link.__dict__, "rows": rows}


def print_local(sweeps: dict, link: hardware.Link, cores: int, rows: list) -> None:
    """The sweep, the fit and the comparison as markdown tables, ready for docs/scaling.md."""
    ranks = sorted(sweeps)
    print("\n| all-reduce size | " + " | ".join(f"{n} ranks (ms)" for n in ranks) + " |")
    print("|---" * (len(ranks) + 1) + "|")
    for nbytes in sorted(set().union(*sweeps.values())):
        print(f"| {nbytes / 2**20:g} MB | " + " | ".join(f"{sweeps[n][nbytes] * 1000:.1f}" for n in ranks) + " |")
    print(f"\nfitted loopback link: busbw {link.busbw_gbs * 1000:.0f} MB/s per rank with a core of its own (x "
          f"{cores}/R for R > {cores} ranks on these {cores} cores), latency {link.latency_us:.0f} us\n")
    print("| model | ranks | compute alone (s/step) | AllReduce ops | all-reduce, none hidden (s) | predicted | "
          "measured (`mpirun`) | error | if backward hid it (GPU rule) | fastest steps: predicted / measured, error "
          "| load (1 min) after each run |")
    print("|---" * 11 + "|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['compute_s']:.3f} | {r['allreduce_ops']} | {r['exposed_s']:.3f} | "
              f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | **{r['error']:+.1%}** | "
              f"{r['if_hidden_predicted_s']:.3f}, {r['if_hidden_error']:+.1%} | {r['fastest_predicted_s']:.3f} / "
              f"{r['fastest_measured_s']:.3f}, {r['fastest_error']:+.1%} | {' '.join(r['loads'])} |")
    print("\nrounds, medians (compute alone / real job, s/step):", "; ".join(
        f"{r['model']} x{r['ranks']}: {[round(t, 3) for t in r['compute_rounds_s']]} / "
        f"{[round(t, 3) for t in r['measured_rounds_s']]}" for r in rows), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("published", "local", "all"), default="all")
    parser.add_argument("--data_dir", default=throughput.DATA_DIR)
    parser.add_argument("--steps", type=int, default=12, help="training steps per local run (the first two untimed)")
    parser.add_argument("--reps", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of compute-alone and real runs")
    parser.add_argument("--models", default=",".join(LOCAL_MODELS), help="local: models, comma-separated")
    parser.add_argument("--ranks", default="2,4", help="local: rank counts, comma-separated")
    parser.add_argument("--reuse", default="", help="local: recompute the predictions from the measurements in this "
                        "--json file of an earlier run instead of measuring again")
    parser.add_argument("--json", default="", help="also write everything here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_allreduce(*args.worker[1:])
    report = {"uptime_start": uptime()}
    if args.part in ("published", "all"):
        report["mindspore"] = mindspore_rows()
        print_mindspore(report["mindspore"])
        report["published"] = published_rows()
        print("\nOther frameworks, context only (not a MindSpore step):")
        print_published(report["published"])
    if args.part in ("local", "all"):
        if args.reuse:
            with open(args.reuse, encoding="utf-8") as f:
                report["local_measured"] = json.load(f)["local_measured"]
        else:
            report["local_measured"] = measure_local(args.data_dir, args.steps, args.reps, args.rounds,
                                                     args.models.split(","), [int(n) for n in args.ranks.split(",")])
            _write(args.json, report)   # the measurements are kept even if a prediction fails
        report["local"] = predict_local(report["local_measured"])
    report["uptime_end"] = uptime()
    print(f"load: start {report['uptime_start']} | end {report['uptime_end']}")
    _write(args.json, report)
    return 0


def _write(path: str, report: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
