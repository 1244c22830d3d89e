"""The option schema, YAML + `--key value` merging, and validation.

argparse is the schema: every option is declared once below with its type,
default and help. A YAML file only changes defaults, and the command line wins
over YAML. Unknown keys in either place are errors with a did-you-mean. Every
error is one line on stderr and exit status 2 (`ConfigError`), never a
traceback.
"""
import argparse
import difflib
import functools
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import yaml

from msdist.base import launch_env
from msdist.base.args import ArgumentParser, boolean
from msdist.base.errors import ConfigError, first_line
from msdist.base.files import atomic_write_text
from msdist.cluster import preemption, stall
from msdist.engine import jit, precision
from msdist.rank.runtime import CPU_ISA_CHOICES
from msdist.run import chunks, profiler


def fusion_split(text: str) -> Optional[List[int]]:
    """`--allreduce_fusion` as parameter indices: "85,160" -> [85, 160]; "" -> [] (one fused group); "auto" -> None
    (buckets by bytes, `engine.buckets.plan_buckets`).

    Raises:
        ConfigError: not auto, nor comma-separated, strictly increasing integers >= 1.
    """
    if str(text).strip().lower() == "auto":
        return None
    parts = [p.strip() for p in str(text).strip().strip("[]").split(",") if p.strip()]
    try:
        indices = [int(p) for p in parts]
    except ValueError:
        indices = [0]
    if any(i < 1 for i in indices) or any(a >= b for a, b in zip(indices, indices[1:])):
        raise ConfigError(f"--allreduce_fusion {text!r} must be strictly increasing parameter indices >= 1, "
                          "e.g. 85,160 (ResNet-50), auto (buckets of 25 MB), or empty for one fused group")
    return indices


@dataclass(frozen=True)
class Option:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Optional[Sequence[Any]] = None
    min: Optional[float] = None        # inclusive lower bound
    above: Optional[float] = None      # exclusive lower bound
    max: Optional[float] = None        # inclusive upper bound
    hashed: bool = True                # part of the config hash stored in checkpoints
    check: Optional[Callable[[Any], None]] = None  # raises ConfigError for a value the other fields cannot reject


def _opt(name, type_, default, help_, **kw) -> Option:
    return Option(name, type_, default, help_, **kw)


