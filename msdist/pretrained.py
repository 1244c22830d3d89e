"""`python -m msdist.pretrained convert IN OUT.ckpt`: pretrained weights as a MindSpore checkpoint, once.

IN is anything `--pretrained` reads (msdist.run.weights): torchvision's .pth/.pt state_dicts, timm's or
torchvision's .safetensors, model zoo / MindCV .ckpt files. OUT holds the same tensors under msdist's
names, with the model name, class count and padding convention in its metadata, so `--pretrained OUT.ckpt`
on every node of a cluster job needs MindSpore alone (no torch, no safetensors) and builds the same network.
"""
import sys
from typing import Optional, Sequence

from msdist.base.args import ArgumentParser
from msdist.base.cli import cli_main


def _parse(argv: Optional[Sequence[str]]):
    parser = ArgumentParser(prog="python -m msdist.pretrained", description="pretrained weights tools")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    convert = sub.add_parser("convert", help="write pretrained weights (.pth, .pt, .safetensors, .ckpt) as a "
                                             "MindSpore checkpoint under msdist's names")
    convert.add_argument("source", metavar="IN", help="the weights file")
    convert.add_argument("output", metavar="OUT.ckpt", help="the MindSpore checkpoint to write")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    from msdist.cluster import runtime
    runtime.prepare(cpu_isa="default", bind_cores=False)  # quiet MindSpore's log; nothing is computed here
    from msdist.run import weights
    print(weights.convert(args.source, args.output))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
