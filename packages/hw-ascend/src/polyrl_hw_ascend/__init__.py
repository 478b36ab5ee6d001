"""polyrl on Huawei Ascend NPUs: the ``npu`` platform (torch-npu, HCCL).

Importing this package imports nothing heavy: ``torch_npu`` loads when the platform probes the
machine or touches the device.
"""

from polyrl_hw_ascend.__about__ import __version__

__all__ = ["__version__"]
