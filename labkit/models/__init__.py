"""Small models used across the labs. None of them knows it is distributed."""

from labkit.models.bert import BERT_PRESETS, Bert, BertConfig, bert_loss, bert_preset
from labkit.models.cnn import MnistCNN
from labkit.models.gpt import GPT, PRESETS, GPTConfig, count_params_meta, gpt_loss, lm_loss, preset
from labkit.models.mlp import MLP

__all__ = [
    "BERT_PRESETS",
    "Bert",
    "BertConfig",
    "bert_loss",
    "bert_preset",
    "GPT",
    "MLP",
    "PRESETS",
    "GPTConfig",
    "MnistCNN",
    "count_params_meta",
    "gpt_loss",
    "lm_loss",
    "preset",
]
