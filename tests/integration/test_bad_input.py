"""Bad input on real processes (`python -m msdist.data`, `python -m msdist.train`, under mpirun too): one
`msdist: error:` line, exit 2, no traceback, and no lost work."""
import glob
import json
import os
import re
import shutil

import pytest

from conftest import run_msdist
from msdist.data import check, shared_check
from image_trees import TINY, _real_images, _make_tree, _jpeg_bytes, _write


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
