"""Input pipeline throughput on a Fruits-360-sized tree, msdist vs native: `python benchmarks/input_pipeline.py`.

msdist's training pipeline (`msdist.data.bench`) against MindSpore's own `ImageFolderDataset` with the same
transforms (decode, resize, pad-4 random crop, horizontal flip, normalize, HWC2CHW, batch 64) at 1, 2 and 4
workers (those beyond this host's cores are skipped: MindSpore refuses them), with and without augmentation,
then the cost of each regularization option. Start-up (build to first batch) and steady img/s (after the
first batch) are measured apart; each figure is the median of `--trials` epochs, msdist and native
alternating in one process (A B B A ...) so that load from other processes hits both alike, and the ratio
is the median of the per-trial ratios. CPU us/img (process CPU time, all threads, steady part) is printed too: a shared
host inflates it far less than wall time. The tables go to benchmarks/results/input_pipeline.md unless
`--no_write`.

Data: a synthesized tree of Fruits-360's size (131 classes, 67,727 training images at 100x100:
`python -m msdist.data synth DIR --classes 131 --per_class 517`), made on first use in the gitignored
`data/fruits360-synth/` (about 2-3 minutes, 520 MB) unless `--data_dir` points elsewhere.
"""
import argparse
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DATA_DIR = os.path.join(REPO, "data", "fruits360-synth")
DOC = os.path.join(REPO, "benchmarks", "results", "input_pipeline.md")
BEGIN, END = "<!-- input_pipeline: begin -->", "<!-- input_pipeline: end -->"
CLASSES, PER_CLASS = 131, 517     # Fruits-360: 131 classes, 67,692 training images
IMAGE_SIZE, BATCH = 100, 64
OPTIONS = {"random_resized": dict(train_crop="random_resized"), "color_jitter 0.4": dict(color_jitter=0.4),
           "mixup 0.2": dict(mixup=0.2), "cutmix 1.0": dict(cutmix=1.0)}


def ensure_data(data_dir: str) -> None:
    if os.path.isdir(os.path.join(data_dir, "Training")):
        return
    from msdist.data.synth import synthesize
    print(f"synthesizing a Fruits-360-sized tree in {data_dir} ({CLASSES} classes x {PER_CLASS} training images; "
          "about 2-3 minutes, 520 MB)", flush=True)
    synthesize(data_dir, CLASSES, PER_CLASS)


def one_epoch(make_epoch) -> tuple:
    """(start-up s, steady img/s, steady CPU us/img) of one epoch."""
    from msdist.data import bench
    rate = bench.measure(make_epoch, 1)
    return rate.startup_s, rate.steady, rate.cpu_us


def compare(setup, workers: int, trials: int) -> dict:
    from msdist.data import bench
    makers = {"msdist": bench.train_epoch_maker(setup, workers), "native": bench.native_epoch_maker(setup, workers)}
    runs = {"msdist": [], "native": []}
    for trial in range(trials):  # alternating A B B A ..., so load from other processes hits both alike
        for name in (("msdist", "native") if trial % 2 == 0 else ("native", "msdist")):
            runs[name].append(one_epoch(makers[name]))
    out = {"ratio": statistics.median(m[1] / n[1] for m, n in zip(runs["msdist"], runs["native"]))}
    for name, rows in runs.items():
        for i, key in enumerate(("startup", "steady", "cpu_us")):
            out[f"{name}_{key}"] = statistics.median(r[i] for r in rows)
    return out


def option_costs(data_dir: str, classes: int, workers: int, trials: int) -> list:
    """Steady img/s and CPU us/img of each regularization option next to plain crop + flip, alternating."""
    from msdist.data import bench
    from msdist.data.augment import Regularization
    setups = {"crop + flip": bench.Setup(data_dir, IMAGE_SIZE, True, BATCH)}
    for name, option in OPTIONS.items():
        setups[name] = bench.Setup(data_dir, IMAGE_SIZE, True, BATCH,
                                   regularization=Regularization(num_classes=classes, **option))
    runs = {name: [] for name in setups}
    for _ in range(trials):
        for name, setup in setups.items():
            runs[name].append(one_epoch(bench.train_epoch_maker(setup, workers)))
    base = statistics.median(r[1] for r in runs["crop + flip"])
    return [{"option": name, "steady": statistics.median(r[1] for r in rows),
             "relative": statistics.median(r[1] for r in rows) / base,
             "cpu_us": statistics.median(r[2] for r in rows)} for name, rows in runs.items()]


