"""The chunk scheduler (`--sink_size K`): how many optimizer steps the next host call runs. Pure, no MindSpore.

The loop runs a chunk of steps, then does at its end what today happens after a step: the heartbeat, the step
line and metrics, the saves by steps, the --max_steps check and the stop agreement. So a chunk never runs past
a place where one of those is due: it ends at the epoch's end, at a log step (`progress.Progress.is_log_step`:
every `log_every` steps of the epoch), at a multiple of `save_every_steps` (global steps), at `max_steps` and
at the profiler window's edges.
Inside those limits a chunk is K steps long; a shorter one (a "tail") is where a limit falls between multiples
of K, or where a resumed run starts between them.

An agreed stop (rank/preempt_stop.py) is asked at every chunk's end, so the run stops at the first chunk end at
or after the agreement's check step: never inside a chunk, on every rank alike, since every rank computes the
same chunks from the same values.
"""
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Sequence, Tuple, Union

from msdist.base.errors import ConfigError
from msdist.data import plan
from msdist.run import hardware


@dataclass(frozen=True)
class Limits:
    """Where chunks must end besides the epoch's end; 0 = no such limit.

    Attributes:
        log_every: the step line's period, in steps of the epoch (a log step is also the epoch's last step).
        save_every_steps: saves by steps, in global steps.
        max_steps: the run's last global step.
        ends: other global steps a chunk ends at: the profiler window's edges (`--profile_steps A:B`: A - 1 and B),
            so that it covers exactly its steps.
    """
    log_every: int = 0
    save_every_steps: int = 0
    max_steps: int = 0
    ends: Tuple[int, ...] = ()


Chunk = plan.Span   # (epoch, its first step in the epoch, steps): a chunk, or a span of sunk chunks


def next_length(global_step: int, step: int, steps_per_epoch: int, k: int, limits: Limits) -> int:
    """The next chunk's length after global step `global_step`, which is step `step` of its epoch (0 at its start).

    Returns 0 when nothing is left to run in this epoch (its end or `max_steps` reached).
    """
    room = min(k, steps_per_epoch - step)
    if limits.log_every:
        room = min(room, limits.log_every - step % limits.log_every)
    if limits.save_every_steps:
        room = min(room, limits.save_every_steps - global_step % limits.save_every_steps)
    if limits.max_steps:
        room = min(room, limits.max_steps - global_step)
    for end in limits.ends:
        if end > global_step:
            room = min(room, end - global_step)
    return max(room, 0)


def epoch_lengths(global_step: int, step: int, steps_per_epoch: int, k: int, limits: Limits) -> Iterator[int]:
    """The chunk lengths from `global_step` (step `step` of its epoch) to the epoch's end or `max_steps`, in order.

    A caller that stops early (an agreed stop) simply takes no more.
    """
    while True:
        length = next_length(global_step, step, steps_per_epoch, k, limits)
        if not length:
            return
        yield length
        global_step, step = global_step + length, step + length


def segments(lengths: List[int], k: int, sinks: bool) -> List[Tuple[bool, List[int]]]:
    """An epoch's chunks grouped by how they run: (sunk, their lengths), in order.

    Where a data sink exists (`sinks`, GPU with K > 1), consecutive K-long chunks form one sunk segment (one call per
    chunk, the batches from the run's sunk dataset: `sunk_spans`) and the others host-fed ones: a sunk graph's step
    count is fixed when it is built (run/feed.py), so a tail shorter than K cannot be a sunk call of the same graph.
    Elsewhere the epoch is one host-fed segment.
    """
    if not sinks:
        return [(False, list(lengths))] if lengths else []
    grouped: List[Tuple[bool, List[int]]] = []
    for length in lengths:
        sunk = length == k
        if grouped and grouped[-1][0] == sunk:
            grouped[-1][1].append(length)
        else:
            grouped.append((sunk, [length]))
    return grouped


def run_chunks(global_step: int, steps_per_epoch: int, epochs: int, k: int, limits: Limits) -> Iterator[Chunk]:
    """Every chunk from `global_step` to the run's end (`epochs` epochs or `max_steps`), in order, each as (epoch,
    its first step of the epoch, length): the epochs' `epoch_lengths` one after the other, as the loop runs them."""
    while global_step < epochs * steps_per_epoch:
        epoch, step = divmod(global_step, steps_per_epoch)
        for length in epoch_lengths(global_step, step, steps_per_epoch, k, limits):
            yield epoch, step, length
            global_step, step = global_step + length, step + length
        if step < steps_per_epoch:   # max_steps
            return


