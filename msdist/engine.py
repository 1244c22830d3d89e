"""The network and the compiled train step."""
from mindspore import nn, ops


class TrainStep(nn.Cell):
    """Forward, backward with a fixed loss scale, gradient reduction over ranks, optimizer update.

    Args:
        net: the model.
        loss_fn: loss cell (logits, labels) -> scalar.
        optimizer: its `loss_scale` must equal `loss_scale` here (it unscales the gradients).
        loss_scale: the fixed scale the loss is multiplied by before backward.
        reducer: cell mapping the gradient tuple to its cross-rank mean (`comm.create_reducer`); None on
            a single rank.
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

    def train_on(self, images, labels):
        """One optimizer step on this rank's batch; the loss (same call as comm.AccumulatingTrainStep)."""
        return self(images, labels)


def create_loss(soft_labels: bool):
    """Training cross-entropy: on class indices, or on float class distributions (mixup, cutmix, smoothing)."""
    return nn.SoftmaxCrossEntropyWithLogits(sparse=not soft_labels, reduction="mean")


def label_placeholder(batch: int, num_classes: int, soft_labels: bool):
    """The label input the train step compiles for: int32 (batch,) or float32 (batch, classes)."""
    import mindspore as ms
    if soft_labels:
        return ms.Tensor(shape=(batch, num_classes), dtype=ms.float32)
    return ms.Tensor(shape=(batch,), dtype=ms.int32)


def build_network(model: str, num_classes: int, zero_init_last_bn: bool, sync_bn: bool, world_size: int):
    """The model from the registry, with cross-rank BatchNorm swapped in when asked."""
    from models import create_model
    net = create_model(model, num_classes, zero_init_last_bn=zero_init_last_bn)
    if sync_bn:
        from msdist.layers import convert_sync_batchnorm
        net = convert_sync_batchnorm(net, world_size)
    return net


def mixed_precision(net, amp_level: str, amp_dtype: str):
    """Cast the network for `amp_level` O2/O3 in `amp_dtype` (float16/bfloat16); O0 returns it unchanged.

    The loss scale in TrainStep keeps small float16 gradients from flushing to zero.
    """
    if amp_level == "O0":
        return net
    import mindspore as ms
    return ms.amp.auto_mixed_precision(net, amp_level, dtype=getattr(ms, amp_dtype))


def default_reducer(params, world_size: int):
    """MindSpore's own fused data-parallel all-reduce (mean); None when there is nothing to reduce."""
    if world_size == 1:
        return None
    return nn.DistributedGradReducer(params, mean=True, degree=world_size)
