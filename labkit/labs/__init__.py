"""Complete labs: each one a training run a notebook drives and `python -m` runs headless."""
