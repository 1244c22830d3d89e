"""The step-time model behind `python -m msdist.plan_scale`: the step msdist runs on GPU, in sink mode.

One step on each of N GPUs = forward + backward of the per-GPU batch (`Compute`), then whatever part of the
gradient exchange is still running when backward ends (exposed communication), plus what the host still adds to
every step (`host_seconds`: MindSpore's end-of-step stream sync and next launch; msdist's Python once per chunk).

- An all-reduce of B bytes over n ranks on one link costs `latency + 2(n-1)/n * B / busbw` (ring, alpha-beta).
  Across nodes NCCL's ring runs through all N GPUs, so each node's link carries 2(N-1)/N * B, at the speed of
  the slowest link on the ring (`ring_allreduce_seconds`, `node_link_bytes`).
- An AllGather of s bytes per rank costs `latency + (n-1) * s / busbw` per level: it grows with N, which is
  what top-K and threshold pay (`allgather_seconds`).
- Each exchange is a `Message`: ready when backward has produced all of its gradients, sent one after the other
  on one stream, one per bucket (MindSpore compiles each of msdist's buckets to one AllReduce op:
  `engine.buckets.fusion_config`). Backward produces the last layers first, and a parameter's share of
  backward time is its share of the network's multiply-adds (`backward_cost`), so a bucket of the last layers
  is ready early. Backward hides the exchange only where msdist's step lets it (`overlaps_backward`): not on a
  CPU rank, not when the step accumulates micro-batches (grad_accum_steps, or an elastic job below MAX nodes),
  not with SyncBN (whose collectives queue behind the buckets, and cost their own latency: `sync_bn_seconds`).

Pure arithmetic, MindSpore-free (the top-K sizes come from the reducer's own rule, imported when used).
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from msdist.run import chunks
from msdist.run.hardware import Link

SCALES = tuple(2 ** i for i in range(11))  # N = 1, 2, 4, ..., 1024
# Backward costs about twice the forward (gradients for the inputs and for the weights, each one forward's
# multiply-adds), so it is 2/3 of a step's compute.
BACKWARD_SHARE = 2 / 3
TOPK_BYTES_PER_ELEMENT = (4, 4)  # msdist's top-K sends an int32 index and a float32 value per kept element


@dataclass(frozen=True)
class Network:
    intra: Link
    inter: Link
    gpus_per_node: int


def allreduce_seconds(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `ranks` ranks on one link: latency + 2(n-1)/n * bytes / busbw."""
    if ranks <= 1:
        return 0.0
    return link.latency_us * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / (link.busbw_gbs * 1e9)


def nodes(world: int, gpus_per_node: int) -> int:
    return math.ceil(world / gpus_per_node)


def node_link_bytes(nbytes: float, world: int) -> float:
    """Bytes a ring all-reduce of `nbytes` over `world` GPUs sends through each link on the ring: 2(N-1)/N of them.

    Across nodes every node's network link is one of those links (NCCL's ring enters and leaves each node once),
    so 2 x 8 GPUs send 1.875x the gradient bytes through each node's port, not the 1.0x of a ring of 2 nodes.
    """
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def ring_allreduce_seconds(nbytes: float, world: int, net: Network) -> float:
    """NCCL's ring all-reduce of `nbytes` over `world` GPUs, `net.gpus_per_node` to a node.

    One node: the ring on its own link. Several: one ring through all GPUs, so each link carries
    `node_link_bytes`; the links run at once and the slowest (the node's port, as a rule) sets the time; the
    latency is one collective's on each level.
    """
    if world <= net.gpus_per_node:
        return allreduce_seconds(nbytes, world, net.intra)
    slowest = min(net.intra.busbw_gbs, net.inter.busbw_gbs)
    latency = (net.intra.latency_us + net.inter.latency_us) * 1e-6
    return latency + node_link_bytes(nbytes, world) / (slowest * 1e9)


def allgather_seconds(per_rank_bytes: float, world: int, net: Network) -> float:
    """AllGather of `per_rank_bytes` from each of `world` ranks: inside each node, then across nodes.

    Every GPU ends with world * s bytes: inside a node it receives (g-1) of every node's shares, and the
    node's link brings in (m-1) nodes' g shares.
    """
    if world <= 1:
        return 0.0
    local = min(world, net.gpus_per_node)
    m = nodes(world, local)
    inside = net.intra.latency_us * 1e-6 + (local - 1) * m * per_rank_bytes / (net.intra.busbw_gbs * 1e9)
    if m == 1:
        return inside
    return inside + net.inter.latency_us * 1e-6 + (m - 1) * local * per_rank_bytes / (net.inter.busbw_gbs * 1e9)


