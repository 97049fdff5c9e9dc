"""Flat DDP: copy every gradient into one contiguous buffer, all-reduce it once.

One collective instead of one per parameter: the latency ``alpha`` is paid once, and a
large message runs at the link's full bandwidth (gloo here: ~1.3-1.6 GB/s from 16 MB up).
The price: two extra copies of all gradients (pack, unpack) and, worse, communication
cannot start before the *last* gradient of backward exists, so nothing overlaps with
compute. :mod:`labkit.ddp.bucketed` splits the buffer; :mod:`labkit.ddp.overlapped` then
sends each piece as soon as it is ready.

Buffer layout (see :meth:`DataParallel.pack`)::

    [ grad_0 (numel_0) | grad_1 (numel_1) | ... | used_0 | used_1 | ... ]
"""

from __future__ import annotations

from labkit.ddp.base import DataParallel


class FlatDDP(DataParallel):
    """All trainable gradients in one buffer, one blocking all-reduce after backward."""

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group; call after the last backward, before step()."""
        if not self.require_sync or not self.params:
            return
        self.elements_reduced = 0
        buf = self.pack(self.params)  # (sum numel + num_params,)
        self.all_reduce(buf, "flat")
        self.unpack(buf, self.params)