TRAIN_OPTIONS = [
    # data
    _opt("data_dir", str, "", "ImageFolder root holding Training/ and Test/ (one folder per class)", hashed=False),
    _opt("bad_images", str, "error", "images the data check finds unusable (corrupt, truncated, empty...): "
         "error = refuse to train, naming them; skip = leave them out on every rank", choices=("error", "skip"),
         hashed=False),
    _opt("image_size", int, 100, "square input resolution the images are resized to", min=8),
    _opt("num_classes", int, 0, "number of classes; 0 takes it from Training/", min=0),
    _opt("augment", boolean, True, "random crop with padding + horizontal flip on training images"),
    _opt("crop_padding", int, 4, "pixels of zero padding around the image before the random crop", min=0),
    _opt("train_crop", str, "resize", "with augment: resize = resize to image_size, then the padded random crop; "
         "random_resized = a random crop of crop_scale of the area at an aspect ratio in crop_ratio, resized to "
         "image_size (Inception/timm style)", choices=("resize", "random_resized")),
    _opt("crop_scale_min", float, 0.08, "random_resized: smallest crop area, as a fraction of the image", above=0,
         max=1),
    _opt("crop_scale_max", float, 1.0, "random_resized: largest crop area, as a fraction of the image", above=0,
         max=1),
    _opt("crop_ratio_min", float, 0.75, "random_resized: smallest crop aspect ratio (width / height)", above=0),
    _opt("crop_ratio_max", float, 4 / 3, "random_resized: largest crop aspect ratio (width / height)", above=0),
    _opt("color_jitter", float, 0.0, "random brightness, contrast and saturation factors in [1 - F, 1 + F] per "
         "training image; 0 = off", min=0, max=1),
    _opt("label_smoothing", float, 0.0, "share of each training target spread evenly over all classes; 0 = off "
         "(the evaluation loss stays plain cross-entropy)", min=0, max=0.99),
    _opt("mixup", float, 0.0, "mixup alpha: blend each training image and label with a partner from the same "
         "global batch, weight ~ Beta(alpha, alpha); 0 = off", min=0),
    _opt("cutmix", float, 0.0, "cutmix alpha: paste a box of a partner image from the same global batch, box "
         "area ~ Beta(alpha, alpha); 0 = off; with mixup too, each step uses one of them at random", min=0),
    _opt("shuffle", boolean, True, "reshuffle the training set every epoch (same permutation on every rank)"),
    _opt("num_workers", int, 0, "dataset map workers per rank; 0 derives it from the cores per rank", min=0),
    # model
    _opt("model", str, "resnet50", "model name from the models registry (resnet18/34/50/101, resnet_tiny)"),
    _opt("zero_init_last_bn", boolean, False, "start every residual block's last BN gamma at zero"),
    _opt("sync_bn", boolean, False, "normalize BatchNorm over the global batch (all ranks) instead of per rank"),
    _opt("dist_bn", str, "reduce", "without sync_bn, make the ranks' BatchNorm running statistics one model before "
         "every evaluation and checkpoint: reduce = mean over ranks, broadcast = rank 0's, none = keep per rank",
         choices=("reduce", "broadcast", "none")),
    _opt("pretrained", str, "", "start from these weights: msdist's own .ckpt, a MindSpore model zoo / MindCV "
         "ResNet .ckpt, or torchvision / timm ResNet weights (.safetensors, .pth/.pt) of the same architecture "
         "(names mapped, docs/model_use.md); the classifier is skipped when the class count differs", hashed=False),
    _opt("freeze_backbone", boolean, False, "train the classifier only: backbone weights and BatchNorm statistics "
         "stay as loaded"),
    _opt("backbone_lr_scale", float, 1.0, "multiply the learning rate of everything but the classifier by this "
         "(fine-tuning: e.g. 0.1)", min=0),
    # optimization
    _opt("epochs", int, 10, "number of training epochs", min=1),
    _opt("max_steps", int, 0, "stop after this many optimizer steps in total; 0 = no limit", min=0),
    _opt("batch_size", int, 32, "GLOBAL batch size, split evenly over the ranks", min=1),
    _opt("lr", float, 0.01, "base learning rate", above=0),
    _opt("scale_lr", boolean, False, "multiply lr by the world size (linear scaling rule)"),
    _opt("lr_schedule", str, "constant", "learning-rate schedule", choices=("constant", "step", "cosine")),
    _opt("warmup_epochs", float, 0.0, "linear warmup from 0 over this many epochs", min=0),
    _opt("lr_step_size", int, 3, "step schedule: epochs between decays", min=1),
    _opt("lr_gamma", float, 0.1, "step schedule: decay factor", above=0),
    _opt("min_lr", float, 0.0, "cosine schedule: final learning rate", min=0),
    _opt("momentum", float, 0.9, "SGD momentum", min=0, max=1),
    _opt("weight_decay", float, 1e-4, "L2 weight decay on conv/dense weights (not BN, not bias)", min=0),
    _opt("loss_scale", precision.parse_loss_scale, "auto", "auto = dynamic when float16 carries gradients (amp "
         "O2/O3 float16, grad_compression fp16), else none; dynamic = halve on overflow and skip that step on every "
         "rank, double after 1000 clean steps (saved in checkpoints); a number = that fixed scale",
         check=precision.check_loss_scale),
    _opt("ema_decay", float, 0.0, "keep an exponential moving average of the weights with this decay per step "
         "(e.g. 0.999), evaluated and saved as {prefix}_rank{r}_ema.ckpt; 0 = off", min=0, max=0.999999),
    _opt("seed", int, 1, "seed for every RNG; identical on every rank", min=0),
    _opt("deterministic", boolean, False, "ask MindSpore for deterministic kernels"),
    # gradient communication (msdist/engine/reducers.py, docs/grad_comm.md)
    _opt("grad_compression", str, "none", "how gradients cross ranks: none = MindSpore's fused float32 all-reduce; "
         "fp16 = all-reduce in float16; topk = each tensor's largest topk_ratio of elements; threshold = elements "
         "above `threshold` (at most topk_ratio of each tensor)", choices=("none", "fp16", "topk", "threshold")),
    _opt("topk_ratio", float, 0.01, "topk/threshold: fraction of each gradient tensor's elements sent per step "
         "(at least one)", above=0, max=1),
    _opt("threshold", float, 1e-3, "threshold: send gradient elements whose magnitude (unscaled, plus the "
         "residual) exceeds this", above=0),
    _opt("error_feedback", boolean, True, "topk/threshold: add what was not sent to the next step's gradient "
         "(a per-parameter residual, saved in checkpoints); false only for experiments"),
    _opt("allreduce_fusion", str, "auto", "gradient all-reduce buckets, each parameters contiguous in network order "
         "and sent last layers first, so a bucket is reduced while backward still runs: auto = cut every 25 MB "
         "(like DDP); indices = cut after these parameters, e.g. 85,160; empty = one fused all-reduce",
         check=fusion_split),
    _opt("grad_accum_steps", int, 1, "micro-batches per optimizer step; batch_size stays the global batch of "
         "one optimizer step, each rank runs it as this many micro-batches", min=1),
    # runtime
    _opt("device_target", str, "auto", "auto = GPU when usable, else CPU", choices=("auto", "CPU", "GPU"), hashed=False),
    _opt("cpu_isa", str, "auto", "oneDNN ISA cap; auto = the fastest for this CPU (probed once, cached), default = "
         "oneDNN's own; the ONEDNN_MAX_CPU_ISA environment variable wins", choices=CPU_ISA_CHOICES, hashed=False),
    _opt("bind_cores", boolean, True, "pin each rank to its own slice of the host's cores when several share it",
         hashed=False),
    _opt("compile_cache", boolean, True, "keep compiled graphs under {output_dir}/compile_cache so a restart "
         "skips compilation (keyed by config, world size, MindSpore version and sources)", hashed=False),
    _opt("amp_level", str, "auto", "mixed precision: auto = O2 on GPU, O0 on CPU; O0 = float32; O2 = low "
         "precision except BatchNorm (and SyncBatchNorm); O3 = all low precision", choices=precision.AMP_LEVELS),
    _opt("amp_dtype", str, "float16", "low-precision type for amp_level O2/O3 (MindSpore's CPU convolutions "
         "accept neither)", choices=("float16", "bfloat16")),
    _opt("jit_level", str, "auto", "MindSpore's compile level for the train step: O0 = kernel by kernel; O1 = plus "
         "automatic kernel fusion (MindSpore 2.10's graph-kernel fusion); auto = O1 on GPU, O0 on CPU "
         "(docs/performance.md)", choices=jit.JIT_LEVELS),
    _opt("sink_size", chunks.parse_size, chunks.AUTO, "optimizer steps per host call (MindSpore's data sink): on "
         "GPU a chunk of K steps is one sunk call fed by the device's data queue; the heartbeat, step line, saves by "
         "steps and the stop check happen between chunks; auto = on GPU chunks of 0.5-1 s from the ranks' forecast "
         "step time (the step line every log_every rounded up to whole chunks; without a forecast the largest K up to "
         "64 dividing log_every and save_every_steps), 1 on CPU (no data sink there); docs/performance.md", hashed=False,
         check=chunks.check_size),
    _opt("verbose", boolean, False, "show MindSpore's own C++ INFO/WARNING lines", hashed=False),
    _opt("log_every", int, 10, "print a progress line every N steps", min=1, hashed=False),
    # where the time goes (docs/performance.md, docs/monitoring.md)
    _opt("profile_steps", str, "", "A:B = run MindSpore's profiler for global steps A to B on --profile_ranks, "
         "written under {output_dir}/profile/rank_R/ (a Chrome trace and MindStudio Insight's folder); empty = off",
         hashed=False, check=profiler.parse_steps),
    _opt("profile_ranks", str, "0", "ranks --profile_steps profiles: comma-separated (0,3) or all", hashed=False,
         check=profiler.parse_ranks),
    _opt("straggler_margin", float, 0.2, "name a rank whose input-wait or core-wait share of a step exceeds the "
         "other ranks' median by this much (0.2 = 20 points), or whose step time exceeds it by this fraction; "
         "0 = off", min=0, max=1, hashed=False),
    _opt("straggler_windows", int, 2, "log windows in a row a rank must be slow before it is named", min=1,
         hashed=False),
    # the stall option family (msdist/cluster/stall.py), which msdist.launch reads from the train options too
    *[_opt(k.name, k.type, k.default, k.help, hashed=False, check=k.parse) for k in stall.KNOBS],
    _opt("tensorboard", boolean, False, "also write TensorBoard scalars under {output_dir}/tb (pip install "
         "'msdist[tensorboard]')", hashed=False),
    # checkpoints and evaluation
    _opt("output_dir", str, "output", "where checkpoints, logs, config.yaml and result.json go", hashed=False),
    _opt("ckpt_prefix", str, "", "checkpoint file prefix; empty = the model name", hashed=False),
    _opt("save_every_epochs", int, 1, "save a checkpoint every N epochs (and always at the end)", min=1, hashed=False),
    _opt("preempt_signal", str, preemption.DEFAULT_SIGNAL, "the signal that asks the job to save a checkpoint at the next step every "
         "rank reaches and exit with status 200 (requeue), e.g. SIGUSR2 for Slurm's --signal=B:USR2@120; a second "
         "one stops at once; SIGUSR1 (stack dumps) and SIGINT (stop now) are refused (docs/cluster.md)",
         hashed=False, check=preemption.check_signal),
    _opt("save_every_steps", int, 0, "also save a checkpoint every N optimizer steps, written by a background "
         "thread (the loop waits only for an in-memory copy); 0 = off", min=0, hashed=False),
    _opt("keep_checkpoint_max", int, 5, "keep the newest N checkpoints of each rank, whatever saved them (epochs, "
         "steps, a preemption), and the newest complete one a resume needs", min=1, hashed=False),
    _opt("resume", str, "", "checkpoint PATH to resume from, or 'auto' for the newest complete checkpoint in "
         "output_dir", hashed=False),
    _opt("overwrite", boolean, False, "start a new run in an output_dir that holds another run's checkpoints; "
         "the old run's ckpt/, config.yaml, result.json... move to {output_dir}/replaced-<time>/, never deleted",
         hashed=False),
    _opt("eval_every_epochs", int, 0, "evaluate every N epochs; 0 = only after training", min=0, hashed=False),
    _opt("eval_batch_size", int, 0, "per-rank evaluation batch; 0 = the per-rank training batch", min=0, hashed=False),
]

