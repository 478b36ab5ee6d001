"""GGUF files as a model source: dequantized through transformers, converted once to an ordinary HF folder.

``model.path`` may name a ``.gguf`` file, or a folder plus ``model.gguf_file``. Before any worker starts,
:func:`resolve_gguf` turns such a model block into an HF folder (safetensors weights in float32, tokenizer files,
``chat_template.jinja``) in a cache keyed by the GGUF file's sha256, and points the block's ``path`` at it. Every
role, process and backend (the FSDP and Megatron engines, the hf and vLLM rollouts, reward models, teachers) then
loads a plain HF folder, and a second run (or process) finds the folder already there.

Which architectures work is transformers' list (:func:`supported_architectures`); the weights are dequantized
(whatever the file's quantization), so the converted model trains and serves in full precision.
``polyrl models convert FILE.gguf --to DIR`` is :func:`convert_gguf` on the command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

#: The marker file a converted folder carries: the source GGUF's name, sha256 and architecture.
MARKER = "polyrl_gguf.json"
#: Bumped when the conversion's output changes, so older cached folders are written again.
CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """polyrl's cache folder: ``$POLYRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/polyrl``, else ``~/.cache/polyrl``."""
    if os.environ.get("POLYRL_CACHE_DIR"):
        return Path(os.environ["POLYRL_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "polyrl"


def supported_architectures() -> list[str]:
    """The GGUF architectures (``general.architecture``) the installed transformers can dequantize."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def _architecture_supported(arch: str, supported: list[str]) -> bool:
    # llama.cpp spells some names without transformers' underscore (qwen2moe, gpt-oss, minimax-m2, t5encoder)
    squash = {a.replace("_", "") for a in supported}
    name = arch.replace("-", "").replace("_", "").lower()
    return name in squash or (name.startswith("t5") and "t5" in squash)


def gguf_source(model: Any) -> Path | None:
    """The GGUF file a model block names (``path`` ending in ``.gguf``, or ``path`` + ``gguf_file``), else None."""
    path = str(getattr(model, "path", "") or "")
    gguf_file = getattr(model, "gguf_file", None)
    if gguf_file:
        return Path(path).expanduser() / str(gguf_file)
    if path.lower().endswith(".gguf"):
        return Path(path).expanduser()
    return None


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says."""

    #: ``general.architecture`` (``llama``, ``qwen2``...).
    architecture: str
    #: ``general.name``, when the file has one.
    name: str | None
    #: How many tensors it holds.
    n_tensors: int


def inspect_gguf(path: str | Path, key: str = "FILE") -> GGUFInfo:
    """Read and check a GGUF file's header and tensor table, without loading its weights.

    Raises :class:`~polyrl.errors.ConfigError` naming ``key`` and the file when the file is missing, not a GGUF,
    truncated or damaged, or of an architecture transformers cannot dequantize.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such GGUF file")
    _require_gguf_package(key, path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{key}={path} is not a GGUF file (it does not start with 'GGUF'); point {key} at a "
                          ".gguf file or an HF model folder")
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # gguf's reader fails in many ways on a cut file: a short array, a bad reshape
        raise ConfigError(f"{key}={path}: the GGUF file is truncated or damaged ({size:,} bytes; "
                          f"{type(exc).__name__}: {exc}); download it again") from None
    if end > size:
        raise ConfigError(f"{key}={path}: the GGUF file is truncated ({size:,} bytes, its tensors need {end:,}); "
                          "download it again")
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ConfigError(f"{key}={path}: the GGUF file names no architecture (general.architecture); it is not a "
                          "model transformers can load")
    architecture = str(arch_field.contents())
    name_field = reader.fields.get("general.name")
    supported = supported_architectures()
    if not _architecture_supported(architecture, supported):
        import transformers

        raise ConfigError(f"{key}={path}: GGUF architecture '{architecture}' cannot be dequantized by transformers "
                          f"{transformers.__version__} (it reads: {', '.join(supported)}); use an HF folder of "
                          "this model instead, or a newer transformers if it adds the architecture")
    return GGUFInfo(architecture, str(name_field.contents()) if name_field is not None else None,
                    len(reader.tensors))


def _require_gguf_package(key: str, path: Path) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}={path}: reading a GGUF file needs the 'gguf' package: pip install 'polyrl[gguf]'"
                          ) from None


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def load_gguf(path: str | Path, key: str = "FILE", *, dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a GGUF file, dequantized by transformers (``dtype`` default float32).

    The model is a plain transformers class (``LlamaForCausalLM``...) built from the file's config with the
    dequantized weights; nothing of the GGUF loader (its ``quantization_config``) stays on it.
    """
    model, tokenizer, _ = _load_checked(path, key, dtype)
    return model, tokenizer


def _load_checked(path: str | Path, key: str, dtype: Any) -> tuple[Any, Any, GGUFInfo]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser().resolve()
    info = inspect_gguf(path, key)
    dtype = dtype or torch.float32
    try:
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except ValueError as exc:
        if "not supported" in str(exc):
            raise ConfigError(f"{key}={path}: transformers cannot load this GGUF ({info.architecture}): {exc}; "
                              "use an HF folder of this model instead") from None
        raise
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader's; the weights below are plain floats
    config.dtype = dtype
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.to(dtype).eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, info


@contextlib.contextmanager
def _no_progress_bars() -> Any:
    """transformers' progress bars off while it runs; its GGUF loader draws a tqdm bar of its own (no switch)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = gguf_utils.tqdm
    gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if bar:
            hf_logging.enable_progress_bar()


def _readable(folder: Path) -> None:
    """A temporary folder (0700) made an ordinary one: what the user's umask gives a new folder and files."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def convert_gguf(path: str | Path, to: str | Path, key: str = "FILE", *, sha256: str | None = None) -> Path:
    """Write a GGUF file as an HF folder at ``to``: ``model.safetensors`` (float32), the tokenizer's files and
    ``chat_template.jinja`` (when the file has a chat template), plus :data:`MARKER`. Returns ``to``.

    The folder is written beside ``to`` and renamed into place, so a reader never sees half of it; an existing
    ``to`` is replaced the same way (readers that opened its files keep reading them).
    """
    path = Path(path).expanduser().resolve()
    to = Path(to).expanduser().resolve()
    sha256 = sha256 or file_sha256(path)
    model, tokenizer, info = _load_checked(path, key, None)
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", dir=to.parent))
    try:
        with _no_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {"source": path.name, "sha256": sha256, "architecture": info.architecture, "name": info.name,
                  "conversion": CONVERSION_VERSION}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _readable(tmp)
        _replace_dir(tmp, to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return to


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is moved aside first and removed after."""
    try:
        os.rename(new, target)
        return
    except OSError:
        if not target.exists():
            raise
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, old / "dir")
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def converted_matches(folder: str | Path, sha256: str) -> bool:
    """Whether ``folder`` is a whole conversion (by this polyrl) of the GGUF file whose sha256 is ``sha256``."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("sha256") == sha256 and marker.get("conversion") == CONVERSION_VERSION
            and (folder / "config.json").is_file() and any(folder.glob("*.safetensors")))


def cached_hf_folder(path: str | Path, key: str = "FILE") -> Path:
    """The HF folder of a GGUF file in polyrl's cache (``cache_dir()/gguf/STEM-SHA12``), converting it on first use."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such GGUF file")
    sha256 = file_sha256(path)
    folder = cache_dir() / "gguf" / f"{path.stem}-{sha256[:12]}"
    if converted_matches(folder, sha256):
        return folder
    with cache_lock(folder):  # one process converts; the others wait for it and find the folder made
        if converted_matches(folder, sha256):
            return folder
        return convert_gguf(path, folder, key, sha256=sha256)


@contextlib.contextmanager
def cache_lock(folder: Path, timeout: float = 1800.0) -> Any:
    """An exclusive lock (``fcntl.flock`` on ``.NAME.lock`` beside ``folder``) while a cache entry is made; waits
    at most ``timeout`` seconds for another process's (the lock goes with its holder, even one that was killed)."""
    import fcntl
    import time

    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f".{folder.name}.lock"
    with open(path, "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}: another process has been making {folder} for over {timeout:.0f} s; "
                                       "if none is, delete the lock file and try again") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve_gguf(model: Any, key: str) -> None:
    """Point a role's ``model`` block (``key`` = ``actor.model``) at the HF folder of the GGUF it names.

    A block whose ``path`` ends in ``.gguf`` (or that sets ``gguf_file``) gets ``path`` = the cached converted
    folder and ``gguf_file`` = None; a ``tokenizer_path`` ending in ``.gguf`` gets the same. Other blocks are left
    as they are. Called before any worker starts (:func:`polyrl.models.paths.check_model_paths`).
    """
    source = gguf_source(model)
    if source is not None:
        where = f"{key}.gguf_file" if getattr(model, "gguf_file", None) else f"{key}.path"
        model.path = str(cached_hf_folder(source, where))
        if getattr(model, "gguf_file", None):
            model.gguf_file = None
    tok = getattr(model, "tokenizer_path", None)
    if tok and str(tok).lower().endswith(".gguf"):
        model.tokenizer_path = str(cached_hf_folder(tok, f"{key}.tokenizer_path"))
