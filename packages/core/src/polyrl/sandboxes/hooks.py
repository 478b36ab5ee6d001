"""Registers the built-in code sandboxes (kind ``sandbox``)."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_sandboxes(register):
    register("local", "polyrl.sandboxes.local:LocalSandbox",
             description="polyrl's namespace sandbox on this machine (Python)")
    register("sandbox_fusion", "polyrl.sandboxes.sandbox_fusion:SandboxFusionSandbox",
             description="a SandboxFusion server's run_code API (reward.sandbox_fusion.url)")
