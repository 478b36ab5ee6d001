"""polyrl hooks of the Ascend plugin. Imports nothing heavy: torch_npu loads when the platform is used."""

from polyrl import hookimpl


@hookimpl
def register_platforms(register):
    # Above cuda (10) and rocm (20): a machine with torch_npu and a visible NPU runs on it.
    register("npu", "polyrl_hw_ascend.platform:NPUPlatform", priority=30, aliases=["ascend"],
             description="Huawei Ascend NPUs with torch-npu and HCCL")
