"""The noise floor of a per-step equivalence check, measured in this process (benchmarks/equivalence.py and
tests/integration/test_equivalence.py import it; it is not part of msdist).

"N ranks train the same model as one card" is checked by comparing weights after a few steps. How
close they can be is not a fixed number: it depends on the model and the images. Two correct
single-card BatchNorm implementations, MindSpore's fused kernel and msdist's (`SyncBatchNorm2d`
over one process: its own statistics from exact sums, then normalization and gradient kernels), run
the same steps from the same weights on the same batches here; the gap between them is what float
rounding alone produces. An N-rank gap is judged next to it.
"""
from typing import Dict, List, Sequence

import numpy as np

BN_KINDS = ("mindspore", "msdist")


def state_of(net, optimizer) -> Dict[str, np.ndarray]:
    """Parameters and momentum buffers by checkpoint name, as float64 (the test's load_params layout)."""
    return {p.name: p.asnumpy().astype(np.float64) for p in list(net.get_parameters()) + list(optimizer.moments)}


def single_card_states(data_dir: str, model: str, image_size: int, batch_size: int, at_steps: Sequence[int],
                       lr: float, seed: int = 1, momentum: float = 0.9, weight_decay: float = 1e-4,
                       loss_scale: float = 1024.0, crop_padding: int = 4) -> Dict[str, List[Dict[str, np.ndarray]]]:
    """Train one card with each BatchNorm kind, as `msdist.train --augment false --shuffle true
    --lr_schedule constant` does, and keep the state after each of `at_steps`.

    Call after MindSpore's context is set (GRAPH_MODE, CPU, deterministic).

    Returns:
        {"mindspore": [state at each step], "msdist": [...]}; states as `state_of`.
    """
    return {kind: _train(kind, data_dir, model, image_size, batch_size, sorted(at_steps), lr, seed, momentum,
                         weight_decay, loss_scale, crop_padding) for kind in BN_KINDS}


def _train(kind, data_dir, model, image_size, batch_size, at_steps, lr, seed, momentum, weight_decay, loss_scale,
           crop_padding):
    import mindspore as ms

    from msdist.engine import optim, precision, step
    from msdist.data import pipeline, plan
    from msdist.engine.loss_scale import LossScaler
    from msdist.engine.sync_bn import replace_batchnorm

    classes = pipeline.class_map(data_dir)
    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, classes)
    steps_per_epoch = plan.steps_per_epoch(len(split), batch_size)
    ms.set_seed(seed)  # as train: identical initial weights for both kinds
    np.random.seed(seed)
    net = step.build_network(model, len(classes), False, False, 1)
    if kind == "msdist":
        replace_batchnorm(net, world_size=1)
    lrs = optim.lr_schedule("constant", lr, at_steps[-1] // steps_per_epoch + 1, steps_per_epoch)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, momentum, weight_decay)
    scaler = LossScaler(precision.LossScalePlan(dynamic=False, initial=loss_scale), world_size=1)
    step_cell = step.TrainStep(net, step.create_loss(soft_labels=False), optimizer, scaler)
    step_cell.set_train(True)
    states, done, epoch = [], 0, 0
    while done < at_steps[-1]:
        spec = pipeline.TrainInput(image_size=image_size, global_batch=batch_size, seed=seed, shuffle=True,
                                   augment=False, padding=crop_padding, workers=1)
        data = pipeline.build_train_dataset(split, spec, epoch)
        for images, labels in data.create_tuple_iterator(num_epochs=1):
            step_cell.train_on(images, labels)
            done += 1
            if done in at_steps:
                states.append(state_of(net, optimizer))
            if done == at_steps[-1]:
                break
        epoch += 1
    return states
