"""The data tree validator behind `python -m msdist.data check DIR` and the trainer's pre-flight check.

It looks at every entry of an ImageFolder tree (`Training/<class>/`, `Test/<class>/`) and sorts it:

* bad files (an image name, i.e. the files training would read, that cannot be used): zero bytes,
  unreadable, not a regular file, a symlink pointing outside the tree, not an image, truncated or
  corrupt, or a format MindSpore's decoder does not read (GIF, WebP, ...);
* ignored entries: non-image files and folders that training passes over anyway;
* tree problems: a split or class folder without usable images, Test classes unknown to Training;
* tree warnings: Training classes missing from Test (training works, labels stay aligned, but those
  classes are never evaluated);
* per-class counts of usable images, so tiny classes can be flagged.

Bad files, tree problems and tree warnings fail the check; training refuses only bad files and tree
problems. Ignored entries and tiny classes are only reported.

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
import hashlib
import json
import logging
import os
import stat
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from msdist.base.errors import DataError, first_line
from msdist.base.files import atomic_write_text
from msdist.cluster.runtime import usable_cores
from msdist.data.pipeline import IMAGE_EXTENSIONS, TEST_SPLIT, TRAIN_SPLIT, is_image

_logger = logging.getLogger(__name__)

SPLITS = (TRAIN_SPLIT, TEST_SPLIT)
DECODABLE_FORMATS = ("JPEG", "PNG", "BMP", "TIFF")   # what MindSpore 2.10 Decode reads (not GIF, WebP)
TINY_CLASS = 10        # default: flag classes with fewer usable images
_CACHE_VERSION = 2     # bump when verdicts change, to invalidate old caches
_SHOWN = 3             # files named in a one-line error before "and N more"


@dataclass(frozen=True)
class BadFile:
    path: str     # relative to the data root, e.g. Training/apple/3.jpg
    reason: str


@dataclass(frozen=True)
class Report:
    """What a scan found. Paths are relative to the data root (`os.path.join` style)."""
    counts: Dict[str, Dict[str, int]]   # split -> class -> usable images
    bad: Tuple[BadFile, ...] = ()
    ignored: Tuple[str, ...] = ()       # non-image entries that training passes over
    problems: Tuple[str, ...] = ()      # tree-level errors
    warnings: Tuple[str, ...] = ()      # tree-level findings training can live with
    from_cache: bool = field(default=False, compare=False)

    @property
    def clean(self) -> bool:
        return not self.bad and not self.problems and not self.warnings

    def tiny_classes(self, minimum: int = TINY_CLASS) -> List[str]:
        """`split/class (n)` for every class with fewer than `minimum` but more than 0 usable images."""
        return [f"{split}/{cls} ({n})" for split, classes in self.counts.items()
                for cls, n in classes.items() if 0 < n < minimum]


# ---------------------------------------------------------------- walking the tree

@dataclass(frozen=True)
class _Tree:
    classes: Dict[str, Tuple[str, ...]]            # split -> class folder names, sorted
    entries: Dict[str, Tuple[str, ...]]            # "split/class" relpath -> entry names, sorted
    stray: Tuple[str, ...]                         # non-folder entries directly inside a split
    missing: Tuple[str, ...]                       # splits that are not folders


def _listdir(path: str) -> Tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError as e:
        raise DataError(f"cannot list {path} ({e.strerror}); check its permissions") from None


def _walk(root: str) -> _Tree:
    """The two levels training looks at: class folders of each split and the entries inside them."""
    classes, entries, stray, missing = {}, {}, [], []
    for split in SPLITS:
        split_dir = os.path.join(root, split)
        if not os.path.isdir(split_dir):
            missing.append(split)
            classes[split] = ()
            continue
        names = _listdir(split_dir)
        classes[split] = tuple(n for n in names if os.path.isdir(os.path.join(split_dir, n)))
        stray += [os.path.join(split, n) for n in names if n not in classes[split]]
        for cls in classes[split]:
            entries[os.path.join(split, cls)] = _listdir(os.path.join(split_dir, cls))
    return _Tree(classes, entries, tuple(stray), tuple(missing))


def _image_relpaths(tree: _Tree) -> List[str]:
    return sorted(os.path.join(folder, name) for folder, names in tree.entries.items() for name in names
                  if is_image(name))


def image_files(data_dir: str) -> List[str]:
    """Every file training would read (image names in class folders), relative and sorted."""
    return _image_relpaths(_walk(data_dir))


# ---------------------------------------------------------------- verdict on one file

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


# ---------------------------------------------------------------- the scan

def scan(data_dir: str, workers: int = 0) -> Report:
    """Check every entry of the tree at `data_dir`, decoding every image for real.

    Args:
        data_dir: ImageFolder root holding Training/ and Test/.
        workers: decoding threads; 0 picks one per usable core (at most 8).

    Raises:
        DataError: only when `data_dir` itself (or a folder in it) cannot be listed.
    """
    tree = _walk_root(data_dir)
    return _report(tree, _bad_files(data_dir, _image_relpaths(tree), workers))


def _walk_root(data_dir: str) -> _Tree:
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir {data_dir!r} does not exist or is not a folder")
    return _walk(data_dir)


def _bad_files(data_dir: str, images: Sequence[str], workers: int = 0) -> List[BadFile]:
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


def _report(tree: _Tree, bad: Sequence[BadFile]) -> Report:
    """The whole tree's report, given every bad file."""
    ignored = list(tree.stray) + sorted(os.path.join(folder, name) for folder, names in tree.entries.items()
                                        for name in names if not is_image(name))
    counts = _usable_counts(tree, {b.path for b in bad})
    return Report(counts, tuple(bad), tuple(ignored), tuple(_tree_problems(tree, counts)),
                  tuple(_tree_warnings(tree)))


