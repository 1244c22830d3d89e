"""msdist: MindSpore graph-mode data-parallel training for image classification."""
from msdist.version import __version__

__all__ = ["__version__"]
