"""polyrl-engine-megatron: the megatron-core training engine (registered as engine ``megatron``).

Importing this package does not import megatron-core; the engine's modules do, when a run selects it.
"""

from polyrl_engine_megatron.__about__ import __version__

__all__ = ["__version__"]
