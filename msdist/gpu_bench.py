"""`python -m msdist.check --gpu_bench --data_dir DIR --output_dir OUT` (or scripts/gpu_check.sh): the first GPU
node's acceptance run.

It trains four short runs through msdist.launch, one device and every local device, each with `--sink_size 1` and
the default `--sink_size auto`, the same seed and `--deterministic true`; then it prints, and writes to
OUT/gpu_bench.json:
- img/s of each run (steady state, result.json's);
- whether the K-step runs' weights equal the 1-step runs' (the largest difference over every parameter);
- the host's share of a 1-step step: what K steps per call removed from it, 1 - t(K)/t(1);
- whether the all-reduce overlapped the backward: the share of NCCL's kernel time spent while a compute kernel ran
  on another stream, read from MindSpore's profiler (`--profile_steps`) where CUPTI is present; otherwise it says it
  could not tell, and why.
On a host without a usable GPU the same runs train on CPU, and the report says so: CPU has no data sink, so both K
run one step per call there (docs/cluster.md, "GPU acceptance run").
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from msdist.base.errors import UserError
from msdist.rank import device, gpu_plugin
from msdist.run import checkpoint, profiler

REPORT = "gpu_bench.json"
CPU_RANKS = 2  # "all local devices" on a CPU host: the smallest data-parallel job
PROFILED = (20, 24)  # global steps the profiled run traces, past compilation and warm-up


@dataclass(frozen=True)
class Arm:
    """One run of the acceptance: `ranks` local devices, `sink_size` steps per host call ("1" or "auto")."""
    ranks: int
    sink_size: str

    @property
    def name(self) -> str:
        return f"{self.ranks}dev_k{self.sink_size}"


def plan_arms(local_devices: int) -> List[Arm]:
    """One device and every local device (one arm when the host has one), each at K=1 and K=auto."""
    counts = [1] if local_devices <= 1 else [1, local_devices]
    return [Arm(n, k) for n in counts for k in ("1", "auto")]


def host_share(step_s_k1: float, step_s_k: float) -> float:
    """The share of a one-step-per-call step that the host's work between steps took: what K steps per call
    removed, 1 - t(K)/t(1) (0 when K gained nothing)."""
    return max(0.0, 1.0 - step_s_k / step_s_k1) if step_s_k1 > 0 else 0.0


def read_kernel_timeline(path: str) -> List[Tuple[str, int, float, float]]:
    """(kernel, stream, start_us, end_us) from MindSpore's GPU profiler file `activity_execute_timestamp_<dev>.txt`.

    Its lines are `kernel;stream;start_ns;duration_us` (MindSpore 2.10 source:
    ccsrc/profiler/device/gpu/gpu_data_saver.cc, GpuDataSaver::WriteActivity; the duration is `(end - start) /
    kTimeUnit`, kTimeUnit = 1000).
    """
    kernels = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").rsplit(";", 3)
            if len(parts) == 4 and parts[1].isdigit():
                start_us = int(parts[2]) / 1000.0
                kernels.append((parts[0], int(parts[1]), start_us, start_us + float(parts[3])))
    return kernels


def _is_allreduce(kernel: str) -> bool:
    # NCCL names its kernels ncclKernel_AllReduce_... (2.x) or ncclDevKernel_AllReduce_... (2.19 on).
    name = kernel.lower()
    return "nccl" in name and "allreduce" in name


def overlap_share(kernels: Sequence[Tuple[str, int, float, float]]) -> Optional[float]:
    """The share of the all-reduce kernels' time during which a compute kernel ran on another stream; None without
    all-reduce kernels."""
    reduces = [k for k in kernels if _is_allreduce(k[0])]
    total = sum(end - start for _, _, start, end in reduces)
    if not reduces or total <= 0:
        return None
    compute = sorted((start, end, stream) for name, stream, start, end in kernels if "nccl" not in name.lower())
    covered = 0.0
    for _, stream, start, end in reduces:
        spans = _merged([(max(s, start), min(e, end)) for s, e, st in compute if st != stream and s < end and e > start])
        covered += sum(e - s for s, e in spans)
    return covered / total


def _merged(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_verdict(target: str, cupti: bool, timeline: Optional[str]) -> Dict:
    """{"overlapped": True/False/None, "share": float or None, "why": text}: what the profiled run says."""
    if target != "GPU":
        return {"overlapped": None, "share": None,
                "why": "could not tell: a CPU run; MindSpore's profiler traces device streams on GPU only"}
    if not cupti:
        return {"overlapped": None, "share": None,
                "why": f"could not tell: {profiler.CUPTI} is not findable, so the profiler traced no device kernel "
                       f"(add CUDA's extras/CUPTI/lib64 to LD_LIBRARY_PATH)"}
    share = overlap_share(read_kernel_timeline(timeline)) if timeline else None
    if share is None:
        return {"overlapped": None, "share": None,
                "why": "could not tell: the profiled run recorded no NCCL all-reduce kernel"}
    return {"overlapped": share > 0.0, "share": round(share, 4),
            "why": f"{100 * share:.1f}% of the all-reduce kernels' time ran beside compute kernels"}


def weight_difference(path_a: str, path_b: str) -> float:
    """The largest absolute difference between two checkpoints' common tensors, weights and training state
    (0.0: bitwise equal); the appended metadata (model, classes, position) is not compared."""
    import numpy as np
    a, b = checkpoint.read_tensors(path_a), checkpoint.read_tensors(path_b)
    worst = 0.0
    for name in sorted(n for n in set(a) & set(b) if hasattr(a[n], "asnumpy") and hasattr(b[n], "asnumpy")):
        x, y = (np.asarray(v.asnumpy(), np.float64) for v in (a[name], b[name]))
        if x.shape == y.shape and x.size:
            worst = max(worst, float(np.max(np.abs(x - y))))
    return worst


def _parse(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    parser = argparse.ArgumentParser(prog="msdist.check --gpu_bench",
                                     description="the first GPU node's acceptance run (docs/cluster.md)")
    parser.add_argument("--data_dir", required=True, help="an ImageFolder tree (Training/ and Test/)")
    parser.add_argument("--output_dir", required=True, help="where the runs and gpu_bench.json go")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--ranks", type=int, default=0,
                        help="'every local device': default the GPUs this host shows, or 2 on a CPU host")
    ns, train_args = parser.parse_known_args(list(argv))
    if ns.steps < 1:
        raise UserError(f"--steps {ns.steps}: give a positive number of steps (a few hundred on a GPU)")
    return ns, train_args


def _device_and_count(ranks: int) -> Tuple[str, int]:
    """The device training will choose here (`device.plan_device` for `auto`) and how many make 'every device'."""
    probe = device.host_probe(os.environ, "/")
    target = device.plan_device("auto", 0, probe).target
    local = ranks or (probe.visible_devices if target == "GPU" else CPU_RANKS)
    return target, local


def _run(arm: Arm, ns, train_args: List[str], profile: bool) -> str:
    """Train one arm through msdist.launch; its output folder. A failed run is one line naming its log."""
    out = os.path.join(ns.output_dir, arm.name)
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, "-m", "msdist.launch", "-n", str(arm.ranks), "--data_dir", ns.data_dir,
               "--output_dir", out, "--max_steps", str(ns.steps), "--sink_size", arm.sink_size,
               "--deterministic", "true", "--seed", "1", *train_args]
    if profile:
        command += ["--profile_steps", f"{PROFILED[0]}:{PROFILED[1]}", "--profile_ranks", "0"]
    log = os.path.join(out, "bench.log")
    print(f"gpu_bench: {arm.name}: {' '.join(command[1:])}", flush=True)
    with open(log, "w", encoding="utf-8") as f:
        status = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT)
    if status != 0:
        raise UserError(f"gpu_bench: the run {arm.name} failed with status {status}; see {log}")
    return out


def _figures(out: str) -> Dict:
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        result = json.load(f)
    steps = [r["median_step_s"] for r in result.get("ranks", [])]
    return {"images_per_sec": result["images_per_sec"], "median_step_s": statistics.median(steps) if steps else 0.0,
            "device_target": result["device_target"]}


def _final_checkpoint(out: str) -> str:
    """Rank 0's newest checkpoint of the run in `out` (its prefix is the run's own: the model, or --ckpt_prefix)."""
    found = glob.glob(os.path.join(out, "ckpt", "*_rank0-*.ckpt"))
    prefix = os.path.basename(found[0]).rsplit("_rank0-", 1)[0] if found else ""
    listed = checkpoint.list_checkpoints(os.path.join(out, "ckpt"), prefix, 0) if prefix else []
    if not listed:
        raise UserError(f"gpu_bench: no checkpoint in {out}/ckpt; the run saved nothing to compare")
    return listed[0].path


def report_lines(report: Dict) -> List[str]:
    """The console's table: one line per arm, then agreement, host share and overlap."""
    lines = [f"gpu_bench on {report['device_target']}" + ("" if report["device_target"] == "GPU" else
             " (no usable GPU here: the same runs on CPU, where K=auto is one step per call)")]
    lines += [f"  {name:14s} {arm['images_per_sec']:9.1f} img/s  {1000 * arm['median_step_s']:8.2f} ms/step"
              for name, arm in report["arms"].items()]
    for ranks, figures in report["per_device_count"].items():
        equal = "bitwise equal" if figures["max_weight_difference"] == 0.0 else \
            f"differ by up to {figures['max_weight_difference']:.3g}"
        share = "not separable on CPU (both K run one step per call)" if figures["host_share"] is None else \
            f"{100 * figures['host_share']:.1f}%"
        lines.append(f"  {ranks} device(s): weights K=1 vs K=auto {equal}; host share of a K=1 step {share}")
    lines.append(f"  all-reduce overlapped backward: {report['overlap']['why']}")
    return lines


