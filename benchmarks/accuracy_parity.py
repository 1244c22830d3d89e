"""N cards = 1 card on real data: paired seeds, a confidence interval and an equivalence verdict.

    python benchmarks/accuracy_parity.py --data_dir DIR --output_dir OUT [--ranks 2] [--seeds 1,2,3,4,5]
        [--model resnet18 --image_size 64 --epochs 3 --batch_size 128 --lr 0.1 --warmup_epochs 0.5] [--margin 0.5]

Three arms train side by side on the image folder DIR, with the same global batch, learning rate and schedule:
1 rank; N ranks with per-rank BatchNorm (msdist's default); N ranks with `--sync_bn true`. Every arm runs every
seed, and a seed's runs are paired: they start from the same weights and train on the same global batches in
the same order. Each run's result.json says so (`pairing`: a checksum of its initial weights and a digest of
every global batch) and the benchmark checks it; an unpaired run is named and left out.

Per arm: the mean accuracy over the seeds. Per N-rank arm: the mean paired difference to 1 rank (points), its 95%
confidence interval (Student's t over the seeds' differences) and an equivalence verdict against +-margin by two
one-sided t-tests (TOST, alpha 0.05, the same as the 90% interval lying inside the margin). Read the margin against
the noise floor printed beside it: the 1-rank seed spread and the test set's own sampling error sqrt(p(1-p)/n).

With `-- --eval_every_epochs 1` every run is evaluated after each epoch, and a second table gives the paired
differences epoch by epoch: at which stage of training the arms part and whether they meet again.

It runs a stated number of epochs. It resumes where it stopped: a run with a result.json is done and read again;
an unfinished run continues from its newest checkpoint (`--resume auto`). It writes OUT/parity.json and
OUT/parity.md after every run, so a partial table is always there.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from scipy import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from msdist import report  # noqa: E402  after the path: this checkout's msdist
from msdist.run.metrics import METRICS_FILE  # noqa: E402
ALPHA = 0.05
ONE_RANK = "1 rank"


def arm_names(ranks: int) -> List[str]:
    return [ONE_RANK, f"{ranks} ranks", f"{ranks} ranks, sync_bn"]


def paired_difference(baseline: Sequence[float], arm: Sequence[float], margin: float) -> dict:
    """The arm's accuracy minus the baseline's, seed by seed, in points: mean, 95% interval, TOST verdict.

    Args:
        baseline, arm: accuracies (0-1) of the same seeds, in the same order.
        margin: the equivalence margin in points (+-).

    Returns:
        mean, sd, the 95% interval (low, high), the TOST p-value (the larger of the two one-sided tests) and the
        verdict: "equivalent" (TOST p < 0.05), "worse" or "better" (the 95% interval lies beyond the margin's
        side of zero and excludes zero), else "inconclusive". With fewer than 2 pairs there is no interval.
    """
    diffs = [100.0 * (b - a) for a, b in zip(baseline, arm)]
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else None
    if n < 2:
        return {"pairs": n, "mean": mean, "sd": None, "ci95": None, "tost_p": None, "verdict": "inconclusive"}
    sd, se, (low, high) = t_interval(diffs)
    if se == 0.0:  # every seed moved by the same amount: the interval is that point
        p_tost = 0.0 if -margin < mean < margin else 1.0
    else:
        p_tost = max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1))
    if p_tost < ALPHA:
        verdict = "equivalent"
    elif high < 0 and mean < -margin:
        verdict = "worse"
    elif low > 0 and mean > margin:
        verdict = "better"
    else:
        verdict = "inconclusive"
    return {"pairs": n, "mean": mean, "sd": sd, "ci95": [low, high], "tost_p": p_tost, "verdict": verdict,
            "decidable_margin": stats.t.ppf(1 - ALPHA, n - 1) * se, "seeds_for_margin": seeds_for_margin(sd, margin)}


def t_interval(diffs: Sequence[float]) -> tuple:
    """sd, standard error and the 95% Student's t interval of the mean of 2 or more paired differences."""
    n, mean, sd = len(diffs), statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = stats.t.ppf(1 - ALPHA / 2, n - 1) * se
    return sd, se, (mean - half, mean + half)


