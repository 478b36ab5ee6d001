"""What every engine's ``export_hf`` shares: the HF model skeleton to save weights into, and the tokenizer.

An engine gathers its full weights (HF names) however it shards them, then calls
``meta_hf_model(...).save_pretrained(out, state_dict=tensors)`` and :func:`save_tokenizer` on one rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def meta_hf_model(hf_config: Any, model_config: Any, *, value: bool) -> Any:
    """The role's transformers model class on the meta device (no memory): a causal LM (an image-text-to-text model
    for a vision-language config), or a token classifier for a value model; with the source folder's generation config (eos ids, sampling defaults), else one
    derived from ``hf_config``. ``model_config`` is the role's ``model`` block."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
        GenerationConfig,
    )

    cls = AutoModelForTokenClassification if value else AutoModelForCausalLM
    if not value and getattr(hf_config, "vision_config", None) is not None:  # a vision-language model
        cls = AutoModelForImageTextToText
    with torch.device("meta"):
        model = cls.from_config(hf_config, trust_remote_code=model_config.trust_remote_code)
    if model.can_generate():
        try:  # the model folder's own sampling defaults (eos ids, temperature...), as from_pretrained reads them
            model.generation_config = GenerationConfig.from_pretrained(model_config.path)
        except OSError:
            model.generation_config = GenerationConfig.from_model_config(hf_config)
    return model


def save_tokenizer(model_config: Any, role: str, out: Path) -> None:
    """Write the role's tokenizer (``model.tokenizer_path`` or ``model.path``) next to exported weights; a
    source without one that loads is a warning, not an error (the weights are still usable)."""
    from transformers import AutoTokenizer

    source = model_config.tokenizer_path or model_config.path
    try:
        AutoTokenizer.from_pretrained(source, trust_remote_code=model_config.trust_remote_code).save_pretrained(out)
    except (OSError, ValueError) as exc:
        logger.warning("export %s: no tokenizer written (%s.model.tokenizer_path / %s.model.path=%s has none "
                       "that loads: %s)", out, role, role, source, exc)
    copy_processor_files(source, out)


#: A multimodal model folder's processor files (beside the tokenizer's), copied as they are into an export.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")


def copy_processor_files(source: str, out: Path) -> None:
    """A vision-language model's processor files (image processor config, chat template) from the local
    folder ``source`` into ``out``, where ``out`` lacks them (a Hub id or a text model: nothing to copy)."""
    import shutil

    folder = Path(source)
    for name in PROCESSOR_FILES:
        if (folder / name).is_file() and not (out / name).exists():
            shutil.copyfile(folder / name, out / name)
