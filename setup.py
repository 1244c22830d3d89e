"""msdist: MindSpore graph-mode data-parallel training for image classification."""
import os
import re

from setuptools import find_packages, setup

_here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_here, "msdist", "__init__.py"), encoding="utf-8") as f:
    _version = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

setup(
    name="msdist",
    version=_version,
    description="MindSpore graph-mode data-parallel training for image classification",
    packages=find_packages(include=["msdist", "msdist.*", "models", "models.*"]),
    # --classes imagenet: the 1000 ImageNet-1k class names, read without torch
    package_data={"msdist.run": ["imagenet_classes.txt"]},
    python_requires=">=3.9",
    # mindspore is not pinned: its wheels are device-specific (CPU / GPU / Ascend builds).
    # safetensors: --pretrained reads timm's and torchvision's .safetensors files (NumPy, no torch).
    install_requires=["mindspore", "numpy", "scipy", "pillow", "pyyaml", "safetensors", "tqdm"],
    extras_require={
        # tensorboard: its event reader checks our files; onnxruntime: runs the exported ONNX model;
        # import-linter: the layer contracts in .importlinter (tests/unit/test_layout.py)
        "test": ["pytest", "hypothesis", "tensorboard", "onnxruntime", "import-linter"],
        "tensorboard": ["tensorboardX"],
        "report": ["matplotlib"],
        # The references, never runtime dependencies (`pip install torch` can pull the multi-GB CUDA build):
        # torchvision's own ResNets prove msdist computes what torch computes (tests/*/test_torch_weights.py),
        # torch reads .pth files for --pretrained and gives benchmarks/throughput.py its PyTorch row.
        "reference": ["torch==2.13.0", "torchvision==0.28.0"],
    },
)
