"""Data tools.

    python -m msdist.data synth OUT [--classes K --per_class M]   write demo data
    python -m msdist.data check DIR [--tiny N]                    validate an ImageFolder tree
    python -m msdist.data bench DIR [--workers W --epochs E --native ...]   the training input pipeline's
                                                                  start-up, steady img/s and CPU per image
"""
import argparse
import sys

from msdist.base.args import ArgumentParser, boolean
from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError, DataError
from msdist.rank import runtime


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m msdist.data", description="msdist data tools")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    synth = sub.add_parser("synth", help="write a demo ImageFolder tree (Training/, Test/) of fruit-like JPEGs")
    synth.add_argument("out", help="output folder")
    synth.add_argument("--classes", type=int, default=4, help="number of classes (default 4)")
    synth.add_argument("--per_class", type=int, default=120, help="training images per class (default 120)")
    synth.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check", help="decode every image of an ImageFolder tree and report what training "
                                         "would trip over; exit 0 only when clean")
    check.add_argument("dir", help="data root holding Training/ and Test/")
    check.add_argument("--tiny", type=int, default=None, metavar="N",
                       help="flag classes with fewer than N usable images (default 10)")
    bench = sub.add_parser("bench", help="start-up, steady images/s and CPU per image of msdist's training input "
                                         "pipeline (read, decode, resize, augment, normalize, batch) on DIR/Training, "
                                         "one rank, and the cores a GPU needs to be fed")
    bench.add_argument("dir", help="data root holding Training/")
    bench.add_argument("--workers", type=int, default=1, help="dataset workers (default 1)")
    bench.add_argument("--image_size", type=int, default=100, help="square resolution (default 100)")
    bench.add_argument("--augment", type=boolean, default=True, help="random crop + flip (default true)")
    bench.add_argument("--batch_size", type=int, default=32, help="batch size (default 32)")
    bench.add_argument("--epochs", type=int, default=2, help="epochs timed (default 2)")
    bench.add_argument("--native", action="store_true",
                       help="also time MindSpore's tutorial pipeline (ImageFolderDataset + C++ random ops) here")
    bench.add_argument("--gpu_rate", type=float, default=5000,
                       help="img/s one GPU trains at, for the cores-per-rank advice (default 5000)")
    bench.add_argument("--stage_images", type=int, default=4096,
                       help="images of the per-stage CPU measurement (default 4096)")
    bench.add_argument("--train_crop", choices=("resize", "random_resized"), default="resize",
                       help="as in training (default resize)")
    for name in ("color_jitter", "mixup", "cutmix"):
        bench.add_argument(f"--{name}", type=float, default=0.0, help="as in training (default 0: off)")
    return parser


@cli_main
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "synth":
        from msdist.data.synth import synthesize
        if args.classes < 2 or args.per_class < 1:
            raise ConfigError("synth needs --classes >= 2 and --per_class >= 1")
        counts = synthesize(args.out, args.classes, args.per_class, seed=args.seed)
        print(f"wrote {counts['Training']} training and {counts['Test']} test images in {args.classes} classes "
              f"to {args.out}")
    elif args.command == "check":
        _check(args.dir, args.tiny)
    elif args.command == "bench":
        _bench(args)
    return 0


def _check(data_dir: str, tiny) -> None:
    runtime.prepare_tool()   # PNG/BMP files are confirmed with MindSpore's decoder, which reads these variables
    from msdist.data import check

    report = check.scan(data_dir)
    print(check.format_report(report, data_dir, check.TINY_CLASS if tiny is None else tiny), flush=True)
    if not report.clean:
        raise DataError(f"{data_dir} is not clean: {len(report.bad)} bad file(s), {len(report.problems)} "
                        f"tree problem(s) and {len(report.warnings)} tree warning(s), listed above")


def _bench(args) -> None:
    import os
    if min(args.workers, args.image_size, args.batch_size, args.epochs, args.stage_images) < 1 or args.gpu_rate <= 0:
        raise ConfigError("bench needs --workers, --image_size, --batch_size, --epochs, --stage_images >= 1 "
                          "and --gpu_rate > 0")
    if args.workers > (os.cpu_count() or 1):
        raise ConfigError(f"--workers {args.workers} exceeds this host's {os.cpu_count()} cores (MindSpore's limit); "
                          f"use at most {os.cpu_count()}")
    runtime.prepare_tool()
    from msdist.data import bench, pipeline
    from msdist.data.augment import Regularization
    pipeline.check_data_dir(args.dir)
    classes = pipeline.class_map(args.dir)
    reg = Regularization(train_crop=args.train_crop, color_jitter=args.color_jitter, mixup=args.mixup,
                         cutmix=args.cutmix, num_classes=len(classes))
    setup = bench.Setup(args.dir, image_size=args.image_size, augment=args.augment, batch_size=args.batch_size,
                        regularization=reg)
    images = len(pipeline.list_split(args.dir, pipeline.TRAIN_SPLIT, classes))
    options = "".join(f", {k} {v}" for k, v in (("train_crop", args.train_crop), ("color_jitter", args.color_jitter),
                                                 ("mixup", args.mixup), ("cutmix", args.cutmix)) if v not in ("resize", 0))
    print(f"bench of {os.path.join(args.dir, pipeline.TRAIN_SPLIT)}: {images} images, workers {args.workers}, "
          f"image_size {args.image_size}, augment {str(args.augment).lower()}{options}, batch {args.batch_size}, "
          f"{args.epochs} epoch(s)", flush=True)
    stages = bench.stage_cpu_us(setup, args.stage_images)
    total = sum(stages.values())
    print(f"CPU per image (1 worker, {min(args.stage_images, images)} images): "
          + ", ".join(f"{name} {stages[name]:.0f} us" for name in bench.STAGES) + f"; total {total:.0f} us", flush=True)
    print(f"one core feeds {1e6 / total:.0f} img/s; a GPU training at {args.gpu_rate:.0f} img/s needs "
          f"{bench.cores_needed(args.gpu_rate, total)} core(s) per rank for its input", flush=True)
    if args.native:
        native = bench.measure(bench.native_epoch_maker(setup, args.workers), args.epochs)
        print(f"native ImageFolderDataset + C++ ops: start-up {native.startup_s:.2f} s, steady "
              f"{native.steady:.0f} img/s", flush=True)
    rate = bench.measure(bench.train_epoch_maker(setup, args.workers), args.epochs)
    later = "" if args.epochs == 1 else f" (later epochs {rate.later_startup_s:.2f} s)"
    print(f"start-up: {rate.startup_s:.2f} s to the first batch{later}", flush=True)
    print(f"msdist training pipeline: {rate.steady:.0f} img/s steady ({rate.images} images after the first batch "
          f"of each epoch)", flush=True)
    print(f"input to the device: {bench.train_input(setup, args.workers).describe_images()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