def loss_difference(baseline: Sequence[dict], arm: Sequence[dict]) -> Optional[dict]:
    """The arm's test loss minus the baseline's, seed by seed (their result.json): mean and 95% interval; None
    under 2 pairs or without losses. A loss that rises where accuracy falls says the arm fits worse, not only
    that its close calls fell the other way."""
    if len(arm) < 2 or not all("loss" in run for run in [*baseline, *arm]):
        return None
    diffs = [b["loss"] - a["loss"] for a, b in zip(baseline, arm)]
    return {"mean": statistics.fmean(diffs), "ci95": list(t_interval(diffs)[2])}


def seeds_for_margin(sd: float, margin: float, most: int = 100000) -> int:
    """How many paired seeds TOST needs to show equivalence within +-`margin` points when the paired differences
    have this `sd` and their true mean is 0: the least n with t(1 - alpha, n - 1) * sd / sqrt(n) < margin.
    (The run's own `decidable_margin` is that half-width at its n: the narrowest margin it could confirm.)"""
    n = 2
    while n < most and stats.t.ppf(1 - ALPHA, n - 1) * sd / math.sqrt(n) >= margin:
        n = n + 1 if n < 100 else int(n * 1.05) + 1
    return n


def sampling_error(accuracy: float, test_images: int) -> float:
    """The test set's own standard error of an accuracy, in points: sqrt(p(1-p)/n)."""
    return 100.0 * math.sqrt(accuracy * (1 - accuracy) / test_images)


def paired_seeds(results: Dict[str, Dict[int, dict]], arm: str) -> tuple:
    """The seeds at which `arm` and 1 rank both finished and are paired, and the names of the unpaired runs."""
    seeds, unpaired = [], []
    for seed, result in sorted(results[arm].items()):
        base = results[ONE_RANK].get(seed)
        if base is None:
            continue
        if result.get("pairing") != base.get("pairing"):
            unpaired.append(f"{arm} seed {seed}")
        else:
            seeds.append(seed)
    return seeds, unpaired


def summarize(results: Dict[str, Dict[int, dict]], ranks: int, margin: float) -> dict:
    """Everything the table shows, from each finished run's result.json (arm -> seed -> result); a run not paired
    with the 1-rank run of its seed is named and left out of its arm."""
    arms, unpaired = {}, []
    for arm in arm_names(ranks):
        seeds = sorted(results[arm])
        if arm != ONE_RANK:
            seeds, bad = paired_seeds(results, arm)
            unpaired += bad
        accs = [results[arm][s]["accuracy"] for s in seeds]
        row = {"seeds": seeds, "accuracy": accs, "mean": statistics.fmean(accs) if accs else None,
               "sd_points": 100 * statistics.stdev(accs) if len(accs) > 1 else None}
        if arm != ONE_RANK:
            row["vs_1_rank"] = paired_difference([results[ONE_RANK][s]["accuracy"] for s in seeds], accs, margin)
            row["loss_vs_1_rank"] = loss_difference([results[ONE_RANK][s] for s in seeds],
                                                    [results[arm][s] for s in seeds])
        arms[arm] = row
    one = arms[ONE_RANK]
    by_epoch = stages(results, {arm: row["seeds"] for arm, row in arms.items() if arm != ONE_RANK}, margin)
    noise = {}
    if one["accuracy"]:
        test_images = next(iter(results[ONE_RANK].values()))["num_samples"]
        noise = {"one_rank_spread_points": [100 * min(one["accuracy"]), 100 * max(one["accuracy"])],
                 "one_rank_sd_points": one["sd_points"], "test_images": test_images,
                 "sampling_error_points": sampling_error(one["mean"], test_images)}
    return {"margin_points": margin, "alpha": ALPHA, "arms": arms, "noise_floor": noise, "unpaired": unpaired,
            "by_epoch": by_epoch}


