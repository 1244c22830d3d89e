"""A trained model outside training: the CLI options, and the network rebuilt from a checkpoint.

`msdist.predict` and `msdist.export` need nothing but a checkpoint: training stores the model name,
class count, input size, normalization, class names and padding convention inside it
(`checkpoint_model.model_meta`), so the Training tree and the training config are not needed.
`python -m msdist.pretrained convert` stores the same fields (`complete_meta`); a checkpoint converted
before it did gets the input size and class names from `--image_size` and `--classes`.
"""
import os
from typing import List, Optional, Sequence, Tuple

from msdist.base.args import ArgumentParser, boolean, positive_int
from msdist.base.errors import ConfigError
from msdist.data import pipeline
from msdist.rank import runtime
from msdist.run import checkpoint_model

# torchvision's ImageNet-1k category names (its weights' meta["categories"]), one a line in class-index order:
# a text file, so naming an ImageNet model's classes needs neither torch nor the network.
IMAGENET_CLASSES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "imagenet_classes.txt")
CLASSES_CHOICES = "imagenet|index|FILE"
# What `complete_meta` asks for where a checkpoint records no value: the option that supplies it.
_OPTION_OF = {"image_size": "--image_size N", "classes": f"--classes {CLASSES_CHOICES}"}


def class_names(spec: str, num_classes: int) -> List[str]:
    """`--classes`: "imagenet" (the 1000 ImageNet-1k names msdist ships), "index" ("0" ... "N-1"), or a text
    file with one class name a line, in class-index order (blank lines skipped).

    Raises:
        ConfigError: the file cannot be read, or it names another number of classes than the model has.
    """
    if spec == "index":
        return [str(i) for i in range(num_classes)]
    path = IMAGENET_CLASSES if spec == "imagenet" else spec
    try:
        with open(path, encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--classes {spec}: cannot read it ({getattr(e, 'strerror', None) or e}); pass a text file "
                          f"of class names, one a line, or imagenet or index") from None
    if len(names) != num_classes:
        raise ConfigError(f"--classes {spec} names {len(names)} classes and the model has {num_classes}; pass a file "
                          f"of {num_classes} names, or --classes index")
    return names


def complete_meta(meta: dict, path: str, image_size: Optional[int] = None, classes: Optional[str] = None) -> dict:
    """A checkpoint's metadata with every field predict and export read, the options replacing stored values.

    mean/std, where missing, are the ImageNet statistics msdist always normalizes with (`pipeline.MEAN/STD`).

    Args:
        path: the checkpoint, for the message.
        image_size, classes: `--image_size` and `--classes` (`class_names`), None where not given.

    Raises:
        ConfigError: the input size or the class names are in neither the checkpoint nor the options: one line
            naming each missing field and the option that supplies it.
    """
    given = {"image_size": image_size,
             "classes": None if classes is None else class_names(classes, int(meta["num_classes"]))}
    meta = {**meta, **{field: value for field, value in given.items() if value is not None}}
    meta.setdefault("mean", list(pipeline.MEAN))
    meta.setdefault("std", list(pipeline.STD))
    missing = [field for field in _OPTION_OF if field not in meta]
    if missing:
        raise ConfigError(f"checkpoint {path} records no {' and no '.join(missing)}: pass "
                          f"{' and '.join(_OPTION_OF[field] for field in missing)}")
    return meta



def cli_parser(prog: str, description: str) -> ArgumentParser:
    """The options every checkpoint-only CLI (predict, export) shares: --ckpt and the runtime ones."""
    parser = ArgumentParser(prog=prog, allow_abbrev=False, description=description)
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by msdist.train (also _best, _ema) or "
                                                      "by msdist.pretrained convert")
    parser.add_argument("--image_size", type=positive_int, default=None, metavar="N",
                        help="the input size, replacing the checkpoint's (which it needs where it records none)")
    parser.add_argument("--classes", default=None, metavar=CLASSES_CHOICES,
                        help="the class names, replacing the checkpoint's: the 1000 ImageNet-1k names, the class "
                             "indices, or a text file of one name a line")
    parser.add_argument("--device_target", default="auto", choices=("auto", "CPU", "GPU"))
    parser.add_argument("--cpu_isa", default="auto", choices=runtime.CPU_ISA_CHOICES)
    parser.add_argument("--verbose", type=boolean, default=False, help="show MindSpore's own log lines")
    return parser


def load_network(path: str, image_size: Optional[int] = None, classes: Optional[str] = None) -> Tuple[object, dict]:
    """The network of checkpoint `path` in inference mode, with its weights, and its metadata (`complete_meta`).

    Raises:
        CheckpointError: the checkpoint is missing, corrupt, has no metadata or does not fit its model.
        ConfigError: the input size or class names are in neither the checkpoint nor the options.
    """
    from msdist.engine import step

    meta = complete_meta(checkpoint_model.read_meta(path), path, image_size, classes)
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