@dataclass(frozen=True)
class Message:
    """One collective: `ready` = share of backward done when its gradients are all there (0..1)."""
    ready: float
    seconds: float


def exposed_seconds(messages: Sequence[Message], backward_s: float) -> float:
    """Communication still running when backward ends; `messages` in send order, one at a time on one stream."""
    end = 0.0
    for m in messages:
        end = max(end, m.ready * backward_s) + m.seconds
    return max(0.0, end - backward_s)


def backward_done(costs: Sequence[float]) -> List[float]:
    """For each parameter (forward order): the share of backward done once its gradient exists.

    Backward runs from the last parameter to the first, so parameter i's gradient is ready after the cost of
    parameters i..end.
    """
    total = sum(costs) or 1.0
    done, after = [], 0.0
    for cost in reversed(costs):
        after += cost
        done.append(after / total)
    return done[::-1]


@dataclass(frozen=True)
class Gradients:
    """What the exchange works on: the buckets (send order), and every parameter in forward order."""
    buckets: Sequence  # engine.buckets.Bucket, send order: one AllReduce op each (buckets.fusion_config)
    sizes: Sequence[Tuple[str, int]]  # (name, float32 bytes), forward order
    costs: Sequence[float]  # backward cost of each parameter (its layer's multiply-adds), forward order

    def allreduce_messages(self, world: int, net: Network, fp16: bool = False) -> List[Message]:
        """One all-reduce per bucket, in send order, each ready when its first parameter's gradient is.

        float32: one fused AllReduce op per bucket; fp16: msdist's reducer sends each bucket as one flattened
        float16 tensor (reducers.Fp16BucketAllReduce), at half the bytes.
        """
        done = backward_done(self.costs)
        scale = 0.5 if fp16 else 1.0
        return [Message(done[b.first], ring_allreduce_seconds(b.nbytes * scale, world, net))
                for b in self.buckets]

    def sync_bn_seconds(self, world: int, net: Network) -> float:
        """The collectives of msdist's SyncBatchNorm in one step (engine/sync_bn.py), every one on the critical path:
        per BatchNorm layer of C channels, the forward's AllGather of [mean, M2] (2C float32 per rank) and the
        backward's AllReduce of two per-channel sums (2C float32). A layer is found by its `gamma`."""
        channels = [nbytes // 4 for name, nbytes in self.sizes if name.endswith("gamma")]
        return sum(allgather_seconds(2 * c * 4, world, net) + ring_allreduce_seconds(2 * c * 4, world, net)
                   for c in channels)

    def topk_messages(self, world: int, net: Network, ratio: float) -> List[Message]:
        """msdist's top-K / threshold: per tensor, from the last, an AllGather of indices and one of values."""
        from msdist.engine.reducers import kept_elements  # the reducer's own rule for K (loads MindSpore)
        done = backward_done(self.costs)
        messages = []
        for i in reversed(range(len(self.sizes))):
            kept = kept_elements(self.sizes[i][1] // 4, ratio)
            seconds = sum(allgather_seconds(kept * width, world, net) for width in TOPK_BYTES_PER_ELEMENT)
            messages.append(Message(done[i], seconds))
        return messages


EXCHANGES = ("none", "fp16", "topk")


def messages_for(exchange: str, grads: Gradients, world: int, net: Network, topk_ratio: float) -> List[Message]:
    if exchange == "topk":
        return grads.topk_messages(world, net, topk_ratio)
    return grads.allreduce_messages(world, net, fp16=exchange == "fp16")


@dataclass(frozen=True)
class Compute:
    """One GPU's forward + backward per image, what the host adds to each step, and what the step does.

    `host_ms`: per step, whatever the launch mode (in sink mode MindSpore's end-of-step sync and next launch,
    `hardware.SINK_STEP_HOST_MS`); `call_ms`: per Python call of the step, which sink mode pays once per chunk
    of `chunks.steps_lasting` steps (`--sink_size auto`). `hides_exchange`: whether backward can run while the exchange does. A GPU computes
    while its links and NCCL's kernels move data; a CPU rank cannot: mccl's ring all-reduce is memcpy, TCP and a
    summing loop run by the rank's own threads on the rank's own cores (docs/scaling.md, "Checked here").
    """
    ms_per_image: float
    host_ms: float
    accum_steps: int = 1
    hides_exchange: bool = True
    sync_bn: bool = False
    call_ms: float = 0.0


def host_seconds(compute: Compute, device_step_s: float) -> float:
    """What the host adds to one step: `host_ms` every step, the Python call spread over its chunk."""
    return (compute.host_ms + compute.call_ms / chunks.steps_lasting(device_step_s)) / 1000


def overlaps_backward(compute: Compute, slots_per_gpu: int = 1) -> bool:
    """Whether backward can hide the gradient exchange in the step msdist compiles.

    No when the rank cannot compute and send at once (a CPU rank), and no where msdist's step has no overlap:
    - accumulation (`grad_accum_steps` > 1, or a rank training several batch slots: an elastic job below its MAX
      nodes): the micro-batches only add to buffers; the reduction runs in the apply graph after all of them
      (engine/step.py, `_ApplyAccumulated`), with no backward left to run beside it;
    - SyncBN: its backward AllReduce per layer runs on the world group's NCCL communicator, as the gradient
      buckets do, and one communicator runs its collectives one after another in the order issued; so backward,
      which needs each layer's result to go on, waits behind every bucket sent before it.
    """
    return compute.hides_exchange and compute.accum_steps == 1 and slots_per_gpu == 1 and not compute.sync_bn


def slots_per_gpu(world: int, max_gpus: int) -> int:
    """Batch slots each GPU trains in an elastic job cut for `max_gpus` (its MAX nodes' GPUs), now at `world`."""
    return max(1, math.ceil(max_gpus / world)) if max_gpus else 1


@dataclass(frozen=True)
class Row:
    gpus: int
    nodes: int
    per_gpu_batch: float
    compute_ms: float
    exposed_ms: float
    host_ms: float
    step_ms: float
    images_per_sec: float
    efficiency: float
    input_cores_per_gpu: float
    overlapped: bool  # backward hides the exchange (`overlaps_backward`)
    dominated: bool  # exposed communication >= compute


@dataclass
class Forecast:
    exchange: str
    rows: List[Row] = field(default_factory=list)

    def first_dominated(self) -> Optional[int]:
        """The first N where the exposed exchange takes at least as long as the compute; None within the table."""
        return next((r.gpus for r in self.rows if r.dominated), None)


def forecast(exchange: str, grads: Gradients, compute: Compute, net: Network, global_batch: int,
             per_gpu_batch: Optional[int], input_us: float, topk_ratio: float = 0.01,
             scales: Sequence[int] = SCALES, max_gpus: int = 0) -> Forecast:
    """Rows for N in `scales`: weak scaling with `per_gpu_batch`, else the global batch kept (strong scaling).

    `max_gpus`: an elastic job's batch is cut for its MAX nodes' GPUs; below them each GPU trains several slots
    as micro-batches (`slots_per_gpu`). Efficiency is images/s per GPU against the first row's (N = 1 in the
    default scales). Strong scaling stops where the global batch no longer gives every GPU one image.
    """
    result = Forecast(exchange)
    first_per_gpu = None
    for n in scales:
        batch = per_gpu_batch if per_gpu_batch else global_batch / n
        if batch < 1:
            break
        compute_s = batch * compute.ms_per_image / 1000
        overlapped = overlaps_backward(compute, slots_per_gpu(n, max_gpus))
        window = compute_s * BACKWARD_SHARE if overlapped else 0.0
        exposed = exposed_seconds(messages_for(exchange, grads, n, net, topk_ratio), window)
        if compute.sync_bn and n > 1:
            exposed += grads.sync_bn_seconds(n, net)
        host = host_seconds(compute, compute_s + exposed)
        step = compute_s + exposed + host
        rate = n * batch / step
        first_per_gpu = first_per_gpu or rate / n
        result.rows.append(Row(n, nodes(n, net.gpus_per_node), batch, compute_s * 1000, exposed * 1000, host * 1000,
                               step * 1000, rate, rate / n / first_per_gpu, batch / step * input_us / 1e6,
                               overlapped, exposed >= compute_s))
    return result