def stages(results: Dict[str, Dict[int, dict]], paired: Dict[str, List[int]], margin: float) -> List[dict]:
    """Epoch by epoch, the 1-rank mean accuracy and each N-rank arm's paired difference to 1 rank (over its
    `paired` seeds that evaluated that epoch), from the accuracies evaluated after every epoch (`by_epoch`); the
    epochs are those every 1-rank run evaluated."""
    one = results[ONE_RANK]
    epochs = sorted(set.intersection(*(set(r.get("by_epoch", {})) for r in one.values()))) if one else []
    rows = []
    for epoch in epochs:
        row = {"epoch": epoch, "one_rank_mean": statistics.fmean(r["by_epoch"][epoch] for r in one.values())}
        for arm, seeds in paired.items():
            seeds = [s for s in seeds if epoch in results[arm][s].get("by_epoch", {})]
            row[arm] = paired_difference([one[s]["by_epoch"][epoch] for s in seeds],
                                         [results[arm][s]["by_epoch"][epoch] for s in seeds], margin)
        rows.append(row)
    return rows


def epoch_accuracies(run_dir: str) -> Dict[int, float]:
    """The accuracy evaluated after each epoch (the run's metrics.jsonl, `--eval_every_epochs`, read by
    `msdist.report`); an epoch run again after a resume counts once, as it ended last."""
    if not os.path.isfile(os.path.join(run_dir, METRICS_FILE)):
        return {}
    return {e["epoch"]: e["val_accuracy"] for e in report.load_run(run_dir).epochs if "val_accuracy" in e}


