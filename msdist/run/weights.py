"""`--pretrained PATH`: start from another model's weights; `--freeze_backbone`, `--backbone_lr_scale`.

Accepted files, all of one ResNet architecture (docs/model_use.md has the tables):
    .ckpt          msdist's own checkpoints (also `python -m msdist.pretrained convert` output), and MindSpore
                   ResNet checkpoints of the model zoo (mindspore-ai/models `official/cv/ResNet`) and MindCV
    .safetensors   timm's and torchvision's ResNet-18/34/50/101 (read with the safetensors package, NumPy only;
                   bfloat16 tensors widen to float32 exactly)
    .pth, .pt      torchvision state_dict files (read with torch when it is installed; weights only, no code)
Their parameter names are mapped to msdist's:

    theirs                                          msdist
    conv1.weight                                    stem.0.weight
    bn1.*                                           stem.1.*
    layer{i}.{j}.conv{k}/bn{k}                      stages.{i-1}.{j}.conv{k}/bn{k}
    layer{i}.{j}.bn{k}d (zoo ResNet-18/34)          stages.{i-1}.{j}.bn{k}
    layer{i}.{j}.downsample / down_sample_layer / down_sample .0 / .1
                                                    stages.{i-1}.{j}.downsample.conv / .bn
    fc.* (torch), end_point.* (zoo), classifier.* (MindCV)   fc.*
    BatchNorm weight, bias, running_mean, running_var (torch)   gamma, beta, moving_mean, moving_variance

Every backbone tensor of the model must be in the file with the same shape, and a torch file may hold
nothing else (but BatchNorm's `num_batches_tracked` counters); otherwise the run stops with one line naming
the first tensor that does not fit. The classifier (`fc.*`) loads only when its class count matches and
otherwise stays freshly initialized. Optimizer state and counters in MindSpore checkpoints are skipped.

The weights also decide how the network pads its parameter-free layers (`models.CONVENTIONS`): torch files
are "torch", MindSpore checkpoints "mindspore" unless their metadata says otherwise. Training records the
convention in every checkpoint's metadata, and whatever rebuilds the network from a checkpoint follows it.
"""
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from models import TORCH_CONVENTION
from msdist.base.errors import CheckpointError, ConfigError, first_line
from msdist.run import checkpoint, checkpoint_model, inference

_logger = logging.getLogger(__name__)

HEAD_PREFIX = "fc."  # the classifier of every msdist model; everything else is the backbone
TORCH_SUFFIXES = (".pth", ".pt")
_SUFFIXES = (".ckpt", ".safetensors") + TORCH_SUFFIXES
_COUNTER = "num_batches_tracked"  # torch BatchNorm's step counter: no MindSpore counterpart, never needed
_BN_LEAVES = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
# safetensors dtype codes NumPy holds as they are; BF16 (no NumPy type) is widened in `_safetensors_array`.
_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                       "U8": "u1", "BOOL": "?"}
# The input size torchvision's and timm's ImageNet ResNets are evaluated at: a converted file's when not told.
IMAGENET_IMAGE_SIZE = 224
# Architectures by (blocks per stage, bottleneck blocks), to name what a file holds.
_ARCHITECTURES = {((2, 2, 2, 2), False): "resnet18", ((3, 4, 6, 3), False): "resnet34",
                  ((3, 4, 6, 3), True): "resnet50", ((3, 4, 23, 3), True): "resnet101",
                  ((1, 1, 1, 1), False): "resnet_tiny"}

_RENAMES: Tuple[Tuple[str, object], ...] = (
    (r"^conv1\.", "stem.0."),
    (r"^bn1\.", "stem.1."),
    (r"^layer([1-9])\.", lambda m: f"stages.{int(m[1]) - 1}."),
    (r"\.bn([0-9])d\.", r".bn\1."),
    (r"\.(?:downsample|down_sample(?:_layer)?)\.0\.", ".downsample.conv."),
    (r"\.(?:downsample|down_sample(?:_layer)?)\.1\.", ".downsample.bn."),
    (r"^(?:end_point|classifier)\.", HEAD_PREFIX),
    # torch's BatchNorm names its tensors like a convolution's: told apart by the layer they belong to
    (r"^(stem\.1|.+\.bn[0-9]|.+\.downsample\.bn)\.(weight|bias|running_mean|running_var)$",
     lambda m: f"{m[1]}.{_BN_LEAVES[m[2]]}"),
)


