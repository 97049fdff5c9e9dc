"""The lessons as a book: executed once, rendered by Sphinx + MyST-NB, read without a kernel.

    .venv/bin/python -m tools.book build     # or ./lab book

``execute``: run a lesson once and cache the executed copy, keyed on the notebook and labkit's
sources. ``static_widgets``: a widget's saved state drawn as static HTML. ``stage``: the book's
source tree (README as the front page, lessons with their outputs, exercises without solutions,
the recorded GPU results). ``build``: Sphinx over that tree, offline.
"""
