"""Small models used across the labs. None of them knows it is distributed."""

from labkit.models.cnn import MnistCNN
from labkit.models.gpt import GPT, GPTConfig
from labkit.models.mlp import MLP

__all__ = ["GPT", "GPTConfig", "MLP", "MnistCNN"]