def to_msdist_name(name: str) -> str:
    """A torchvision / timm / model zoo / MindCV ResNet parameter name in msdist's naming (msdist's own stay)."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


@dataclass(frozen=True)
class Source:
    """A weights file in memory: its tensors under msdist's names, and how they were trained.

    Attributes:
        path: the file.
        kind: "torch" (torchvision / timm naming) or "mindspore" (msdist, model zoo, MindCV).
        tensors: {msdist name: array}; BatchNorm counters left out.
        names: {msdist name: the file's own name}, for messages.
        counters: the file's `num_batches_tracked` entries (skipped).
        convention: the padding convention the weights were trained with (models.CONVENTIONS).
        meta: the file's own msdist metadata (checkpoint_model.model_meta), {} where it has none.
    """
    path: str
    kind: str
    tensors: Dict[str, np.ndarray]
    names: Dict[str, str]
    counters: Tuple[str, ...]
    convention: str
    meta: Dict = field(default_factory=dict)

    @property
    def architecture(self) -> Optional[str]:
        """The msdist model these tensors make up (resnet18 ... resnet101, resnet_tiny), or None."""
        blocks = {}
        for name in self.tensors:
            found = re.match(r"stages\.(\d+)\.(\d+)\.", name)
            if found:
                blocks[int(found[1])] = max(blocks.get(int(found[1]), 0), int(found[2]) + 1)
        depths = tuple(blocks[i] for i in sorted(blocks))
        return _ARCHITECTURES.get((depths, any(".conv3." in n for n in self.tensors)))

    @property
    def num_classes(self) -> Optional[int]:
        head = self.tensors.get(HEAD_PREFIX + "weight")
        return None if head is None else int(head.shape[0])


def _read_safetensors(path: str) -> Dict[str, np.ndarray]:
    from safetensors import SafetensorError, deserialize
    try:
        with open(path, "rb") as f:
            entries = deserialize(f.read())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} as .safetensors: {first_line(str(e))}; is the file complete "
                              "(a finished download)?") from None
    return {name: _safetensors_array(path, name, entry) for name, entry in entries}


def _safetensors_array(path: str, name: str, entry: dict) -> np.ndarray:
    """One deserialized safetensors tensor as a NumPy array; bfloat16 widened to float32.

    Raises:
        CheckpointError: a dtype NumPy has no type for (float8 and the like), naming the tensor.
    """
    if entry["dtype"] == "BF16":  # a bfloat16 is the upper half of a float32: widening it is exact
        return (np.frombuffer(entry["data"], "<u2").astype("<u4") << 16).view("<f4").reshape(entry["shape"])
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor {name} is {entry['dtype']}, which msdist does not read (float64/32/16, "
                              "bfloat16 and integer tensors only); save the weights in float32")
    return np.frombuffer(entry["data"], _SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _read_torch(path: str) -> Dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a torch file and reading it needs torch, which is not installed: "
                              "pip install torch (the CPU wheel is enough), or convert it to .safetensors "
                              "where torch is installed") from None
    try:  # weights_only: tensors and plain containers, never code from the file
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for unreadable files
        raise CheckpointError(f"cannot read {path} as a torch state_dict: {first_line(str(e)) or type(e).__name__}"
                              "; is the file complete (a finished download)?") from None
    for key in ("model", "state_dict"):  # torchvision's reference scripts and timm's train.py wrap it
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state_dict; save model.state_dict()")
    # float32 from any float dtype: NumPy has no bfloat16, and MindSpore casts to the parameter's dtype anyway
    return {name: (value.detach().float() if value.is_floating_point() else value).numpy()
            for name, value in state.items() if isinstance(value, torch.Tensor)}


def _read_mindspore(path: str) -> Tuple[Dict[str, np.ndarray], Dict]:
    """A MindSpore checkpoint's tensors (appended strings and scalars left out) and its msdist metadata."""
    raw = checkpoint.read_tensors(path)
    meta = json.loads(raw[checkpoint.META_KEY]) if isinstance(raw.get(checkpoint.META_KEY), str) else {}
    tensors = {name: value.asnumpy() for name, value in raw.items() if hasattr(value, "asnumpy")}
    return tensors, meta


def read(path: str) -> Source:
    """Read a weights file of any accepted kind (module docstring) into msdist's names.

    Raises:
        CheckpointError: missing, of another format, too large, unreadable or truncated, a torch file without
            torch installed, or two of its tensors taking the same msdist name.
    """
    if not path.endswith(_SUFFIXES):
        raise CheckpointError(f"pretrained weights {path} are not a {', '.join(_SUFFIXES)} file; only those are "
                              "loaded (never arbitrary pickle)")
    checkpoint.check_size(path, "pretrained weights")
    meta = {}
    if path.endswith(TORCH_SUFFIXES):
        raw = _read_torch(path)
    elif path.endswith(".safetensors"):
        raw = _read_safetensors(path)
    else:
        raw, meta = _read_mindspore(path)
    # torch's BatchNorm statistics tell its naming apart (a .safetensors file may hold MindSpore's too).
    kind = "torch" if path.endswith(TORCH_SUFFIXES) or any(n.endswith(".running_var") for n in raw) else "mindspore"
    convention = TORCH_CONVENTION if kind == "torch" else checkpoint_model.meta_convention(meta)
    tensors, names = {}, {}
    for name, value in raw.items():
        if name.endswith(_COUNTER):
            continue
        mapped = to_msdist_name(name)
        if mapped in names:
            raise CheckpointError(f"{path} holds both {names[mapped]} and {name}, one tensor in msdist ({mapped}); "
                                  "pass the weights of one model")
        tensors[mapped], names[mapped] = np.asarray(value), name
    return Source(path, kind, tensors, names, tuple(n for n in raw if n.endswith(_COUNTER)), convention, meta)


@dataclass(frozen=True)
class Plan:
    """Which file tensor goes into which model parameter, and what is left out."""
    loads: Dict[str, np.ndarray]   # model parameter name -> value
    head: str                      # what happened to the classifier, for the report
    skipped: Dict[str, List[str]]  # group -> the file's names it holds (besides a classifier left fresh)


def _does_not_fit(source: Source, model: str, detail: str) -> CheckpointError:
    held = source.architecture
    fix = f"they are a {held}: pass --model {held}, or" if held and held != model else "pass"
    return CheckpointError(f"pretrained weights {source.path} do not fit --model {model}: {detail}; {fix} "
                           f"weights of a {model}")


def plan(net, source: Source, model: str) -> Plan:
    """Match `source` against `net`'s parameters.

    Args:
        model: the model's name (--model), for the message when the file holds another architecture.

    Raises:
        CheckpointError: a backbone tensor is missing or has another shape, or a torch file holds a tensor the
            model has no place for (the first one is named).
    """
    tensors = dict(source.tensors)
    params = list(net.get_parameters())
    head = [p for p in params if p.name.startswith(HEAD_PREFIX)]
    head_fits = all(p.name in tensors and tuple(tensors[p.name].shape) == tuple(p.shape) for p in head)
    loads = {}
    for param in params:
        value = tensors.pop(param.name, None)
        if param.name.startswith(HEAD_PREFIX) and not head_fits:
            continue
        if value is None:
            raise _does_not_fit(source, model, f"it has no {param.name} (model {list(param.shape)})")
        if tuple(value.shape) != tuple(param.shape):
            raise _does_not_fit(source, model, f"{source.names[param.name]} is {list(value.shape)} there, the model "
                                               f"needs {list(param.shape)} ({param.name})")
        loads[param.name] = value
    if source.kind == "torch" and tensors:  # a torch file holds the model only: anything more is another model
        extra = sorted(tensors)[0]
        raise _does_not_fit(source, model, f"it has {source.names[extra]}, which the model has no place for")
    skipped = {"optimizer/state entries": sorted(source.names[n] for n in tensors),
               "BatchNorm counters (num_batches_tracked)": sorted(source.counters)}
    return Plan(loads, _head_text(source, head, head_fits), {group: names for group, names in skipped.items() if names})


def _head_text(source: Source, head: list, fits: bool) -> str:
    classes = int(head[0].shape[0]) if head else 0
    if fits:
        return f"head loaded ({classes} classes)"
    if source.num_classes is None:
        return "head fresh (none in the file)"
    return f"head fresh ({source.num_classes} -> {classes} classes)"


def report(source: Source, result: Plan) -> str:
    """The one-line summary of a load, e.g. 'loaded 100 backbone tensors; head fresh (4 -> 2 classes); ...'."""
    backbone = sum(not n.startswith(HEAD_PREFIX) for n in result.loads)
    parts = [f"loaded {backbone} backbone tensors", result.head]
    parts += [f"skipped {len(names)} {group}" for group, names in result.skipped.items()]
    return f"pretrained {source.path} ({source.kind} naming, {source.convention} padding): " + "; ".join(parts)


def load_pretrained(net, source: Source, model: str) -> Plan:
    """Copy `source`'s weights into `net` (names mapped, classifier skipped on another class count) and log it.

    The console gets one grouped line; this rank's log file also gets every name loaded and skipped.
    """
    import mindspore as ms

    result = plan(net, source, model)
    for param in net.get_parameters():
        if param.name in result.loads:
            param.set_data(ms.Tensor(result.loads[param.name], dtype=param.dtype))
    _logger.info(report(source, result))
    _logger.info("pretrained %s: loaded %s", source.path, ", ".join(result.loads), extra={"console": False})
    for group, names in result.skipped.items():
        _logger.info("pretrained %s: skipped %s: %s", source.path, group, ", ".join(names), extra={"console": False})
    return result


def freeze_backbone(net) -> int:
    """Stop training everything but the classifier: no gradients, and BatchNorm keeps its running statistics.

    Returns:
        The number of parameters frozen.

    A cross-rank BatchNorm (sync_bn) has no frozen mode: `startup.check_frozen_backbone` refuses the two
    together before MindSpore loads.
    """
    from mindspore import nn

    frozen = 0
    for name, cell in net.cells_and_names():
        if name.startswith(HEAD_PREFIX.rstrip(".")):
            continue
        if isinstance(cell, nn.BatchNorm2d):
            cell.use_batch_statistics = False  # normalize with (and never update) the pretrained statistics
    for param in net.get_parameters():
        if not param.name.startswith(HEAD_PREFIX):
            param.requires_grad = False
            frozen += 1
    _logger.info("freeze_backbone: %d backbone parameters frozen; training %s only", frozen, HEAD_PREFIX + "*")
    return frozen


def convert(path: str, output: str, image_size: Optional[int] = None, classes: Optional[str] = None) -> Tuple[str, Dict]:
    """Write `path`'s weights as a MindSpore checkpoint under msdist's names, with its sha256 sidecar and every field
    of the metadata predict and export read (`inference.complete_meta`).

    Args:
        image_size, classes: `--image_size` and `--classes` (`inference.class_names`). Where not given, an msdist
            checkpoint keeps its own; other files get IMAGENET_IMAGE_SIZE and, with 1000 classes, the ImageNet-1k
            names, else the class indices.

    Returns:
        The loading report line, and the metadata written.

    Raises:
        CheckpointError: the file cannot be read or is not one of msdist's ResNets.
        ConfigError: OUT is not a .ckpt, or `classes` does not fit the model.
    """
    from models import create_model

    if not output.endswith(".ckpt"):
        raise ConfigError(f"the converted file must end in .ckpt (a MindSpore checkpoint), not {output}")
    source = read(path)
    model = source.architecture
    if model is None or source.num_classes is None:
        raise CheckpointError(f"{path} is not a ResNet-18/34/50/101 with its classifier in torchvision, timm, model "
                              "zoo, MindCV or msdist naming; nothing to convert")
    net = create_model(model, source.num_classes, convention=source.convention)
    result = load_pretrained(net, source, model)
    kept = {k: source.meta[k] for k in ("image_size", "classes", "mean", "std") if k in source.meta}
    if classes is None and "classes" not in kept:
        classes = "imagenet" if source.num_classes == 1000 else "index"
    meta = inference.complete_meta({"image_size": IMAGENET_IMAGE_SIZE, **kept, "model": model,
                                    "num_classes": source.num_classes, "convention": source.convention,
                                    "converted_from": os.path.basename(path)}, output, image_size, classes)
    checkpoint.save_weights([{"name": p.name, "data": p} for p in net.get_parameters()], output, meta)
    return report(source, result), meta
