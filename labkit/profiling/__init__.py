"""Profiler-first diagnosis: where a training step's time goes, per rank.

* ``breakdown.py``  ``record_function`` regions around the parts of a step, read back from
  ``torch.profiler`` into a per-rank breakdown (data wait, host-to-device copy, forward,
  backward, exposed communication, optimizer, other), plus counts of collectives and host syncs.
* ``derived.py``    utilisation against FLOP efficiency (``FlopCounterMode``) and cost metrics
  (samples/s, GPU-hours per million samples at a stated price, time-to-accuracy).

Import from the submodules (``labkit.profiling.breakdown``).
"""
