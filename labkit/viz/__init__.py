"""Pictures have one home: matplotlib figures and ipywidgets. Techniques do not draw.

One module per lesson topic: ``collectives`` (ring strip, busbw, alpha-beta), ``ddp`` (overlap
timeline), ``zero`` (ledger bars), ``tp``, ``pipeline`` (timelines, schedule widget), ``layout``
(rank grid), ``planner`` (plan widget), ``memory_widget``, ``scaling``, ``profiling``,
``cluster`` (busbw over sizes, strong scaling, step breakdown on the emulated cluster),
``mixed_links`` (slow-link scan, miniature measured against predicted); import from the
submodule. Figures take measured records or model outputs and return the
matplotlib ``Figure`` (or the widget), so notebooks stay thin: a call and a display.
"""
