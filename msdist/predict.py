"""`python -m msdist.predict --ckpt PATH IMAGE_OR_DIR [...]`: top-k classes and probabilities per image.

Everything the model needs (architecture, class count, input size, normalization, class names) comes
from the checkpoint's own metadata, so neither the Training tree nor a config is needed (`--image_size`
and `--classes` supply them for a checkpoint that records none, or replace them). A directory
stands for every image under it. A file that cannot be read or decoded is reported on its own line
(and in `--json` as {"path", "error"}); the other images still get their predictions, and the exit
status is then 1 (0 when every image was predicted, 2 for a bad command line or checkpoint).
"""
import json
import sys
from typing import Optional, Sequence

import numpy as np

from msdist.base.args import boolean, positive_int
from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError
from msdist.run import inference, startup

BATCH = 16  # images per forward pass; the last batch is zero-padded so the graph compiles once


def _parse(argv: Optional[Sequence[str]]):
    parser = inference.cli_parser("msdist.predict", "Top-k class names and probabilities for images, from a "
                                                     "checkpoint alone.")
    parser.add_argument("paths", nargs="+", metavar="IMAGE_OR_DIR", help="image files and/or folders of images")
    parser.add_argument("--topk", type=positive_int, default=5, help="classes to show per image [5]")
    parser.add_argument("--json", type=boolean, default=False, nargs="?", const=True,
                        help="print one JSON document instead of text lines")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise probabilities, computed in float64."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def top_k(probs: np.ndarray, classes: Sequence[str], k: int) -> list:
    """[{'class', 'probability'}] of the k most probable classes, best first (ties: lower label first)."""
    order = np.argsort(-probs, kind="stable")[:k]
    return [{"class": classes[i], "probability": float(probs[i])} for i in order]


def _logits(net, images: list) -> np.ndarray:
    import mindspore as ms
    batch = np.stack(images + [np.zeros_like(images[0])] * (BATCH - len(images)))
    return net(ms.Tensor(batch)).asnumpy()[:len(images)]


def predict(net, meta: dict, paths: Sequence[str], k: int) -> list:
    """One record per path, in order: {'path', 'predictions'} or {'path', 'error'}."""
    records, pending = [], []   # pending: (record, image) waiting for a full batch

    def flush():
        if pending:
            for (record, _), probs in zip(pending, softmax(_logits(net, [img for _, img in pending]))):
                record["predictions"] = top_k(probs, meta["classes"], k)
            pending.clear()

    for path in paths:
        record = {"path": path}
        records.append(record)
        try:
            pending.append((record, inference.preprocess(path, meta)))
        except OSError as e:  # this file only: the others still get their predictions
            record["error"] = f"cannot read it ({e.strerror or e})"
        except (RuntimeError, ValueError):  # MindSpore's decoder: its own message is a multi-line C++ report
            record["error"] = "cannot decode it as an image (corrupt, truncated, or not JPEG/PNG/BMP)"
        if len(pending) == BATCH:
            flush()
    flush()
    return records


def _print_text(records: list) -> None:
    for record in records:
        if "error" in record:
            print(f"{record['path']}: error: {record['error']}", file=sys.stderr, flush=True)
        else:
            shown = ", ".join(f"{p['class']} {p['probability']:.4f}" for p in record["predictions"])
            print(f"{record['path']}: {shown}", flush=True)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    startup.start_standalone(args.device_target, args.verbose, args.cpu_isa)
    net, meta = inference.load_network(args.ckpt, args.image_size, args.classes)
    paths = inference.expand_paths(args.paths)
    if not paths:
        raise ConfigError(f"no images found in {', '.join(args.paths)}")
    records = predict(net, meta, paths, min(args.topk, len(meta["classes"])))
    if args.json:
        print(json.dumps({"ckpt": args.ckpt, "model": meta["model"], "predictions": records}, indent=2))
    else:
        _print_text(records)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
