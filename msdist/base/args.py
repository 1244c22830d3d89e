"""Command-line plumbing every face shares: one ArgumentParser, one boolean, one positive_int.

A leaf (imports nothing of msdist but the error family), so every layer's face may use it: a bad
command line is one `ConfigError` line (exit status 2 through `cli_main`) whichever face reads it.
"""
import argparse

from msdist.base.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, no usage block) instead of printing and exiting.

    Every msdist CLI uses it, so `cli_main` reports all bad command lines the same way.
    """

    def error(self, message):
        raise ConfigError(message)


def boolean(text: str) -> bool:
    """`true/false` (also yes/no, on/off, 1/0) from the command line or YAML."""
    low = str(text).strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is below 1")
    return value
