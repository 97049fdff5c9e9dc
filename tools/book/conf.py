"""Sphinx configuration of labkit's book (copied into the staged source tree by tools/book).

Sphinx + MyST-NB + sphinx-book-theme: every piece is a pip package, so the book builds offline
(no theme or template is fetched), notebooks are read with their outputs as executed by the
test suite (execution off here), and Sphinx's own search index needs no server.
"""

project = "labkit"
author = "the labkit developers"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # executed once, by the test suite (tools/book/execute.py)
myst_heading_anchors = 3  # "page.ipynb#S1-MNIST-on-2-GPUs" links resolve to headings
# $...$ is drawn as MathML when staged (tools/book/stage.py): no MathJax from a CDN
html_theme = "sphinx_book_theme"
html_title = "labkit"
html_favicon = "favicon.svg"  # else the browser asks for /favicon.ico and logs a 404
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
html_last_updated_fmt = None
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]

myst_heading_slug_func = "tools.book.slug.jupyterlab_slug"  # imported by name (-j 2)
html_context = {"default_mode": "light"}  # else the theme logs "invalid theme mode" on load
