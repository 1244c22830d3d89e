"""The claim of each elastic membership: one file per generation in the shared log dir, created exclusively, so
that two sides of a network partition can never both go on under one generation (msdist.launcher.elastic).

The file server decides, not a host's cache. NFS may tell a host for acdirmin..acdirmax (30-60 s by default)
that a file another host has just created does not exist (stat, open), but an exclusive create (O_CREAT |
O_EXCL: NFSv3 CREATE EXCLUSIVE, NFSv4 OPEN EXCLUSIVE) is answered by the server. So a membership is claimed, and
a node checks that it shares the directory, by an exclusive create; only reading another node's claim
(`claimed_after`, a partition's other side) may lag by that cache.
"""
import json
import os
from typing import Optional

from msdist.base.errors import ConfigError
from msdist.launcher.membership import View


def _path(log_dir: str, view: View) -> str:
    return os.path.join(log_dir, "membership", f"{view.job}-{view.generation}.json")


def _create_exclusively(path: str) -> Optional[int]:
    """A new file's descriptor, or None if `path` exists (as the file server knows it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None


def claim(log_dir: str, view: View) -> bool:
    """Claim generation `view.generation` for `view`, once for the job: False if another node claimed it."""
    fd = _create_exclusively(_path(log_dir, view))
    if fd is None:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(view.as_dict(), f)
    return True


def claimed_after(log_dir: str, view: View) -> Optional[View]:
    """The view claimed for the generation after `view`'s, if any node claimed it (and this host sees it)."""
    try:
        with open(_path(log_dir, View(view.job, view.generation + 1, ())), encoding="utf-8") as f:
            return View.from_dict(json.load(f))
    except (OSError, ValueError, KeyError):
        return None   # none, or still being written


def check_shared(log_dir: str, output_dir: str, view: View) -> None:
    """The claim of `view` must be in this node's log dir too: elastic restarts need one shared --output_dir.

    Every node hears of a view only after its claim was made, so where the directory is shared an exclusive
    create of the claim's name fails, whatever this host's cache shows.

    Raises:
        ConfigError: the create succeeded (it is undone): this node's --output_dir is not node 0's.
    """
    path = _path(log_dir, view)
    fd = _create_exclusively(path)
    if fd is None:
        return
    os.close(fd)
    os.remove(path)
    raise ConfigError(f"--output_dir {output_dir} is not the one node 0 ({view.scheduler_host}) writes to: an elastic "
                      "job needs storage every node sees")
