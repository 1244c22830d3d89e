"""What saving by steps costs the training loop: `python benchmarks/background_save.py [--quick]`.

(1) ResNet-50 at 100 px (global batch 32, Fruits-360 4-class subset, one rank): one run of `--max_steps 60
    --save_every_steps 50`. Its step 50 is saved in the background (the loop waits for the replica check
    and the in-memory copy only) and its last step by the ordinary blocking save, so one run measures both
    on the same state. Each cost is the loop's wait per save over the 50 steps between saves; the
    background one adds the slowdown of the steps run while the write was in flight.
(2) The tiny test model, 600 steps with `--save_every_steps 50`: the step loop's cost of the background
    writes apart from the copy, measured within that run (so a change of load between runs, on a shared
    machine, does not count): the time the steps run while a write was in flight took beyond the run's
    median step, over the run's total (bound: <= 1%). A run without saves gives the median step beside it.

Per-step times come from metrics.jsonl (`--log_every 1`), the waits from the rank log. Prints the
numbers and the load average; the last line is their JSON.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "fruits360-4"))
TINY_DATA = os.path.join(REPO, "tests", "data", "fruits360-mini")
EVERY = 50
_WAITED = re.compile(r"save by steps at global step (\d+): the loop waited ([\d.]+) s")
_WRITTEN = re.compile(r"saved \S+ in the background in ([\d.]+) s")
_BLOCKING = re.compile(r"blocking save at global step (\d+) took ([\d.]+) s")


def _train(args, output_dir) -> dict:
    """Run msdist.train standalone; per-step times (global step -> s) and the save figures from its log."""
    subprocess.run([sys.executable, "-m", "msdist.train", *args, "--log_every", "1", "--output_dir", output_dir],
                   check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL)
    steps = {}
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "step":
                steps[record["global_step"]] = record["rank_step_s"][0]
    with open(os.path.join(output_dir, "logs", "rank_0.log"), encoding="utf-8") as f:
        log = f.read()
    return {"steps": steps, "waited": [float(s) for _, s in _WAITED.findall(log)],
            "written": [float(s) for s in _WRITTEN.findall(log)],
            "blocking": [float(s) for _, s in _BLOCKING.findall(log)]}


def _write_overlap(steps: dict, saved_at: list, written: list, median: float) -> float:
    """Seconds the steps run while each background write was in flight took beyond the run's median step
    (at least the step right after each save)."""
    extra = 0.0
    for at, write_s in zip(saved_at, written):
        elapsed, g = 0.0, at + 1
        while g in steps and (g == at + 1 or elapsed < write_s):
            extra += steps[g] - median
            elapsed += steps[g]
            g += 1
    return extra


def resnet50(tmp: str, data_dir: str, max_steps: int) -> dict:
    run = _train(["--model", "resnet50", "--image_size", "100", "--batch_size", "32", "--data_dir", data_dir,
                  "--epochs", "100", "--max_steps", str(max_steps), "--save_every_steps", str(EVERY)],
                 os.path.join(tmp, "resnet50"))
    steps = run["steps"]
    step_s = statistics.median(steps[g] for g in range(EVERY - 9, EVERY + 1))   # before the save
    slowdown = _write_overlap(steps, [EVERY], run["written"], step_s)
    per_window = EVERY * step_s
    return {"step_s": round(step_s, 3), "blocking_save_s": run["blocking"][-1],
            "background_wait_s": run["waited"][0], "background_write_s": run["written"][0],
            "steps_during_write_extra_s": round(slowdown, 3),
            "blocking_cost": round(run["blocking"][-1] / per_window, 4),
            "background_cost": round((run["waited"][0] + max(slowdown, 0.0)) / per_window, 4)}


def tiny(tmp: str, epochs: int) -> dict:
    args = ["--config", os.path.join(REPO, "configs", "tiny_test.yaml"), "--data_dir", TINY_DATA, "--epochs",
            str(epochs), "--save_every_epochs", str(epochs)]
    plain = _train(args, os.path.join(tmp, "tiny_plain"))
    saving = _train(args + ["--save_every_steps", str(EVERY)], os.path.join(tmp, "tiny_saving"))
    median = statistics.median(saving["steps"].values())
    total = sum(saving["steps"].values())
    saved_at = list(range(EVERY, len(saving["steps"]) + 1, EVERY))[:len(saving["written"])]
    # Within the saving run, so a load change between the two runs does not count: the steps that ran
    # while a write was in flight, beyond the run's median step.
    overlap = _write_overlap(saving["steps"], saved_at, saving["written"], median)
    return {"steps": len(saving["steps"]), "saves": len(saving["waited"]), "median_step_s": round(median, 4),
            "plain_median_step_s": round(statistics.median(plain["steps"].values()), 4),
            "total_s": round(total, 3), "copies_s": round(sum(saving["waited"]), 3),
            "writes_s": round(sum(saving["written"]), 3), "steps_during_writes_extra_s": round(overlap, 3),
            "cost_apart_from_copy": round(overlap / total, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (ResNet-50 55, tiny 25 epochs)")
    parser.add_argument("--data_dir", default=DATA_DIR, help=f"the Fruits-360 4-class subset [{DATA_DIR}]")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="msdist-bgsave-") as tmp:
        figures = {"load_before": os.getloadavg()[0],
                   "resnet50": resnet50(tmp, ns.data_dir, 55 if ns.quick else 60),
                   "tiny": tiny(tmp, 25 if ns.quick else 50),
                   "load_after": os.getloadavg()[0]}
    r50, small = figures["resnet50"], figures["tiny"]
    print(f"ResNet-50 100 px: {r50['step_s']} s/step; every {EVERY} steps a blocking save stops the loop "
          f"{r50['blocking_save_s']} s ({r50['blocking_cost']:.2%}), a background save {r50['background_wait_s']} s "
          f"for the copy + {r50['steps_during_write_extra_s']} s slower steps while it writes "
          f"{r50['background_write_s']} s ({r50['background_cost']:.2%})")
    print(f"tiny: {small['steps']} steps of median {small['median_step_s']} s ({small['plain_median_step_s']} s in "
          f"the run without saves), {small['saves']} background saves: copies {small['copies_s']} s, writes "
          f"{small['writes_s']} s, steps during the writes {small['steps_during_writes_extra_s']:+} s beyond the "
          f"median of {small['total_s']} s: {small['cost_apart_from_copy']:+.2%} apart from the copy (bound <= 1%)")
    print(f"load average {figures['load_before']:.1f} before, {figures['load_after']:.1f} after")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
