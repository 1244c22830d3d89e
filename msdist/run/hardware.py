"""The hardware `python -m msdist.plan_scale` forecasts for: GPU compute, links, this host's own costs.

Every figure is a constant with its source (docs/scaling.md lists them again, with the reasoning). One set
of constants per GPU and per link preset: nothing here is fitted to a published multi-GPU result, so the
validation table in docs/scaling.md is a test of the model, not of a fit.

MindSpore-free: plain data and the look-ups that refuse what the tables do not hold.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from msdist.base.errors import ConfigError

REFERENCE_SIZE = 224  # px: every published figure below is ImageNet training at 224 x 224

# Forward GFLOPs per 224 px image (torchvision's model docs: "GFLOPS" column, which counts multiply-adds).
# Used only to carry a published ResNet-50 figure to ResNet-18 / ResNet-101 where no figure is published.
GFLOPS_224 = {"resnet18": 1.81, "resnet50": 4.09, "resnet101": 7.80}

STEP_MS_HOWTO = ("--step_ms from one real 1-GPU run: 1000 * global_batch / images_per_sec of its result.json "
                 "(python -m msdist.train --config C --max_steps 200 on that GPU, then read OUTPUT/result.json)")


@dataclass(frozen=True)
class Throughput:
    """Training images/s of one GPU at 224 px, measured at `batch` images per GPU."""
    images_per_sec: float
    batch: int
    source: str


_DLE = "NVIDIA DeepLearningExamples PyTorch RN50 v1.5 README, 1-GPU row; batch from its configs.yml"
_TF17 = "tensorflow.org benchmarks (May 2017), 1-GPU row, synthetic data"
# (gpu, precision) -> ResNet-50 v1.5 at 224 px. precision "fp32" is amp O0 (TF32 math on A100/H100, as the
# published runs), "amp" is O2/O3 float16.
RESNET50: Dict[Tuple[str, str], Throughput] = {
    ("V100", "fp32"): Throughput(367, 112, _DLE + " (DGX-1 16GB, FP32)"),
    ("V100", "amp"): Throughput(1200, 256, _DLE + " (DGX-1 16GB, mixed precision)"),
    ("A100", "fp32"): Throughput(938, 256, _DLE + " (DGX A100 80GB, TF32)"),
    ("A100", "amp"): Throughput(2470, 256, _DLE + " (DGX A100 80GB, mixed precision)"),
    # No H100 row in DeepLearningExamples: 2x A100, Lambda's H100 analysis ("vision models ~2x" A100 SXM), for
    # frameworks with native sm_90 kernels. MindSpore 2.10's own kernels have none (FIRST_START), so the figure
    # assumes the convolutions run in cuDNN/cuBLAS builds that carry sm_90 code (CUDA 11.8's) and that the rest,
    # elementwise and memory-bound, loses little as driver-compiled compute_86 PTX. Not measured; ~30% either way.
    ("H100", "fp32"): Throughput(2 * 938, 256, "derived: 2x the A100 TF32 row (Lambda Labs H100 analysis, vision ~2x)"),
    ("H100", "amp"): Throughput(2 * 2470, 256, "derived: 2x the A100 AMP row (Lambda Labs H100 analysis, vision ~2x)"),
    ("K80", "fp32"): Throughput(52.4, 64, _TF17 + ", EC2 p2.8xlarge distributed table"),
    ("P100", "fp32"): Throughput(219, 64, _TF17 + ", DGX-1 (P100) table"),
}
# Published figures for other models; the rest are carried from ResNet-50 by GFLOPS_224.
OTHER_MODELS: Dict[Tuple[str, str, str], Throughput] = {
    ("P100", "fp32", "resnet101"): Throughput(119.4, 64, "Horovod README (2017), 'Baseline single-GPU (batch "
                                                         "size=64)', Pascal GPU, ResNet-101"),
}
GPUS = ("K80", "P100", "V100", "A100", "H100")
# GPUs newer than the machine code in MindSpore 2.10's GPU kernels, and what their first start costs. Read from the
# wheel's plugin/gpu/libcuda_ops.so.11 fatbinaries: each of its 407 modules has machine code for sm_60, 61, 70, 75
# and 80 (139.6 MB for sm_80) and PTX for compute_60 and compute_86 (193 MB uncompressed), so on an sm_90 GPU the
# driver compiles the compute_86 PTX when the module loads (eagerly: the plugin's CUDA 11.6 runtime has no lazy
# loading). ptxas 11.8 -O3 for sm_90 compiled 12 random modules (3.65 MB of that PTX) in 5.6 s of CPU on this host:
# scaled by bytes, ~5 min of one core for all of it, in every rank's process until the JIT cache holds it.
FIRST_START = {
    "H100": "MindSpore 2.10's GPU kernels carry machine code up to sm_80 and PTX (compute_86), none for the H100's "
            "sm_90: at its first start each rank's driver compiles their 193 MB of PTX, ~5 min of one CPU core "
            "(ptxas 11.8 on a sample, scaled), then keeps it in the CUDA JIT cache (CUDA_CACHE_PATH on a "
            "persistent volume, CUDA_CACHE_MAXSIZE above the ~140 MB of code); the rows assume that cost paid "
            "once, and 2x an A100's step (Lambda Labs' ~2x for vision, which needs CUDA 11.8's cuDNN with its sm_90 "
            "code); not measured",
}


def gpu_throughput(gpu: str, model: str, precision: str) -> Throughput:
    """Images/s of one `gpu` training `model` at 224 px in `precision` ("fp32" or "amp").

    Raises:
        ConfigError: a GPU, model or precision the table does not hold, naming --step_ms.
    """
    name = gpu.upper()
    if name not in GPUS:
        raise ConfigError(f"--gpu {gpu!r} is not in the compute table ({', '.join(GPUS)}); pass {STEP_MS_HOWTO}")
    if model not in GFLOPS_224:
        raise ConfigError(f"model {model!r} is not in the compute table ({', '.join(GFLOPS_224)}); pass {STEP_MS_HOWTO}")
    published = OTHER_MODELS.get((name, precision, model))
    if published:
        return published
    base = RESNET50.get((name, precision))
    if base is None:
        raise ConfigError(f"no published {precision} figure for {name} (amp needs tensor cores: V100, A100, H100); "
                          f"use --amp_level O0 or pass {STEP_MS_HOWTO}")
    if model == "resnet50":
        return base
    ratio = GFLOPS_224["resnet50"] / GFLOPS_224[model]
    return Throughput(base.images_per_sec * ratio, base.batch,
                      f"derived: ResNet-50 row x {ratio:.2f} (torchvision GFLOPS ratio); {base.source}")


# Peak dense FLOP/s of one GPU (NVIDIA's data sheets: Tesla K80, P100 SXM2, V100 SXM2, A100 SXM4, H100 SXM5;
# tensor-core figures without sparsity), for the utilisation msdist.train reports. "fp32" is amp O0, which runs
# TF32 tensor cores on A100/H100 as the throughput rows above do; "amp" is float16. K80 is one GK210 of the
# board's two (boost clock); P100 has no tensor cores, its float16 rate is twice its float32.
PEAK_TFLOPS: Dict[Tuple[str, str], float] = {
    ("K80", "fp32"): 4.37, ("P100", "fp32"): 10.6, ("P100", "amp"): 21.2,
    ("V100", "fp32"): 15.7, ("V100", "amp"): 125.0, ("A100", "fp32"): 156.0, ("A100", "amp"): 312.0,
    ("H100", "fp32"): 494.7, ("H100", "amp"): 989.4,
}


def precision_of(amp_level: str) -> str:
    """The tables' precision of a resolved `--amp_level`: "fp32" for O0 (TF32 tensor cores on A100/H100), else
    "amp" (float16)."""
    return "fp32" if amp_level == "O0" else "amp"


def gpu_of_product(model_name: str) -> Optional[str]:
    """The tables' name (`GPUS`) of a GPU product name ("Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB"...); None
    for a GPU the tables do not hold."""
    return next((gpu for gpu in GPUS if gpu in model_name.upper()), None)


def gpu_peak_flops(model_name: str, precision: str) -> Optional[float]:
    """One GPU's peak FLOP/s in `precision` ("fp32" or "amp"), from its product name; None for a GPU the table
    does not hold."""
    peak = PEAK_TFLOPS.get((gpu_of_product(model_name), precision))
    return None if peak is None else peak * 1e12


def ms_per_image(gpu: str, model: str, precision: str, image_size: int) -> float:
    """One `gpu`'s training milliseconds per image of `model` at `image_size`: its 224 px row scaled by pixels.

    Raises:
        ConfigError: what `gpu_throughput` refuses.
    """
    return 1000 / gpu_throughput(gpu, model, precision).images_per_sec * (image_size / REFERENCE_SIZE) ** 2


def sunk_step_seconds(product_name: str, model: str, precision: str, image_size: int, images: int
                      ) -> Optional[float]:
    """One sunk step of `images` images on the GPU named `product_name` (its compute, and what MindSpore's loop adds
    to every step, `SINK_STEP_HOST_MS`); None where the tables hold no figure for it."""
    gpu = gpu_of_product(product_name)
    if gpu is None:
        return None
    try:
        per_image = ms_per_image(gpu, model, precision, image_size)
    except ConfigError:
        return None
    return (per_image * images + SINK_STEP_HOST_MS) / 1000


# ----------------------------------------------------------------------------------------------- links

# Share of a link's line rate that a ring all-reduce reaches as bus bandwidth. NCCL's own tests report about
# 230-240 GB/s busbw on DGX A100's 300 GB/s NVLink (0.77-0.8); one figure for every link, so no preset is
# tuned to a published run.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Link:
    """One level of the network: a ring's bus bandwidth (GB/s) and the fixed cost of one collective (us)."""
    name: str
    busbw_gbs: float
    latency_us: float
    source: str


