"""The scheduler's generation in a job of several nodes: node 0 names each scheduler it starts, so that the
other nodes' launchers, restarting, never join the previous attempt's scheduler while it is still dying.
A token in the shared log dir, written and read by msdist.launch only (msdist.launcher.supervisor).
When node 0's launcher ends for good it replaces the token with its exit status, so that a node restarting
then (its rank died after node 0's ranks had finished the job, or node 0 gave up) ends at once instead of
waiting --stall_startup_timeout for a scheduler that will never come.
"""
import os
import time
import uuid

from msdist.base.files import atomic_write_text


def _generation_path(log_dir: str) -> str:
    return os.path.join(log_dir, "scheduler.generation")


def read_generation(log_dir: str) -> str:
    """The token of the scheduler node 0 started last ("" before the first)."""
    try:
        with open(_generation_path(log_dir), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def new_generation(log_dir: str) -> None:
    """Node 0, before each scheduler starts: a fresh token in the shared log dir, so that other nodes
    restarting never join the previous attempt's scheduler while it is still dying."""
    atomic_write_text(_generation_path(log_dir), uuid.uuid4().hex)


_ENDED = "ended "


class NodeZeroEnded(Exception):
    """Node 0's launcher ended (with `code`) while this node waited to restart."""

    def __init__(self, code: int):
        self.code = code
        super().__init__("node 0's launcher finished the job (exit 0) while this node restarted: nothing is left "
                         "to run" if code == 0 else
                         f"node 0's launcher ended with exit {code} while this node restarted: see its output")


def mark_ended(log_dir: str, code: int) -> None:
    """Node 0, once its launcher's outcome is final (`code`, its exit status)."""
    atomic_write_text(_generation_path(log_dir), f"{_ENDED}{code}")


def wait_for_new_generation(log_dir: str, joined: str, timeout_s: float) -> None:
    """Other nodes, before a restart: wait until node 0 has started a scheduler newer than `joined`; raises
    NodeZeroEnded if node 0's launcher ended instead."""
    deadline = time.monotonic() + timeout_s
    while (token := read_generation(log_dir)) == joined:
        if time.monotonic() > deadline:
            raise RuntimeError(f"node 0 did not start a new scheduler within {timeout_s:.0f} s")
        time.sleep(0.2)
    if token.startswith(_ENDED):
        raise NodeZeroEnded(int(token[len(_ENDED):]))
