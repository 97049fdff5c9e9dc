"""Large-batch optimizers from scratch: LARS (You et al. 2017) and LAMB (You et al. 2019).

Both scale each layer's update by a *trust ratio* ``||w|| / ||update||``, so no layer moves
by more than a set fraction of its own norm however large the global learning rate grows
with the batch (the linear scaling rule's failure mode, notebook 13 §K5).
"""

from labkit.optim.layerwise import LAMB, LARS, trust_ratio

__all__ = ["LAMB", "LARS", "trust_ratio"]