def _usable_counts(tree: _Tree, bad: set) -> Dict[str, Dict[str, int]]:
    return {split: {cls: sum(1 for name in tree.entries[os.path.join(split, cls)]
                             if is_image(name) and os.path.join(split, cls, name) not in bad)
                    for cls in tree.classes[split]}
            for split in SPLITS}


def _tree_problems(tree: _Tree, counts: Dict[str, Dict[str, int]]) -> List[str]:
    problems = [f"{split}/ is missing: data_dir needs {TRAIN_SPLIT}/ and {TEST_SPLIT}/ with one folder per class"
                for split in tree.missing]
    for split in SPLITS:
        if split not in tree.missing and not tree.classes[split]:
            problems.append(f"{split}/ has no class folders; put each class's images in {split}/<class>/")
        for cls, usable in counts[split].items():
            if usable:
                continue
            folder = os.path.join(split, cls)
            found = sum(1 for name in tree.entries[folder] if is_image(name))
            problems.append(f"{folder}/ has no usable images (all {found} are bad)" if found else
                            f"{folder}/ is an empty class folder (no {'/'.join(IMAGE_EXTENSIONS)} files); "
                            "add images or remove it")
    unknown = sorted(set(tree.classes[TEST_SPLIT]) - set(tree.classes[TRAIN_SPLIT]))
    if unknown and not tree.missing:
        problems.append(f"{TEST_SPLIT}/ has classes unknown to {TRAIN_SPLIT}/: {', '.join(unknown)}; "
                        f"add them to {TRAIN_SPLIT}/ or remove them from {TEST_SPLIT}/")
    return problems


def _tree_warnings(tree: _Tree) -> List[str]:
    untested = sorted(set(tree.classes[TRAIN_SPLIT]) - set(tree.classes[TEST_SPLIT]))
    if not untested or tree.missing:
        return []
    return [f"{TRAIN_SPLIT}/ classes missing from {TEST_SPLIT}/: {', '.join(untested)}; they are trained on but "
            f"never evaluated (labels stay aligned); add {TEST_SPLIT}/<class>/ images to evaluate them"]


# ---------------------------------------------------------------- fingerprint cache