# Options read together as one (min, max) range: checked once both are resolved, before MindSpore loads.
RANGES = (("crop_scale_min", "crop_scale_max"), ("crop_ratio_min", "crop_ratio_max"))

EVAL_OPTIONS = TRAIN_OPTIONS + [
    _opt("ckpt", str, "", "checkpoint to evaluate", hashed=False),
]


def _metavar(opt: Option) -> str:
    return opt.type.__name__ if opt.type in (int, float, str, boolean) else "value"


def _build_parser(prog: str, options: Sequence[Option]) -> ArgumentParser:
    parser = ArgumentParser(prog=prog, allow_abbrev=False,
                     description="Every option can also be set in the YAML given by --config.")
    parser.add_argument("--config", default="", help="YAML file whose keys set the defaults below")
    for opt in options:
        extra = f" (choices: {', '.join(map(str, opt.choices))})" if opt.choices else ""
        parser.add_argument(f"--{opt.name}", type=opt.type, default=None, metavar=_metavar(opt),
                            help=f"{opt.help}{extra} [default: {opt.default!r}]")
    return parser


def _closest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not close:
        # `epochs_num` vs `epochs`: a shared stem is a better hint than edit distance.
        close = [k for k in known if key.startswith(k) or k.startswith(key)][:1]
    return close[0] if close else ""


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    close = _closest(key, known)
    return f" (did you mean --{close}?)" if close else ""


