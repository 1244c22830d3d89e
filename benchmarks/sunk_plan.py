"""What the run's one sunk dataset costs the host at start: `python benchmarks/sunk_plan.py [--epochs N]`.

On GPU with `--sink_size K > 1` the run's sunk chunks take their batches from one dataset spanning the run
(`pipeline.build_span_dataset`, docs/performance.md "One sunk graph per run"), so its index plan covers every epoch
at once: this rank's samples (`plan.span_samples`) and MindSpore's `SubsetSampler` over them (`pipeline.reader`).
This builds both for an ImageNet-sized split (1,281,167 images, global batch 1024, 8 ranks, rank 0, every step of
`--epochs` epochs sunk), without reading an image, and prints the seconds and the peak resident memory they add,
per image read on the rank and extrapolated to 90 epochs.
"""
import argparse
import resource
import tempfile
import time

from msdist.data import pipeline, plan

IMAGES, GLOBAL_BATCH, RANKS = 1_281_167, 1024, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:   # the reader's folder must exist; nothing in it is read
        split = pipeline.Split(files=("x.jpg",) * IMAGES, labels=(0,) * IMAGES, root=root,
                               positions=tuple(range(IMAGES)), extensions=(".jpg",), classes=(("c", 0),))
        layout = plan.BatchLayout(RANKS, RANKS, 0)
        steps = plan.steps_per_epoch(IMAGES, GLOBAL_BATCH)
        spans = [(epoch, 0, steps) for epoch in range(args.epochs)]
        import mindspore.dataset  # noqa: F401  (loaded before the clock: not the plan's cost)
        before, began = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
        rows, _ = plan.span_samples(IMAGES, GLOBAL_BATCH, 0, True, layout, spans)
        planned = time.perf_counter()
        pipeline.reader(split, rows.reshape(-1), 1)
        seconds = time.perf_counter() - began
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024   # ru_maxrss is in KiB
    images = rows.size
    print(f"{args.epochs} epochs, rank 0 of {RANKS}: {images:,} images read")
    print(f"index plan {planned - began:.2f} s, sampler {seconds - (planned - began):.2f} s, peak memory +{grown / 2**20:.0f} MiB")
    print(f"per image: {seconds / images * 1e6:.2f} us, {grown / images:.0f} B; "
          f"90 epochs: {seconds / args.epochs * 90:.0f} s, {grown / args.epochs * 90 / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
