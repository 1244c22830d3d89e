"""Logging set-up: the standard `logging` tree, configured once per process. Every rank writes its own log
file (`base.files.rank_log_path`), rank 0 also speaks on stdout."""
import logging
import os
import sys

from msdist.base.files import rank_log_path

_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(message)s"


def _console_wanted(record: logging.LogRecord) -> bool:
    # Step lines pass `extra={"console": False}` while the progress bar owns the terminal.
    return getattr(record, "console", True)


def setup_logging(log_dir: str, rank: int, console: bool, name: str = "rank") -> str:
    """Send msdist's log to `{log_dir}/{name}_{rank}.log`, and to stdout on the console rank.

    Returns:
        The log file path.
    """
    os.makedirs(log_dir, exist_ok=True)
    path = rank_log_path(log_dir, rank, name)
    root = logging.getLogger("msdist")
    root.handlers.clear()
    root.setLevel(logging.INFO)
    root.propagate = False
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), "%H:%M:%S"))
    root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(logging.Formatter("%(message)s"))
        stream.addFilter(_console_wanted)
        root.addHandler(stream)
    crash = logging.getLogger("msdist.crash")
    crash.handlers = [file_handler]
    crash.propagate = False
    return path
