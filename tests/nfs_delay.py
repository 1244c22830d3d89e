"""An NFS client's view of the elastic launchers' claim files, for the tests: nothing here is imported by msdist.

NFS caches a directory's attributes for acdirmin (30 s by default) up to acdirmax (60 s): a host that looked up a
name a moment ago may be told for that long that a file another host has just created there does not exist. With
MSDIST_TEST_NFS_DELAY=S, a launcher started through tests/launch_with_nfs_delay.py sees a file under
logs/membership/ that another process wrote (its mtime) only S seconds later, through stat (os.path.exists) and
open for reading alike. Files it created itself it sees at once, and an exclusive create (O_CREAT | O_EXCL) is
answered by the real file system, as NFS's server decides it.
"""
import builtins
import errno
import os
import sys
import time

ENV = "MSDIST_TEST_NFS_DELAY"
_WHERE = f"{os.sep}logs{os.sep}membership{os.sep}"


def install(delay_s: float) -> None:
    own = set()
    real_stat, real_open, real_os_open = os.stat, builtins.open, os.open

    def hidden(path) -> bool:
        try:
            name = os.fsdecode(os.fspath(path))
        except TypeError:
            return False   # a file descriptor
        if _WHERE not in name or os.path.abspath(name) in own:
            return False
        try:
            written = real_stat(name).st_mtime
        except OSError:
            return False
        if time.time() - written >= delay_s:
            return False
        print(f"nfs_delay: {name} not visible here yet", file=sys.stderr, flush=True)
        return True

    def stat(path, *args, **kwargs):
        if hidden(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return real_stat(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if not set(mode) & set("wax+") and hidden(file):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT:
            own.add(os.path.abspath(os.fsdecode(path)))
        return fd

    os.stat, builtins.open, os.open = stat, open_, os_open
