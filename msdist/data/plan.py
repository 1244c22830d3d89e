"""The index plan: which sample each rank reads at each step, and with which augmentation parameters.

Pure Python and NumPy (no MindSpore), so every property is testable on its own:

* N ranks train on exactly the single-card batches: at global step s the N shards together are the
  single-card batch s. `train_indices` cuts one per-epoch permutation (same seed on every rank) into
  global batches and deals each batch out by rank;
* a job keeps its batch layout when its world size changes (`BatchLayout`): the global batch is cut into
  the shards of its original ranks ("slots"), and each rank trains the slots it owns as micro-batches;
* evaluation sees every Test image exactly once over all ranks (no padding, nothing dropped);
* every random choice is a pure function: per sample of (seed, epoch, sample), per batch-mixing of
  (seed, epoch, global step). So augmentation is the same on 1 or N cards, after a restart, and
  whatever order the dataset engine's workers finish in.
"""
import numpy as np

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from msdist.base.errors import ConfigError, DataError

# Streams of `uniform`: one per independent random choice, so adding one never shifts another.
STREAM_CROP_Y, STREAM_CROP_X, STREAM_FLIP = 1, 2, 3
STREAM_JITTER = (4, 5, 6)               # brightness, contrast, saturation
STREAM_RESIZED_CROP = 16                # + 4 * attempt + (area, ratio, top, left)
RESIZED_CROP_ATTEMPTS = 10


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Full global batches per epoch; the remainder is dropped, as on a single card."""
    return num_samples // global_batch


def per_rank_batch(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        raise DataError(f"batch_size {global_batch} is the global batch and must divide evenly over "
                        f"{world_size} ranks; use a multiple of {world_size}, e.g. "
                        f"{max(world_size, global_batch // world_size * world_size)}")
    return global_batch // world_size


def micro_batch_size(per_rank_batch: int, accum_steps: int) -> int:
    """Per-rank micro-batch: the rank's share of one optimizer step's batch, split in `accum_steps`."""
    if per_rank_batch % accum_steps:
        raise ConfigError(f"the per-rank batch {per_rank_batch} does not split into grad_accum_steps "
                          f"{accum_steps} equal micro-batches; make batch_size a multiple of world size x "
                          "grad_accum_steps")
    return per_rank_batch // accum_steps


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's global batch is cut, and which part this rank trains.

    The global batch is `slots` slots: slot s holds exactly the images rank s of a job of `slots` ranks
    trains on (`train_indices`). Rank r of `world_size` owns slots r, r + world_size, ... and runs them as
    micro-batches of one optimizer step. With slots == world_size that is one slot per rank: plain data
    parallelism. A job started for more ranks than it has now (its nodes shrank, or it grew back) keeps
    the sample order, the per-micro-batch BatchNorm statistics and the global batch of the original job.
    slots >= world_size (`run/options.slots_for` sees to it).
    """
    slots: int = 1
    world_size: int = 1
    rank: int = 0

    @property
    def owned(self) -> Tuple[int, ...]:
        """The slots this rank trains, in the order it runs them."""
        return tuple(range(self.rank, self.slots, self.world_size))

    @property
    def even(self) -> bool:
        """Whether every rank owns as many slots (then every rank runs as many micro-batches)."""
        return self.slots % self.world_size == 0

    def slot_batch(self, global_batch: int) -> int:
        return per_rank_batch(global_batch, self.slots)

    def rank_batch(self, global_batch: int) -> int:
        """The images this rank reads per optimizer step: its slots' together."""
        return len(self.owned) * self.slot_batch(global_batch)

    def micro_steps(self, accum_steps: int) -> int:
        """Micro-batches this rank runs per optimizer step: `accum_steps` per slot it owns."""
        return len(self.owned) * accum_steps

    def gradient_scale(self, accum_steps: int) -> float:
        """What this rank's summed micro-batch gradients (and losses) are multiplied by before the mean over
        ranks: world_size / (slots x accum_steps), so that the mean is every micro-batch's mean on every
        rank, whatever number of slots each rank owns. 1 / accum_steps when slots == world_size, exactly."""
        return self.world_size / (self.slots * accum_steps)


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The single-card sample order of one epoch; identical on every rank."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def train_indices(num_samples: int, global_batch: int, epoch: int, seed: int, shuffle: bool,
                  world_size: int, rank: int) -> np.ndarray:
    """This rank's samples for one epoch, in order.

    Rank r takes every N-th sample of the epoch's order starting at r. Because the per-rank batch is
    B/N, its step-s batch is positions s*B + r, s*B + r + N, ... < (s+1)*B: the N ranks' step-s
    batches are exactly the single-card step-s batch.
    """
    used = epoch_permutation(num_samples, seed, epoch, shuffle)[: steps_per_epoch(num_samples, global_batch)
                                                                 * global_batch]
    return used[rank::world_size]


