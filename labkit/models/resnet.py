"""ResNet (He et al. 2016, "Deep Residual Learning", arXiv 1512.03385), sized by arguments.

``resnet50()`` is the ImageNet model of the paper's Table 1 (bottleneck blocks [3, 4, 6, 3],
25,557,032 parameters with batch-norm affine terms); build it on the ``meta`` device to count
parameters and FLOPs without allocating. ``resnet_mini()`` is the same architecture shrunk
until it trains on 28x28 MNIST digits in seconds on a CPU (interview scenario S2, notebook 13).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)  # stride on the 3x3 (v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.down(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """Stem, stages of residual blocks (each stage after the first halves the resolution and
    doubles the width), global average pool, linear classifier."""

    def __init__(
        self,
        blocks: Sequence[int] = (3, 4, 6, 3),
        width: int = 64,
        bottleneck: bool = True,
        in_channels: int = 3,
        num_classes: int = 1000,
        imagenet_stem: bool = True,
    ):
        super().__init__()
        if not blocks or min(blocks) < 1 or width < 1:
            raise ValueError(f"need blocks >= 1 per stage and width >= 1, got {blocks}, {width}")
        block = Bottleneck if bottleneck else BasicBlock
        if imagenet_stem:  # 7x7 stride 2 then 3x3 max-pool: 224 -> 56
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        else:  # small images: one 3x3 stride-2 conv, 28 -> 14
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
            )
        layers: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            w = width * 2**i
            for j in range(n):
                layers.append(block(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w * block.expansion
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, C, H', W')
        return self.fc(x.mean(dim=(2, 3)))  # (B, C) -> (B, num_classes)


def resnet50(**kwargs: object) -> ResNet:
    return ResNet((3, 4, 6, 3), 64, True, **kwargs)  # type: ignore[arg-type]


def resnet_mini(width: int = 8, num_classes: int = 10) -> ResNet:
    """Two basic-block stages on 1x28x28 digits: about 8k parameters at width 8."""
    return ResNet((1, 1), width, False, in_channels=1, num_classes=num_classes, imagenet_stem=False)
