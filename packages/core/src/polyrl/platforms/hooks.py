"""Registers the built-in platforms."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "polyrl.platforms.base:CPUPlatform", priority=0, description="CPU with gloo")
    register("cuda", "polyrl.platforms.base:CUDAPlatform", priority=10, description="NVIDIA GPUs with NCCL")
