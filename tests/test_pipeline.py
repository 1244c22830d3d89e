"""The data pipeline: the pure index plan, MindSpore's C++ reader in the plan's order, read errors, bench CLI."""
import os
import shutil

import numpy as np
import pytest

from conftest import run_msdist
from msdist.data import pipeline, plan
from msdist.errors import DataError


def _copy_tree(data_dir, tmp_path):
    root = str(tmp_path / "data")
    shutil.copytree(data_dir, root)
    return root


def _reference_batch(files, image_size):
    """Decode, resize, normalize each file on its own (eager MindSpore ops): what the pipeline must give."""
    from mindspore.dataset import vision
    out = []
    for path in files:
        image = vision.Decode()(np.fromfile(path, dtype=np.uint8))
        image = vision.Resize((image_size, image_size))(image)
        out.append(vision.HWC2CHW()(vision.Normalize(pipeline.MEAN, pipeline.STD)(image)))
    return np.stack(out)


def test_uniform_is_a_pure_function_of_seed_epoch_sample_stream():
    index = np.arange(1000)
    u = plan.uniform(3, 1, index, plan.STREAM_FLIP)
    assert ((0 <= u) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.05
    np.testing.assert_array_equal(plan.uniform(3, 1, index[::-1], plan.STREAM_FLIP), u[::-1])  # order-free
    for other in (plan.uniform(4, 1, index, plan.STREAM_FLIP), plan.uniform(3, 2, index, plan.STREAM_FLIP),
                  plan.uniform(3, 1, index, plan.STREAM_CROP_X)):
        assert abs(np.corrcoef(u, other)[0, 1]) < 0.1
    params = plan.augment_params(3, 1, index, padding=4)
    assert params.shape == (1000, 3) and params[:, :2].max() == 8 and set(params[:, 2]) == {0, 1}
    np.testing.assert_array_equal(params[17], plan.augment_params(3, 1, 17, padding=4))


def test_reader_follows_msdist_listing_with_excluded_files_and_mixed_extensions(data_dir, tmp_path):
    """ImageFolderDataset lists every image (excluded ones too, any extension case); the sampler maps
    msdist's split onto its positions, so each file arrives in the plan's order with its label."""
    root = _copy_tree(data_dir, tmp_path)
    lemon = os.path.join(root, "Training", "lemon")
    first = sorted(os.listdir(lemon))[0]
    os.rename(os.path.join(lemon, first), os.path.join(lemon, "0_upper.JPG"))   # sorts first, upper case
    with open(os.path.join(lemon, "notes.txt"), "w", encoding="utf-8") as f:
        f.write("not an image")
    excluded = [os.path.join(root, "Training", "apple", sorted(os.listdir(os.path.join(root, "Training", "apple")))[1])]
    split = pipeline.list_split(root, "Training", pipeline.class_map(root), exclude=excluded)
    assert excluded[0] not in split.files and os.path.join(lemon, "0_upper.JPG") in split.files
    data = pipeline.build_eval_dataset(split, batch_size=len(split), image_size=24, world_size=1, rank=0, workers=2)
    images, labels = next(data.create_tuple_iterator(num_epochs=1, output_numpy=True))
    np.testing.assert_array_equal(labels, split.labels)
    np.testing.assert_allclose(images, _reference_batch(split.files, 24), rtol=0, atol=1e-5)


@pytest.mark.parametrize("content", [b"", b"this is not an image " * 40], ids=["empty", "not_an_image"])
def test_corrupt_file_in_the_middle_of_a_shard_is_named(data_dir, tmp_path, content):
    """A file that breaks after the data check: MindSpore's reader fails, msdist names the file in one line.

    (A JPEG cut short kills the process inside MindSpore 2.10's decoder with SIGFPE, with or without
    msdist; the pre-flight data check is what names those, see test_bad_input.py.)
    """
    root = _copy_tree(data_dir, tmp_path)
    split = pipeline.list_split(root, "Training", pipeline.class_map(root))
    rank1 = plan.train_indices(len(split), 16, 0, 1, True, 2, 1)
    victim = split.files[rank1[len(rank1) // 2]]          # in the middle of rank 1's shard
    with open(victim, "wb") as f:
        f.write(content)
    data = pipeline.build_train_dataset(split, batch_size=8, image_size=32, epoch=0, seed=1, shuffle=True,
                                        augment=True, padding=2, world_size=2, rank=1, global_batch=16, workers=2)
    with pytest.raises(DataError) as err:   # (the engine reads ahead, so it may fail before batch 1 arrives)
        for _ in data.create_tuple_iterator(num_epochs=1, output_numpy=True):
            pass
    assert victim in str(err.value) and "\n" not in str(err.value)


def test_bench_cli_prints_images_per_second(data_dir):
    proc = run_msdist("data", ["bench", data_dir, "--image_size", "32", "--epochs", "1", "--batch_size", "16"],
                      timeout=120)
    rate = float(proc.stdout.split("msdist training pipeline:")[1].split("img/s")[0])
    assert rate > 0