def main(argv: Sequence[str]) -> int:
    ns, train_args = _parse(argv)
    target, local = _device_and_count(ns.ranks)
    arms = plan_arms(local)
    widest = max(a.ranks for a in arms)
    cupti = target == "GPU" and gpu_plugin.findable_here(profiler.CUPTI)
    profile_arm = Arm(widest, "auto") if cupti and widest > 1 and ns.steps > PROFILED[1] else None
    outs = {arm: _run(arm, ns, train_args, arm == profile_arm) for arm in arms}
    figures = {arm: _figures(out) for arm, out in outs.items()}
    per_count = {}
    for ranks in sorted({a.ranks for a in arms}):
        one, k = Arm(ranks, "1"), Arm(ranks, "auto")
        # On CPU both run one step per call (no data sink): their difference is noise, not the host's share.
        share = host_share(figures[one]["median_step_s"], figures[k]["median_step_s"]) if target == "GPU" else None
        per_count[str(ranks)] = {
            "max_weight_difference": weight_difference(_final_checkpoint(outs[one]), _final_checkpoint(outs[k])),
            "host_share": None if share is None else round(share, 4)}
    timelines = glob.glob(os.path.join(outs[profile_arm], profiler.PROFILE_DIR, "rank_0", "**",
                                       "activity_execute_timestamp_*.txt"), recursive=True) if profile_arm else []
    report = {"device_target": figures[arms[0]]["device_target"], "steps": ns.steps,
              "arms": {a.name: {**asdict(a), **figures[a]} for a in arms}, "per_device_count": per_count,
              "overlap": overlap_verdict(target, cupti, timelines[0] if timelines else None)}
    path = os.path.join(ns.output_dir, REPORT)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print("\n".join(report_lines(report) + [f"  written to {path}"]), flush=True)
    return 0
