"""Mixed precision: a dynamic loss scaler and fp32 master weights with a bf16/fp16 compute copy."""

from labkit.precision.loss_scaler import DynamicLossScaler, to_fp32, update_scale
from labkit.precision.mixed import (
    MixedPrecisionTrainer,
    grads_to_master,
    master_copy,
    master_to_model,
)

__all__ = [
    "DynamicLossScaler",
    "MixedPrecisionTrainer",
    "grads_to_master",
    "master_copy",
    "master_to_model",
    "to_fp32",
    "update_scale",
]
