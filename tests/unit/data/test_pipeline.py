"""data/pipeline.py: the pure index plan, augmentation (the training crop), MindSpore's C++ reader in the plan's
order, read errors, the class map, and the un-augmented training input."""
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

import reference_pipeline
from conftest import pad_crop_flip
from msdist.base.errors import ConfigError, DataError
from msdist.data import bench, pipeline, plan
from msdist.data import augment
from msdist.data.augment import Regularization, normalize


def _copy_tree(data_dir, tmp_path):
    root = str(tmp_path / "data")
    shutil.copytree(data_dir, root)
    return root


def _reference_batch(files, image_size, crops=None, padding=0):
    """Decode, resize, (zero-pad, crop, flip by `crops`), normalize each file on its own (eager MindSpore ops):
    what the pipeline must give."""
    from mindspore.dataset import vision
    out = []
    for i, path in enumerate(files):
        image = vision.Decode()(np.fromfile(path, dtype=np.uint8))
        image = vision.Resize((image_size, image_size))(image)
        if crops is not None:
            image = pad_crop_flip(image, crops[i], padding)
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


def test_batch_crop_flip_equals_the_per_image_reference():
    images = np.random.default_rng(0).integers(1, 255, (64, 7, 9, 3), dtype=np.uint8)
    params = plan.augment_params(1, 0, np.arange(64), padding=3)
    expected = np.stack([pad_crop_flip(x, p, 3) for x, p in zip(images, params)]).transpose(0, 3, 1, 2)
    got = augment.pad_crop_flip_batch(list(images), params, 3)
    np.testing.assert_array_equal(got, expected)


def test_augmented_batch_is_the_per_image_crop_of_the_zero_padded_image_normalized(mini_split):
    """The batch map crops uint8 pixels and the chain normalizes after it: the padding is normalized black."""
    spec = pipeline.TrainInput(image_size=32, global_batch=8, seed=3, shuffle=True, augment=True, padding=6, workers=2)
    data = pipeline.build_train_dataset(mini_split, spec, epoch=2)
    images, labels = next(data.create_tuple_iterator(num_epochs=1, output_numpy=True))
    samples = plan.rank_steps(len(mini_split), 8, 2, 3, True, 1, (0,))[0]
    crops = plan.augment_params(3, 2, samples, 6)
    assert (crops[:, :2] != 6).any(axis=1).sum() >= 6     # most images shifted, so padding shows
    expected = _reference_batch([mini_split.files[i] for i in samples], 32, crops, padding=6)
    np.testing.assert_array_equal(labels, np.asarray(mini_split.labels)[samples])
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-5)


def test_resized_crop_box_stays_inside_and_in_range():
    for index in range(200):
        top, left, h, w = augment.resized_crop_box(100, 60, plan.resized_crop_uniforms(1, 0, index), (0.2, 1.0),
                                                   (0.75, 4 / 3))
        assert 0 <= top and top + h <= 100 and 0 <= left and left + w <= 60
        assert 0.19 <= h * w / 6000 <= 1.0
    assert augment.resized_crop_box(100, 10, np.ones((10, 4)) * 0.99, (0.9, 1.0), (0.75, 4 / 3)) == (43, 0, 13, 10)


def test_soft_targets_and_cutmix_weight():
    targets = augment.soft_labels(np.array([0, 2]), 4, 0.2)
    np.testing.assert_allclose(targets, [[0.85, 0.05, 0.05, 0.05], [0.05, 0.05, 0.85, 0.05]], rtol=1e-6)
    ones, zeros = np.ones((2, 3, 10, 10), np.float32), np.zeros((2, 3, 10, 10), np.float32)
    mixed, weights = augment.mix_batch(ones, zeros, np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32)[::-1],
                                       lam=0.5, box=(0.0, 0.0, 0.5, 0.4))
    assert mixed[0].mean() == pytest.approx(0.8)            # a 5x4 box of the partner pasted in
    np.testing.assert_allclose(weights[0], [0.8, 0.2], rtol=1e-6)


