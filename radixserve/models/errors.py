"""The errors of locating, reading and loading a model."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be located, parsed or loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but uses an architecture or feature we do not implement."""
