"""labkit: distributed deep-learning training, built from scratch and checked against PyTorch.

The folder layout is the syllabus; start with :mod:`labkit.launch`.
"""

from labkit import launch  # a callable package: labkit.launch(fn, *args, world_size=2)
from labkit.launch.world import World  # ranks that stay alive across calls and cells

__all__ = ["World", "launch"]
__version__ = "0.1.0"
