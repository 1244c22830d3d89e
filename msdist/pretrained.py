"""`python -m msdist.pretrained convert IN OUT.ckpt [--image_size N] [--classes imagenet|index|FILE]`.

Pretrained weights as a MindSpore checkpoint, once. IN is anything `--pretrained` reads (msdist.run.weights):
torchvision's .pth/.pt state_dicts, timm's or torchvision's .safetensors, model zoo / MindCV .ckpt files.
OUT holds the same tensors under msdist's names, with its sha256 sidecar (OUT.ckpt.json) like every
checkpoint msdist writes, so `--pretrained OUT.ckpt` on every node of a cluster job needs MindSpore alone
(no torch, no safetensors) and builds the same network. Its metadata has every field `msdist.predict` and
`msdist.export` read: model, class count, padding convention, input size (224 unless told: torchvision's
and timm's ImageNet evaluation size), class names (the ImageNet-1k names for a 1000-class head, else the
indices, unless told), mean and std. It holds weights alone: `--resume` refuses it, `--pretrained` takes it.
"""
import sys
from typing import Optional, Sequence

from msdist.base.args import ArgumentParser, positive_int
from msdist.base.cli import cli_main
from msdist.run import inference, weights


def _parse(argv: Optional[Sequence[str]]):
    parser = ArgumentParser(prog="python -m msdist.pretrained", description="pretrained weights tools")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    convert = sub.add_parser("convert", help="write pretrained weights (.pth, .pt, .safetensors, .ckpt) as a "
                                             "MindSpore checkpoint under msdist's names")
    convert.add_argument("source", metavar="IN", help="the weights file")
    convert.add_argument("output", metavar="OUT.ckpt", help="the MindSpore checkpoint to write")
    convert.add_argument("--image_size", type=positive_int, default=None, metavar="N",
                         help=f"the input size the weights were trained at [{weights.IMAGENET_IMAGE_SIZE}; an msdist "
                              "checkpoint's own]")
    convert.add_argument("--classes", default=None, metavar=inference.CLASSES_CHOICES,
                         help="the class names: the 1000 ImageNet-1k names, the class indices, or a text file of one "
                              "name a line [imagenet for a 1000-class head, else index; an msdist checkpoint's own]")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    from msdist.rank import runtime
    runtime.prepare(cpu_isa="default", bind_cores=False)  # quiet MindSpore's log; nothing is computed here
    line, meta = weights.convert(args.source, args.output, args.image_size, args.classes)
    print(line)
    names = ", ".join(meta["classes"][:3]) + (", ..." if len(meta["classes"]) > 3 else "")
    print(f"wrote {args.output} ({meta['model']}, {meta['num_classes']} classes: {names}; input "
          f"{meta['image_size']}x{meta['image_size']}; {meta['convention']} padding)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
