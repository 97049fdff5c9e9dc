"""The book's heading anchors, as JupyterLab makes them (a module, so Sphinx's parallel build
can import it by name)."""


def jupyterlab_slug(text: str) -> str:
    """JupyterLab's heading anchor (spaces become hyphens, nothing else changes), so the links
    the lessons use in JupyterLab (``13_interview_walkthroughs.ipynb#heading=S1-MNIST-on-2-GPUs``,
    staged as ``#S1-MNIST-on-2-GPUs``) land on the same heading in the book."""
    return text.strip().replace(" ", "-")
