"""polyrl: reinforcement-learning post-training, as a small core and pluggy plugins.

Public entry points: :mod:`polyrl.protocols` (what plugins implement),
:data:`polyrl.hookimpl` (the hook marker), :func:`polyrl.plugins.get_plugin_manager`.
"""

from polyrl.__about__ import __version__
from polyrl.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl"]
