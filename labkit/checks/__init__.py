"""Automatic checks for the exercises: one module per lesson, shared helpers in :mod:`core`."""
