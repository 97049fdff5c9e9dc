"""A small CNN for 28x28 MNIST digits (about 0.2M parameters): compute-bound on a CPU."""

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