def _load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found; pass an existing YAML, e.g. --config configs/resnet50_fruits360.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read ({e.strerror})") from None
    # ValueError: bad bytes (UnicodeDecodeError) or an impossible value such as the date 2020-13-45;
    # RecursionError: absurdly deep nesting.
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
        raise ConfigError(f"config file {path!r} is not valid YAML ({first_line(str(e)) or type(e).__name__}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must be a mapping of option: value, got {type(data).__name__}")
    return data


def _coerce(opt: Option, value: Any, where: str) -> Any:
    """Turn a YAML value into the option's type, as strictly as the command line would."""
    try:
        if isinstance(value, bool) and opt.type is not boolean:
            raise ValueError(f"expected {opt.type.__name__}, got a boolean")
        if isinstance(value, (dict, list)) or value is None:
            raise ValueError(f"expected a single {opt.type.__name__} value, got {type(value).__name__}")
        if opt.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value} is not a whole number")
        return opt.type(value if isinstance(value, (str, bool)) or opt.type is not boolean else str(value))
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{where}{opt.name}: {e}") from None


def _validate(opt: Option, value: Any, where: str) -> None:
    if opt.check is not None:
        opt.check(value)
    if opt.choices is not None and value not in opt.choices:
        close = _closest(str(value), list(map(str, opt.choices)))
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(f"{where}{opt.name}={value!r} is not one of {', '.join(map(str, opt.choices))}{hint}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{where}{opt.name}={value} must be a finite number")
        if opt.min is not None and value < opt.min:
            raise ConfigError(f"{where}{opt.name}={value} must be >= {opt.min}")
        if opt.above is not None and value <= opt.above:
            raise ConfigError(f"{where}{opt.name}={value} must be > {opt.above}")
        if opt.max is not None and value > opt.max:
            raise ConfigError(f"{where}{opt.name}={value} must be <= {opt.max}")


