"""Core issue: single-card and mpirun data-parallel training, checkpoints, resume, one evaluation result."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from conftest import (REPO, TINY_CONFIG, base_env, checkpoints, load_params, mpirun, pad_crop_flip, run_msdist,
                      tiny_args)
from msdist.base.errors import ConfigError, DataError
from msdist.data import pipeline, plan
from msdist.engine import optim
from msdist.run import checkpoint, config, startup

TEST_SIZE = 64  # tests/data/fruits360-mini


# ---------------------------------------------------------------- fast, in-process


def test_every_config_parses():
    names = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".yaml"))
    assert {"resnet50_fruits360.yaml", "resnet18_fruits360.yaml", "tiny_test.yaml"} <= set(names)
    for name in names:
        cfg = config.parse(["--config", os.path.join(REPO, "configs", name)])
        assert cfg.model and cfg.batch_size > 0, name
        # What msdist.train checks before MindSpore loads (model name, batch splits), for 1 to 8 ranks.
        for world in (1, 2, 4, 8):
            startup.check_model(cfg, world)
            startup.check_batch_split(cfg, world)


def test_a_config_with_an_unknown_model_is_refused_before_mindspore(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: resnet5\n")
    with pytest.raises(ConfigError, match="unknown model 'resnet5'; did you mean resnet50"):
        startup.check_model(config.parse(["--config", str(bad)]), 1)


def test_model_names_are_the_register_model_functions_read_without_importing_them(tmp_path):
    """One source of truth: a family's names are its @register_model functions, read from its source, so a
    name is checkable before MindSpore (which every family module imports) loads."""
    (tmp_path / "family_x.py").write_text("import mindspore\nfrom models import registry\n\n\n"
                                          "@registry.register_model\ndef net_a(num_classes, **kwargs):\n    pass\n\n\n"
                                          "def _helper():\n    pass\n")
    code = ("import sys; from models import add_family, list_models; add_family('family_x'); names = list_models(); "
            "assert 'net_a' in names and '_helper' not in names and 'resnet50' in names, names; "
            "assert 'family_x' not in sys.modules and 'mindspore' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_seed_config_matches_the_tutorial():
    """The tutorial's recipe, but float32 without its fixed scale 1024: under amp O0 it changed nothing numerically
    and cost the per-step overflow check (issue 32 item 8)."""
    cfg = config.parse(["--config", os.path.join(REPO, "configs", "resnet50_fruits360.yaml")])
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.momentum, cfg.loss_scale, cfg.epochs, cfg.image_size) == \
        ("resnet50", 32, 0.01, 0.9, "auto", 10, 100)


def test_cli_overrides_yaml_and_rejects_unknown_keys(tmp_path):
    cfg = config.parse(["--config", TINY_CONFIG, "--lr", "0.5", "--augment", "false"])
    assert cfg.lr == 0.5 and cfg.augment is False and cfg.model == "resnet_tiny"
    with pytest.raises(ConfigError, match="did you mean --epochs"):
        config.parse(["--epochs_num", "3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 4\n")
    with pytest.raises(ConfigError, match="batch_sise.*did you mean --batch_size"):
        config.parse(["--config", str(bad)])


def test_resolved_config_round_trips(tmp_path):
    cfg = config.parse(["--config", TINY_CONFIG, "--seed", "7"])
    path = tmp_path / "config.yaml"
    config.save(cfg, str(path))
    again = config.parse(["--config", str(path)])
    assert vars(again) == {**vars(cfg), "config": str(path)}
    assert config.config_hash(again) == config.config_hash(cfg)


def test_lr_schedules_with_warmup():
    const = optim.lr_schedule("constant", 0.1, epochs=2, steps_per_epoch=10, warmup_epochs=1)
    assert len(const) == 20 and const[0] == pytest.approx(0.01) and const[9] == pytest.approx(0.1)
    assert const[19] == pytest.approx(0.1)
    step = optim.lr_schedule("step", 0.1, epochs=6, steps_per_epoch=2, step_size=2, gamma=0.1)
    assert step[3] == pytest.approx(0.1) and step[4] == pytest.approx(0.01) and step[8] == pytest.approx(0.001)
    cos = optim.lr_schedule("cosine", 0.1, epochs=4, steps_per_epoch=5, min_lr=0.0)
    assert cos[0] == pytest.approx(0.1) and cos[-1] < 0.002 and np.all(np.diff(cos) <= 0)


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


def _assert_class_metrics_consistent(metrics: dict, classes=("apple", "lemon", "mango", "raspberry")) -> None:
    """The confusion-matrix, top-5 and per-class counts agree with each other and with top-1."""
    confusion = np.array(metrics["confusion_matrix"])
    assert confusion.shape == (len(classes), len(classes)) and confusion.dtype.kind == "i"
    assert confusion.sum() == metrics["num_samples"] == TEST_SIZE
    assert np.trace(confusion) == metrics["correct"]
    assert metrics["num_samples"] >= metrics["top5_correct"] >= metrics["correct"]
    assert metrics["per_class_total"] == confusion.sum(axis=1).tolist()
    assert metrics["per_class_correct"] == np.diag(confusion).tolist()
    assert sum(metrics["per_class_correct"]) == metrics["correct"]
    for acc, right, total in zip(metrics["per_class_accuracy"], metrics["per_class_correct"],
                                 metrics["per_class_total"]):
        assert acc == right / total
    assert metrics["classes"] == list(classes)


def test_class_counts_top5_and_confusion():
    from msdist.run.evaluation import class_counts, summarize_counts
    logits = np.array([[9, 1, 2, 3, 4, 5, 6],     # true 0, predicted 0
                       [9, 1, 2, 3, 4, 5, 6],     # true 6: second best, top-5 hit
                       [9, 1, 2, 3, 4, 5, 6],     # true 1: last, a top-5 miss
                       [0, 0, 5, 0, 0, 0, 0]], dtype=np.float32)  # true 2, predicted 2
    labels = np.array([0, 6, 1, 2])
    counts = class_counts(logits, labels, 7) + class_counts(logits[:1], labels[:1], 7)  # summed like ranks
    metrics = summarize_counts(counts, 0.0, 7)
    assert (metrics["correct"], metrics["top5_correct"], metrics["num_samples"]) == (3, 4, 5)
    assert metrics["confusion_matrix"][0][0] == 2 and metrics["confusion_matrix"][6][0] == 1
    assert metrics["confusion_matrix"][1][0] == 1 and metrics["confusion_matrix"][2][2] == 1
    assert metrics["per_class_accuracy"][:3] == [1.0, 0.0, 1.0] and metrics["per_class_accuracy"][3] is None
    few = summarize_counts(class_counts(logits[2:3, :3], labels[2:3], 3), 0.0, 3)  # true 1 ranks last of 3
    assert (few["correct"], few["top5_correct"]) == (0, 1)  # fewer than 5 classes: top-5 covers all of them


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(DataError, match="batch_size 15 .* multiple of 2"):
        plan.per_rank_batch(15, 2)


@pytest.mark.parametrize("name", ["resnet_tiny", "resnet18", "resnet34", "resnet50", "resnet101"])
def test_model_forward_shape(name):
    import mindspore as ms
    from models import create_model, list_models
    assert name in list_models()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = create_model(name, num_classes=5)
    net.set_train(False)
    out = net(ms.Tensor(np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32))).asnumpy()
    assert out.shape == (2, 5) and np.isfinite(out).all()


def test_zero_init_last_bn():
    from models import create_model
    net = create_model("resnet50", 3, zero_init_last_bn=True)
    gammas = {p.name: p.asnumpy() for p in net.get_parameters() if p.name.endswith("bn3.gamma")}
    assert len(gammas) == 16 and all(np.all(g == 0) for g in gammas.values())


# ---------------------------------------------------------------- real runs


@pytest.mark.multiprocess
def test_standalone_run_learns_and_reports(standalone_run):
    out, proc = standalone_run
    result = json.loads((out / "result.json").read_text())
    assert result["accuracy"] > 0.7, result  # 4 classes: chance is 0.25
    assert result["num_samples"] == TEST_SIZE and result["world_size"] == 1
    assert result["images_per_sec"] > 0 and result["train_seconds"] > 0 and result["epochs"] == 5
    _assert_class_metrics_consistent(result)
    assert proc.stdout.count("eval result: {'accuracy': ") == 1
    assert "global batch 16 = 16 per rank" in proc.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["model"] == "resnet_tiny"
    assert (out / "logs" / "rank_0.log").exists()
    assert [os.path.basename(p) for p in checkpoints(out, 0)] == ["resnet_tiny_rank0-5_12.ckpt"]
    assert "[INFO]" not in proc.stderr and "[WARNING]" not in proc.stderr  # MindSpore's C++ logs are off


@pytest.mark.multiprocess
def test_verbose_lets_mindspores_own_log_lines_through(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--max_steps", 1, "--verbose", "true"))
    assert "[INFO]" in proc.stderr or "[WARNING]" in proc.stderr


@pytest.mark.multiprocess
def test_eval_cli_standalone_and_mpirun_agree(standalone_run, data_dir, tmp_path):
    out, _ = standalone_run
    expected = json.loads((out / "result.json").read_text())["accuracy"]
    ckpt = checkpoints(out, 0)[0]
    for ranks in (1, 2):
        eval_out = tmp_path / f"eval{ranks}"
        proc = run_msdist("eval", tiny_args(data_dir, eval_out, "--ckpt", ckpt), ranks=ranks)
        assert proc.stdout.count("eval result:") == 1
        got = json.loads((eval_out / "eval_result.json").read_text())
        assert got["num_samples"] == TEST_SIZE and got["world_size"] == ranks
        assert got["accuracy"] == pytest.approx(expected, abs=1e-12)
        _assert_class_metrics_consistent(got)
        assert got["confusion_matrix"] == json.loads((out / "result.json").read_text())["confusion_matrix"]


def _schedulers_of(output_dir) -> set:
    """Scheduler processes (watchdog and MindSpore scheduler) of one job: their stdout is its scheduler.log."""
    found = set()
    for pid in _pids_of("msdist.cluster.scheduler"):
        try:
            if os.readlink(f"/proc/{pid}/fd/1").startswith(str(output_dir)):
                found.add(pid)
        except OSError:
            pass
    return found


def _wait_until_no_scheduler(output_dir, timeout_s: float) -> set:
    deadline = time.time() + timeout_s
    while _schedulers_of(output_dir) and time.time() < deadline:
        time.sleep(0.5)
    return _schedulers_of(output_dir)


@pytest.fixture(scope="module")
def mpirun_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("mpirun2")
    proc = run_msdist("train", tiny_args(data_dir, out, "--epochs", 1, "--ema_decay", 0.9), ranks=2)
    return out, proc


@pytest.mark.multiprocess
def test_mpirun_two_ranks_one_result(mpirun_run):
    out, proc = mpirun_run
    assert proc.stdout.count("eval result: {'accuracy': ") == 1
    result = json.loads((out / "result.json").read_text())
    assert result["num_samples"] == TEST_SIZE and result["world_size"] == 2
    assert result["accuracy"] > 0.7 and result["per_rank_batch"] == 8
    _assert_class_metrics_consistent(result)  # counts summed over both ranks: every Test image exactly once
    assert "global batch 16 = 8 per rank" in proc.stdout
    assert (out / "logs" / "rank_0.log").exists() and (out / "logs" / "rank_1.log").exists()
    assert "rank1" not in proc.stdout  # only rank 0 speaks on the console


@pytest.mark.multiprocess
def test_scale_lr_multiplies_the_lr_by_the_world_size(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--max_steps", 1, "--log_every", 1, "--lr", 0.03,
                                         "--lr_schedule", "constant", "--warmup_epochs", 0, "--scale_lr", "true"),
                      ranks=2)
    assert "| lr 0.060000 |" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_mpirun_checkpoints_are_per_rank_and_identical(mpirun_run):
    out, _ = mpirun_run
    (rank0,), (rank1,) = checkpoints(out, 0), checkpoints(out, 1)
    assert os.path.basename(rank0) == "resnet_tiny_rank0-1_12.ckpt"
    assert os.path.basename(rank1) == "resnet_tiny_rank1-1_12.ckpt"
    a, b = load_params(rank0), load_params(rank1)
    trained = [n for n in a if "moving_" not in n]  # without sync_bn, BN running stats are per rank by design
    assert trained and all(np.array_equal(a[n], b[n]) for n in trained)
    accuracy = json.loads((out / "result.json").read_text())["accuracy"]
    for rank in (0, 1):  # the final evaluation is the only one, so it is each rank's best
        best = checkpoint.read_best(str(out / "ckpt"), "resnet_tiny", rank)
        assert best is not None and (best["epoch"], best["accuracy"]) == (1, accuracy)
    # The EMA (BatchNorm statistics included, averaged over ranks) is one model on every rank.
    ema0, ema1 = (load_params(checkpoint.tagged_path(str(out / "ckpt"), "resnet_tiny", r, "ema")) for r in (0, 1))
    model = {n for n in a if not n.startswith(("ema.", "msdist_state."))}
    assert model <= ema0.keys() and all(np.array_equal(ema0[n], ema1[n]) for n in model)
    assert not np.array_equal(ema0["stem.1.moving_mean"], a["stem.1.moving_mean"])  # an average, not a copy
    # Identical files are stored once: rank 1's names are hard links to rank 0's files, and the best, taken
    # right after the last save of the same model, is that checkpoint.
    best0, best1 = (checkpoint.best_path(str(out / "ckpt"), "resnet_tiny", r) for r in (0, 1))
    ema_paths = [checkpoint.tagged_path(str(out / "ckpt"), "resnet_tiny", r, "ema") for r in (0, 1)]
    assert os.path.samefile(rank0, rank1) and os.path.samefile(*ema_paths) and os.path.samefile(best1, rank0)
    assert all(name.endswith((".ckpt", ".ckpt.json")) and not name.startswith(".") for name in os.listdir(out / "ckpt"))


@pytest.mark.multiprocess
def test_scheduler_gone_after_run(mpirun_run):
    out, _ = mpirun_run
    assert (out / "logs" / "scheduler.log").exists()  # rank 0 did start one
    assert not _wait_until_no_scheduler(out, 10)  # its watchdog reaps it a few seconds after rank 0 exits


@pytest.mark.multiprocess
def test_indivisible_batch_under_mpirun_fails_fast_and_clearly(data_dir, tmp_path):
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--batch_size", 15), ranks=2, check=False, timeout=120)
    assert proc.returncode != 0
    assert "batch_size 15 is the global batch and must divide evenly over 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.multiprocess
def test_killed_rank_ends_job_and_scheduler(data_dir, tmp_path):
    cmd = mpirun(2) + [sys.executable, "-m", "msdist.train"] + tiny_args(data_dir, tmp_path, "--epochs", 20,
                                                                        "--log_every", 5)
    job = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        log1 = tmp_path / "logs" / "rank_1.log"
        deadline = time.time() + 120
        while time.time() < deadline and not (log1.exists() and "step 5/" in log1.read_text()):
            time.sleep(0.5)
        assert "step 5/" in log1.read_text(), "rank 1 never started training"
        rank1 = [p for p in _pids_of("msdist.train") if _env_of(p).get("OMPI_COMM_WORLD_RANK") == "1"
                 and str(tmp_path) in _cmdline_of(p)]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        assert job.wait(timeout=15) != 0  # the bound: a dead rank ends the job within 15 s
    finally:
        if job.poll() is None:
            job.kill()
    assert not _wait_until_no_scheduler(tmp_path, 10)
    assert not [p for p in _pids_of("msdist.train") if str(tmp_path) in _cmdline_of(p)]


def _pids_of(pattern: str) -> list:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _env_of(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


@pytest.mark.multiprocess
def test_resume_continues_at_the_right_epoch_and_lr(data_dir, tmp_path):
    """Stop mid-epoch 2, resume from that checkpoint's PATH: same final weights as one uninterrupted run.

    (`--resume auto` is what msdist.launch's restarts and the mpirun retry script use: test_launch.py.)
    """
    common = ("--epochs", 2, "--deterministic", "true", "--log_every", 1)
    run_msdist("train", tiny_args(data_dir, tmp_path / "full", *common))
    run_msdist("train", tiny_args(data_dir, tmp_path / "cut", *common, "--max_steps", 18))
    [stopped] = [p for p in checkpoints(tmp_path / "cut", 0) if p.endswith("-2_6.ckpt")]
    resumed = run_msdist("train", tiny_args(data_dir, tmp_path / "cut", *common, "--resume", stopped))
    assert "resumed from" in resumed.stdout and "epoch 1, step 6 of 12, global step 18" in resumed.stdout
    lrs = optim.lr_schedule("cosine", 0.05, 2, 12, warmup_epochs=0.5)
    first = next(line for line in resumed.stdout.splitlines() if line.startswith("epoch 2/2 step 7/12"))
    assert f"lr {lrs[18]:.6f}" in first  # the LR schedule continues at step 19, not from the start
    full = load_params(checkpoints(tmp_path / "full", 0)[-1], include_state=True)
    final = [p for p in checkpoints(tmp_path / "cut", 0) if p.endswith("-2_12.ckpt")]
    cut = load_params(final[0], include_state=True)
    assert full.keys() == cut.keys()
    for name in full:
        np.testing.assert_allclose(cut[name], full[name], rtol=1e-6, atol=1e-7, err_msg=name)