def test_crop_ranges_must_be_ordered():
    """Checked when the options are parsed, before MindSpore loads (so msdist.launch's pre-check finds it too)."""
    from msdist.run import config
    with pytest.raises(ConfigError, match="crop_scale_min=0.9 exceeds crop_scale_max=0.5"):
        config.parse(["--crop_scale_min", "0.9", "--crop_scale_max", "0.5"])
    with pytest.raises(ConfigError, match="crop_ratio_min=2.0 exceeds crop_ratio_max"):
        config.parse(["--crop_ratio_min", "2"])
    from msdist import launch
    with pytest.raises(ConfigError, match="crop_scale_min=0.9 exceeds crop_scale_max=0.5"):
        launch.parse_args(["-n", "2", "--crop_scale_min", "0.9", "--crop_scale_max", "0.5"])


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
    msdist; the pre-flight data check is what names those, see data/test_check.py.)
    """
    root = _copy_tree(data_dir, tmp_path)
    split = pipeline.list_split(root, "Training", pipeline.class_map(root))
    rank1 = plan.train_indices(len(split), 16, 0, 1, True, 2, 1)
    victim = split.files[rank1[len(rank1) // 2]]          # in the middle of rank 1's shard
    with open(victim, "wb") as f:
        f.write(content)
    spec = pipeline.TrainInput(image_size=32, global_batch=16, seed=1, shuffle=True, augment=True, padding=2, workers=2,
                               layout=plan.BatchLayout(2, 2, 1))
    data = pipeline.build_train_dataset(split, spec, epoch=0)
    with pytest.raises(DataError) as err:   # (the engine reads ahead, so it may fail before batch 1 arrives)
        for _ in data.create_tuple_iterator(num_epochs=1, output_numpy=True):
            pass
    assert victim in str(err.value) and "\n" not in str(err.value)


RECIPES = {
    "crop_flip": Regularization(),
    "random_resized": Regularization(train_crop="random_resized", crop_scale=(0.25, 1.0)),
    "color_jitter": Regularization(color_jitter=0.4),
    "label_smoothing": Regularization(label_smoothing=0.1, num_classes=4),
    "mixup": Regularization(mixup=0.4, num_classes=4),
    "cutmix": Regularization(cutmix=1.0, num_classes=4),
    "all": Regularization(train_crop="random_resized", color_jitter=0.3, label_smoothing=0.1, mixup=0.2, cutmix=1.0,
                          num_classes=4),
}


def _global_batches(split, reg, world, skip=0, steps=3, workers=2, augment=True, build=pipeline.build_train_dataset):
    """The first `steps` global batches (images, labels) as the ranks of a `world`-card job assemble them."""
    images, labels = [None] * steps, [None] * steps
    for rank in range(world):
        spec = pipeline.TrainInput(image_size=32, global_batch=8, seed=5, shuffle=True, augment=augment, padding=2,
                                   workers=workers, layout=plan.BatchLayout(world, world, rank),
                                   regularization=reg or Regularization())
        data = build(split, spec, epoch=1, skip_steps=skip)
        for step, (x, y) in enumerate(data.create_tuple_iterator(num_epochs=1, output_numpy=True)):
            if step == steps:
                break
            if rank == 0:
                images[step], labels[step] = np.empty((8,) + x.shape[1:], x.dtype), np.empty((8,) + y.shape[1:], y.dtype)
            images[step][rank::world], labels[step][rank::world] = x, y   # rank r holds positions r, r+N, ...
    return images, labels


@pytest.fixture(scope="module")
def mini_split(data_dir):
    return pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))


@pytest.mark.parametrize("name", list(RECIPES))
def test_augmentation_is_the_same_on_1_and_2_ranks_and_after_resume(mini_split, name):
    """Through MindSpore's engine: 2 ranks' step-s batches, put together, are the 1-card step-s batch, pixel for
    pixel and label for label, and a resume at step 1 continues with the same batches."""
    reg = RECIPES[name]
    single_x, single_y = _global_batches(mini_split, reg, 1)
    two_x, two_y = _global_batches(mini_split, reg, 2)
    resumed_x, resumed_y = _global_batches(mini_split, reg, 2, skip=1, steps=2)
    for step in range(3):
        np.testing.assert_array_equal(two_x[step], single_x[step])
        np.testing.assert_array_equal(two_y[step], single_y[step])
    for step in range(2):
        np.testing.assert_array_equal(resumed_x[step], single_x[step + 1])
        np.testing.assert_array_equal(resumed_y[step], single_y[step + 1])
    assert single_x[0].shape == (8, 3, 32, 32) and single_x[0].dtype == np.float32
    if reg.soft_labels:
        assert single_y[0].shape == (8, 4) and single_y[0].dtype == np.float32
        np.testing.assert_allclose(single_y[0].sum(axis=1), 1, rtol=1e-6)
    if name == "label_smoothing":
        assert single_y[0].max() == pytest.approx(0.925) and single_y[0].min() == pytest.approx(0.025)
    elif name != "crop_flip":   # the option changes the images
        plain_x, _ = _global_batches(mini_split, RECIPES["crop_flip"], 1, steps=1)
        assert not np.array_equal(plain_x[0], single_x[0])


BEFORE_26 = dict(RECIPES, plain_without_augment=None, jitter_without_augment=Regularization(color_jitter=0.4),
                 smoothing_without_augment=Regularization(label_smoothing=0.1, num_classes=4))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BEFORE_26))
def test_batches_are_bitwise_those_of_the_pipeline_before_issue_26(mini_split, name):
    """Moving the per-sample work into the parallel workers changed no bit: at 1 and 2 workers and on 1 and 2
    ranks, every global batch equals the old one-thread pipeline's (tests/reference_pipeline.py)."""
    augment = not name.endswith("without_augment")
    expected = _global_batches(mini_split, BEFORE_26[name], 1, workers=1, augment=augment,
                               build=reference_pipeline.train_dataset)
    for world, workers in ((1, 1), (1, 2), (2, 1), (2, 2)):
        got = _global_batches(mini_split, BEFORE_26[name], world, workers=workers, augment=augment)
        for new, old in zip(got[0] + got[1], expected[0] + expected[1]):
            assert new.dtype == old.dtype and new.shape == old.shape, (world, workers)
            assert new.tobytes() == old.tobytes(), f"{name}: {world} rank(s), {workers} worker(s) differ"


