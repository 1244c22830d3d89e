"""data/plan.py: each global step's shards are the single-card batch, reshuffled every epoch with one
permutation everywhere, through the real pipeline too."""
import numpy as np
import pytest

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
