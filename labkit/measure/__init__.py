"""Measurement has one home: timing harnesses, measured records, fits.

Techniques do not time themselves.

* ``timing.py``      interleaved step timing with warm-up, medians and spread (min / median / max).
* ``collectives.py`` algbw/busbw as nccl-tests defines them, ours against torch's.
* ``ping_pong.py``   one message between two ranks: the alpha-beta unit.
* ``ring_trace.py``  the readable ring step by step, from a real run (the lesson's picture).
* ``tp.py``          activation bytes per layer and communication per block of tensor parallelism.
* ``pipeline.py``    measured pipeline timelines and bubbles against the simulator.
* ``threed.py``      the 3D miniature's step breakdown against the planner.
* ``scaling.py``     scaling records: speed-up, efficiency, MFU, GPU-hours, time-to-accuracy.
* ``capstone.py``    the GPT-2 1.3B step on a GPU (tokens/s, MFU, memory against the estimate).
* ``profiling.py``   the miniature ResNet's strong and weak scaling.
* ``compression.py`` DDP gradient compression on the MNIST lab: accuracy, loss, bytes per step.
* ``cluster.py``     on the emulated cluster: DDP step variants, strong scaling
                     (``cluster_comm.py``: its three all-reduces and their busbw over sizes).
* ``mixed_links.py`` per-link-class alpha-beta under load, and the 10B miniature's measured step.

Add one module per kind of measurement; import from the submodule (``labkit.measure.timing``).
"""
