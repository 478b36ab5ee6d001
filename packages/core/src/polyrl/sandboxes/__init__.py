"""Code sandboxes: where code-execution rewards run a response's program (kind ``sandbox``, selected by
``reward.sandbox``). Built in: ``local`` (polyrl's namespace sandbox) and ``sandbox_fusion`` (a SandboxFusion
server's HTTP API). See docs/reward_models.md, "Code rewards"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.sandboxes.base import CodeSandbox, ExecutionResult
    from polyrl.sandboxes.local import LocalSandbox
    from polyrl.sandboxes.sandbox_fusion import SandboxFusionSandbox

_EXPORTS = {
    "CodeSandbox": "polyrl.sandboxes.base",
    "ExecutionResult": "polyrl.sandboxes.base",
    "LocalSandbox": "polyrl.sandboxes.local",
    "SandboxFusionSandbox": "polyrl.sandboxes.sandbox_fusion",
}

__getattr__ = lazy_getattr(__name__, _EXPORTS)

__all__ = ["CodeSandbox", "ExecutionResult", "LocalSandbox", "SandboxFusionSandbox"]
