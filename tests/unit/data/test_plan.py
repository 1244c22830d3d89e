"""data/plan.py: each global step's shards are the single-card batch, reshuffled every epoch with one
permutation everywhere, through the real pipeline too; evaluation shards cover Test exactly once; a batch that
does not divide is a clear error."""
import numpy as np
import pytest

from conftest import TEST_SIZE
from msdist.base.errors import DataError
from msdist.data import pipeline, plan


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_of_each_global_step_are_the_single_card_batch(world, shuffle):
    n, global_batch, seed = 1962, 48, 3  # 48 splits over 2, 3, 4 and 8 ranks
    for epoch in (0, 1, 5):
        single = plan.train_indices(n, global_batch, epoch, seed, shuffle, 1, 0)
        shards = [plan.train_indices(n, global_batch, epoch, seed, shuffle, world, r) for r in range(world)]
        b = plan.per_rank_batch(global_batch, world)
        assert all(len(s) == len(single) // world for s in shards)
        for step in range(len(single) // global_batch):
            together = np.concatenate([s[step * b:(step + 1) * b] for s in shards])
            assert sorted(together) == sorted(single[step * global_batch:(step + 1) * global_batch])
        used = np.concatenate(shards)
        assert len(set(used.tolist())) == len(used) == (n // global_batch) * global_batch  # each sample once


def test_reshuffles_every_epoch_with_one_permutation_everywhere():
    first = plan.epoch_permutation(100, seed=1, epoch=0, shuffle=True)
    assert not np.array_equal(first, plan.epoch_permutation(100, seed=1, epoch=1, shuffle=True))
    assert np.array_equal(first, plan.epoch_permutation(100, seed=1, epoch=0, shuffle=True))
    assert sorted(first) == list(range(100))


def test_real_pipeline_shards_rebuild_the_single_card_batches(data_dir):
    """Through MindSpore's dataset engine (decode, augmentation on): 2 ranks' step-s images together
    are exactly the single-card step-s images."""
    classes = pipeline.class_map(data_dir)
    split = pipeline.list_split(data_dir, "Training", classes)

    def batches(world, rank):
        spec = pipeline.TrainInput(image_size=32, global_batch=16, seed=5, shuffle=True, augment=True, padding=2,
                                   workers=1, layout=plan.BatchLayout(world, world, rank))
        data = pipeline.build_train_dataset(split, spec, epoch=1)
        out = []
        for images, _ in data.create_tuple_iterator(num_epochs=1, output_numpy=True):
            out.append(images)
            if len(out) == 3:
                break
        return out

    single, r0, r1 = batches(1, 0), batches(2, 0), batches(2, 1)
    for s in range(3):
        together = np.concatenate([r0[s], r1[s]])
        key = lambda x: x.reshape(len(x), -1).sum(axis=1)  # noqa: E731
        np.testing.assert_allclose(np.sort(key(together)), np.sort(key(single[s])), rtol=1e-6)


# slots, world size -> each rank's slots (a job started for `slots` ranks, now on `world`)
OWNERSHIP = [
    (2, 2, [(0,), (1,)]),                       # as started: one slot per rank
    (2, 1, [(0, 1)]),                           # shrunk to one rank: it runs both
    (4, 2, [(0, 2), (1, 3)]),
    (4, 3, [(0, 3), (1,), (2,)]),               # uneven: 3 of 4 nodes
    (8, 3, [(0, 3, 6), (1, 4, 7), (2, 5)]),
    (3, 1, [(0, 1, 2)]),
]


@pytest.mark.parametrize("slots,world,owned", OWNERSHIP)
@pytest.mark.parametrize("accum", [1, 2])
def test_every_slot_has_one_owner_and_the_mean_over_ranks_is_the_mean_over_micro_batches(slots, world, owned, accum):
    layouts = [plan.BatchLayout(slots, world, rank) for rank in range(world)]
    assert [layout.owned for layout in layouts] == owned
    assert all(layout.even == (slots % world == 0) for layout in layouts)
    assert [layout.micro_steps(accum) for layout in layouts] == [len(o) * accum for o in owned]
    # Each rank scales its summed micro-batch gradients, then the all-reduce takes the mean over ranks: every
    # micro-batch must weigh 1 / (slots x accum), on every rank, however many slots it owns.
    assert all(layout.gradient_scale(accum) / world == 1 / (slots * accum) for layout in layouts)
    assert sum(layout.rank_batch(48) for layout in layouts) == 48


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (4, 1), (2, 4), (8, 2)])
def test_one_slot_per_rank_scales_exactly_as_plain_accumulation(world, accum):
    """slots == world size is today's data parallelism: the accumulated mean's factor is bitwise 1 / accum."""
    layout = plan.BatchLayout(world, world, world - 1)
    assert layout.gradient_scale(accum) == 1.0 / accum and layout.owned == (world - 1,)


@pytest.mark.parametrize("slots,world", [(2, 1), (4, 3), (8, 3)])
def test_a_rank_owning_several_slots_reads_their_shards_side_by_side(slots, world):
    """Slot s's images are exactly rank s's of a job of `slots` ranks, mixing partners included."""
    n, batch, seed = 200, 16, 4
    for rank in range(world):
        owned = plan.BatchLayout(slots, world, rank).owned
        steps = plan.rank_steps(n, batch, 1, seed, True, slots, owned, skip_steps=2)
        originals = [plan.rank_steps(n, batch, 1, seed, True, slots, (s,), skip_steps=2) for s in owned]
        assert np.array_equal(steps, np.concatenate(originals, axis=1))
        partners, _ = plan.rank_partners(n, batch, 1, seed, True, slots, owned, 2, 0.4, 0.0)
        original = [plan.rank_partners(n, batch, 1, seed, True, slots, (s,), 2, 0.4, 0.0)[0] for s in owned]
        assert np.array_equal(partners, np.concatenate(original, axis=1))


def test_eval_shards_cover_test_exactly_once():
    for world in (1, 2, 3, 4, 8):
        shards = [plan.eval_indices(TEST_SIZE, world, r) for r in range(world)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(TEST_SIZE))


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(DataError, match="batch_size 15 .* multiple of 2"):
        plan.per_rank_batch(15, 2)
