"""Whether one image file is usable for training: the file system, a full PIL decode, and MindSpore's decoder.

How images are decoded, and why this way: every file is decoded for real with PIL (fast, thread
friendly, and its errors say *what* is wrong). For JPEG, PIL and MindSpore both use libjpeg-turbo and
agree (0 disagreements over ~3000 truncated/bit-flipped JPEGs PIL accepted). Every other format
MindSpore decodes with OpenCV, which rejects some truncated PNGs and odd BMPs that PIL accepts, so
MindSpore's own `Decode` has the last word on those. MindSpore is not used for everything because a
badly truncated JPEG leaves its decoder in a state where the *next* JPEG fails too (MindSpore 2.10),
which would flag good files.
"""
import concurrent.futures
import contextlib
import os
import stat
import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from msdist.base.errors import first_line
from msdist.rank.runtime import usable_cores

DECODABLE_FORMATS = ("JPEG", "PNG", "BMP", "TIFF")   # what MindSpore 2.10 Decode reads (not GIF, WebP)


@dataclass(frozen=True)
class BadFile:
    path: str     # relative to the data root, e.g. Training/apple/3.jpg
    reason: str


def _inside(path: str, root_real: str) -> bool:
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real + os.sep)


def _file_problem(path: str, root_real: str) -> Tuple[Optional[str], str]:
    """(reason the file is bad or None, PIL format) from the file system and a full PIL decode."""
    from PIL import Image, UnidentifiedImageError

    if not _inside(path, root_real):
        return f"symlink pointing outside the data tree (to {os.path.realpath(path)})", ""
    try:
        info = os.stat(path)
    except OSError as e:
        broken = "; broken symlink" if os.path.islink(path) else ""
        return f"unreadable ({e.strerror}{broken})", ""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file", ""   # a folder or a FIFO named like an image; reading a FIFO would hang
    if info.st_size == 0:
        return "zero-byte file", ""
    try:
        handle = open(path, "rb")
    except OSError as e:
        return f"unreadable ({e.strerror})", ""
    with handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PIL warns about odd metadata; only failures matter here
        try:
            with Image.open(handle) as image:
                image.load()
                fmt = image.format or ""
        except UnidentifiedImageError:
            return "not an image (no known image format)", ""
        except Exception as e:  # noqa: BLE001 - any decoder failure means the file is unusable
            text = first_line(str(e)) or type(e).__name__
            return ("truncated image" if "truncated" in text.lower() else f"corrupt image: {text}"), ""
    if fmt not in DECODABLE_FORMATS:
        return f"a {fmt} image, which MindSpore does not decode; convert it to JPEG or PNG", fmt
    return None, fmt


@contextlib.contextmanager
def _c_stderr_silenced():
    """Mute file descriptor 2: libpng and OpenCV inside MindSpore print their complaints there directly."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _mindspore_problem(path: str) -> Optional[str]:
    """MindSpore's verdict on a non-JPEG image that PIL accepted (its OpenCV decoder is stricter)."""
    from mindspore.dataset import vision

    try:
        with _c_stderr_silenced():
            image = vision.Decode()(np.fromfile(path, dtype=np.uint8))
    except Exception:  # noqa: BLE001 - MindSpore raises RuntimeError with a C++ trace; the verdict is enough
        return "corrupt image (MindSpore's decoder rejects it, e.g. a truncated PNG)"
    if image.ndim != 3 or image.shape[2] != 3:
        return f"decodes to shape {list(image.shape)}, not a 3-channel image"
    return None


def bad_files(data_dir: str, images: Sequence[str], workers: int = 0) -> List[BadFile]:
    """Decode each of `images` (paths relative to data_dir) for real; the bad ones, with their reasons."""
    root_real = os.path.realpath(data_dir)
    full = [os.path.join(data_dir, rel) for rel in images]
    # PIL releases the GIL while decoding, so threads scale with cores.
    with concurrent.futures.ThreadPoolExecutor(workers or min(8, len(usable_cores()))) as pool:
        verdicts = list(pool.map(lambda p: _file_problem(p, root_real), full))
    bad = []
    for rel, path, (reason, fmt) in zip(images, full, verdicts):
        if reason is None and fmt != "JPEG":
            reason = _mindspore_problem(path)   # serial: MindSpore's eager ops are not meant for threads
        if reason is not None:
            bad.append(BadFile(rel, reason))
    return bad