def tables(rows: list, options: list, data_dir: str, images: int, classes: int, cores: int, skipped: list,
           trials: int) -> str:
    lines = [f"Data: `{data_dir}`, {images} training images in {classes} classes (synthesized at Fruits-360's size), "
             f"{IMAGE_SIZE}x{IMAGE_SIZE}, batch {BATCH}, one rank, {cores} cores (load average "
             f"{os.getloadavg()[0]:.1f} at the end, this benchmark's own threads included); medians of {trials} epoch(s) each. Steady img/s counts from each "
             "epoch's first batch; start-up is the time from building the epoch's pipeline to that batch.", "",
             "| workers | augment | msdist steady img/s | native steady img/s | msdist / native | msdist start-up s "
             "| native start-up s | msdist CPU us/img | native CPU us/img |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['augment']} | {r['msdist_steady']:.0f} | {r['native_steady']:.0f} | "
                     f"{r['ratio']:.2f} | {r['msdist_startup']:.2f} | {r['native_startup']:.2f} | "
                     f"{r['msdist_cpu_us']:.0f} | {r['native_cpu_us']:.0f} |")
    if skipped:
        lines += ["", f"Not measured: {', '.join(map(str, skipped))} workers (more than this host's {cores} cores; "
                  "MindSpore refuses num_parallel_workers above the core count)."]
    lines += ["", f"Regularization options (augment on, {max(r['workers'] for r in rows)} workers, msdist only):", "",
              "| option | steady img/s | vs crop + flip | CPU us/img |", "|---|---|---|---|"]
    for o in options:
        lines.append(f"| {o['option']} | {o['steady']:.0f} | {o['relative']:.2f} | {o['cpu_us']:.0f} |")
    return "\n".join(lines)


def write_section(text: str) -> None:
    with open(DOC, encoding="utf-8") as f:
        doc = f.read()
    section = f"{BEGIN}\n{text}\n{END}"
    doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, doc, flags=re.S)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=DATA_DIR, help=f"ImageFolder root, synthesized when absent "
                                                             f"(default {DATA_DIR})")
    parser.add_argument("--trials", type=int, default=3, help="epochs per pipeline and setting (default 3)")
    parser.add_argument("--no_write", action="store_true", help="print the tables only")
    args = parser.parse_args()
    ensure_data(args.data_dir)
    from msdist.rank import runtime
    runtime.prepare_tool()
    from msdist.data import bench, pipeline
    classes = pipeline.class_map(args.data_dir)
    images = len(pipeline.list_split(args.data_dir, pipeline.TRAIN_SPLIT, classes))
    print(f"data: {args.data_dir} ({images} training images)", flush=True)
    warm = bench.Setup(args.data_dir, IMAGE_SIZE, True, BATCH)
    bench.measure(bench.train_epoch_maker(warm, 1), 1)   # the first pipeline of a process pays MindSpore's start-up
    cores = os.cpu_count() or 1
    rows = []
    for workers in (w for w in (1, 2, 4) if w <= cores):
        for augment in (False, True):
            result = compare(bench.Setup(args.data_dir, IMAGE_SIZE, augment, BATCH), workers, args.trials)
            rows.append({"workers": workers, "augment": str(augment).lower(), **result})
            print(f"workers {workers} augment {augment!s:5}: msdist {result['msdist_steady']:.0f} img/s, native "
                  f"{result['native_steady']:.0f} img/s, ratio {result['ratio']:.2f}", flush=True)
    options = option_costs(args.data_dir, len(classes), min(cores, 4), args.trials)
    text = tables(rows, options, args.data_dir, images, len(classes), cores, [w for w in (1, 2, 4) if w > cores],
                  args.trials)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
