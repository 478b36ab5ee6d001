"""Let megatron-core run on the ``cpu`` platform (gloo process groups, CPU tensors).

megatron-core is written for CUDA: it asks ``torch.cuda.current_device()`` where to allocate, keeps its
tensor-parallel RNG streams with ``torch.cuda.get_rng_state``/``manual_seed``, synchronises streams, and its
optimizers check ``param.type() == "torch.cuda.FloatTensor"``. On a CPU build of torch each of these raises (or,
for the lazily queued RNG calls, silently does nothing). This module makes those calls mean "the CPU":

* every loaded ``megatron.core`` module sees a stand-in ``torch`` module whose ``cuda`` attribute is
  :class:`CPUCudaNamespace`: ``current_device()`` is ``cpu``; the RNG functions act on the CPU default
  generator (so the tensor-parallel RNG tracker really forks the generator dropout draws from); synchronize,
  streams, events, NVTX ranges and cache calls are no-ops; memory statistics are 0. Everything else goes to the
  real ``torch.cuda`` and fails loudly as before. ``torch.cuda`` itself is NOT changed: the rest of the process
  (transformers, polyrl, a rollout) still sees a machine without CUDA.
* the stand-in ``torch``'s tensor factories (``zeros``, ``tensor``, ...) put ``device="cuda"`` tensors on
  the CPU (megatron writes that literal for causal masks, optimizer scalars and grad-norm buffers).
* megatron's private RNG helpers ``_get_cuda_rng_state``/``_set_cuda_rng_state`` (the latter queues its work
  with ``torch.cuda._lazy_call``, which never runs without CUDA) are replaced by CPU-generator versions.
* a few megatron functions that call tensor methods (``Tensor.cuda()``, ``Tensor.type()``) run with CPU
  tensors reported as CUDA tensors for the duration of the call only (see ``_TENSOR_AS_CUDA_FUNCTIONS``).

What this proves and what it does not: with it, megatron-core's own model, tensor/pipeline parallel
communication (over gloo), RNG tracker, optimizers and schedules run unchanged on CPU, so layouts, weight
conversion and losses can be compared exactly. It says nothing about CUDA kernels, Transformer Engine, fused
ops, NCCL or memory behaviour; those are tested only on a GPU.

Apply it only on the ``cpu`` platform (``apply_cpu_emulation``); it is idempotent. The names it touches are
private to megatron-core, so it is tied to the tested versions in :data:`TESTED_MEGATRON_CORE`; another version
is refused unless ``POLYRL_MEGATRON_ALLOW_UNTESTED=1`` (and ``tests/test_cpu_emulation.py`` then shows what broke).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from polyrl.errors import ConfigError

logger = logging.getLogger(__name__)

#: megatron-core releases this emulation (and the converters) were tested with.
TESTED_MEGATRON_CORE: tuple[str, ...] = ("0.16.1",)
#: Set to ``1`` to run with a megatron-core release not in :data:`TESTED_MEGATRON_CORE` anyway.
ALLOW_UNTESTED_ENV = "POLYRL_MEGATRON_ALLOW_UNTESTED"
PIP_LINE = f"pip install --no-deps megatron-core=={TESTED_MEGATRON_CORE[-1]}"

# The modules whose functions the emulation wraps, imported before patching so that they exist.
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)
# (module, qualified name) of the functions that call Tensor.cuda()/Tensor.type() on parameters, gradients and
# optimizer states (every such call site in megatron-core 0.16.1 on the GPT/optimizer/checkpoint paths).
_TENSOR_AS_CUDA_FUNCTIONS = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.restore_from_cpu"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.dist_checkpointing.exchange_utils", "exchange_loaded_tensors_gather_rounds"),
    ("megatron.core.dist_checkpointing.exchange_utils", "exchange_loaded_tensors_broadcast"),
    ("megatron.core.tensor_parallel.data", "broadcast_data"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
)
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_applied = False


def check_megatron_core() -> str:
    """The installed megatron-core version; a :class:`~polyrl.errors.ConfigError` if it is missing or untested.

    ``POLYRL_MEGATRON_ALLOW_UNTESTED=1`` turns the untested-version error into a warning.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        raise ConfigError(f"engine 'megatron' needs megatron-core, which is not installed: {PIP_LINE} "
                          "(without extras: they pull CUDA packages)") from None
    if installed not in TESTED_MEGATRON_CORE:
        message = (f"megatron-core {installed} is installed, but polyrl-engine-megatron was tested with "
                   f"{', '.join(TESTED_MEGATRON_CORE)}: {PIP_LINE}, or set {ALLOW_UNTESTED_ENV}=1 to try it anyway")
        if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("1", "true", "yes"):
            raise ConfigError(message)
        logger.warning("%s (%s is set)", message, ALLOW_UNTESTED_ENV)
    return installed