def _link(name: str, line_gbs: float, latency_us: float, what: str) -> Link:
    return Link(name, line_gbs * LINK_EFFICIENCY, latency_us, f"{what}: {line_gbs:g} GB/s x {LINK_EFFICIENCY}")


# Line rates: NVLink per GPU and direction (NVIDIA's V100/A100/H100 datasheets: 6, 12, 18 links of 25 GB/s);
# PCIe 3.0 x16 15.75 GB/s; network ports Gb/s / 8, one port per node. Latencies: NCCL's small-message
# all-reduce over NVLink/PCIe/InfiniBand is ~10-20 us; TCP over Ethernet ~50 us.
INTRA_LINKS = {link.name: link for link in (
    _link("nvlink-v100", 150, 10, "NVLink 2, 6 links x 25 GB/s (DGX-1V)"),
    _link("nvlink-a100", 300, 10, "NVLink 3, 12 links x 25 GB/s (DGX A100)"),
    _link("nvlink-h100", 450, 10, "NVLink 4, 18 links x 25 GB/s (DGX H100)"),
    _link("pcie", 15.75, 15, "PCIe 3.0 x16 (K80, P100 PCIe servers)"),
)}
INTER_LINKS = {link.name: link for link in (
    _link("eth10", 10 / 8, 50, "10 Gb Ethernet (EC2 p2.8xlarge), one port per node"),
    _link("eth25", 25 / 8, 50, "25 Gb Ethernet / RoCE, one port per node"),
    _link("eth50", 50 / 8, 50, "50 Gb Ethernet, one port per node"),
    _link("ib100", 100 / 8, 10, "100 Gb InfiniBand EDR, one port per node"),
    _link("ib200", 200 / 8, 10, "200 Gb InfiniBand HDR, one port per node"),
    _link("ib400", 400 / 8, 10, "400 Gb InfiniBand NDR, one port per node"),
)}
# The link a GPU's servers usually have inside, and the default between nodes when none is named.
USUAL_INTRA = {"K80": "pcie", "P100": "pcie", "V100": "nvlink-v100", "A100": "nvlink-a100", "H100": "nvlink-h100"}
DEFAULT_INTER = "ib100"


