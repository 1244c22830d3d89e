"""The pre-flight data check split over ranks: `python benchmarks/data_check.py [--data_dir DIR] [--ranks 1 2]`.

For each rank count N it runs the check that training runs before its first step
(`msdist.data.shared_check.shared_report`, with an empty cache so every image is decoded) in `mpirun -n N`
processes, and prints the job's wall time for it and each rank's share. mpirun binds each rank to its
own core, as in training, so N = 1 is what rank 0 alone used to do before the check was split. The figures go to docs/data.md by hand.

Data: the Fruits-360-sized tree `benchmarks/input_pipeline.py` synthesizes (data/fruits360-synth/).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from input_pipeline import DATA_DIR, ensure_data  # noqa: E402  (benchmarks/ is this script's folder)

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def worker(data_dir: str, log_dir: str) -> None:
    """One rank: join the job, time the split check, rank 0 prints every rank's seconds."""
    from msdist.run import startup
    started = startup.start(["--data_dir", data_dir, "--output_dir", log_dir], checks=())
    dist, collectives = startup.join(started, log_dir)
    from msdist.data import shared_check
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        report = shared_check.shared_report(data_dir, dist.rank, collectives, cache_dir=cache)
        seconds = collectives.gather([time.perf_counter() - start])[:, 0]
    if dist.is_main:
        images = sum(sum(c.values()) for c in report.counts.values()) + len(report.bad)
        print(f"{dist.world_size} rank(s): {seconds.max():.1f} s for {images} images ({len(report.bad)} bad); "
              f"per rank {', '.join(f'{s:.1f}' for s in seconds)} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=DATA_DIR, help=f"ImageFolder root (default {DATA_DIR})")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts to time (default 1 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        if args.worker:
            worker(args.data_dir, logs)
            return 0
        ensure_data(args.data_dir)
        env = dict(os.environ, **MPI_ENV, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for n in args.ranks:
            subprocess.run(["mpirun", "-n", str(n), "--oversubscribe", sys.executable, os.path.abspath(__file__), "--worker", "--data_dir",
                                       args.data_dir], env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
