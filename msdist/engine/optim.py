"""Learning-rate schedules and the optimizer."""
import math

import numpy as np

# The names nn.Momentum gives its own state: `moments.<parameter name>` and the step counter, whose
# value is the learning-rate schedule's position.
MOMENTS_PREFIX = "moments."
STATE_PREFIXES = (MOMENTS_PREFIX, "global_step")


def lr_schedule(kind: str, base_lr: float, epochs: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
                step_size: int = 3, gamma: float = 0.1, min_lr: float = 0.0) -> np.ndarray:
    """The learning rate of every optimizer step of the run (float32, length epochs * steps_per_epoch).

    Linear warmup from ~0 to `base_lr` over `warmup_epochs`, then constant, step decay (x `gamma`
    every `step_size` epochs) or cosine decay to `min_lr` (Goyal et al., Loshchilov & Hutter).
    """
    total = epochs * steps_per_epoch
    warmup = min(total, int(round(warmup_epochs * steps_per_epoch)))
    lrs = np.empty(total, dtype=np.float64)
    for t in range(total):
        if t < warmup:
            lrs[t] = base_lr * (t + 1) / warmup
        elif kind == "constant":
            lrs[t] = base_lr
        elif kind == "step":
            lrs[t] = base_lr * gamma ** ((t // steps_per_epoch) // step_size)
        elif kind == "cosine":
            progress = (t - warmup) / max(1, total - warmup)
            lrs[t] = min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown lr schedule {kind!r}")
    return lrs.astype(np.float32)


def param_groups(params, weight_decay: float, lrs: np.ndarray = None, backbone_lr_scale: float = 1.0,
                 head_prefix: str = "fc.") -> list:
    """Decay conv and dense weights only; BatchNorm parameters and biases are left alone.

    With `backbone_lr_scale` != 1, every parameter outside the classifier (`head_prefix`) follows the
    schedule `lrs` times that scale; the classifier follows `lrs` itself. The last group, `order_params`,
    keeps the optimizer's parameter list (and so the gradient tuple) in network order, as MindSpore's
    model zoo does (mindspore-ai/models official/cv/ResNet/src/util.py:25-36): without it MindSpore lists
    the groups one after the other (nn/optim/optimizer.py:612-617), and a gradient bucket of consecutive
    parameters would mix the first and the last layers.
    """
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if backbone_lr_scale == 1.0:
        return groups + [{"order_params": params}]
    import mindspore as ms
    split = []
    for group in groups:
        for in_head, scale in ((True, 1.0), (False, backbone_lr_scale)):
            chosen = [p for p in group["params"] if p.name.startswith(head_prefix) == in_head]
            if chosen:
                split.append({**group, "params": chosen, "lr": ms.Tensor((lrs * scale).astype(np.float32))})
    return split + [{"order_params": params}]


def create_optimizer(params, lrs: np.ndarray, momentum: float, weight_decay: float, backbone_lr_scale: float = 1.0,
                     head_prefix: str = "fc."):
    """SGD with momentum following the per-step schedule `lrs` (position kept in `global_step`); a step can be
    skipped on the device (`momentum.Momentum.step_unless`).

    Gradients reach it already unscaled (`step.ScaledUpdate`), so its own `loss_scale` stays 1.
    `backbone_lr_scale` scales the learning rate of everything outside the classifier (`head_prefix`).
    """
    import mindspore as ms
    from msdist.engine.momentum import Momentum
    return Momentum(param_groups(params, weight_decay, lrs, backbone_lr_scale, head_prefix),
                    learning_rate=ms.Tensor(lrs), momentum=momentum)


def state_parameters(optimizer) -> list:
    """The optimizer's moments and step counter (named under STATE_PREFIXES): what an exact resume needs of it."""
    return list(optimizer.moments) + [optimizer.global_step]