def test_mixing_partners_cross_ranks():
    """A partner is drawn from the whole global batch, so some of rank 0's partners are rank 1's samples."""
    mix = plan.mix_for_step(seed=5, epoch=1, step=0, global_batch=8, mixup=0.4, cutmix=0.0)
    assert sorted(mix.partner) == list(range(8)) and (mix.partner[0::2] % 2 == 1).any()
    partners, _ = plan.rank_partners(192, 8, 1, 5, True, 2, (0,), 0, 0.4, 0.0)
    single = plan.train_indices(192, 8, 1, 5, True, 1, 0).reshape(-1, 8)
    assert np.isin(partners[0], single[0][1::2]).any()


def test_cores_needed_rounds_up():
    assert bench.cores_needed(5000, 200) == 1 and bench.cores_needed(5001, 200) == 2
    assert bench.cores_needed(20000, 210) == 5 and bench.cores_needed(10, 1) == 1


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


# ---------------------------------------------------------------- uint8 to the device (issue 40 item 3): a batch that
# is still integer pixels leaves the pipeline as uint8 and the train step normalizes it in its graph; the images, the
# loss and the weights equal the host-normalized path's; colour jitter and mixing keep float32.

def _uint8_spec(**kwargs):
    return pipeline.TrainInput(image_size=32, global_batch=4, seed=3, shuffle=True, augment=True, padding=4, workers=1,
                               **kwargs)


def _first_uint8_batch(data_dir, spec):
    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, pipeline.class_map(data_dir))
    images, labels = next(pipeline.build_train_dataset(split, spec, epoch=0).create_tuple_iterator(
        num_epochs=1, output_numpy=True))
    return images, labels


