"""Small ImageFolder trees for the data-check and bad-input tests: real Fruits-360 images from the shipped
mini set, plus every kind of bad file planted where the test wants it."""
import contextlib
import faulthandler
import glob
import io
import os
import shutil

from PIL import Image

from conftest import REAL_DATA, TINY_CONFIG
from msdist.data import pipeline


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


@contextlib.contextmanager
def _no_hang(seconds=60):
    """A hang inside the block, in Python or C++, ends the test run with every thread's stack."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


TINY = ["--config", TINY_CONFIG]