def sunk_spans(run: Iterable[Chunk], k: int) -> List[Chunk]:
    """The run's sunk steps (its K-long chunks, `segments`) as spans (epoch, first step, steps) of consecutive steps
    of one epoch, in order: what the run's one sunk dataset holds (`pipeline.build_span_dataset`, run/feed.py)."""
    spans: List[Chunk] = []
    for epoch, step, length in run:
        if length != k:
            continue
        if spans and spans[-1][0] == epoch and sum(spans[-1][1:]) == step:
            spans[-1] = (epoch, spans[-1][1], spans[-1][2] + k)
        else:
            spans.append((epoch, step, k))
    return spans


def auto_size(log_every: int, save_every_steps: int, cap: int) -> int:
    """`--sink_size auto` where a data sink exists: the largest K, at most `cap`, that divides `log_every` and
    `save_every_steps` (when set), so that those limits cut no chunk short."""
    period = log_every
    if save_every_steps:
        period = math.gcd(period, save_every_steps)
    return max(d for d in range(1, min(period, cap) + 1) if period % d == 0)


AUTO = "auto"
AUTO_CAP = 64   # steps: without a step time, a chunk of ResNet-50 on an A100 (~10 ms a step) stays under a second
TIMED_CAP = 256  # steps: with one, a bound should the forecast be far too slow


def steps_lasting(step_s: float, chunk_s: float = hardware.SINK_CHUNK_S) -> int:
    """The fewest steps of `step_s` seconds that last `chunk_s` (at least one): a sunk chunk of about 0.5-1 s, the
    model zoo's per-call length, long enough that the per-call host work is paid rarely, short enough that the
    heartbeat, the step line and a stop come within a second."""
    return max(1, math.ceil(chunk_s / step_s)) if step_s > 0 else 1


def timed_size(step_s: float, log_every: int, save_every_steps: int) -> Tuple[int, int]:
    """GPU `auto` once the step time is known: (K, the step line's period).

    K is `steps_lasting(step_s)` (at most TIMED_CAP); with `save_every_steps`, the smallest divisor of it from there
    (or itself), so that saves cut no chunk. The step line comes at a chunk's end: `log_every` rounded up to a
    whole number of chunks.
    """
    k = min(steps_lasting(step_s), TIMED_CAP)
    if save_every_steps:
        k = next((d for d in range(k, save_every_steps + 1) if save_every_steps % d == 0), save_every_steps)
    return k, k * -(-log_every // k)


def agreed_size(step_s_of_ranks: Sequence[float], k: int, log_every: int, save_every_steps: int) -> Tuple[int, int]:
    """(K, the step line's period) every rank runs, from each rank's forecast of its sunk step (0: none): chunk ends
    are the job's collectives, so every rank must take the same. The slowest rank sets the chunk's time (the others
    wait for it in the exchange); without a forecast on every rank, (`k`, `log_every`) as resolved from the options.
    """
    if not step_s_of_ranks or min(step_s_of_ranks) <= 0:
        return k, log_every
    return timed_size(max(step_s_of_ranks), log_every, save_every_steps)


def parse_size(text) -> Union[str, int]:
    """`--sink_size` from the command line or YAML: `auto` or a whole number (checked by `check_size`)."""
    text = str(text).strip().lower()
    return int(text) if text.lstrip("-").isdigit() else text


def check_size(value) -> None:
    """Raise ConfigError unless `value` is `auto` or a positive whole number."""
    if value != AUTO and not (isinstance(value, int) and value > 0):
        raise ConfigError(f"--sink_size {value!r} must be a positive whole number of steps per host call, or auto")


def resolve_size(requested, device_target: str, several_slots: bool, log_every: int, save_every_steps: int) -> int:
    """K, the steps per host call on this device.

    CPU has no data sink (MindSpore's DatasetHelper refuses one there: mindspore/train/dataset_helper.py:372-384),
    so `auto` is 1 there; an explicit K still groups the loop's boundary work into chunks of K steps. On GPU `auto`
    is `auto_size` until the ranks agree on the step time at start-up (`agreed_size`). A rank owning several batch
    slots (an elastic job below MAX nodes) swaps BatchNorm statistics from the host between them
    (`step.TrainStep.train_on`), never inside one sunk graph: K is 1 there (`describe` says why).
    `--grad_accum_steps` alone is sunk: `sink.SunkStep` unrolls the micro-batches in its graph.
    """
    if several_slots:
        return 1
    if requested != AUTO:
        return int(requested)
    return auto_size(log_every, save_every_steps, AUTO_CAP) if device_target == "GPU" else 1


def describe(k: int, sunk: bool, several_slots: bool) -> str:
    """The start-up line's account of K: `sink_size 10: chunks of up to 10 steps, each one sunk call (GPU)`."""
    if several_slots:
        return "sink_size 1: this rank owns several batch slots, whose BatchNorm statistics the host swaps"
    how = "each one sunk call (GPU)" if sunk else "one host call per step (no data sink on this device)"
    return f"sink_size {k}: chunks of up to {k} steps, {how}"
