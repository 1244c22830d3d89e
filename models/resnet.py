"""ResNet family for MindSpore (He et al., "Deep Residual Learning for Image Recognition",
https://arxiv.org/abs/1512.03385).

The bottleneck puts its stride on the 3x3 convolution ("ResNet v1.5"), as MindSpore's model zoo
ResNet-50 does. Convolutions use He (Kaiming) normal init in fan-out mode; `zero_init_last_bn`
starts every block's last BatchNorm gamma at zero so each block begins as the identity
(Goyal et al., https://arxiv.org/abs/1706.02677).

`convention` (models.CONVENTIONS) is how the stem's max-pool pads, after the weights the network will hold:
"mindspore" pads as MindSpore's pad_mode="same" (0 before, 1 after on an even map; the model zoo, MindCV,
msdist's own training), "torch" pads 1 on every side (torchvision, timm). Everything else already computes
what torch computes (symmetric convolution padding, BatchNorm eps 1e-5, mean pool, Dense = Linear); the test
against torchvision's own models (tests/integration/test_torch_weights.py) would find any other difference.
"""
from typing import Sequence, Type

from mindspore import nn
from mindspore.common.initializer import HeNormal, HeUniform

from models.registry import CONVENTIONS, DEFAULT_CONVENTION, TORCH_CONVENTION, register_model


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel, stride=stride, pad_mode="pad", padding=kernel // 2, has_bias=False,
                     weight_init=HeNormal(mode="fan_out", nonlinearity="relu"))


def _bn(channels: int, zero_gamma: bool = False) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=0.9, gamma_init="zeros" if zero_gamma else "ones")


class _SymmetricMaxPool(nn.Cell):
    """torch's MaxPool2d(3, 2, padding=1): pad 1 pixel on every side, then pool without padding.

    Zero padding gives exactly torch's (-inf padding) result and gradients here because the pool follows a ReLU:
    every input is >= 0, and where a zero wins, ReLU passes no gradient either way. MindSpore's own
    pad_mode="pad" pool would do too, but it does not export to ONNX.
    """

    def __init__(self):
        super().__init__()
        self.pad = nn.Pad(((0, 0), (0, 0), (1, 1), (1, 1)))
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="valid")

    def construct(self, x):
        return self.pool(self.pad(x))


def _stem_pool(convention: str) -> nn.Cell:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; choose one of {', '.join(CONVENTIONS)}")
    if convention == TORCH_CONVENTION:
        return _SymmetricMaxPool()
    return nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="same")


class _Downsample(nn.Cell):
    """1x1 projection on the shortcut when the block changes shape."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv = _conv(in_ch, out_ch, 1, stride)
        self.bn = _bn(out_ch)

    def construct(self, x):
        return self.bn(self.conv(x))


class BasicBlock(nn.Cell):
    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int = 1, zero_init_last_bn: bool = False):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1, self.bn1 = _conv(in_ch, width, 3, stride), _bn(width)
        self.conv2, self.bn2 = _conv(width, out_ch, 3), _bn(out_ch, zero_init_last_bn)
        self.relu = nn.ReLU()
        self.downsample = _Downsample(in_ch, out_ch, stride) if stride != 1 or in_ch != out_ch else None

    def construct(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class Bottleneck(nn.Cell):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1, zero_init_last_bn: bool = False):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1, self.bn1 = _conv(in_ch, width, 1), _bn(width)
        self.conv2, self.bn2 = _conv(width, width, 3, stride), _bn(width)
        self.conv3, self.bn3 = _conv(width, out_ch, 1), _bn(out_ch, zero_init_last_bn)
        self.relu = nn.ReLU()
        self.downsample = _Downsample(in_ch, out_ch, stride) if stride != 1 or in_ch != out_ch else None

    def construct(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + shortcut)


class ResNet(nn.Cell):
    """Stem, four stages of residual blocks, global average pool, linear classifier.

    Args:
        block: BasicBlock or Bottleneck.
        layers: blocks per stage.
        num_classes: classifier outputs.
        widths: channels of each stage's 3x3 convolutions.
        small_stem: a 3x3 stride-1 stem without max-pool, for tiny images.
        zero_init_last_bn: zero gamma in every block's last BatchNorm.
        convention: how the stem's max-pool pads (module docstring); the weights' framework decides.
    """

    def __init__(self, block: Type[nn.Cell], layers: Sequence[int], num_classes: int,
                 widths: Sequence[int] = (64, 128, 256, 512), small_stem: bool = False,
                 zero_init_last_bn: bool = False, convention: str = DEFAULT_CONVENTION):
        super().__init__()
        stem_ch = widths[0]
        if small_stem:
            self.stem = nn.SequentialCell([_conv(3, stem_ch, 3), _bn(stem_ch), nn.ReLU()])
        else:
            self.stem = nn.SequentialCell([_conv(3, stem_ch, 7, 2), _bn(stem_ch), nn.ReLU(),
                                           _stem_pool(convention)])
        stages, in_ch = [], stem_ch
        for i, (width, depth) in enumerate(zip(widths, layers)):
            blocks = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(in_ch, width, stride, zero_init_last_bn))
                in_ch = width * block.expansion
            stages.append(nn.SequentialCell(blocks))
        self.stages = nn.SequentialCell(stages)
        self.num_features = in_ch
        self.fc = nn.Dense(in_ch, num_classes, weight_init=HeUniform(), bias_init="zeros")

    def forward_features(self, x):
        return self.stages(self.stem(x))

    def forward_head(self, x):
        return self.fc(x.mean(axis=(2, 3)))

    def construct(self, x):
        return self.forward_head(self.forward_features(x))


@register_model
def resnet18(num_classes: int, **kwargs) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, **kwargs)


@register_model
def resnet34(num_classes: int, **kwargs) -> ResNet:
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, **kwargs)


@register_model
def resnet50(num_classes: int, **kwargs) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, **kwargs)


@register_model
def resnet101(num_classes: int, **kwargs) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 23, 3), num_classes, **kwargs)


@register_model
def resnet_tiny(num_classes: int, **kwargs) -> ResNet:
    """One BasicBlock per stage and narrow widths: seconds to compile and train, for tests."""
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes, widths=(8, 16, 32, 64), small_stem=True, **kwargs)
