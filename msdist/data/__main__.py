"""Data tools.

    python -m msdist.data synth OUT [--classes K --per_class M]   write demo data
    python -m msdist.data check DIR [--tiny N]                    validate an ImageFolder tree
"""
import argparse
import sys

from msdist.config import ArgumentParser
from msdist.errors import ConfigError, DataError, cli_main


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
    return 0


def _check(data_dir: str, tiny) -> None:
    from msdist import runtime
    runtime.prepare()   # PNG/BMP files are confirmed with MindSpore's decoder, which reads these variables
    from msdist.data import check

    report = check.scan(data_dir)
    print(check.format_report(report, data_dir, check.TINY_CLASS if tiny is None else tiny), flush=True)
    if not report.clean:
        raise DataError(f"{data_dir} is not clean: {len(report.bad)} bad file(s), {len(report.problems)} "
                        f"tree problem(s) and {len(report.warnings)} tree warning(s), listed above")


if __name__ == "__main__":
    sys.exit(main())
