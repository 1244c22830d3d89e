"""Writing files so that a reader (another rank, the launcher, a resumed run) never sees half of one."""
import os


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: str, final: str) -> None:
    """Move a finished `tmp` over `final`, on disk before and after the rename (survives a power cut)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")


def atomic_write_text(path: str, text: str, durable: bool = False) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old file or the new one.

    Args:
        durable: also fsync the file and its folder (checkpoint sidecars); off for files rewritten
            often whose loss only costs a retry (heartbeats, caches).
    """
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: ranks sharing a folder never write the same tmp
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    if durable:
        replace_durably(tmp, path)
    else:
        os.replace(tmp, path)


def rank_log_path(log_dir: str, rank: int, name: str = "rank") -> str:
    """A rank's msdist log file, `{log_dir}/{name}_{rank}.log`.

    The one naming rule for the process that writes it (run/logs.py) and those that append to it or point to
    it (the watchdog's stack dumps, msdist.check --plan); here because this is the lowest layer they share.
    """
    return os.path.join(log_dir, f"{name}_{rank}.log")