@pytest.mark.parametrize("augment, train_crop", [(True, "resize"), (True, "random_resized"), (False, "resize")])
def test_pixels_out_are_the_host_paths_images_before_normalizing(data_dir, augment, train_crop):
    reg = Regularization(train_crop=train_crop)
    host = _uint8_spec(regularization=reg)
    device = replace(host, device_normalizes=True)
    host, device = replace(host, augment=augment), replace(device, augment=augment)
    assert device.pixels_out and not host.pixels_out
    pixels, labels = _first_uint8_batch(data_dir, device)
    floats, host_labels = _first_uint8_batch(data_dir, host)
    assert pixels.dtype == np.uint8 and floats.dtype == np.float32 and pixels.shape == floats.shape
    np.testing.assert_array_equal(labels, host_labels)
    np.testing.assert_array_equal(normalize(pixels, pipeline.MEAN, pipeline.STD), floats)


@pytest.mark.parametrize("reg", [Regularization(color_jitter=0.4), Regularization(mixup=0.2, num_classes=4)])
def test_colour_jitter_and_mixing_keep_float32_and_say_why(data_dir, reg):
    spec = _uint8_spec(regularization=reg, device_normalizes=True)
    assert not spec.pixels_out
    images, _ = _first_uint8_batch(data_dir, spec)
    assert images.dtype == np.float32
    why = "colour jitter" if reg.color_jitter else "mixup/cutmix"
    assert spec.describe_images() == f"float32, normalized on the host ({why} computes in float): 0.0 MiB per step"


def test_the_plan_line_gives_the_bytes_per_step():
    spec = pipeline.TrainInput(image_size=224, global_batch=256, seed=1, shuffle=True, augment=True, padding=4,
                               workers=1, device_normalizes=True)
    assert spec.describe_images() == "uint8 pixels, normalized in the train step's graph: 36.8 MiB per step"
    assert replace(spec, device_normalizes=False).describe_images() == (
        "float32, normalized on the host (its consumer takes normalized images): 147.0 MiB per step")


@pytest.mark.slow  # compiles and trains two networks per case
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_step_normalizing_uint8_trains_as_the_host_normalized_batch(data_dir, accum_steps):
    """The same batches through both paths: losses and weights bit for bit equal on CPU (the graph's cast, subtract
    and divide are the host's float32 operations)."""
    import mindspore as ms
    from msdist.engine import loss_scale, optim, precision, step
    pixels, labels = _first_uint8_batch(data_dir, _uint8_spec(device_normalizes=True))
    floats = normalize(pixels, pipeline.MEAN, pipeline.STD)
    results = []
    for images, norm in ((floats, None), (pixels, (pipeline.MEAN, pipeline.STD))):
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_seed(2)
        net = step.build_network("convnet_tiny", 4, False, False, 1)
        optimizer = optim.create_optimizer(net.trainable_params(), np.full(4, 0.05, np.float32), 0.9, 1e-4)
        scaler = loss_scale.LossScaler(precision.loss_scale_plan("auto", "O0", "float16", "none"), 1)
        train = step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps,
                               normalize=norm)
        losses = [float(train.train_on(ms.Tensor(images), ms.Tensor(labels)).asnumpy()) for _ in range(3)]
        results.append((losses, [p.asnumpy() for p in net.trainable_params()]))
    (host_losses, host_weights), (device_losses, device_weights) = results
    np.testing.assert_array_equal(device_losses, host_losses)
    for host_w, device_w in zip(host_weights, device_weights):
        np.testing.assert_array_equal(device_w, host_w)


def test_an_error_naming_one_of_the_datasets_files_is_an_unreadable_image():
    batches = pipeline.Batches(None, ["/data/Training/apple/1.jpg", "/data/Training/pear/2.jpg"])
    error = batches.unreadable("RuntimeError: Exception thrown from dataset pipeline. Refer to 'Dataset Pipeline "
                               "Error Message'. Invalid image file: /data/Training/pear/2.jpg, decode failed")
    assert "cannot read image /data/Training/pear/2.jpg" in str(error)
    assert batches.unreadable("For 'GetNext', get data timeout. Queue name: q") is None
