"""Bad input never crashes cryptically and never loses work (issue 8).

Small ImageFolder trees are built per test from a handful of real Fruits-360 images plus planted
bad files. The data check and config parsing run in-process (fast, and fuzzed with hypothesis);
every command-line promise (one `msdist: error:` line, exit 2, no traceback) is checked on real
`python -m msdist.data` / `python -m msdist.train` processes.
"""
import contextlib
import faulthandler
import glob
import io
import json
import os
import pickle
import re
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import REAL_DATA, TINY_CONFIG, run_msdist
from msdist.base.errors import CheckpointError, ConfigError, DataError
from msdist.cluster.distributed import Collectives
from msdist.data import check, pipeline, shared_check
from msdist.run import config

TINY = ["--config", TINY_CONFIG]


# ---------------------------------------------------------------- helpers

def _real_images(split, cls, n):
    return sorted(glob.glob(os.path.join(REAL_DATA, split, cls, "*.jpg")))[:n]


def _make_tree(root, train=4, test=2, classes=("apple", "lemon", "mango")):
    """A clean ImageFolder tree of real JPEGs: `train`/`test` images per class."""
    for split, n in ((pipeline.TRAIN_SPLIT, train), (pipeline.TEST_SPLIT, test)):
        for cls in classes:
            os.makedirs(os.path.join(root, split, cls))
            for src in _real_images(split, cls, n):
                shutil.copy(src, os.path.join(root, split, cls))
    return str(root)


def _jpeg_bytes():
    with open(_real_images("Training", "apple", 1)[0], "rb") as f:
        return f.read()


