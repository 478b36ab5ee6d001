"""polyrl-engine-fsdp: the FSDP2 training engine (registered as engine ``fsdp``, alias ``fsdp2``)."""

from polyrl_engine_fsdp.__about__ import __version__

__all__ = ["__version__"]
