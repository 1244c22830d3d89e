"""One run: its options and start-up, checkpoints, monitoring, and the model outside training.

Imports from msdist.engine, msdist.data, msdist.rank and msdist.cluster; the `python -m msdist.*` faces import
from here.
"""
