"""Character-level tiny-shakespeare (about 1.1 MB of plays, public domain), shipped with labkit.

``CharDataset`` turns the text into (input, target) windows of ``block_size`` ids, with the
target shifted by one character: the setup of nanoGPT's shakespeare_char.
"""

from __future__ import annotations

from pathlib import Path

import torch

from labkit.data import shipped


def load_text(path: str | Path | None = None) -> str:
    return Path(path or shipped("text/tinyshakespeare.txt")).read_text(encoding="utf-8")


class CharDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``block_size`` character ids; ``split`` takes the first 90% or last 10%."""

    def __init__(self, block_size: int = 128, split: str = "train", text: str | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        text = load_text() if text is None else text
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.ids = ids[:cut] if split == "train" else ids[cut:]
        if len(self.ids) <= block_size:
            raise ValueError(
                f"text of {len(self.ids)} characters is too short for block_size={block_size}"
            )
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.ids) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)
