"""The compiled train step and evaluation."""
import numpy as np
import mindspore as ms
from mindspore import nn, ops


class TrainStep(nn.Cell):
    """Forward, backward with a fixed loss scale, gradient reduction over ranks, optimizer update.

    Args:
        net: the model.
        loss_fn: loss cell (logits, labels) -> scalar.
        optimizer: its `loss_scale` must equal `loss_scale` here (it unscales the gradients).
        loss_scale: the fixed scale the loss is multiplied by before backward.
        reducer: cell mapping the gradient tuple to its cross-rank mean; None on a single rank.
    """

    def __init__(self, net, loss_fn, optimizer, loss_scale: float, reducer=None):
        super().__init__(auto_prefix=False)
        self.net_with_loss = nn.WithLossCell(net, loss_fn)
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.loss_scale = loss_scale
        self.reducer = reducer

    def construct(self, images, labels):
        loss = self.net_with_loss(images, labels)
        sens = ops.fill(loss.dtype, loss.shape, self.loss_scale)
        grads = self.grad(self.net_with_loss, self.weights)(images, labels, sens)
        if self.reducer is not None:
            grads = self.reducer(grads)
        return ops.depend(loss, self.optimizer(grads))


def default_reducer(params, world_size: int):
    """MindSpore's own fused data-parallel all-reduce (mean); None when there is nothing to reduce."""
    if world_size == 1:
        return None
    return nn.DistributedGradReducer(params, mean=True, degree=world_size)


def cross_entropy_sum(logits: np.ndarray, labels: np.ndarray) -> float:
    """Summed softmax cross-entropy on the host, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].sum())


def evaluate(net, dataset, batch_size: int, collectives) -> dict:
    """Exact accuracy over the whole Test set: each rank counts its shard, integer counts are summed.

    A short last batch is zero-padded up to `batch_size` so the graph compiles once; the padded
    rows are never counted.
    """
    net.set_train(False)
    correct = seen = 0
    loss_sum = 0.0
    for images, labels in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True):
        n = len(labels)
        if n < batch_size:
            images = np.concatenate([images, np.zeros((batch_size - n,) + images.shape[1:], images.dtype)])
        logits = net(ms.Tensor(images)).asnumpy()[:n]
        correct += int((logits.argmax(axis=1) == labels).sum())
        seen += n
        loss_sum += cross_entropy_sum(logits, labels)
    net.set_train(True)
    correct, seen, loss_sum = collectives.sum([correct, seen, loss_sum])
    return {"accuracy": correct / seen if seen else 0.0, "num_samples": int(seen), "correct": int(correct),
            "loss": loss_sum / seen if seen else float("nan")}
