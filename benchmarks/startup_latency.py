"""Time to the first training step, launch after launch: `python benchmarks/startup_latency.py [--runs N]`.

Issue #34 item 1: one launch in four waited 90-110 s in start-up. This launches 2 ranks of
`msdist.train --config configs/tiny_test.yaml --max_steps 2` on tests/data/fruits360-mini N times
each under msdist.launch, mpirun and msrun, and prints, per launcher, the p50, p95 and maximum
seconds from the launch command to rank 0's first logged step (the first "step" record of
metrics.jsonl, written at step 2 with --max_steps 2), how many launches failed, and the lag between
the two ranks' registrations as the scheduler logged them, and how many launches named a rank "not
registered with the scheduler" (and respawned it, under msdist.launch). Target: p95 <= 2x p50.

The host is shared: the load average (`uptime`) is printed with the figures. The last line is the
JSON of everything; `--json PATH` also writes it to a file.
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO, "tests", "data", "fruits360-mini")
CONFIG = os.path.join(REPO, "configs", "tiny_test.yaml")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
LAUNCHERS = ("msdist.launch", "mpirun", "msrun")
LAUNCH_LIMIT_S = 400
NOT_REGISTERED = "not registered with the scheduler"   # msdist.cluster.registration's line
# MindSpore's scheduler: "... 2026-11-26-07:05:26.571.043 [...] ProcessRegister] The new node: 1(role: ..."
_REGISTERED = re.compile(r"(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d)\.(\d{3})\.\d{3} \[[^]]*\] ProcessRegister\] The new node")


def _train_args(out: str, extra) -> list:
    return ["--config", CONFIG, "--data_dir", DATA_DIR, "--output_dir", out, "--max_steps", "2", *extra]


def _command(launcher: str, work: str, out: str, extra) -> list:
    train = _train_args(out, extra)
    if launcher == "msdist.launch":
        return [sys.executable, "-m", "msdist.launch", "-n", "2", *train]
    if launcher == "mpirun":
        return ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "msdist.train", *train]
    port = str(_free_port())
    return ["msrun", "--worker_num", "2", "--local_worker_num", "2", "--master_port", port, "--join", "True",
            "--log_dir", os.path.join(work, "msrun_logs"), "python3", "-m", "msdist.train", *train]


def _free_port() -> int:
    sys.path.insert(0, REPO)
    from msdist.cluster.rendezvous import free_port  # pylint: disable=import-outside-toplevel
    return free_port()


def _env() -> dict:
    env = dict(os.environ, **MPI_ENV)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # msrun runs a binary only when it is named python, python3 or pytest: this interpreter comes first
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _first_step_time(out: str):
    try:
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("kind") == "step":
                    return record["time"]
    except (OSError, ValueError):
        pass
    return None


def _registration_lag(work: str):
    """Seconds between the first and the last rank's registration, from any scheduler log under `work`."""
    for path in glob.glob(os.path.join(work, "**", "scheduler*.log"), recursive=True):
        with open(path, encoding="utf-8", errors="replace") as f:
            stamps = [datetime.strptime(m.group(1), "%Y-%m-%d-%H:%M:%S").timestamp() + int(m.group(2)) / 1000
                      for m in _REGISTERED.finditer(f.read())]
        if len(stamps) >= 2:
            return round(max(stamps) - min(stamps), 2)
    return None


def launch_once(launcher: str, extra) -> dict:
    work = tempfile.mkdtemp(prefix="startup_latency_")
    out = os.path.join(work, "run")
    began = time.time()
    try:
        proc = subprocess.run(_command(launcher, work, out, extra), cwd=work, env=_env(), capture_output=True,
                              text=True, timeout=LAUNCH_LIMIT_S)
        status, console = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        status, console = "timeout", ""
    first = _first_step_time(out)
    row = {"launcher": launcher, "status": status, "wall_s": round(time.time() - began, 1),
           "first_step_s": round(first - began, 1) if first else None, "registration_lag_s": _registration_lag(work),
           "named": console.count(NOT_REGISTERED), "respawned": console.count("respawning it")}
    if status == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:  # kept: the logs say why (scheduler.log, rank logs)
        row["kept"] = work
    return row


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(rows) -> dict:
    times = [r["first_step_s"] for r in rows if r["first_step_s"] is not None]
    lags = [r["registration_lag_s"] for r in rows if r["registration_lag_s"] is not None]
    if not times:
        return {"launches": len(rows), "failed": len(rows)}
    return {"launches": len(rows), "failed": len(rows) - len(times), "p50_s": statistics.median(times),
            "p95_s": percentile(times, 0.95), "max_s": max(times),
            "p95_within_2x_p50": percentile(times, 0.95) <= 2 * statistics.median(times),
            "max_registration_lag_s": max(lags) if lags else None,
            "named_unregistered": sum(1 for r in rows if r["named"]), "respawned": sum(r["respawned"] for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="launches per launcher (the issue asks for 20)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset of "
                        + ", ".join(LAUNCHERS))
    parser.add_argument("--json", default="", help="also write the JSON summary to this file")
    parser.add_argument("train_args", nargs="*", help="extra msdist.train options (after --), e.g. --bind_cores false")
    args = parser.parse_args()
    launchers = [name for name in args.launchers.split(",") if name]
    print(f"load before: {os.getloadavg()}", flush=True)
    rows = []
    for i in range(args.runs):  # interleaved, so a load spike on the shared host hits every launcher alike
        for launcher in launchers:
            row = launch_once(launcher, args.train_args)
            rows.append(row)
            print(f"{i + 1:3d} {launcher:14s} status {row['status']} first step {row['first_step_s']} s "
                  f"wall {row['wall_s']} s registration lag {row['registration_lag_s']} s named {row['named']} "
                  f"respawned {row['respawned']}", flush=True)
    summary = {name: summarize([r for r in rows if r["launcher"] == name]) for name in launchers}
    load = os.getloadavg()
    for name, s in summary.items():
        print(f"{name:14s} {s['launches']} launches, {s['failed']} failed | first step p50 {s.get('p50_s')} s "
              f"p95 {s.get('p95_s')} s max {s.get('max_s')} s | p95 <= 2x p50: {s.get('p95_within_2x_p50')} | "
              f"max registration lag {s.get('max_registration_lag_s')} s | launches naming a rank "
              f"{s.get('named_unregistered')}, respawns {s.get('respawned')}")
    print(f"load after: {load}")
    result = {"runs": rows, "summary": summary, "load_after": load}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"summary": summary, "load_after": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
