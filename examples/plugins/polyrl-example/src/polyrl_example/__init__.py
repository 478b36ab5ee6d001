"""polyrl-example: a template third-party plugin. Copy this folder, rename, and edit."""

from polyrl_example.__about__ import __version__

__all__ = ["__version__"]
