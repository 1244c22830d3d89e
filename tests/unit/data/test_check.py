"""data/check.py, data/verdict.py, data/shared_check.py: the tree check names every bad file with its reason,
leaves the same files out of both splits, caches by tree fingerprint, and accepts exactly what MindSpore's
decoder accepts (fuzzed with hypothesis). Trees are built per test from real images (tests/image_trees.py)."""
import glob
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from msdist.base.errors import DataError
from msdist.data import check, pipeline, shared_check
from msdist.rank.distributed import Collectives
from image_trees import _real_images, _make_tree, _jpeg_bytes, _encoded, _write, _plant_bad_files, _no_hang


def _rel(path):
    return path.replace(os.sep, "/")


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
