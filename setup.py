"""msdist: MindSpore graph-mode data-parallel training for image classification."""
import os

from setuptools import find_packages, setup

_here = os.path.dirname(os.path.abspath(__file__))
_version = {}
with open(os.path.join(_here, "msdist", "version.py"), encoding="utf-8") as f:
    exec(f.read(), _version)

setup(
    name="msdist",
    version=_version["__version__"],
    description="MindSpore graph-mode data-parallel training for image classification",
    packages=find_packages(include=["msdist", "msdist.*", "models", "models.*"]),
    python_requires=">=3.9",
    # mindspore is not pinned: its wheels are device-specific (CPU / GPU / Ascend builds).
    install_requires=["mindspore", "numpy", "scipy", "pillow", "pyyaml"],
    extras_require={
        # tensorboard: its event reader checks our files; onnxruntime: runs the exported ONNX model
        "test": ["pytest", "hypothesis", "tensorboard", "onnxruntime"],
        "tensorboard": ["tensorboardX"],
        "report": ["matplotlib"],
        "bench": ["torch==2.13.0"],  # benchmarks/throughput.py's PyTorch reference row
    },
)
