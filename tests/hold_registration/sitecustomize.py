"""Test-only (tests/integration/test_unregistered_rank.py): hold one rank back before it can register with MindSpore's
scheduler, the deterministic stand-in for the start-up race of issue #34. Nothing in msdist imports this.

With this folder on PYTHONPATH, Python runs this file at start-up in every process. Given
MSDIST_TEST_HOLD="RANK:SECONDS:MARKER", the first worker process of rank RANK (MS_NODE_ID under
msdist.launch, OMPI_COMM_WORLD_RANK under mpirun, RANK_ID under msrun) creates MARKER and sleeps
SECONDS; a rank started again afterwards (a respawn) finds MARKER and goes on. Where it sleeps:
MSDIST_TEST_HOLD_AT="start" (the default), before anything else runs, so the rank never reaches the local
ranks' start-up exchange either; "join", in `mindspore.communication.init` (where a rank registers), after
every start-up step before it, as the race leaves a rank.
"""
import importlib.abc
import importlib.util
import os
import sys
import time

_JOIN_MODULE = "mindspore.communication"


def _rank() -> str:
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return ""
    for name in ("MS_NODE_ID", "OMPI_COMM_WORLD_RANK", "RANK_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return ""


def _hold(seconds: float, marker: str) -> None:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    time.sleep(seconds)


class _HoldAtJoin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads `mindspore.communication` as usual, then makes its `init` hold first."""

    def __init__(self, seconds: float, marker: str):
        self.seconds, self.marker, self.spec = seconds, marker, None

    def find_spec(self, fullname, path, target=None):
        if fullname != _JOIN_MODULE or self.spec is not None:
            return None
        sys.meta_path.remove(self)
        self.spec = importlib.util.find_spec(fullname)
        return importlib.util.spec_from_loader(fullname, self, origin=self.spec.origin, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__spec__ = self.spec
        module.__path__ = self.spec.submodule_search_locations
        module.__file__ = self.spec.origin
        self.spec.loader.exec_module(module)
        init = module.init

        def held_init(*args, **kwargs):
            _hold(self.seconds, self.marker)
            return init(*args, **kwargs)

        module.init = held_init


def _install() -> None:
    spec = os.environ.get("MSDIST_TEST_HOLD", "")
    if not spec:
        return
    rank, seconds, marker = spec.split(":", 2)
    if _rank() != rank:
        return
    if os.environ.get("MSDIST_TEST_HOLD_AT", "start") == "join":
        sys.meta_path.insert(0, _HoldAtJoin(float(seconds), marker))
    else:
        _hold(float(seconds), marker)


_install()
