"""A small CNN for 28x28 MNIST digits: compute-bound on a CPU.

Parameters, for ``channels = C``, ``hidden = H`` and 10 classes (weights + biases)::

    conv1  1 -> C, 3x3         9C + C
    conv2  C -> 2C, 3x3        18C^2 + 2C
    fc1    2C*7*7 -> H         98CH + H
    fc2    H -> 10             10H + 10

The default (C=32, H=128): 320 + 18,496 + 401,536 + 1,290 = 421,642 parameters (1.6 MiB of
fp32 gradients); ``channels=8`` (notebook 01's lab): 80 + 1,168 + 100,480 + 1,290 = 103,018.
fc1 holds 95% of them: the convolutions are few parameters but most of the FLOPs.
"""

from __future__ import annotations

import torch
from torch import nn


class MnistCNN(nn.Module):
    def __init__(self, channels: int = 32, hidden: int = 128, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, 1, 28, 28)
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)  # (B, C, 14, 14)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)  # (B, 2C, 7, 7)
        x = x.flatten(1)  # (B, 2C*49)
        return self.fc2(torch.relu(self.fc1(x)))  # (B, num_classes)