def table(summary: dict, setup: str) -> str:
    """The markdown table of `summarize`'s result."""
    lines = [setup, "",
             "| arm | seeds | accuracy, mean | paired difference vs 1 rank (points) | 95% CI | TOST p | verdict |",
             "|---|---|---|---|---|---|---|"]
    for arm, row in summary["arms"].items():
        mean = f"{row['mean']:.4f}" if row["mean"] is not None else "-"
        diff = row.get("vs_1_rank")
        if diff is None or diff["mean"] is None:
            cells = ["-", "-", "-", "-"]
        else:
            ci = interval(diff["ci95"]) if diff["ci95"] else "-"
            p = f"{diff['tost_p']:.3f}" if diff["tost_p"] is not None else "-"
            cells = [f"{diff['mean']:+.2f}", ci, p, diff["verdict"]]
        lines.append(f"| {arm} | {len(row['seeds'])} | {mean} | " + " | ".join(cells) + " |")
    noise = summary["noise_floor"]
    if noise:
        lines += ["", f"Noise floor: 1-rank seeds span {noise['one_rank_spread_points'][0]:.2f}.."
                      f"{noise['one_rank_spread_points'][1]:.2f} % (sd "
                      f"{noise['one_rank_sd_points'] or 0:.2f} points); the test set's sampling error is "
                      f"{noise['sampling_error_points']:.2f} points ({noise['test_images']} images). "
                      f"Margin +-{summary['margin_points']} points, TOST at alpha {summary['alpha']}."]
    for arm, row in summary["arms"].items():
        diff = row.get("vs_1_rank")
        if diff and diff.get("decidable_margin") is not None:
            lines.append(f"{arm}: at this spread (sd {diff['sd']:.2f} points over {diff['pairs']} seeds) the "
                         f"narrowest margin TOST could confirm is +-{diff['decidable_margin']:.2f} points; "
                         f"+-{summary['margin_points']} needs about {diff['seeds_for_margin']} paired seeds.")
        loss = row.get("loss_vs_1_rank")
        if loss:
            lines.append(f"{arm}: test loss vs 1 rank {loss['mean']:+.4f} {interval(loss['ci95'], 4)} (95% CI).")
    if summary["unpaired"]:
        lines.append(f"Left out, not paired with the 1-rank run of their seed: {', '.join(summary['unpaired'])}.")
    if summary["by_epoch"]:
        arms = list(summary["arms"])[1:]
        lines += ["", "By epoch: paired difference vs 1 rank, points [95% CI]", "",
                  "| epoch | 1 rank, mean | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
        for row in summary["by_epoch"]:
            cells = [epoch_cell(row[arm]) for arm in arms]
            lines.append(f"| {row['epoch']} | {row['one_rank_mean']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def epoch_cell(diff: dict) -> str:
    """One arm's paired difference at one epoch: its mean and, from 2 seeds on, its 95% interval."""
    if diff["mean"] is None:
        return "-"
    return f"{diff['mean']:+.2f}" + (f" {interval(diff['ci95'])}" if diff["ci95"] else "")


def interval(ci: Sequence[float], digits: int = 2) -> str:
    return f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def train_command(arm: str, ranks: int, seed: int, run_dir: str, args) -> List[str]:
    """The msdist command of one run; every arm gets the same options but its rank count and sync_bn."""
    train = ["-m", "msdist.train", "--config", args.config, "--data_dir", args.data_dir, "--output_dir", run_dir,
             "--seed", str(seed), "--resume", "auto", "--sync_bn", "true" if arm.endswith("sync_bn") else "false",
             "--save_every_epochs", "1", "--log_every", "1000"]
    for name in ("model", "image_size", "epochs", "batch_size", "lr", "warmup_epochs"):
        if getattr(args, name) is not None:
            train += [f"--{name}", str(getattr(args, name))]
    train += args.train_args
    if arm == ONE_RANK:
        return [sys.executable] + train
    if args.launcher == "mpirun":
        return ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable] + train
    return [sys.executable, "-m", "msdist.launch", "-n", str(ranks)] + train[2:]


def run_once(arm: str, seed: int, args) -> dict:
    """One run, or its result.json if it finished before; an unfinished run resumes from its newest checkpoint."""
    run_dir = os.path.join(args.output_dir, arm.replace(" ", "_").replace(",", ""), f"seed{seed}")
    result_path = os.path.join(run_dir, "result.json")
    if not os.path.exists(result_path):
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        began = time.perf_counter()
        with open(os.path.join(args.output_dir, "runs.log"), "a", encoding="utf-8") as log:
            subprocess.run(train_command(arm, args.ranks, seed, run_dir, args), cwd=REPO, env=env, check=True,
                           stdout=log, stderr=subprocess.STDOUT)
        print(f"ran {arm} seed {seed} in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    with open(result_path, encoding="utf-8") as f:
        return json.load(f) | {"by_epoch": epoch_accuracies(run_dir)}


def write_outputs(results: dict, args) -> dict:
    summary = summarize(results, args.ranks, args.margin)
    summary["setup"] = {k: v for k, v in vars(args).items() if k != "train_args"} | {"train_args": args.train_args}
    setup = (f"{args.model or 'config model'}, {args.epochs or 'config'} epochs, global batch "
             f"{args.batch_size or 'config'}, data {os.path.abspath(args.data_dir)}")
    with open(os.path.join(args.output_dir, "parity.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    text = table(summary, setup)
    with open(os.path.join(args.output_dir, "parity.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return summary


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="an ImageFolder tree (Training/, Test/)")
    parser.add_argument("--output_dir", required=True, help="the runs and parity.json; rerun to resume")
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "resnet18_fruits360.yaml"))
    parser.add_argument("--ranks", type=int, default=2, help="the N of the N-rank arms")
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated; at least 5 for a verdict worth reading")
    parser.add_argument("--margin", type=float, default=0.5, help="equivalence margin, accuracy points")
    parser.add_argument("--launcher", choices=("msdist", "mpirun"), default="msdist")
    for name, kind in (("model", str), ("image_size", int), ("epochs", int), ("batch_size", int), ("lr", float),
                       ("warmup_epochs", float)):
        parser.add_argument(f"--{name}", type=kind, default=None, help="default: the config's")
    parser.add_argument("train_args", nargs="*", help="after --: more msdist.train options, the same for every arm")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    results = {arm: {} for arm in arm_names(args.ranks)}
    for seed in (int(s) for s in args.seeds.split(",")):  # seed by seed: each finished seed is a pair
        for arm in results:
            results[arm][seed] = run_once(arm, seed, args)
            summary = write_outputs(results, args)
    print(table(summary, f"written {os.path.join(args.output_dir, 'parity.json')}"), end="")
    return summary


if __name__ == "__main__":
    main()
