"""A trained model outside training: the CLI options, and the network rebuilt from a checkpoint.

`msdist.predict` and `msdist.export` need nothing but a checkpoint: training stores the model name,
class count, input size, normalization, class names and padding convention inside it
(`checkpoint_model.model_meta`), so the Training tree and the training config are not needed.
"""
import os
from typing import Sequence, Tuple

from msdist.base.args import ArgumentParser, boolean
from msdist.cluster import runtime
from msdist.data import pipeline
from msdist.run import checkpoint_model


def cli_parser(prog: str, description: str) -> ArgumentParser:
    """The options every checkpoint-only CLI (predict, export) shares: --ckpt and the runtime ones."""
    parser = ArgumentParser(prog=prog, allow_abbrev=False, description=description)
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by msdist.train (also _best, _ema)")
    parser.add_argument("--device_target", default="auto", choices=("auto", "CPU", "GPU"))
    parser.add_argument("--cpu_isa", default="auto", choices=runtime.CPU_ISA_CHOICES)
    parser.add_argument("--verbose", type=boolean, default=False, help="show MindSpore's own log lines")
    return parser


def load_network(path: str) -> Tuple[object, dict]:
    """The network of checkpoint `path` in inference mode, with its weights, and the checkpoint's metadata.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt, has no metadata or does not fit its model.
    """
    from msdist.engine import step

    meta = checkpoint_model.read_meta(path)
    net = step.build_network(meta["model"], int(meta["num_classes"]), False, False, 1,
                             checkpoint_model.meta_convention(meta))
    checkpoint_model.load_weights(path, net)
    net.set_train(False)
    return net, meta


def preprocess(path: str, meta: dict):
    """One image file -> float32 CHW array, exactly as evaluation transforms it.

    Raises:
        OSError: the file cannot be read. RuntimeError/ValueError: MindSpore cannot decode it.
    """
    import numpy as np
    from mindspore.dataset import transforms

    data = np.fromfile(path, dtype=np.uint8)
    chain = transforms.Compose(pipeline.eval_transforms(int(meta["image_size"]), meta["mean"], meta["std"]))
    return np.asarray(chain(data), dtype=np.float32)


def expand_paths(paths: Sequence[str]) -> list:
    """Files named directly, plus every image under each directory (recursive, sorted)."""
    found = []
    for path in paths:
        if not os.path.isdir(path):
            found.append(path)  # a missing or unreadable file is reported by the caller, not dropped here
            continue
        for root, dirs, files in os.walk(path):
            dirs.sort()
            found.extend(os.path.join(root, f) for f in sorted(files) if pipeline.is_image(f))
    return found
