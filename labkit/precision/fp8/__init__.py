"""FP8 training from scratch: formats, four scaling recipes, an FP8 linear (and its
tensor-parallel forms).

* ``formats.py``     e4m3 / e5m2 next to bf16 / fp16, derived from their bits
* ``scaled.py``      (data, scale, block) tensors; the GEMM, emulated or ``torch._scaled_mm``
* ``recipe.py``      what a recipe decides (blocks, scales), and the unscaled control
* ``tensorwise.py``  one scale per tensor from its amax now
* ``delayed.py``     Transformer Engine's amax history and margin
* ``rowwise.py``     one scale per row / column along K
* ``tiles.py``       DeepSeek-V3's 1x128 / 128x128 tiles, fp32 accumulation per 128 of K
* ``linear.py``      the autograd Function (e4m3 forward, e5m2 gradients) and ``Fp8Linear``
* ``parallel.py``    column- and row-parallel FP8 linears over labkit's tp mappings
"""

from labkit.precision.fp8.delayed import Delayed, delayed_scaling_step
from labkit.precision.fp8.formats import FORMATS, FloatFormat, format_table
from labkit.precision.fp8.linear import RECIPES, Fp8Config, Fp8Linear, fp8_linears, make_recipe
from labkit.precision.fp8.recipe import Recipe, Unscaled
from labkit.precision.fp8.rowwise import Rowwise
from labkit.precision.fp8.scaled import E4M3, E5M2, Scaled, matmul, quantize
from labkit.precision.fp8.tensorwise import Tensorwise
from labkit.precision.fp8.tiles import Tiles

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "RECIPES",
    "Delayed",
    "FloatFormat",
    "Fp8Config",
    "Fp8Linear",
    "Recipe",
    "Rowwise",
    "Scaled",
    "Tensorwise",
    "Tiles",
    "Unscaled",
    "delayed_scaling_step",
    "format_table",
    "fp8_linears",
    "make_recipe",
    "matmul",
    "quantize",
]
