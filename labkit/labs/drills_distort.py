"""The elastic distortion behind the ``starved_loader`` drill (Simard et al. 2003).

A random displacement field, smoothed by a Gaussian and resampled, per sample and unbatched on
purpose: its cost in ``__getitem__`` is the fault. Loader workers unpickle :class:`Distorted`
by this module's path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["Distorted"]


def _gaussian_kernel(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - size // 2
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k = k / k.sum()
    return (k[:, None] * k[None, :])[None, None]  # (1, 1, size, size)


class Distorted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Digits with an elastic distortion per sample: a random displacement field smoothed by a
    Gaussian, then resampled (Simard et al. 2003). Deliberately per-sample and unbatched."""

    def __init__(self, base: Dataset, kernel: int, alpha: float = 0.3, seed: int = 0):
        self.base, self.alpha, self.seed = base, alpha, seed
        self.kernel = _gaussian_kernel(kernel, sigma=kernel / 3)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 28), torch.linspace(-1, 1, 28), indexing="ij")
        self.grid = torch.stack([xs, ys], -1)[None]  # (1, 28, 28, 2), x then y as grid_sample wants

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img, label = self.base[i]  # (1, 28, 28)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        field = torch.rand(2, 1, 28, 28, generator=g) * 2 - 1  # (2 displacement maps, 1, 28, 28)
        pad = self.kernel.shape[-1] // 2
        field = F.conv2d(field, self.kernel, padding=pad).view(1, 2, 28, 28) * self.alpha
        grid = self.grid + field.permute(0, 2, 3, 1)  # (1, 28, 28, 2)
        return F.grid_sample(img[None], grid, align_corners=False)[0], label
