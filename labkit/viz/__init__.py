"""Pictures have one home: matplotlib figures and ipywidgets. Techniques do not draw.

One module per lesson topic (``labkit.viz.collectives``, ``labkit.viz.pipeline``, ...);
import from the submodule. Figures take measured records or model outputs and return the
matplotlib ``Figure`` (or the widget), so notebooks stay thin: a call and a display.
"""
