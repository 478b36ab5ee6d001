"""polyrl on AMD GPUs: the ``rocm`` platform (torch's ROCm build, RCCL behind the ``nccl`` backend).

Importing this package imports nothing heavy; torch loads when the platform is used.
"""

from polyrl_hw_rocm.__about__ import __version__

__all__ = ["__version__"]