def _split_unknown(parser: ArgumentParser, argv: Sequence[str], known: Sequence[str]):
    ns, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            raise ConfigError(f"unknown option --{key}{_did_you_mean(key, known)}")
        raise ConfigError(f"unexpected argument {token!r}; options are written --key value")
    return ns


def _tell_renamed(old: str, where: str = "") -> None:
    """One line on stderr naming the new name of option `old`, so that scripts and YAML files move over.

    Said by the process the user started: rank 0 only (every rank reads the same), and not by the ranks of
    msdist.launch, which parsed the same command line and file before it started them.
    """
    launch = launch_env.detect_launch()
    if launch.rank == 0 and launch.launcher != "msdist.launch":
        print(f"msdist: {where}--{old} is now --{stall.RENAMED[old]} (docs/launch.md#stall-options)",
              file=sys.stderr, flush=True)


def renamed_to_current(argv: Sequence[str]) -> List[str]:
    """`argv` with options that were renamed (`stall.RENAMED`) written under their current names (with
    `_tell_renamed`'s notice)."""
    out = []
    for token in argv:
        key, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if key in stall.RENAMED:
            _tell_renamed(key)
            token = f"--{stall.RENAMED[key]}{eq}{value}"
        out.append(token)
    return out


def _yaml_renamed_to_current(data: dict, path: str) -> dict:
    """A YAML file's keys, renamed ones (`stall.RENAMED`) under their current names, as on the command line."""
    out = {}
    for key, value in data.items():
        key = str(key)
        if key in stall.RENAMED:
            if stall.RENAMED[key] in data:
                raise ConfigError(f"{path} sets both {key} and {stall.RENAMED[key]}; keep {stall.RENAMED[key]}, "
                                  f"the current name of {key}")
            _tell_renamed_in_file(key, path)
            key = stall.RENAMED[key]
        out[key] = value
    return out


@functools.lru_cache(maxsize=None)
def _tell_renamed_in_file(old: str, path: str) -> None:
    """`_tell_renamed` once per file and key in a process: msdist.launch reads the file twice (option checks,
    then path checks)."""
    _tell_renamed(old, f"{path}: ")


def parse(argv: Optional[Sequence[str]] = None, options: Sequence[Option] = TRAIN_OPTIONS,
          prog: str = "msdist.train", suggest_also: Sequence[str] = ()) -> argparse.Namespace:
    """Resolve the configuration: schema defaults < YAML < command line.

    Args:
        suggest_also: option names of a wrapping CLI (msdist.launch), offered by did-you-mean too.

    Raises:
        ConfigError: unknown key, bad type, out-of-range value or missing file.
    """
    by_name = {o.name: o for o in options}
    parser = _build_parser(prog, options)
    cli = _split_unknown(parser, renamed_to_current(sys.argv[1:] if argv is None else argv),
                         list(by_name) + list(suggest_also))
    values = {o.name: o.default for o in options}
    if cli.config:
        for key, value in _yaml_renamed_to_current(_load_yaml(cli.config), cli.config).items():
            if key not in by_name:
                raise ConfigError(f"unknown key {key!r} in {cli.config}{_did_you_mean(key, list(by_name))}")
            values[key] = _coerce(by_name[key], value, f"{cli.config}: ")
            _validate(by_name[key], values[key], f"{cli.config}: ")
    for name in by_name:
        value = getattr(cli, name)
        if value is not None:
            _validate(by_name[name], value, "--")
            values[name] = value
    _check_ranges(values)
    return argparse.Namespace(config=cli.config, **values)


def _check_ranges(values: dict) -> None:
    """The cross-field rules: each of `RANGES` present in `values` has min <= max."""
    for low_name, high_name in RANGES:
        if low_name in values and high_name in values and values[low_name] > values[high_name]:
            raise ConfigError(f"{low_name}={values[low_name]} exceeds {high_name}={values[high_name]}; "
                              "pass a range with min <= max")


def config_hash(cfg: argparse.Namespace, options: Sequence[Option] = TRAIN_OPTIONS) -> str:
    """A short hash of everything that shapes the trained model (not paths or logging)."""
    payload = {o.name: getattr(cfg, o.name) for o in options if o.hashed}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def save(cfg: argparse.Namespace, path: str) -> None:
    """Write the resolved config as YAML that `--config` accepts back."""
    values = {k: v for k, v in vars(cfg).items() if k != "config"}
    # Through a rename: a crash mid-write must not leave a half config that `--config` refuses on resume.
    atomic_write_text(path, yaml.safe_dump(values, sort_keys=False))
