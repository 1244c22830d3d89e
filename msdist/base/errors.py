"""User-facing errors: what a user can fix, named in one line (`cli.cli_main` reports them).

A leaf: it imports nothing of msdist, so every layer can raise these.
"""
import contextlib


class UserError(Exception):
    """Something the user can fix; the message names the problem and the fix.

    `alike` is set where every rank of a job finds the same problem in the same inputs (options, paths,
    the data tree): then one rank per host reports it instead of every rank (see `cli_main`).
    """
    alike = False


@contextlib.contextmanager
def alike_on_every_rank():
    """Mark the UserErrors raised inside as ones every rank finds alike (deterministic checks of shared inputs)."""
    try:
        yield
    except UserError as e:
        e.alike = True
        raise


class ConfigError(UserError):
    """A bad option, config file or value."""


class DataError(UserError, ValueError):
    """A data tree that cannot be used as given."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used."""


class NonFiniteError(UserError):
    """Training met an inf or NaN it may not skip (a fixed loss scale); the options or the data must change."""


def first_line(message: str) -> str:
    """The first informative line of an error message (MindSpore's start with rulers and headings)."""
    for line in message.splitlines():
        line = line.strip()
        if any(c.isalnum() for c in line) and not line.startswith("- "):
            return line
    return ""
