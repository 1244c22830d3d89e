"""`python -m msdist.report OUTPUT_DIR [OUTPUT_DIR ...]`: curves and a one-screen summary of runs.

Reads what a run leaves in its output directory: `metrics.jsonl` (written by rank 0 while it
trains, so a running job can be reported too), `config.yaml` and, once finished, `result.json`.
Draws loss, accuracy, learning rate and throughput against epoch into one PNG, every run overlaid
in its own colour, and prints config, world size, best and final accuracy, time and img/s.
When result.json holds the per-class counts (confusion matrix), a second PNG,
`{OUTPUT_DIR}/classes.png`, shows the confusion matrix and each class's accuracy. A run of several ranks gets
`{OUTPUT_DIR}/ranks.png`: each rank's step time and input-wait share over the run, the log windows in which
a rank was named slow (run/stragglers.py) shaded.
Needs matplotlib: `pip install 'msdist[report]'`.
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import yaml

from msdist.base.args import ArgumentParser
from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError, DataError
from msdist.run.metrics import METRICS_FILE
from msdist.run.progress import format_duration

# Options every summary shows; any other option whose value differs between the runs is added.
_KEY_OPTIONS = ("model", "image_size", "batch_size", "epochs", "lr", "scale_lr", "lr_schedule", "sync_bn", "seed")
# Options that name places or logging, never a difference worth reporting.
_IGNORED_OPTIONS = {"config", "data_dir", "output_dir", "ckpt_prefix", "resume", "log_every", "verbose",
                    "tensorboard", "keep_checkpoint_max"}


@dataclass
class Run:
    """One output directory, read back."""
    path: str
    label: str
    config: dict
    result: Optional[dict]
    world_size: Optional[int]
    steps: List[dict] = field(default_factory=list)
    epochs: List[dict] = field(default_factory=list)
    stragglers: List[dict] = field(default_factory=list)   # the `straggler` records: a rank named slow

    def best_accuracy(self) -> Optional[tuple]:
        """(accuracy, epoch) of the best evaluation, None when the run never evaluated."""
        scored = [(e["val_accuracy"], e["epoch"]) for e in self.epochs if "val_accuracy" in e]
        if self.result is not None:  # the final evaluation; a run stopped by max_steps has no epoch record of it
            scored.append((self.result["accuracy"], self.epochs[-1]["epoch"] if self.epochs else self.result["epochs"]))
        return max(scored, key=lambda s: s[0]) if scored else None

    def final_accuracy(self) -> Optional[float]:
        if self.result is not None:
            return self.result["accuracy"]
        scored = [e["val_accuracy"] for e in self.epochs if "val_accuracy" in e]
        return scored[-1] if scored else None

    def train_seconds(self) -> Optional[float]:
        if self.result is not None:
            return self.result.get("train_seconds")
        return sum(e["epoch_seconds"] for e in self.epochs) if self.epochs else None

    def images_per_sec(self) -> Optional[float]:
        if self.result is not None:
            return self.result.get("images_per_sec")
        return self.epochs[-1]["images_per_sec"] if self.epochs else None


def _epoch_axis(record: dict) -> float:
    """Fractional epochs done at a record: a step line half-way through epoch 3 sits at 2.5."""
    return record["epoch"] - 1 + record["step"] / record["steps_per_epoch"]


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_run(path: str, label: Optional[str] = None) -> Run:
    """Read one output directory.

    Raises:
        DataError: the directory has no metrics.jsonl, or a line of it is not JSON.
    """
    metrics = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(metrics):
        raise DataError(f"{path!r} has no {METRICS_FILE}; pass the --output_dir of an msdist.train run")
    records = []
    with open(metrics, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    raise DataError(f"{metrics}:{number} is not a JSON object; the file is damaged") from None
    config_path = os.path.join(path, "config.yaml")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    result = _read_json(os.path.join(path, "result.json"))
    starts = [r for r in records if r["kind"] == "run"]
    world = result["world_size"] if result else (starts[-1]["world_size"] if starts else None)
    name = label or os.path.basename(os.path.normpath(path))
    return Run(path, name if world is None else f"{name} ({world}p)", config, result, world,
               [r for r in records if r["kind"] == "step"], [r for r in records if r["kind"] == "epoch"],
               [r for r in records if r["kind"] == "straggler"])


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _duration(seconds: Optional[float]) -> str:
    return "-" if seconds is None else format_duration(seconds)


def summary(runs: Sequence[Run]) -> str:
    """The text summary: shared and differing config, then one row per run."""
    configs = [r.config for r in runs]
    keys = [k for k in _KEY_OPTIONS if any(k in c for c in configs)]
    differing = sorted({k for c in configs for k in c if k not in _IGNORED_OPTIONS and k not in keys
                        and len({json.dumps(x.get(k)) for x in configs}) > 1})
    lines = []
    for run in runs:
        shown = " ".join(f"{k}={run.config[k]}" for k in keys + differing if k in run.config)
        lines.append(f"{run.label}: {run.path}")
        lines.append(f"    {shown or '(no config.yaml)'}")
    header = f"{'run':<24} {'world':>5} {'best acc (epoch)':>17} {'final acc':>9} {'train time':>10} {'img/s':>9}"
    lines += ["", header, "-" * len(header)]
    for run in runs:
        best = run.best_accuracy()
        best_text = "-" if best is None else f"{best[0]:.4f} ({best[1]})"
        lines.append(f"{run.label:<24} {_fmt(run.world_size):>5} {best_text:>17} {_fmt(run.final_accuracy(), '.4f'):>9}"
                     f" {_duration(run.train_seconds()):>10} {_fmt(run.images_per_sec(), '.1f'):>9}")
    return "\n".join(lines)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("the report needs matplotlib: pip install 'msdist[report]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def plot(runs: Sequence[Run], out_path: str) -> None:
    """Write the 2x2 figure: loss, accuracy, learning rate and throughput against epoch."""
    plt = _import_pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (ax_loss, ax_acc), (ax_lr, ax_speed) = axes
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps_x = [_epoch_axis(r) for r in run.steps]
        evals = [e for e in run.epochs if "val_accuracy" in e]
        evals_x = [_epoch_axis(e) for e in evals]
        ax_loss.plot(steps_x, [r["loss"] for r in run.steps], color=color, alpha=0.35, linewidth=1)
        ax_loss.plot([_epoch_axis(e) for e in run.epochs], [e["train_loss"] for e in run.epochs], color=color,
                     marker="o", label=f"{run.label} train")
        ax_loss.plot(evals_x, [e["val_loss"] for e in evals], color=color, marker="s", linestyle="--",
                     label=f"{run.label} val")
        ax_acc.plot(evals_x, [e["val_accuracy"] for e in evals], color=color, marker="o", label=run.label)
        ax_lr.plot(steps_x, [r["lr"] for r in run.steps], color=color, label=run.label)
        ax_speed.plot(steps_x, [r["images_per_sec"] for r in run.steps], color=color, alpha=0.6, label=run.label)
    titles = (("loss (thin: logged steps, o: epoch mean, --: val)", "loss"), ("validation accuracy", "accuracy"),
              ("learning rate", "lr"), ("throughput, all ranks", "images/s"))
    for ax, (title, ylabel) in zip(axes.flat, titles):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    ax_loss.set_yscale("log")  # the first epoch's losses would flatten the rest of the curve
    ax_acc.set_ylim(top=1.01)  # a run at 100% keeps its points inside the frame
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


RANKS_PNG = "ranks.png"


def plot_ranks(run: Run, out_path: str) -> None:
    """Write each rank's step time and input-wait share per log window against epoch; the windows in which a rank
    was slow (`slow_ranks` of the step records) shaded, and each rank named (`straggler` records) labelled."""
    plt = _import_pyplot()
    windows = [r for r in run.steps if "rank_step_s" in r]
    fig, (ax_step, ax_wait) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, constrained_layout=True)
    x = [_epoch_axis(r) for r in windows]
    for rank in range(max(len(r["rank_step_s"]) for r in windows)):  # a job that changed size: each rank's own
        held = [(at, r) for at, r in zip(x, windows) if rank < len(r["rank_step_s"])]
        for ax, key in ((ax_step, "rank_step_s"), (ax_wait, "rank_input_wait")):
            ax.plot([at for at, _ in held], [r[key][rank] for _, r in held], color=f"C{rank}", label=f"rank {rank}")
    for before, record in zip([0.0] + x, windows):
        for ax in (ax_step, ax_wait) if record.get("slow_ranks") else ():
            ax.axvspan(before, _epoch_axis(record), color="red", alpha=0.12, linewidth=0)
    at_step = {r["global_step"]: _epoch_axis(r) for r in windows}
    for named in run.stragglers:
        ax_step.annotate(f"rank {named['rank']} {named['verdict']}", (at_step.get(named["global_step"], 0),
                         named["step_s"]), fontsize="small", color="red")
    ax_step.set_title(f"{run.label}: seconds per step, each rank (shaded: a rank named slow)")
    ax_wait.set_title("share of each rank's step spent waiting for input")
    ax_step.set_ylabel("s/step")
    ax_wait.set_ylabel("input wait")
    ax_wait.set_ylim(0, 1)
    ax_wait.set_xlabel("epoch")
    for ax in (ax_step, ax_wait):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


CLASSES_PNG = "classes.png"


def plot_classes(result: dict, out_path: str, title: str = "") -> None:
    """Write the confusion matrix (counts, true class by predicted class) and per-class accuracy as one PNG.

    Args:
        result: a result.json / eval_result.json with `confusion_matrix` and, optionally, `classes`.
    """
    plt = _import_pyplot()
    confusion = result["confusion_matrix"]
    n = len(confusion)
    names = result.get("classes") or [str(i) for i in range(n)]
    per_class = [row[i] / sum(row) if sum(row) else 0.0 for i, row in enumerate(confusion)]
    side = min(4 + 0.4 * n, 30)  # large class counts stay readable up to a point, then the labels shrink
    fig, (ax_cm, ax_acc) = plt.subplots(1, 2, figsize=(2 * side, side), constrained_layout=True)
    image = ax_cm.imshow(confusion, cmap="Blues")
    fig.colorbar(image, ax=ax_cm, shrink=0.8)
    if n <= 30:  # beyond that the numbers would overlap; the colours still tell
        peak = max(max(row) for row in confusion) or 1
        for i, row in enumerate(confusion):
            for j, count in enumerate(row):
                ax_cm.text(j, i, str(count), ha="center", va="center", fontsize="small",
                           color="white" if count > peak / 2 else "black")
    ax_cm.set_xticks(range(n), names, rotation=90)
    ax_cm.set_yticks(range(n), names)
    ax_cm.set_xlabel("predicted class")
    ax_cm.set_ylabel("true class")
    ax_cm.set_title(f"{title} confusion matrix ({sum(map(sum, confusion))} test images)".strip())
    ax_acc.barh(range(n), per_class, color="C0")
    ax_acc.set_yticks(range(n), names)
    ax_acc.invert_yaxis()  # same class order top to bottom as the matrix
    ax_acc.set_xlim(0, 1)
    ax_acc.set_xlabel("accuracy")
    ax_acc.set_title(f"per-class accuracy (top-1 {result['accuracy']:.4f}, top-5 {result['top5_accuracy']:.4f})")
    ax_acc.grid(axis="x", alpha=0.3)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = ArgumentParser(prog="msdist.report", allow_abbrev=False,
                     description="Curves (report.png) and a text summary of one or more msdist.train runs; "
                                 "several OUTPUT_DIRs are overlaid.")
    parser.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="a run's --output_dir")
    parser.add_argument("--out", default="", help="PNG to write [OUTPUT_DIR/report.png for one run, "
                                                  "./report.png for several]")
    parser.add_argument("--label", action="append", default=[],
                        help="legend name of each run, in order (repeat the option) [the directory name]")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.label and len(args.label) != len(args.output_dirs):
        raise ConfigError(f"got {len(args.label)} --label for {len(args.output_dirs)} OUTPUT_DIRs; give one per run")
    return args


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    labels = args.label or [None] * len(args.output_dirs)
    runs = [load_run(path, label) for path, label in zip(args.output_dirs, labels)]
    out = args.out or (os.path.join(args.output_dirs[0], "report.png") if len(runs) == 1 else "report.png")
    plot(runs, out)
    print(summary(runs))
    print(f"\nwrote {out}")
    for run in runs:
        if any(len(r.get("rank_step_s", ())) > 1 for r in run.steps):
            ranks_out = os.path.join(run.path, RANKS_PNG)
            plot_ranks(run, ranks_out)
            print(f"wrote {ranks_out}")
        if run.result is not None and "confusion_matrix" in run.result:
            classes_out = os.path.join(run.path, CLASSES_PNG)
            plot_classes(run.result, classes_out, run.label)
            print(f"wrote {classes_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
