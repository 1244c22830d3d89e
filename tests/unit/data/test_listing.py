"""data/pipeline.py and data/plan.py: the class map, evaluation shards, the training crop and the un-augmented
training input."""
import os
import shutil

import numpy as np
import pytest

from conftest import TEST_SIZE, pad_crop_flip
from msdist.base.errors import DataError
from msdist.data import pipeline, plan


def test_class_map_stays_aligned_when_test_lacks_a_class(tmp_path, data_dir):
    for split, classes in (("Training", ["apple", "lemon", "mango"]), ("Test", ["apple", "mango"])):
        for name in classes:
            os.makedirs(tmp_path / split / name)
            src = os.path.join(data_dir, split, name)
            for f in sorted(os.listdir(src))[:2]:
                shutil.copy(os.path.join(src, f), tmp_path / split / name / f)
    classes = pipeline.class_map(str(tmp_path))
    test = pipeline.list_split(str(tmp_path), "Test", classes)
    assert classes == {"apple": 0, "lemon": 1, "mango": 2}
    assert sorted(set(test.labels)) == [0, 2]  # mango keeps label 2 although lemon is absent
    os.makedirs(tmp_path / "Test" / "kiwi")
    with pytest.raises(DataError, match="kiwi"):
        pipeline.list_split(str(tmp_path), "Test", classes)


def test_eval_shards_cover_test_exactly_once():
    for world in (1, 2, 3, 4, 8):
        shards = [plan.eval_indices(TEST_SIZE, world, r) for r in range(world)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(TEST_SIZE))


def test_random_crop_is_at_training_resolution_from_the_padded_image():
    image = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3) + 1   # no zeros: padding shows as 0
    centred = pad_crop_flip(image, np.array([2, 2, 0]), padding=2)
    np.testing.assert_array_equal(centred, image)                        # offset = padding: the image itself
    corner = pad_crop_flip(image, np.array([0, 4, 1]), padding=2)
    assert corner.shape == image.shape                                   # never a small patch blown up
    assert (corner[:2] == 0).all() and (corner[2:, :2] == 0).all()       # 2 rows above, 2 columns right, mirrored
    np.testing.assert_array_equal(corner[2:, 2:], image[:6, 2:][:, ::-1])
    for index in range(50):
        dy, dx, flip = plan.augment_params(seed=1, epoch=0, index=index, padding=2)
        assert 0 <= dy <= 4 and 0 <= dx <= 4 and flip in (0, 1)
    assert (plan.augment_params(1, 0, 7, 2) == plan.augment_params(1, 0, 7, 2)).all()


def test_no_augment_no_shuffle_trains_on_the_test_transform_in_file_order(data_dir):
    """`--augment false --shuffle false`: training batches are the plain resized images, in file order."""
    split = pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))
    spec = pipeline.TrainInput(image_size=32, global_batch=8, seed=1, shuffle=False, augment=False, padding=2,
                               workers=1)
    train = pipeline.build_train_dataset(split, spec, epoch=3)
    plain = pipeline.build_eval_dataset(split, batch_size=8, image_size=32, world_size=1, rank=0, workers=1)
    (images, labels), (expected, expected_labels) = [next(d.create_tuple_iterator(num_epochs=1, output_numpy=True))
                                                     for d in (train, plain)]
    assert images.shape == (8, 3, 32, 32)
    np.testing.assert_array_equal(labels, expected_labels)
    np.testing.assert_array_equal(labels, np.array(split.labels[:8]))
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-6)


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(DataError, match="batch_size 15 .* multiple of 2"):
        plan.per_rank_batch(15, 2)
