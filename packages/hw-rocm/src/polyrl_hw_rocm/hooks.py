"""polyrl hooks of the ROCm plugin. Imports nothing heavy: the platform module loads when it is used."""

from polyrl import hookimpl


@hookimpl
def register_platforms(register):
    # Above cuda (10), which declines ROCm builds of torch anyway; below npu (30).
    register("rocm", "polyrl_hw_rocm.platform:ROCmPlatform", priority=20, aliases=["amd"],
             description="AMD GPUs with a ROCm build of torch and RCCL")
