"""Image classifiers as flat `nn.Sequential` layer lists: a small digits CNN; VGG-16, ResNet-50, AlexNet."""

from __future__ import annotations

import torch
from torch import nn


def digits_cnn(
    num_classes: int = 10, in_channels: int = 1, image_size: int = 8, width: int = 32, dropout: float = 0.1
) -> nn.Sequential:
    """A small CNN for 8x8 digits. No BatchNorm: micro-batching would change its statistics."""
    pooled = image_size // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * pooled * pooled, 4 * width),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(4 * width, num_classes),
    )


def vgg16(num_classes: int = 1000, in_channels: int = 3, image_size: int = 224) -> nn.Sequential:
    """torchvision's VGG-16 (with BatchNorm-free layers as in the paper), one entry per torch layer."""
    from torchvision.models import vgg16 as tv_vgg16

    net = tv_vgg16(weights=None, num_classes=num_classes)
    features = list(net.features)
    if in_channels != 3:
        features[0] = nn.Conv2d(in_channels, 64, kernel_size=3, padding=1)
    features = _drop_pools_that_do_not_fit(features, in_channels, image_size)
    return _sequential([*features, net.avgpool, nn.Flatten(), *net.classifier])


def alexnet(
    num_classes: int = 1000, in_channels: int = 3, image_size: int = 224, dropout: float = 0.5
) -> nn.Sequential:
    """torchvision's AlexNet; below 64 px the 11x11/4 stem becomes 3x3/1 so small images keep their pixels."""
    from torchvision.models import alexnet as tv_alexnet

    net = tv_alexnet(weights=None, num_classes=num_classes, dropout=dropout)
    features = list(net.features)
    if image_size < 64:
        features[0] = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1)
    elif in_channels != 3:
        features[0] = nn.Conv2d(in_channels, 64, kernel_size=11, stride=4, padding=2)
    features = _drop_pools_that_do_not_fit(features, in_channels, image_size)
    return _sequential([*features, net.avgpool, nn.Flatten(), *net.classifier])


def resnet50(num_classes: int = 1000, in_channels: int = 3, image_size: int = 224) -> nn.Sequential:
    """torchvision's ResNet-50, one entry per stem layer and per bottleneck block (residuals stay inside a block).

    Below 64 px the stem is the CIFAR one (3x3/1 convolution, no max-pool). BatchNorm is kept as in the
    paper; its statistics are per micro-batch under pipelining.
    """
    from torchvision.models import resnet50 as tv_resnet50

    net = tv_resnet50(weights=None, num_classes=num_classes)
    if image_size < 64:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    stem = [net.conv1, net.bn1, net.relu, net.maxpool]
    blocks = [block for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for block in stage]
    return _sequential([*stem, *blocks, net.avgpool, nn.Flatten(), net.fc])


def _drop_pools_that_do_not_fit(layers: list[nn.Module], in_channels: int, image_size: int) -> list[nn.Module]:
    """Remove the max-pools that would shrink a small input below 1x1 (the adaptation to small images)."""
    kept: list[nn.Module] = []
    x = torch.zeros(1, in_channels, image_size, image_size)
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, nn.MaxPool2d):
                kernel = layer.kernel_size if isinstance(layer.kernel_size, int) else layer.kernel_size[0]
                if x.shape[-1] < kernel:
                    continue
            x = layer(x)
            kept.append(layer)
    return kept


def _sequential(layers: list[nn.Module]) -> nn.Sequential:
    """Build the Sequential with in-place ops turned off: a stage's input is a leaf that autograd must keep."""
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "inplace"):
                module.inplace = False
    return nn.Sequential(*layers)
