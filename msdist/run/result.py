"""How a run ends: its result file (train's result.json, eval's eval_result.json) and the console's closing block."""
import json
import os
from typing import Optional, Sequence, Tuple

from msdist.base.files import atomic_write_text
from msdist.run.progress import format_duration


def input_wait_line(summary: dict) -> str:
    """`input wait rank 1 waited most: 12.0% of its time | rank 0: 0.031 s/step, 1.0% | ...`, or "" without figures.

    Args:
        summary: `meter.RankFigures.summary()` (or a result holding its fields).
    """
    if not summary.get("ranks"):
        return ""
    most = summary["ranks"][summary["most_input_wait_rank"]]
    per_rank = " | ".join(f"rank {r['rank']}: {r['median_step_s']:.3f} s/step, {100 * r['input_wait_share']:.1f}%"
                          for r in summary["ranks"])
    return (f"input wait rank {most['rank']} waited most: {100 * most['input_wait_share']:.1f}% of its time | "
            f"{per_rank}")


def summary_block(title: str, metrics: dict, *, world_size: int, wall_seconds: float,
                  images_per_sec: Optional[float] = None, files: Sequence[Tuple[str, str]] = ()) -> str:
    """The few lines that end a run on the console: the job's result and where its outputs are.

    Args:
        title: e.g. "msdist.train done".
        metrics: the job's evaluation (`accuracy`, `correct`, `num_samples`, `loss`, and `top5_accuracy` if present).
        files: (label, path) pairs; those that do not exist are left out.
    """
    accuracy = f"top-1 {metrics['accuracy']:.4f} ({metrics['correct']}/{metrics['num_samples']} test images)"
    if "top5_accuracy" in metrics:
        accuracy += f" | top-5 {metrics['top5_accuracy']:.4f}"
    speed = f" | {images_per_sec:.1f} img/s" if images_per_sec else ""
    lines = [f"== {title} ==", f"accuracy   {accuracy}", f"loss       {metrics['loss']:.4f}",
             f"job        {world_size} rank(s){speed} | wall time {format_duration(wall_seconds)}"]
    waits = input_wait_line(metrics)
    if waits:
        lines.append(waits)
    width = max((len(label) for label, _ in files), default=0)
    lines += [f"{label.ljust(max(width, 10))} {path}" for label, path in files if path and os.path.exists(path)]
    return "\n".join(lines)


def write_result(path: str, result: dict, title: str, files: Sequence[Tuple[str, str]], *, wall_seconds: float,
                 images_per_sec: Optional[float] = None) -> None:
    """Write a run's result file atomically (a reader never sees half of it), then the console's closing block:
    the job's accuracy and where everything is (`files`: (label, path) pairs after the result)."""
    atomic_write_text(path, json.dumps(result, indent=2))
    print(f"eval result: {{'accuracy': {result['accuracy']:.4f}}}", flush=True)
    print(summary_block(title, result, world_size=result["world_size"], wall_seconds=wall_seconds,
                        images_per_sec=images_per_sec, files=[("result", path), *files]), flush=True)
