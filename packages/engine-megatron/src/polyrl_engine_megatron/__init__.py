"""polyrl-engine-megatron: the megatron-core training engine (registered as engine ``megatron``).

Importing this package does not import megatron-core; the engine's modules do, when a run selects it.
"""

import warnings

from polyrl_engine_megatron.__about__ import __version__

# megatron-core warns, once per module it imports, that Transformer Engine and Apex are missing and it falls back
# to its local implementations. This engine uses those local layers on purpose (docs/engines/megatron.md), so the
# warnings say nothing a user can act on; left on, eight lines of them came before a start-up check's one-line error.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning)

__all__ = ["__version__"]
