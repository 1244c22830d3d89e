"""`python tests/train_with_test_models.py ARGS`: `msdist.train` with the test-only models and faults.

convnet_tiny (tests/convnet.py) is a BatchNorm-free model for exactness tests; it is not a product
model, so only this wrapper registers it. With MSDIST_TEST_OVERFLOW="RANK:STEP" set, rank RANK's
gradients of global step STEP are made infinite (tests/overflow.py); with MSDIST_TEST_HANG_WRITE="RANK:STEP",
rank RANK's background write of global step STEP hangs half-written (tests/write_fault.py); with
MSDIST_TEST_SLOW_INPUT="RANK:SECONDS:FROM", rank RANK's batches arrive SECONDS late from its FROM-th on
(tests/slow_input.py). Everything else is the real trainer.
"""
import os

from models import add_family

add_family("convnet")  # tests/ is sys.path[0] when this file runs as a script

from msdist.run import build  # noqa: E402  (after the registration; MindSpore-free)
from msdist.train import main  # noqa: E402


def _build_model_with_overflow(run, dist, data, rt, _build=build.build_model):
    import overflow  # imports MindSpore, which start-up has prepared by now
    overflow.install(os.environ[overflow.ENV], dist.rank)
    return _build(run, dist, data, rt)


if os.environ.get("MSDIST_TEST_OVERFLOW"):
    build.build_model = _build_model_with_overflow
if os.environ.get("MSDIST_TEST_SLOW_INPUT"):
    import slow_input
    slow_input.install(os.environ[slow_input.ENV])
if os.environ.get("MSDIST_TEST_HANG_WRITE"):
    import write_fault
    write_fault.install(os.environ[write_fault.ENV])

raise SystemExit(main())
