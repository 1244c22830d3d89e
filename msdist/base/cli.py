"""The wrapper of every `python -m msdist.*` main: a UserError becomes one line and exit status 2, a crash one
line (the traceback goes to the rank's log) and exit status 1."""
import functools
import logging
import os
import sys

from msdist.base import launch_env
from msdist.base.errors import UserError, first_line

# Configured by run/logs.setup_logging to reach the rank's log file only, never the console.
_crash_logger = logging.getLogger("msdist.crash")


def _reports_for_its_host() -> bool:
    """Rank 0, and local rank 0 of every other host (whose files may differ from rank 0's)."""
    launch = launch_env.detect_launch()  # environment only, no MindSpore
    if launch.rank == 0:
        return True
    return launch.local_world_size < launch.world_size and launch.local_rank == 0


# Called with the exception before a crash is reported; one may end the process with a better account
# (distributed: rank 0 waits for MindSpore's scheduler to name the rank its cluster timed out).
# Global because it is process-wide by nature: the hook is registered deep inside distributed init,
# and `cli_main` wraps the face's main() from outside; nothing passes between the two but the process.
_CRASH_HOOKS = []


def add_crash_hook(hook) -> None:
    _CRASH_HOOKS.append(hook)


def whole_lines() -> None:
    """Make each console line one write(2), even under PYTHONUNBUFFERED=1 (common in containers).

    Unbuffered, print() writes the text and its newline in two calls, so under mpirun and msrun, which merge
    every rank's output into one stream, another rank's line can land between them: two lines become one.
    Line buffering writes a line whole (a pipe keeps a write of up to 4 KiB whole) and still shows it at once.
    Several lines in one print flush before print's own newline: end the text with it (`end=""`) to keep them whole.
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a caller may have put an io.StringIO there: nothing to set
            stream.reconfigure(line_buffering=True, write_through=False)


def cli_main(func):
    """Wrap a CLI main: UserError -> `msdist: error: ...` and exit 2; a crash -> one line, traceback to the log.

    The full traceback of an unexpected error is written to the msdist log (the rank's log file
    once logging is set up), so nothing is lost while the console stays readable.
    """
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        whole_lines()
        try:
            return func(*args, **kwargs)
        except UserError as e:
            if e.alike and not _reports_for_its_host():
                raise SystemExit(2) from None  # its host's reporting rank prints the same line
            # To the rank's log file only: the console gets the one line below. Before logging is set
            # up there is no handler, and logging's last-resort handler would print a second line.
            if _crash_logger.hasHandlers():
                _crash_logger.error("error: %s", e)
            print(f"msdist: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            print("msdist: interrupted", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
            _crash_logger.exception("unhandled error")
            for hook in _CRASH_HOOKS:
                hook(e)
            where = next((h.baseFilename for h in _crash_logger.handlers if hasattr(h, "baseFilename")), None)
            first = first_line(str(e))
            hint = f"; full traceback in {where}" if where else ""
            # The rank label: under mpirun the console mixes every rank's lines.
            print(f"msdist: {type(e).__name__}: {first}{launch_env.rank_label(os.environ)}{hint}", file=sys.stderr, flush=True)
            if where is None:
                raise
            raise SystemExit(1) from None
    return wrapper
