"""`python tests/train_with_test_models.py ARGS`: `msdist.train` with the test-only models known too.

convnet_tiny (tests/convnet.py) is a BatchNorm-free model for exactness tests; it is not a product
model, so only this wrapper registers it. Everything else is the real trainer.
"""
from models import add_family

add_family("convnet", ("convnet_tiny",))  # tests/ is sys.path[0] when this file runs as a script

from msdist.train import main  # noqa: E402  (after the registration, which must not load MindSpore)

raise SystemExit(main())