class _NoOpStream:
    """A CUDA stream or event stand-in: every method does nothing (CPU work is already ordered) and returns another
    stand-in (``stream.record_event()`` is an event whose ``synchronize()`` megatron's MoE dispatcher calls)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: _NoOpStream()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class CPUCudaNamespace(types.ModuleType):
    """What megatron-core's modules see as ``torch.cuda`` under the emulation: the CPU, under CUDA's names.

    Attributes not defined here come from the real ``torch.cuda`` (so an unemulated call still raises).
    """

    def __init__(self) -> None:
        super().__init__("torch.cuda (polyrl CPU emulation)")
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state,
                                            manual_seed=self.manual_seed, manual_seed_all=self.manual_seed)
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                          range=lambda *a, **k: contextlib.nullcontext(), mark=lambda *a, **k: None)
        self.Stream = self.Event = _NoOpStream

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.default_generator,)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def current_stream(device: Any = None) -> _NoOpStream:
        return _NoOpStream()

    default_stream = current_stream

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def set_stream(stream: Any = None) -> None:
        pass

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}


# Tensor factories megatron calls with a literal ``device="cuda"`` (masks, optimizer scalars, grad-norm buffers).
_FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn",
                        "randint", "zeros_like", "ones_like", "empty_like", "full_like"})


def _is_cuda(device: Any) -> bool:
    return (isinstance(device, str) and device.split(":")[0] == "cuda") or (
        isinstance(device, torch.device) and device.type == "cuda")


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory") and not torch.cuda.is_available():  # no pinned-memory allocator without CUDA
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return wrapper


class _TorchWithCPUCuda(types.ModuleType):
    """``torch`` as megatron-core's modules see it under the emulation: the real module, with ``cuda`` replaced
    and tensor factories that put ``device="cuda"`` tensors on the CPU."""

    def __init__(self, cuda: CPUCudaNamespace) -> None:
        super().__init__("torch (polyrl CPU emulation)")
        self.cuda = cuda
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CUDA = CPUCudaNamespace()
_TORCH = _TorchWithCPUCuda(_CUDA)
_CUDA_TYPES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cpu_tensors_as_cuda() -> Iterator[None]:
    """For the duration of the block, ``Tensor.cuda()`` keeps a CPU tensor where it is and ``Tensor.type()``
    names a CPU float tensor by its CUDA type name (what megatron's optimizers check parameters against)."""
    cuda, type_ = torch.Tensor.cuda, torch.Tensor.type

    def _cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.device.type == "cpu" else cuda(self, *args, **kwargs)

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        return type_(self, *args, **kwargs)

    torch.Tensor.cuda, torch.Tensor.type = _cuda, _type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = cuda, type_  # type: ignore[method-assign]


def _wrap_tensor_as_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_as_cuda():
            return fn(*args, **kwargs)

    wrapper.__polyrl_cpu_emulation__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_function(module: types.ModuleType, qualname: str) -> None:
    """Run ``module.qualname`` (a function or a method) under :func:`_cpu_tensors_as_cuda`. A module-level
    function is also replaced where other megatron modules imported it by name."""
    if "." in qualname:
        owner_name, attr = qualname.rsplit(".", 1)
        owner = getattr(module, owner_name)
        fn = owner.__dict__[attr]
        kind = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
        plain = fn.__func__ if kind else fn
        if not getattr(plain, "__polyrl_cpu_emulation__", False):
            wrapped = _wrap_tensor_as_cuda(plain)
            setattr(owner, attr, kind(wrapped) if kind else wrapped)
        return
    fn = getattr(module, qualname)
    if getattr(fn, "__polyrl_cpu_emulation__", False):
        return
    wrapped = _wrap_tensor_as_cuda(fn)
    for name, other in list(sys.modules.items()):
        if name.startswith("megatron.core") and other is not None and getattr(other, qualname, None) is fn:
            setattr(other, qualname, wrapped)


def _move_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``moe_utils.maybe_move_tensor_to_cpu`` with the CPU as the device: the MoE token dispatcher moves
    its split sizes "to the host" and, with ``as_numpy``, expects numpy arrays (it hands them to all-to-all)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _replace_function(module_name: str, name: str, replacement: Callable[..., Any]) -> None:
    """``module_name.name`` becomes ``replacement``, also where other megatron modules imported it by name."""
    original = getattr(importlib.import_module(module_name), name)
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and module is not None and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class _DropExpectedRNGWarning(logging.Filter):
    # The tracker warns when the CPU generator moves inside a fork; under the emulation the forked "device"
    # generator IS the CPU generator, so the move is the fork working as intended.
    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def _patch_loaded_modules() -> int:
    """Point every loaded ``megatron.core`` module's ``torch`` at the stand-in; returns how many changed."""
    changed = 0
    for name, module in list(sys.modules.items()):
        in_megatron = name == "megatron.core" or name.startswith("megatron.core.")
        if in_megatron and module is not None and getattr(module, "torch", None) is torch:
            module.torch = _TORCH
            changed += 1
    return changed


class _PatchedLoader:
    """Wraps a module loader: after a ``megatron.core`` module runs, it too sees the stand-in ``torch``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        if getattr(module, "torch", None) is torch:
            module.torch = _TORCH


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches megatron-core modules imported after :func:`apply_cpu_emulation` (megatron imports lazily)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron.core."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchedLoader(spec.loader)
                return spec
        return None


def apply_cpu_emulation() -> None:
    """Make megatron-core run on CPU (see the module docstring). Idempotent; call it on the ``cpu`` platform only.

    Checks the megatron-core version first (:func:`check_megatron_core`). megatron-core modules imported later
    (megatron imports some inside functions) are patched as they load.
    """
    global _applied
    if not _applied:
        check_megatron_core()
        for name in _MODULES:
            importlib.import_module(name)
        random = sys.modules["megatron.core.tensor_parallel.random"]
        random._get_cuda_rng_state = _get_rng_state
        random._set_cuda_rng_state = _set_rng_state
        logging.getLogger(random.__name__).addFilter(_DropExpectedRNGWarning())
        for module_name, qualname in _TENSOR_AS_CUDA_FUNCTIONS:
            _wrap_function(importlib.import_module(module_name), qualname)
        _replace_function("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", _move_tensor_to_host)
        sys.meta_path.insert(0, _PatchOnImport())
        _applied = True
    n = _patch_loaded_modules()
    if n:
        logger.debug("megatron-core CPU emulation: %d modules now see torch.cuda as the CPU", n)


def cpu_emulation_active() -> bool:
    """Whether :func:`apply_cpu_emulation` ran in this process."""
    return _applied