def fingerprint(data_dir: str) -> str:
    """A hash of the tree's layout and file stats (names, sizes, mtimes, symlink targets).

    Cheap (stat only, no reads): an unchanged fingerprint means an unchanged verdict, so the trainer
    does not decode the whole data set again on every run.
    """
    tree = _walk(data_dir)
    digest = hashlib.sha256(f"{_CACHE_VERSION}\0{os.path.realpath(data_dir)}\0{tree.missing}\n".encode())
    for split in SPLITS:
        digest.update(f"{split}\0{tree.classes[split]}\n".encode())
    for rel in list(tree.stray) + [os.path.join(f, n) for f, names in sorted(tree.entries.items()) for n in names]:
        path = os.path.join(data_dir, rel)
        try:
            info = os.stat(path)
            stats = f"{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}"
        except OSError as e:
            stats = f"error {e.errno}"
        link = os.readlink(path) if os.path.islink(path) else ""
        digest.update(f"{rel}\0{stats}\0{link}\n".encode())
    return digest.hexdigest()[:32]


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/msdist/data_check` (usually ~/.cache/msdist/data_check)."""
    from msdist.cluster.isa_probe import cache_dir
    return os.path.join(cache_dir(), "data_check")


def _to_json(report: Report) -> dict:
    return {"counts": report.counts, "bad": [[b.path, b.reason] for b in report.bad],
            "ignored": list(report.ignored), "problems": list(report.problems), "warnings": list(report.warnings)}


def _from_json(data: dict) -> Report:
    return Report({s: {c: int(n) for c, n in classes.items()} for s, classes in data["counts"].items()},
                  tuple(BadFile(p, r) for p, r in data["bad"]), tuple(data["ignored"]), tuple(data["problems"]),
                  tuple(data["warnings"]),
                  from_cache=True)


def _read_cache(path: str) -> Optional[Report]:
    """The verdict stored at `path`; None when there is none or it cannot be read (then the scan just runs)."""
    try:
        with open(path, encoding="utf-8") as f:
            return _from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: str, report: Report) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(_to_json(report)))  # a concurrent reader sees old or whole new
    except OSError as e:
        _logger.debug("data check cache %s not written: %s", path, e)


def shared_report(data_dir: str, rank: int, collectives, cache_dir: Optional[str] = None) -> Report:
    """The tree's report, the same on every rank: the cached verdict when every rank has it, else a scan
    split over the ranks (each decodes every N-th image of the sorted listing) with the verdicts merged.

    Every rank stores the merged verdict under the tree's fingerprint, so the next run skips the decoding.

    Args:
        rank: this rank; its slice is the images at positions rank, rank + N, ...
        collectives: `distributed.Collectives` (N ranks; world size 1 scans everything).
        cache_dir: where verdicts are kept; default `default_cache_dir()`.
    """
    tree = _walk_root(data_dir)
    path = os.path.join(cache_dir or default_cache_dir(), f"{fingerprint(data_dir)}.json")
    cached = _read_cache(path)
    if collectives.gather([float(cached is not None)]).all():
        return cached
    images = _image_relpaths(tree)
    mine = images[rank::collectives.world_size]
    start = time.perf_counter()
    bad = _bad_files(data_dir, mine)
    _logger.info("data check of %s: this rank decoded %d of %d images (slice %d of %d) in %.1f s, %d bad", data_dir,
                 len(mine), len(images), rank + 1, collectives.world_size, time.perf_counter() - start, len(bad))
    merged = [BadFile(p, r) for text in collectives.gather_text(json.dumps([[b.path, b.reason] for b in bad]))
              for p, r in json.loads(text)]
    report = _report(tree, sorted(merged, key=lambda b: b.path))
    _write_cache(path, report)
    return report


# ---------------------------------------------------------------- what training does with a report

def _name_some(items: Sequence[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def training_exclusions(report: Report, data_dir: str, skip_bad: bool) -> List[str]:
    """The relative paths training must leave out, or a DataError when the tree cannot be trained on.

    Args:
        skip_bad: leave bad files out (`bad_images: skip`) instead of refusing them (`bad_images: error`).

    Raises:
        DataError: a tree problem (always), or bad files unless `skip_bad`; the message names them.
    """
    full_list = f"; see all with: python -m msdist.data check {data_dir}"
    if report.problems:
        raise DataError(f"data_dir {data_dir}: {_name_some(report.problems)}{full_list}")
    if report.bad and not skip_bad:
        named = [f"{b.path} ({b.reason})" for b in report.bad]
        raise DataError(f"{len(report.bad)} bad image file(s) in {data_dir}: {_name_some(named)}; fix or delete "
                        f"them, or pass --bad_images skip to train without them{full_list}")
    return [b.path for b in report.bad]


def _listing_id(relpaths: Sequence[str]) -> float:
    digest = hashlib.sha256("\n".join(relpaths).encode()).digest()
    return float(int.from_bytes(digest[:6], "little"))   # 48 bits: exact in float64


def shared_exclusions(data_dir: str, skip_bad: bool, rank: int, collectives,
                      cache_dir: Optional[str] = None) -> List[str]:
    """Check the tree on all ranks together and give every rank the same list of files to leave out.

    Each rank decodes its slice of the images (`shared_report`, cached); the merged verdict is the same
    on every rank. Ranks that see different files under `data_dir` fail together rather than train on
    different data sets.

    Args:
        skip_bad: leave bad files out instead of refusing them.
        rank: this rank (rank 0 logs what the check found).
        collectives: `distributed.Collectives`.

    Returns:
        Paths to exclude, spelled as the pipeline spells them (`os.path.join(data_dir, ...)`).

    Raises:
        DataError: on every rank alike, when the check refuses the tree.
    """
    listings = collectives.gather([_listing_id(image_files(data_dir))])[:, 0]
    if np.any(listings != listings[0]):
        raise DataError(f"ranks see different image files under {data_dir}; give every node the same data tree")
    report = shared_report(data_dir, rank, collectives, cache_dir)
    if rank == 0:
        _log_report(report, data_dir, skip_bad)
    return [os.path.join(data_dir, rel) for rel in training_exclusions(report, data_dir, skip_bad)]


def _log_report(report: Report, data_dir: str, skip_bad: bool) -> None:
    source = "cached verdict" if report.from_cache else "scanned"
    _logger.info("data check of %s (%s): %d bad, %d ignored non-image entries, %d problems", data_dir, source,
                 len(report.bad), len(report.ignored), len(report.problems))
    for bad in report.bad:
        _logger.warning("bad image %s: %s", os.path.join(data_dir, bad.path), bad.reason)
    if report.bad and skip_bad and not report.problems:
        _logger.warning("bad_images skip: skipped %d bad image file(s) on every rank", len(report.bad))
    for warning in report.warnings:
        _logger.warning("data check: %s", warning)
    if report.ignored:
        _logger.info("ignored %d non-image entries (e.g. %s)", len(report.ignored), report.ignored[0])
    tiny = report.tiny_classes()
    if tiny:
        _logger.warning("tiny classes (fewer than %d usable images): %s", TINY_CLASS, ", ".join(tiny))


def format_report(report: Report, data_dir: str, tiny: int = TINY_CLASS) -> str:
    """The human-readable report `python -m msdist.data check` prints."""
    classes = sorted({c for split in report.counts.values() for c in split})
    width = max([len("class")] + [len(c) for c in classes])
    lines = [f"data check of {data_dir}",
             f"  {'class':<{width}}  {TRAIN_SPLIT:>8}  {TEST_SPLIT:>8}"]
    for cls in classes:
        cells = []
        for split in SPLITS:
            n = report.counts.get(split, {}).get(cls)
            cells.append(f"{'-' if n is None else n:>8}")
        tiny_mark = any(0 < report.counts.get(s, {}).get(cls, 0) < tiny for s in SPLITS)
        lines.append(f"  {cls:<{width}}  {'  '.join(cells)}" + ("  tiny" if tiny_mark else ""))
    totals = [sum(report.counts.get(s, {}).values()) for s in SPLITS]
    lines.append(f"  {'total':<{width}}  {totals[0]:>8}  {totals[1]:>8}")
    sections = [("bad files", [f"{b.path}: {b.reason}" for b in report.bad]),
                ("tree problems", list(report.problems)),
                ("tree warnings", list(report.warnings)),
                ("ignored non-image entries (training passes over them)", list(report.ignored)),
                (f"tiny classes (fewer than {tiny} usable images)", report.tiny_classes(tiny))]
    for title, items in sections:
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  {item}" for item in items]
    lines.append("clean" if report.clean else
                 f"NOT clean: {len(report.bad)} bad file(s), {len(report.problems)} tree problem(s), "
                 f"{len(report.warnings)} tree warning(s)")
    return "\n".join(lines)
