"""`python -m msdist.export --ckpt PATH --format MINDIR --output F`: a trained model for inference.

MINDIR runs with `mindspore.load(F)` + `nn.GraphCell` (or MindSpore Lite) and gives the checkpoint's
logits; the network, input size and class names come from the checkpoint's own metadata (`--image_size`
and `--classes` supply them for a checkpoint that records none, or replace them). ONNX is
written too (MindSpore 2.10 exports it on CPU). The input is float32 NCHW of the training
image_size, normalized as in evaluation (mean/std in the checkpoint's metadata); the output is
the logits, one row per image.
"""
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from msdist.base.args import positive_int
from msdist.base.cli import cli_main
from msdist.run import inference, startup

SUFFIXES = {"MINDIR": ".mindir", "ONNX": ".onnx"}


def _parse(argv: Optional[Sequence[str]]):
    parser = inference.cli_parser("msdist.export", "Export a checkpoint's network for inference.")
    parser.add_argument("--format", default="MINDIR", type=str.upper, choices=sorted(SUFFIXES),
                        help="MINDIR (mindspore.load + nn.GraphCell, MindSpore Lite) or ONNX [MINDIR]")
    parser.add_argument("--output", required=True, help="file to write; the format's suffix is added if missing")
    parser.add_argument("--batch_size", type=positive_int, default=1,
                        help="the exported graph's fixed batch size [1]")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def output_path(output: str, file_format: str) -> str:
    """`output` with the format's suffix (MindSpore would append it anyway; we name the real file)."""
    suffix = SUFFIXES[file_format]
    return output if output.lower().endswith(suffix) else output + suffix


def export(net, meta: dict, path: str, file_format: str, batch_size: int = 1) -> str:
    """Write `net` (inference mode) in `file_format` to `path`, plus `{path}.json` with its metadata.

    The metadata sidecar (class names, input size, normalization) lets an inference service label
    the logits without the checkpoint.
    """
    import mindspore as ms

    size = int(meta["image_size"])
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    stem = path[: -len(SUFFIXES[file_format])]
    ms.export(net, ms.Tensor(np.zeros((batch_size, 3, size, size), np.float32)), file_name=stem,
              file_format=file_format)
    with open(f"{path}.json", "w", encoding="utf-8") as f:
        json.dump({**meta, "format": file_format, "input_shape": [batch_size, 3, size, size]}, f, indent=2)
    return path


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    startup.start_standalone(args.device_target, args.verbose, args.cpu_isa)
    net, meta = inference.load_network(args.ckpt, args.image_size, args.classes)
    path = export(net, meta, output_path(args.output, args.format), args.format, args.batch_size)
    print(f"wrote {path} ({args.format}, {meta['model']}, input {args.batch_size}x3x{meta['image_size']}x"
          f"{meta['image_size']}, {meta['num_classes']} classes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
