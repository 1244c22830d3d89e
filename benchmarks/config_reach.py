"""How far the training config namespace reaches into msdist: `python benchmarks/config_reach.py [DATA_DIR]`.

Runs `msdist.train` in this process (one rank, CPU, the tiny test recipe, 2 steps) under a profile hook and
records every msdist function whose frame, when it returns, holds the namespace `config.parse` made (that very
object, as an argument or a variable). It prints:
  * hops from argv to the built model: the function calls holding the namespace from `main(argv)` until
    `build.build_model` returns, with the distinct functions and modules they are;
  * places reading the config outside start-up: the distinct functions holding it after `startup.start` returned
    (the join, the build, the Trainer, the face's own wiring), for the whole run. docs/architecture.md keeps the
    figures (target 0).
"""
import argparse
import os
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from msdist.rank import runtime  # noqa: E402  after the path: this checkout's msdist

PACKAGE = os.path.join(REPO, "msdist") + os.sep
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


class Reach:
    """The profile hook: which msdist functions held the namespace, and when."""

    def __init__(self):
        self.namespace = None         # what config.parse returned
        self.phase = "start-up"       # -> "build" once startup.start returns -> "run" once build_model returns
        self.to_model = []            # (module, function) per call holding the namespace, up to the built model
        self.after_start = Counter()  # (module, function) -> calls, after start-up

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if event != "return" or not code.co_filename.startswith(PACKAGE) or code.co_name in COMPREHENSIONS:
            return  # a comprehension is a frame of its own on Python 3.11 only: part of its function's place
        where = (os.path.relpath(code.co_filename, PACKAGE), code.co_qualname)
        if where == ("run/config.py", "parse") and isinstance(arg, argparse.Namespace) and self.namespace is None:
            self.namespace = arg
        if self.namespace is not None and any(v is self.namespace for v in frame.f_locals.values()):
            if self.phase != "run":
                self.to_model.append(where)
            if self.phase != "start-up":
                self.after_start[where] += 1
        if where == ("run/startup.py", "start"):
            self.phase = "build"
        elif where == ("run/build.py", "build_model"):
            self.phase = "run"


def main(data_dir: str) -> None:
    from msdist import train
    runtime.exit_without_teardown = lambda code: code  # the face ends its process; this one must report
    reach = Reach()
    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", os.path.join(REPO, "configs", "tiny_test.yaml"), "--data_dir", data_dir,
                "--output_dir", out, "--device_target", "CPU", "--epochs", "1", "--max_steps", "2"]
        sys.setprofile(reach)
        try:
            status = train.main(argv)
        finally:
            sys.setprofile(None)
    assert status == 0, f"msdist.train exited with {status}"
    distinct = sorted(set(reach.to_model))
    print(f"hops from argv to the built model: {len(reach.to_model)} calls holding the config, "
          f"{len(distinct)} functions in {len({m for m, _ in distinct})} modules")
    for (module, function), calls in sorted(Counter(reach.to_model).items()):
        print(f"  {module}:{function} x{calls}")
    print(f"places reading the config outside start-up: {len(reach.after_start)}")
    for (module, function), calls in sorted(reach.after_start.items()):
        print(f"  {module}:{function} x{calls}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "tests", "data", "fruits360-mini"))
