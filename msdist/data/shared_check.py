"""The data check across a job's ranks: each rank decodes a slice of the images, the verdicts are merged so
every rank has the same report, and the report is cached under the tree's fingerprint so the next run
skips the decoding (`check.py` is the check itself).
"""
import hashlib
import json
import logging
import os
import time
from typing import List, Optional, Sequence

import numpy as np

from msdist.base.errors import DataError
from msdist.base.files import atomic_write_text
from msdist.data.check import (SPLITS, TINY_CLASS, Report, image_files, image_relpaths, report_of,
                               training_exclusions, walk_root)
from msdist.data.verdict import BadFile, bad_files

_logger = logging.getLogger(__name__)
_CACHE_VERSION = 2     # bump when verdicts change, to invalidate old caches


def fingerprint(data_dir: str) -> str:
    """A hash of the tree's layout and file stats (names, sizes, mtimes, symlink targets).

    Cheap (stat only, no reads): an unchanged fingerprint means an unchanged verdict, so the trainer
    does not decode the whole data set again on every run.
    """
    tree = walk_root(data_dir)
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
    from msdist.rank.isa_probe import cache_dir
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
    tree = walk_root(data_dir)
    path = os.path.join(cache_dir or default_cache_dir(), f"{fingerprint(data_dir)}.json")
    cached = _read_cache(path)
    if collectives.gather([float(cached is not None)]).all():
        return cached
    images = image_relpaths(tree)
    mine = images[rank::collectives.world_size]
    start = time.perf_counter()
    bad = bad_files(data_dir, mine)
    _logger.info("data check of %s: this rank decoded %d of %d images (slice %d of %d) in %.1f s, %d bad", data_dir,
                 len(mine), len(images), rank + 1, collectives.world_size, time.perf_counter() - start, len(bad))
    merged = [BadFile(p, r) for text in collectives.gather_text(json.dumps([[b.path, b.reason] for b in bad]))
              for p, r in json.loads(text)]
    report = report_of(tree, sorted(merged, key=lambda b: b.path))
    _write_cache(path, report)
    return report


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