def _encoded(fmt, mode="RGB", size=24):
    image = Image.open(_real_images("Training", "lemon", 1)[0]).convert("RGB").resize((size, size)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _plant_bad_files(root):
    """Every kind of bad file, each in Training/; returns {relative path: word its reason must contain}."""
    jpeg = _jpeg_bytes()
    train = os.path.join(root, "Training")
    _write(os.path.join(train, "apple", "truncated.jpg"), jpeg[: len(jpeg) // 2])
    _write(os.path.join(train, "apple", "random.jpg"), os.urandom(3000))
    _write(os.path.join(train, "lemon", "empty.jpg"), b"")
    _write(os.path.join(train, "lemon", "animated.jpg"), _encoded("GIF"))
    _write(os.path.join(train, "mango", "cut.png"), _encoded("PNG")[:-12])   # PIL accepts, MindSpore does not
    os.symlink(_real_images("Training", "apple", 1)[0], os.path.join(train, "mango", "outside.jpg"))
    os.symlink(os.path.join(train, "mango", "gone.jpg"), os.path.join(train, "mango", "broken.jpg"))
    os.makedirs(os.path.join(train, "mango", "folder.jpg"))
    os.mkfifo(os.path.join(train, "mango", "pipe.jpg"))   # reading it would hang forever
    return {"Training/apple/truncated.jpg": "truncated", "Training/apple/random.jpg": "not an image",
            "Training/lemon/empty.jpg": "zero-byte", "Training/lemon/animated.jpg": "GIF",
            "Training/mango/cut.png": "MindSpore", "Training/mango/outside.jpg": "outside",
            "Training/mango/broken.jpg": "broken symlink", "Training/mango/folder.jpg": "not a regular file",
            "Training/mango/pipe.jpg": "not a regular file"}


def _run(module, *args, ranks=1):
    return run_msdist(module, list(args), ranks=ranks, timeout=300, check=False)


def _one_error_line(proc, *words):
    """Exit 2 and exactly one `msdist: error:` line on stderr (no traceback, no C++ stack) naming `words`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("msdist: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and "C++" not in proc.stderr + proc.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _rel(path):
    return path.replace(os.sep, "/")


@contextlib.contextmanager
def _no_hang(seconds=60):
    """A hang inside the block, in Python or C++, ends the test run with every thread's stack."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def mindspore_decode():
    """MindSpore's own image decoder, loaded quietly once for the module."""
    os.environ.setdefault("GLOG_v", "3")
    from mindspore.dataset import vision
    return vision.Decode()


# ---------------------------------------------------------------- the data check, in-process

def test_clean_tree_is_clean(tmp_path):
    root = _make_tree(tmp_path / "data")
    report = check.scan(root)
    assert report.clean and not report.bad and not report.problems and not report.ignored
    assert report.counts == {"Training": {"apple": 4, "lemon": 4, "mango": 4},
                             "Test": {"apple": 2, "lemon": 2, "mango": 2}}


def test_every_bad_file_is_named_with_its_reason(tmp_path, mindspore_decode):
    root = _make_tree(tmp_path / "data")
    expected = _plant_bad_files(root)
    _write(os.path.join(root, "Training", "lemon", "notes.txt"), b"not an image")
    report = check.scan(root)
    reasons = {_rel(b.path): b.reason for b in report.bad}
    assert set(reasons) == set(expected)
    for path, word in expected.items():
        assert word in reasons[path], (path, reasons[path])
    assert [_rel(p) for p in report.ignored] == ["Training/lemon/notes.txt"]   # ignored, not bad
    assert report.counts["Training"] == {"apple": 4, "lemon": 4, "mango": 4}    # only the good ones count
    assert not report.clean


def test_tree_problems_empty_class_extra_and_missing_test_class(tmp_path):
    root = _make_tree(tmp_path / "data")
    os.makedirs(os.path.join(root, "Training", "kiwi"))                       # empty class folder
    os.makedirs(os.path.join(root, "Test", "papaya"))                          # Test class unknown to Training
    shutil.copy(_real_images("Test", "apple", 1)[0], os.path.join(root, "Test", "papaya"))
    shutil.rmtree(os.path.join(root, "Test", "mango"))                         # Training class missing from Test
    report = check.scan(root)
    assert any("Training/kiwi/ is an empty class folder" in p for p in report.problems), report.problems
    assert any("unknown to Training/: papaya" in p for p in report.problems), report.problems
    # A class missing from Test is reported (the check is not clean) but does not stop training.
    assert not any("mango" in p for p in report.problems), report.problems
    assert any("missing from Test/" in w and "mango" in w for w in report.warnings), report.warnings
    assert not report.clean
    with pytest.raises(DataError, match="empty class folder"):
        check.training_exclusions(report, root, skip_bad=True)      # skip never hides tree problems


@pytest.mark.multiprocess
def test_trainer_runs_when_test_lacks_a_class_and_keeps_labels(tmp_path):
    root = _make_tree(tmp_path / "data", train=4, test=2)
    shutil.rmtree(os.path.join(root, "Test", "mango"))
    out = tmp_path / "out"
    proc = _run("train", *TINY, "--data_dir", root, "--output_dir", str(out), "--max_steps", "1",
                "--batch_size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "classes missing from Test/: mango" in proc.stdout
    assert "3 classes" in proc.stdout                      # the model still has an output for mango
    result = json.load(open(out / "result.json"))
    assert result["num_samples"] == 4                      # apple + lemon, 2 each
    assert check.scan(root).warnings and _run("data", "check", root).returncode == 2


def test_tiny_classes_are_flagged_not_failed(tmp_path):
    root = _make_tree(tmp_path / "data", train=12, test=2)
    for extra in sorted(glob.glob(os.path.join(root, "Training", "apple", "*.jpg")))[3:]:
        os.remove(extra)
    report = check.scan(root)
    assert report.clean
    assert report.tiny_classes(10) == ["Training/apple (3)", "Test/apple (2)", "Test/lemon (2)", "Test/mango (2)"]
    assert "Training/apple (3)" in check.format_report(report, root, 10)


def test_training_exclusions_error_names_files_skip_returns_them(tmp_path):
    root = _make_tree(tmp_path / "data")
    _write(os.path.join(root, "Training", "apple", "truncated.jpg"), _jpeg_bytes()[:700])
    _write(os.path.join(root, "Test", "lemon", "empty.jpg"), b"")
    report = check.scan(root)
    with pytest.raises(DataError) as err:
        check.training_exclusions(report, root, skip_bad=False)
    message = str(err.value)
    assert "\n" not in message and "--bad_images skip" in message
    assert "truncated.jpg" in message and "empty.jpg" in message
    assert sorted(map(_rel, check.training_exclusions(report, root, skip_bad=True))) == [
        "Test/lemon/empty.jpg", "Training/apple/truncated.jpg"]


def test_shared_exclusions_leave_bad_files_out_of_both_splits(tmp_path):
    root = _make_tree(tmp_path / "data")
    _write(os.path.join(root, "Training", "apple", "random.jpg"), os.urandom(500))
    _write(os.path.join(root, "Test", "lemon", "empty.jpg"), b"")
    excluded = shared_check.shared_exclusions(root, True, 0, Collectives(1), cache_dir=str(tmp_path / "cache"))
    classes = pipeline.class_map(root)
    train = pipeline.list_split(root, "Training", classes, exclude=excluded)
    test = pipeline.list_split(root, "Test", classes, exclude=excluded)
    assert len(train) == 12 and len(test) == 6
    assert not any(f.endswith(("random.jpg", "empty.jpg")) for f in train.files + test.files)
    with pytest.raises(DataError, match="2 bad image"):
        shared_check.shared_exclusions(root, False, 0, Collectives(1), cache_dir=str(tmp_path / "cache"))


def test_scan_is_cached_by_tree_fingerprint(tmp_path):
    root = _make_tree(tmp_path / "data")
    cache = str(tmp_path / "cache")
    first = shared_check.shared_report(root, 0, Collectives(1), cache)
    again = shared_check.shared_report(root, 0, Collectives(1), cache)
    assert not first.from_cache and again.from_cache and again == first == check.scan(root)
    _write(os.path.join(root, "Training", "apple", "zero.jpg"), b"")           # the tree changed: scan again
    changed = shared_check.shared_report(root, 0, Collectives(1), cache)
    assert not changed.from_cache and [_rel(b.path) for b in changed.bad] == ["Training/apple/zero.jpg"]


# ---------------------------------------------------------------- agreement with MindSpore's decoder

_ENCODINGS = [("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"),
              ("PNG", "I;16"), ("PNG", "LA"), ("BMP", "RGB"), ("BMP", "1"), ("GIF", "RGB"), ("WEBP", "RGB"),
              ("TIFF", "RGB")]


@pytest.fixture(scope="module")
def fuzz_tree(tmp_path_factory):
    return _make_tree(tmp_path_factory.mktemp("fuzz") / "data", train=1, test=1, classes=("apple", "lemon"))


def _verdict(tree, data):
    """The check's verdict on `data` planted as Training/apple/fuzz.jpg: None (usable) or the reason."""
    _write(os.path.join(tree, "Training", "apple", "fuzz.jpg"), data)
    report = check.scan(tree, workers=1)
    bad = {_rel(b.path): b.reason for b in report.bad}
    assert set(bad) <= {"Training/apple/fuzz.jpg"}
    return report, bad.get("Training/apple/fuzz.jpg")


@pytest.mark.parametrize("fmt, mode", _ENCODINGS)
def test_check_accepts_exactly_what_mindspore_decodes(fuzz_tree, mindspore_decode, fmt, mode):
    data = _encoded(fmt, mode)
    try:
        mindspore_reads = mindspore_decode(np.frombuffer(data, np.uint8)).shape[2] == 3
    except RuntimeError:
        mindspore_reads = False
    _, reason = _verdict(fuzz_tree, data)
    assert (reason is None) == mindspore_reads, (fmt, mode, reason)


# ---------------------------------------------------------------- property-based: random bytes as images


@st.composite
def _image_like_bytes(draw):
    """Pure noise, or a real encoded image: intact, cut short, or with a few bytes overwritten."""
    kind = draw(st.sampled_from(["noise", "intact", "cut", "overwritten"]))
    if kind == "noise":
        return draw(st.binary(max_size=2048))
    data = bytearray(_encoded(*draw(st.sampled_from(_ENCODINGS))))
    if kind == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    for _ in range(draw(st.integers(1, 4)) if kind == "overwritten" else 0):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=80, deadline=10000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=_image_like_bytes())
def test_random_bytes_as_image_give_a_clear_verdict(fuzz_tree, mindspore_decode, data):
    with _no_hang():
        report, reason = _verdict(fuzz_tree, data)
    event("refused" if reason else "accepted")
    if reason:
        with pytest.raises(DataError, match="fuzz.jpg"):
            check.training_exclusions(report, fuzz_tree, skip_bad=False)
    else:
        # Accepted means the trainer's own decoder reads it: no C++ error can reach training.
        with _no_hang():
            assert mindspore_decode(np.frombuffer(data, np.uint8)).shape[2] == 3


# ---------------------------------------------------------------- config errors, in-process

@pytest.mark.parametrize("argv, words", [
    (["--epochs_num", "3"], ["unknown option --epochs_num", "did you mean --epochs?"]),
    (["--lr", "abc"], ["--lr", "invalid float value"]),
    (["--lr", "-0.1"], ["lr=-0.1 must be > 0"]),
    (["--batch_size", "0"], ["batch_size=0 must be >= 1"]),
    (["--bad_images", "ignore"], ["--bad_images='ignore' is not one of error, skip"]),
    (["--dist_bn", "reduse"], ["--dist_bn='reduse' is not one of reduce, broadcast, none (did you mean reduce?)"]),
    (["--overwrite", "maybe"], ["--overwrite"]),
    (["--config", "no/such.yaml"], ["config file 'no/such.yaml' not found"]),
])
def test_cli_config_errors_are_one_clear_line(argv, words):
    with pytest.raises(ConfigError) as err:
        config.parse(argv)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("epochs_num: 3\n", ["unknown key 'epochs_num'", "did you mean --epochs?"]),
    ("lr: fast\n", ["lr: could not convert"]),
    ("batch_size: 0\n", ["batch_size=0 must be >= 1"]),
    ("bad_images: maybe\n", ["bad_images='maybe' is not one of error, skip"]),
    ("seed: 2020-13-45\n", ["not valid YAML"]),
    ("- a list\n", ["must be a mapping"]),
])
def test_yaml_config_errors_are_one_clear_line(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.parse(["--config", str(path)])
    for word in words:
        assert word in str(err.value)


_YAML_KEYS = [o.name for o in config.TRAIN_OPTIONS] + ["epochs_num", "config"]
_YAML_VALUES = st.one_of(st.text(max_size=20), st.integers().map(str), st.floats().map(str), st.sampled_from(
    ["~", "[1, 2]", "{a: 1}", "&a [*a]", ".nan", "-.inf", "1e400", "0x1F", "2020-13-45", "!!binary aGk=",
     "!!python/object:os.system", "true", "'no'", "[[[[[[[[[[[[[[]]]]]]]]]]]]]]"]))
_YAML_TEXTS = st.one_of(
    st.text(max_size=300),
    st.lists(st.tuples(st.sampled_from(_YAML_KEYS), _YAML_VALUES), max_size=5).map(
        lambda pairs: "".join(f"{k}: {v}\n" for k, v in pairs)),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")))


@settings(max_examples=300, deadline=2000, derandomize=True)
@given(text=_YAML_TEXTS)
def test_random_yaml_config_parses_or_raises_config_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "random.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        try:
            with _no_hang():
                config.parse(["--config", path])
        except ConfigError as e:
            assert str(e).strip()


@settings(max_examples=200, deadline=2000, derandomize=True)
@given(argv=st.lists(st.one_of(st.sampled_from([f"--{k}" for k in _YAML_KEYS]), st.text(max_size=12)),
                     max_size=6).filter(lambda a: not {"-h", "--help"} & set(a)))
def test_random_command_line_parses_or_raises_config_error(argv):
    try:
        with _no_hang():
            config.parse(argv)
    except ConfigError as e:
        assert str(e).strip()


# ---------------------------------------------------------------- output_dir safety, in-process

def test_output_dir_with_checkpoints_is_refused_then_moved_aside_never_deleted(tmp_path):
    from msdist.train import _claim_output_dir

    out = tmp_path / "out"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").write_bytes(b"old weights")
    (out / "result.json").write_text('{"accuracy": 0.9}')
    (out / "logs").mkdir()
    (out / "compile_cache").mkdir()
    with pytest.raises(ConfigError, match="--resume auto.*--overwrite true"):
        _claim_output_dir(str(out), "", False, True)
    assert _claim_output_dir(str(out), "auto", False, True) is None        # resuming is fine
    assert _claim_output_dir(str(out), "", True, False) is None            # other ranks move nothing
    assert (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").exists()
    archive = _claim_output_dir(str(out), "", True, True)
    assert os.path.basename(archive).startswith("replaced-")
    assert open(os.path.join(archive, "ckpt", "resnet_tiny_rank0-1_2.ckpt"), "rb").read() == b"old weights"
    assert json.load(open(os.path.join(archive, "result.json"))) == {"accuracy": 0.9}
    assert sorted(os.listdir(out)) == sorted(["compile_cache", "logs", os.path.basename(archive)])
    assert _claim_output_dir(str(out), "", False, True) is None            # now free for a new run


# ---------------------------------------------------------------- checkpoints from elsewhere, in-process

def test_foreign_checkpoint_files_are_refused_before_reading(tmp_path):
    from msdist.run import checkpoint

    expected = {"fc.weight": ((2, 4), "Float32")}
    pt = tmp_path / "model.pt"
    pt.write_bytes(pickle.dumps({"fc.weight": [1, 2]}))
    with pytest.raises(CheckpointError, match="never pickle"):
        checkpoint.load(str(pt), expected)
    pickled = tmp_path / "pickled.ckpt"
    pickled.write_bytes(pickle.dumps({"fc.weight": [1, 2]}))
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(str(pickled), expected)
    huge = tmp_path / "huge.ckpt"
    with open(huge, "wb") as f:
        f.truncate(checkpoint.MAX_CHECKPOINT_BYTES + 1)    # sparse: no disk used
    with pytest.raises(CheckpointError, match="over the .* cap"):
        checkpoint.load(str(huge), expected)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_checkpoint_names_every_parameter_that_does_not_fit(tmp_path, fmt):
    import mindspore as ms
    from msdist.run import checkpoint

    path = str(tmp_path / f"model.{fmt}")
    ms.save_checkpoint([{"name": "fc.weight", "data": ms.Tensor(np.ones((2, 4), np.float16))},
                        {"name": "fc.bias", "data": ms.Tensor(np.zeros((2,), np.float32))},
                        {"name": "old.head", "data": ms.Tensor(np.zeros((3,), np.float32))}], path, format=fmt)
    fits = {"fc.weight": ((2, 4), "Float16"), "fc.bias": ((2,), "Float32"), "old.head": ((3,), "Float32")}
    loaded = checkpoint.load(path, fits)["params"]
    assert sorted(loaded) == sorted(fits) and loaded["fc.weight"].asnumpy().sum() == 8
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, {"fc.weight": ((2, 4), "Float32"), "fc.bias": ((2,), "Float32"),
                               "conv.weight": ((1,), "Float32")})
    message = str(err.value)
    assert "missing 1 parameter(s): conv.weight" in message and "unexpected 1 parameter(s): old.head" in message
    assert "fc.weight is Float16[2, 4], model needs Float32[2, 4]" in message


# ---------------------------------------------------------------- real processes

@pytest.mark.multiprocess
def test_data_check_cli_exit_status_and_one_error_line(tmp_path):
    root = _make_tree(tmp_path / "data")
    clean = _run("data", "check", root)
    assert clean.returncode == 0 and clean.stdout.strip().endswith("clean") and not clean.stderr.strip(), clean
    _write(os.path.join(root, "Training", "apple", "truncated.jpg"), _jpeg_bytes()[:900])
    _write(os.path.join(root, "Test", "lemon", "empty.jpg"), b"")
    os.makedirs(os.path.join(root, "Test", "papaya"))
    dirty = _run("data", "check", root)
    _one_error_line(dirty, "2 bad file(s)", "2 tree problem(s)")
    for named in ("Training/apple/truncated.jpg: truncated image", "Test/lemon/empty.jpg: zero-byte file",
                  "unknown to Training/: papaya", "Test/papaya/ is an empty class folder"):
        assert named in dirty.stdout, dirty.stdout


@pytest.mark.multiprocess
def test_trainer_path_errors_are_one_line(tmp_path):
    root = _make_tree(tmp_path / "data")
    _one_error_line(_run("train", *TINY, "--epochs_num", "3"), "did you mean --epochs?")
    _one_error_line(_run("train", *TINY, "--data_dir", str(tmp_path / "nowhere")), str(tmp_path / "nowhere"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _one_error_line(_run("train", *TINY, "--data_dir", root, "--output_dir", str(blocker / "out")),
                    "is not writable")
    out = tmp_path / "taken"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").write_bytes(b"x")
    _one_error_line(_run("train", *TINY, "--data_dir", root, "--output_dir", str(out)),
                    "holds another run's checkpoints", "--overwrite true")
    assert (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").read_bytes() == b"x"
    # No GPU on this machine (nor in CI): forcing one is a clear error, not MindSpore's plugin trace.
    _one_error_line(_run("train", *TINY, "--data_dir", root, "--output_dir", str(tmp_path / "gpu"),
                         "--device_target", "GPU"), "--device_target GPU", "--device_target CPU")


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory):
    """40 training / 8 test real images in 2 classes, plus a truncated JPEG, random bytes, an empty file, a .txt."""
    root = _make_tree(tmp_path_factory.mktemp("bad") / "data", train=20, test=4, classes=("apple", "lemon"))
    _write(os.path.join(root, "Training", "apple", "truncated.jpg"), _jpeg_bytes()[:1000])
    _write(os.path.join(root, "Test", "lemon", "random.jpg"), os.urandom(2000))
    _write(os.path.join(root, "Training", "lemon", "empty.jpg"), b"")
    _write(os.path.join(root, "Training", "lemon", "notes.txt"), b"hello")
    return root


@pytest.mark.multiprocess
def test_trainer_refuses_bad_images_by_default_naming_them(bad_tree, tmp_path):
    proc = _run("train", *TINY, "--data_dir", bad_tree, "--output_dir", str(tmp_path / "out"),
                "--max_steps", "2")
    _one_error_line(proc, "3 bad image file(s)", "truncated.jpg", "random.jpg", "empty.jpg", "--bad_images skip")


@pytest.mark.multiprocess
def test_trainer_skip_run_then_foreign_checkpoint_and_overwrite(bad_tree, tmp_path):
    out = tmp_path / "out"
    proc = _run("train", *TINY, "--data_dir", bad_tree, "--output_dir", str(out), "--max_steps", "2",
                "--bad_images", "skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped 3 bad image file(s)" in proc.stdout and "ignored 1 non-image" in proc.stdout
    assert "40 train / 8 test images" in proc.stdout
    result = json.load(open(out / "result.json"))
    assert result["skipped_images"] == 3 and result["num_samples"] == 8

    # A checkpoint of resnet_tiny does not fit resnet18: refused before loading, naming what differs.
    ckpt = sorted(glob.glob(str(out / "ckpt" / "*-*.ckpt")))[-1]
    assert os.path.basename(ckpt) == "resnet_tiny_rank0-1_2.ckpt"   # max_steps stopped in epoch 1, at step 2
    other = _run("train", *TINY, "--data_dir", bad_tree, "--output_dir", str(tmp_path / "other"),
                 "--bad_images", "skip", "--model", "resnet18", "--resume", ckpt)
    _one_error_line(other, "does not fit the model", "fc.weight is Float32[2, 64], model needs Float32[2, 512]")
    # --overwrite true: a new run in the same output_dir; the old checkpoints are moved aside, intact.
    old = {os.path.basename(p): open(p, "rb").read() for p in glob.glob(str(out / "ckpt" / "*.ckpt"))}
    again = _run("train", *TINY, "--data_dir", bad_tree, "--output_dir", str(out), "--max_steps", "1",
                 "--bad_images", "skip", "--overwrite", "true")
    assert again.returncode == 0, again.stderr[-3000:]
    (archive,) = glob.glob(str(out / "replaced-*"))
    assert {name: open(os.path.join(archive, "ckpt", name), "rb").read() for name in old} == old
    assert json.load(open(os.path.join(archive, "result.json")))["global_steps"] == 2
    assert json.load(open(out / "result.json"))["global_steps"] == 1 and os.listdir(out / "ckpt")

    moved = os.path.join(archive, "ckpt", os.path.basename(ckpt))
    evaluated = _run("eval", *TINY, "--data_dir", bad_tree, "--output_dir", str(tmp_path / "eval"),
                     "--bad_images", "skip", "--model", "resnet18", "--ckpt", moved)
    _one_error_line(evaluated, "does not fit the model", "fc.weight is Float32[2, 64], model needs Float32[2, 512]")


@pytest.mark.multiprocess
def test_two_ranks_leave_out_the_same_bad_files(bad_tree, tmp_path):
    # The tree's verdict may be cached by an earlier test of this module; this one watches the ranks decode.
    cached = os.path.join(shared_check.default_cache_dir(), f"{shared_check.fingerprint(bad_tree)}.json")
    if os.path.exists(cached):
        os.remove(cached)
    out = tmp_path / "out"
    proc = _run("train", *TINY, "--data_dir", bad_tree, "--output_dir", str(out), "--max_steps", "2",
                "--bad_images", "skip", ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out / "result.json"))
    assert result["world_size"] == 2 and result["skipped_images"] == 3 and result["num_samples"] == 8
    for rank in (0, 1):   # each rank decoded half the tree, and both got the merged verdict
        with open(out / "logs" / f"rank_{rank}.log", encoding="utf-8") as f:
            log = f.read()
        assert "40 train / 8 test images" in log and f"decoded {26 - rank} of 51 images (slice {rank + 1} of 2)" in log


@pytest.mark.multiprocess
@pytest.mark.parametrize("slice_", [0, 1])
def test_split_check_finds_a_bad_file_whichever_ranks_slice_holds_it(tmp_path, slice_):
    """Rank r decodes the images at positions r, r + 2, ... of the sorted listing; a bad file in either slice
    stops both ranks with the same one-line error, and only the rank whose slice holds it found it."""
    root = _make_tree(tmp_path / "data", train=4, test=2, classes=("apple", "lemon"))
    _write(os.path.join(root, "Training", "lemon", "bad.jpg"), os.urandom(2000))
    if check.image_files(root).index(os.path.join("Training", "lemon", "bad.jpg")) % 2 != slice_:
        shutil.copy(_real_images("Training", "apple", 1)[0], os.path.join(root, "Training", "apple", "0_extra.jpg"))
    assert check.image_files(root).index(os.path.join("Training", "lemon", "bad.jpg")) % 2 == slice_
    out = tmp_path / "out"
    proc = _run("train", *TINY, "--data_dir", root, "--output_dir", str(out), "--max_steps", "1", ranks=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("msdist: error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr    # every rank refuses, one prints
    assert "1 bad image file(s)" in errors[0] and "Training/lemon/bad.jpg" in errors[0], errors
    for rank in (0, 1):
        with open(out / "logs" / f"rank_{rank}.log", encoding="utf-8") as f:
            found = re.search(r"decoded (\d+) of (\d+) images \(slice (\d) of 2\) in [\d.]+ s, (\d+) bad", f.read())
        assert found and int(found[3]) == rank + 1 and int(found[4]) == (rank == slice_), found
        assert int(found[1]) == len(range(rank, int(found[2]), 2))
