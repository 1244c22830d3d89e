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

Each image is decoded for real (`verdict.py` says how and why). Across the ranks of a job, the scan
is split and its verdict cached (`shared_check.py`).
"""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from msdist.base.errors import DataError
from msdist.data.pipeline import IMAGE_EXTENSIONS, TEST_SPLIT, TRAIN_SPLIT, is_image
from msdist.data.verdict import BadFile, bad_files

SPLITS = (TRAIN_SPLIT, TEST_SPLIT)
TINY_CLASS = 10        # default: flag classes with fewer usable images
_SHOWN = 3             # files named in a one-line error before "and N more"


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
class Tree:
    classes: Dict[str, Tuple[str, ...]]            # split -> class folder names, sorted
    entries: Dict[str, Tuple[str, ...]]            # "split/class" relpath -> entry names, sorted
    stray: Tuple[str, ...]                         # non-folder entries directly inside a split
    missing: Tuple[str, ...]                       # splits that are not folders


def _listdir(path: str) -> Tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError as e:
        raise DataError(f"cannot list {path} ({e.strerror}); check its permissions") from None


def _walk(root: str) -> Tree:
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
    return Tree(classes, entries, tuple(stray), tuple(missing))


def image_relpaths(tree: Tree) -> List[str]:
    return sorted(os.path.join(folder, name) for folder, names in tree.entries.items() for name in names
                  if is_image(name))


def image_files(data_dir: str) -> List[str]:
    """Every file training would read (image names in class folders), relative and sorted."""
    return image_relpaths(_walk(data_dir))


# ---------------------------------------------------------------- the scan

def scan(data_dir: str, workers: int = 0) -> Report:
    """Check every entry of the tree at `data_dir`, decoding every image for real.

    Args:
        data_dir: ImageFolder root holding Training/ and Test/.
        workers: decoding threads; 0 picks one per usable core (at most 8).

    Raises:
        DataError: only when `data_dir` itself (or a folder in it) cannot be listed.
    """
    tree = walk_root(data_dir)
    return report_of(tree, bad_files(data_dir, image_relpaths(tree), workers))


def walk_root(data_dir: str) -> Tree:
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir {data_dir!r} does not exist or is not a folder")
    return _walk(data_dir)


def report_of(tree: Tree, bad: Sequence[BadFile]) -> Report:
    """The whole tree's report, given every bad file."""
    ignored = list(tree.stray) + sorted(os.path.join(folder, name) for folder, names in tree.entries.items()
                                        for name in names if not is_image(name))
    counts = _usable_counts(tree, {b.path for b in bad})
    return Report(counts, tuple(bad), tuple(ignored), tuple(_tree_problems(tree, counts)),
                  tuple(_tree_warnings(tree)))


def _usable_counts(tree: Tree, bad: set) -> Dict[str, Dict[str, int]]:
    return {split: {cls: sum(1 for name in tree.entries[os.path.join(split, cls)]
                             if is_image(name) and os.path.join(split, cls, name) not in bad)
                    for cls in tree.classes[split]}
            for split in SPLITS}


def _tree_problems(tree: Tree, counts: Dict[str, Dict[str, int]]) -> List[str]:
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


def _tree_warnings(tree: Tree) -> List[str]:
    untested = sorted(set(tree.classes[TRAIN_SPLIT]) - set(tree.classes[TEST_SPLIT]))
    if not untested or tree.missing:
        return []
    return [f"{TRAIN_SPLIT}/ classes missing from {TEST_SPLIT}/: {', '.join(untested)}; they are trained on but "
            f"never evaluated (labels stay aligned); add {TEST_SPLIT}/<class>/ images to evaluate them"]


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
