"""torch-named weight files for the --pretrained tests: msdist's own ResNet parameters written under
torchvision's and timm's names (safetensors, no torch needed)."""
import re

import numpy as np


_TORCH_BN = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}


def _torch_name(name: str) -> str:
    """An msdist ResNet parameter name as torchvision and timm write it."""
    name = re.sub(r"^stem\.0\.", "conv1.", re.sub(r"^stem\.1\.", "bn1.", name))
    name = re.sub(r"^stages\.(\d)\.", lambda m: f"layer{int(m[1]) + 1}.", name)
    name = name.replace(".downsample.conv.", ".downsample.0.").replace(".downsample.bn.", ".downsample.1.")
    return re.sub(r"\.(gamma|beta|moving_mean|moving_variance)$", lambda m: "." + _TORCH_BN[m[1]], name)


def _write_torch_named(params: dict, path, extra=None) -> None:
    """{msdist name: array} as a torch-named .safetensors file, BatchNorm counters included as torch saves them."""
    from safetensors.numpy import save_file
    tensors = {_torch_name(name): np.ascontiguousarray(value) for name, value in params.items()}
    for name in [n for n in tensors if n.endswith(".running_var")]:
        tensors[name.replace(".running_var", ".num_batches_tracked")] = np.array(1000, np.int64)
    save_file({**tensors, **(extra or {})}, str(path))


def _model_params(model: str, num_classes: int, seed: int = 3) -> dict:
    import mindspore as ms
    from models import create_model
    ms.set_seed(seed)
    rng = np.random.default_rng(seed)
    params = {}
    for param in create_model(model, num_classes).get_parameters():
        value = param.asnumpy()
        if "moving_" in param.name:  # statistics a fresh model would not have
            value = rng.random(value.shape, dtype=np.float32) + 0.5
        params[param.name] = value
    return params