def eval_indices(num_samples: int, world_size: int, rank: int) -> np.ndarray:
    """Every sample exactly once over all ranks: no padding, nothing dropped."""
    return np.arange(rank, num_samples, world_size)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of 64-bit integers (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(seed: int, epoch: int, index, stream: int) -> np.ndarray:
    """Uniform [0, 1) numbers, one per sample: a hash of (seed, epoch, sample, stream).

    A counter-based hash instead of a generator per sample: it is vectorized over `index` (a
    generator per sample costs ~0.2 ms, as much as decoding the image) and depends on nothing else.
    """
    with np.errstate(over="ignore"):
        z = np.uint64(0)
        for part in (seed, epoch):
            z = _mix(np.asarray(z + np.uint64(part) + _GOLDEN, dtype=np.uint64))
        z = _mix(z + np.asarray(stream, dtype=np.uint64) + _GOLDEN)   # `stream` and `index` broadcast
        z = _mix(z + np.asarray(index, dtype=np.uint64) + _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def augment_params(seed: int, epoch: int, index, padding: int) -> np.ndarray:
    """(dy, dx, flip) per sample, int32: crop offset into the zero-padded image and mirror flag.

    `index` may be one sample (shape (3,)) or an array of samples (shape (n, 3)).
    """
    u = uniform(seed, epoch, np.asarray(index)[..., None], np.array([STREAM_CROP_Y, STREAM_CROP_X, STREAM_FLIP]))
    return np.minimum((u * np.array([2 * padding + 1, 2 * padding + 1, 2])).astype(np.int64),
                      [2 * padding, 2 * padding, 1]).astype(np.int32)


def jitter_factors(seed: int, epoch: int, index, strength: float) -> np.ndarray:
    """(n, 3) brightness, contrast and saturation factors, each uniform in [1 - strength, 1 + strength]."""
    return 1 + strength * (2 * uniform(seed, epoch, np.asarray(index)[..., None], np.array(STREAM_JITTER)) - 1)


def resized_crop_uniforms(seed: int, epoch: int, index: int) -> np.ndarray:
    """(attempts, 4) uniforms for one sample's random-resized-crop tries: area, log-ratio, top, left."""
    streams = STREAM_RESIZED_CROP + np.arange(4 * RESIZED_CROP_ATTEMPTS)
    return uniform(seed, epoch, index, streams).reshape(RESIZED_CROP_ATTEMPTS, 4)


@dataclass(frozen=True)
class Mix:
    """One global step's batch mixing: every rank draws the same, from (seed, epoch, step).

    `partner[j]` is the global-batch position whose image and label position j is mixed with;
    `box` is cutmix's (top, left, bottom, right) as fractions of the image, None for mixup.
    """
    lam: float
    partner: np.ndarray
    box: Optional[Tuple[float, float, float, float]] = None


def mix_for_step(seed: int, epoch: int, step: int, global_batch: int, mixup: float, cutmix: float) -> Mix:
    """Mixup (Beta(mixup, mixup) weight) or cutmix (a Beta(cutmix, cutmix)-sized box); both on: half each.

    Like timm's Mixup, one weight and one box per batch, and the partner of a sample is another
    sample of the same global batch: a rank may mix with an image another rank trains on, so the
    rank reads that partner too.
    """
    rng = np.random.default_rng([seed, epoch, step, 0x313])
    partner = rng.permutation(global_batch)
    use_cutmix = cutmix > 0 and (mixup <= 0 or rng.random() < 0.5)
    alpha = cutmix if use_cutmix else mixup
    lam = float(rng.beta(alpha, alpha))
    if not use_cutmix:
        return Mix(lam, partner)
    cut = np.sqrt(1.0 - lam)   # the box covers 1 - lam of the image
    cy, cx = rng.random(2)
    box = (max(cy - cut / 2, 0.0), max(cx - cut / 2, 0.0), min(cy + cut / 2, 1.0), min(cx + cut / 2, 1.0))
    return Mix(lam, partner, box)


def rank_steps(num_samples: int, global_batch: int, epoch: int, seed: int, shuffle: bool, slots: int,
               owned: Sequence[int], skip_steps: int = 0) -> np.ndarray:
    """(steps, images per step) samples this rank trains on at each step of the epoch from `skip_steps` on:
    the `owned` slots' shards of a `slots`-way split, side by side in that order."""
    batch = per_rank_batch(global_batch, slots)
    return np.concatenate([train_indices(num_samples, global_batch, epoch, seed, shuffle, slots, s).reshape(-1, batch)
                           for s in owned], axis=1)[skip_steps:]


def global_batches(num_samples: int, global_batch: int, epoch: int, seed: int, shuffle: bool,
                   slots: int) -> np.ndarray:
    """(steps, global batch) samples of one epoch as the `slots` shards deal them, put back in single-card order.

    Slot s holds the batch positions s, s + slots, ...; laid back there, every slot count gives the single-card
    batches. What a run trains on, independent of its world size: the parity benchmark compares it across runs.
    """
    shards = rank_steps(num_samples, global_batch, epoch, seed, shuffle, slots, range(slots))
    steps, batch = len(shards), per_rank_batch(global_batch, slots)
    return shards.reshape(steps, slots, batch).transpose(0, 2, 1).reshape(steps, global_batch)


def rank_partners(num_samples: int, global_batch: int, epoch: int, seed: int, shuffle: bool, slots: int,
                  owned: Sequence[int], skip_steps: int, mixup: float, cutmix: float):
    """The partners of this rank's samples, laid out as `rank_steps`' (steps, images per step), and each step's Mix."""
    order = train_indices(num_samples, global_batch, epoch, seed, shuffle, 1, 0).reshape(-1, global_batch)
    partners, mixes = [], []
    for step in range(skip_steps, len(order)):
        mix = mix_for_step(seed, epoch, step, global_batch, mixup, cutmix)
        partners.append(np.concatenate([order[step][mix.partner[s::slots]] for s in owned]))
        mixes.append(mix)
    return np.array(partners, dtype=np.int64).reshape(-1, len(owned) * (global_batch // slots)), mixes


# A run of consecutive steps of one epoch: (epoch, its first step in the epoch, steps).
Span = Tuple[int, int, int]


def span_samples(num_samples: int, global_batch: int, seed: int, shuffle: bool, layout: BatchLayout,
                 spans: Sequence[Span], mixup: float = 0.0, cutmix: float = 0.0) -> Tuple[np.ndarray, np.ndarray]:
    """What this rank reads for `spans`, one after the other: (steps, images per step) samples as `rank_steps` lays
    them out (each step's mixing partners after its own samples when mixup or cutmix is on), and (steps, 2) rows
    of (epoch, step of the epoch), the step each batch is.

    Each epoch's plan is computed once, for its consecutive spans (a run's spans come in order).
    """
    rows, at, epoch, plan_of_epoch = [], [], None, None
    for span_epoch, first, steps in spans:
        if span_epoch != epoch:
            epoch = span_epoch
            plan_of_epoch = rank_steps(num_samples, global_batch, epoch, seed, shuffle, layout.slots, layout.owned)
            if mixup > 0 or cutmix > 0:
                partners, _ = rank_partners(num_samples, global_batch, epoch, seed, shuffle, layout.slots,
                                            layout.owned, 0, mixup, cutmix)
                plan_of_epoch = np.concatenate([plan_of_epoch, partners], axis=1)
        rows.append(plan_of_epoch[first:first + steps])
        at.append(np.stack([np.full(steps, epoch), np.arange(first, first + steps)], axis=1))
    return np.concatenate(rows), np.concatenate(at).astype(np.int64)