def links(network: str, gpu: Optional[str]) -> Tuple[Link, Link]:
    """(intra-node, inter-node) links from `--network` ("NAME" or "INTRA,INTER"), the GPU's usual ones filling in.

    Raises:
        ConfigError: a name that is no preset.
    """
    intra = INTRA_LINKS[USUAL_INTRA.get((gpu or "").upper(), "pcie")]
    inter = INTER_LINKS[DEFAULT_INTER]
    for name in (n.strip() for n in network.split(",") if n.strip()):
        if name in INTRA_LINKS:
            intra = INTRA_LINKS[name]
        elif name in INTER_LINKS:
            inter = INTER_LINKS[name]
        else:
            raise ConfigError(f"--network {name!r} is not a preset; choose from {', '.join(INTRA_LINKS)} (inside a "
                              f"node) and {', '.join(INTER_LINKS)} (between nodes), e.g. nvlink-a100,ib200")
    return intra, inter


# ------------------------------------------------------------------------------------- this host's costs

# Host work of one Python call of the train step (batch fetch, dispatch, loss bookkeeping, heartbeat, logging),
# measured on this host with a graph of negligible compute by benchmarks/host_work.py (docs/performance.md, "Host
# work per step": 1140 us, median of 200 steps, load 2.7, with the batch fetched behind the step and the launch's
# compile check skipped). docs/scaling.md "Host work" has a cross-check. In sink mode on GPU (--sink_size, issue
# 40) one call runs a chunk of K steps, so it is paid once per chunk: SINK_CHUNK_S is the chunk `auto` aims at.
HOST_OVERHEAD_MS = 1.1
SINK_CHUNK_S = 0.5
# What stays in every step in sink mode. MindSpore 2.10's loop-count actor ends each step of its C++ loop with a
# sync of all streams, and only then sends the next step to the data-prepare actor:
# mindspore/ccsrc/backend/ms_backend/runtime/actors/base/loop_count_actor.cc (the path the 2.10 wheel's
# libmindspore_ms_backend.so, commit 2d550373 of r2.10, embeds with the same log lines; read in the public mirror
# mindspore-ai/mindspore_test at 24081efd), LoopCountActor::RealRun, lines 80-100: "Sync stream in the step end."
# at line 84, SyncAllStreams at line 90, PostRun at line 99, whose SendOutput sends the data-prepare actor the next
# step (GetNeedSyncStream in graph_scheduler.cc is true for every training graph). So the GPU idles from the step's
# last kernel until the host has woken from the sync and launched the next step's first kernel:
# - SYNC_ROUND_TRIP_US: one host-device round trip, ~20 us on a V100 (NVIDIA's Nsight Systems guide, a PyTorch
#   elementwise kernel's launch-to-start);
# - STEP_LAUNCH_US: MindSpore's own work from one step to the next (data prepare, GetNext, the first launch),
#   bounded by its launch of a compiled graph back to back on this host, Python call included: 72-76 us
#   (benchmarks/host_work.py's "launch floor", docs/performance.md).
SYNC_ROUND_TRIP_US = 20.0
STEP_LAUNCH_US = 75.0
SINK_STEP_HOST_MS = (SYNC_ROUND_TRIP_US + STEP_LAUNCH_US) / 1000
# CPU per training image of msdist's input pipeline, one worker, 100 px JPEGs resized to 100 px
# (`python -m msdist.data bench`, docs/data.md): read+decode 114 us (per source image), resize 18 us and
# batch (normalize, layout, batch) 72 us (both per output pixel, so they scale with image_size^2).
INPUT_DECODE_US = 114.0
INPUT_PER_PIXEL_US = (18.0 + 72.0) / (100 * 100)


def input_us_per_image(image_size: int) -> float:
    """msdist's measured CPU microseconds per training image at `image_size` (decode fixed, the rest per pixel)."""
    return INPUT_DECODE_US + INPUT_PER_PIXEL_US * image_size * image_size
