"""A checkpoint against the model it is loaded into: the same tensors, one to one.

Every load path calls :func:`check_one_to_one` before it copies anything: a loader that only
reads the tensors the model asks for would resume a 5-layer checkpoint into a 4-layer model
(block 4 silently dropped) or an untied checkpoint into a tied model (the saved head
dropped). The first difference is named, in the model's order, then the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from labkit.checkpoint.layout import CheckpointError

__all__ = ["check_one_to_one"]


def check_one_to_one(
    path: Path | str, saved: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise a :class:`CheckpointError` unless ``saved`` (key -> shape, as the checkpoint at
    ``path`` holds them) and ``model`` (what the model expects) have the same keys and shapes."""
    for key, shape in model.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {path} does not match the model: tensor {key!r} "
                                  f"{tuple(shape)} is missing (another model?)")  # fmt: skip
        if tuple(saved[key]) != tuple(shape):
            raise CheckpointError(f"checkpoint {path} does not match the model: tensor {key!r} "
                                  f"has shape {tuple(saved[key])} there, the model expects "
                                  f"{tuple(shape)}")  # fmt: skip
    extra = [k for k in saved if k not in model]
    if extra:
        raise CheckpointError(f"checkpoint {path} does not match the model: tensor {extra[0]!r} "
                              f"{tuple(saved[extra[0]])} is not in the model ({len(extra)} "
                              f"such tensors)")  # fmt: skip
