"""Prompt datasets for text-to-image RL in verl's row format, with negative prompts.

A row::

    {"data_source": "ocr",
     "prompt": [{"role": "user", "content": 'an image with the text "lunar garden"'}],
     "negative_prompt": "blurry, low quality",
     "ability": "text_to_image",
     "reward_model": {"style": "rule", "ground_truth": "lunar garden"},
     "extra_info": {"split": "train", "index": 0}}

``prompt`` may also be a plain string. Files are parquet or JSON lines and are read with the
core's dataset loaders (:func:`polyrl.data.dataset.load_rows`), so ``data.train_files`` of a
``flow_grpo`` run takes them as they are; so are Flow-GRPO's own prompt files (``dataset/ocr/train.txt``,
``dataset/pickscore/train.txt``: :func:`load_prompt_lines`; ``dataset/geneval/train_metadata.jsonl``:
:func:`from_flow_grpo`). ``data_source`` picks the image reward when
``reward.function`` is empty (docs/diffusion.md, "Rewards").
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from polyrl.errors import DataError

#: A small built-in vocabulary for offline OCR prompt sets (no download).
OCR_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "lunar", "amber", "cobalt", "forest", "harbor", "maple", "nickel",
    "orbit", "pepper", "quartz", "silver", "tiger", "violet", "winter", "yellow", "zebra", "candle", "delta",
    "ember", "falcon", "glacier", "honey", "island", "jungle", "kettle", "lemon", "marble", "north", "ocean",
    "piano", "rocket", "sunset", "tunnel", "urban", "velvet", "willow", "copper", "meadow", "canyon", "breeze",
)
#: Templates of OCR prompts; ``{text}`` is the ground truth the image must show.
OCR_TEMPLATES = (
    'an image with the text "{text}"',
    'a shop sign that says "{text}"',
    'a poster with the words "{text}" in large letters',
    'a chalkboard with "{text}" written on it',
)


def prompt_row(prompt: str, *, index: int, data_source: str, negative_prompt: str | None = None,
               ground_truth: Any = None, split: str = "train", chat: bool = True,
               extra_info: dict | None = None) -> dict:
    """One row in verl's format; ``chat`` puts the prompt in a one-message chat list (verl's RL datasets do)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"row {index}: prompt must be a non-empty string, got {prompt!r}")
    row: dict[str, Any] = {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}] if chat else prompt,
        "ability": "text_to_image",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **(extra_info or {})},
    }
    if negative_prompt is not None:
        row["negative_prompt"] = negative_prompt
    return row


def prompt_rows(prompts: Iterable[str], *, data_source: str, negative_prompt: str | None = None,
                ground_truths: Sequence[Any] | None = None, split: str = "train", chat: bool = True) -> list[dict]:
    """Rows for ``prompts`` (one negative prompt for all, optional ground truths aligned with the prompts)."""
    prompts = list(prompts)
    if ground_truths is not None and len(ground_truths) != len(prompts):
        raise DataError(f"{len(prompts)} prompts but {len(ground_truths)} ground truths")
    return [prompt_row(p, index=i, data_source=data_source, negative_prompt=negative_prompt,
                       ground_truth=None if ground_truths is None else ground_truths[i], split=split, chat=chat)
            for i, p in enumerate(prompts)]


def ocr_rows(n: int, *, seed: int = 0, words_per_text: tuple[int, int] = (1, 2), split: str = "train",
             negative_prompt: str | None = "blurry, distorted letters, low quality",
             words: Sequence[str] = OCR_WORDS, templates: Sequence[str] = OCR_TEMPLATES,
             data_source: str = "ocr") -> list[dict]:
    """``n`` OCR prompts in the style of Flow-GRPO's text-rendering task: random words ``text`` ->
    a prompt showing ``"text"`` in quotes and ``ground_truth = text``; reproducible from ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    low, high = words_per_text
    if not 1 <= low <= high:
        raise ValueError(f"words_per_text must be (low, high) with 1 <= low <= high, got {words_per_text}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))
        prompt = rng.choice(templates).format(text=text)
        rows.append(prompt_row(prompt, index=i, data_source=data_source, negative_prompt=negative_prompt,
                               ground_truth=text, split=split))
    return rows


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write ``rows`` as parquet (``.parquet``) or JSON lines (``.jsonl``/``.json``); returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), str(path))
    elif path.suffix in (".jsonl", ".json"):
        import json

        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise DataError(f"{path}: write .parquet or .jsonl files")
    return path


def check_prompt_row(row: Any, source: str, i: int) -> None:
    """Raise :class:`~polyrl.errors.DataError` naming the file, row and key when ``row`` is not a prompt row:
    verl's checks plus a string ``negative_prompt`` and a non-empty prompt text."""
    from polyrl.data.dataset import validate_row

    validate_row(row, source, i)
    negative = row.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise DataError(f"{source} row {i}: 'negative_prompt' must be a string, got {type(negative).__name__}")
    prompt = row["prompt"]
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    if not text.strip():
        raise DataError(f"{source} row {i}: the prompt text is empty")


def load_prompt_lines(path: str | Path, *, config: Any = None) -> list[dict]:
    """Rows of a prompt file in Flow-GRPO's text format (``dataset/<task>/<split>.txt``: one prompt a line, blank
    lines skipped; registered as the ``.txt`` dataset loader). ``data_source`` is the folder's name (``ocr``,
    ``pickscore``...; it picks the image reward), ``extra_info`` the split (the file's stem) and line index, and an
    ``ocr`` prompt's ground truth its quoted text (what Flow-GRPO's OCR reward compares with). Prompts stay plain
    strings, as Flow-GRPO passes them."""
    from polyrl_diffusion.rewards import quoted_text

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    task, split = path.parent.name, path.stem
    prompts = [line.strip() for line in lines if line.strip()]
    return [prompt_row(p, index=i, data_source=task, ground_truth=quoted_text(p) if task == "ocr" else None,
                       split=split, chat=False) for i, p in enumerate(prompts)]


#: Flow-GRPO's GenEval prompt files: ``dataset/geneval/<split>_metadata.jsonl``.
GENEVAL_SUFFIX = "_metadata.jsonl"


def from_flow_grpo(rows: list[dict], path: str | Path) -> list[dict]:
    """``rows`` of ``path`` in verl's format: rows of Flow-GRPO's GenEval metadata files (``*_metadata.jsonl``:
    ``{"tag", "include", "prompt", ...}`` without a ``data_source``) get ``data_source="geneval"`` and their metadata
    (everything but the prompt) as ``extra_info``, where a GenEval reward reads it; other rows are kept as they are."""
    name = Path(path).name
    if not name.endswith(GENEVAL_SUFFIX):
        return rows
    split = name[: -len(GENEVAL_SUFFIX)]
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, dict) and "data_source" not in row and "prompt" in row:
            meta = {k: v for k, v in row.items() if k != "prompt"}
            row = {"data_source": "geneval", "prompt": row["prompt"], "ability": "text_to_image",
                   "reward_model": {"style": "rule", "ground_truth": None},
                   "extra_info": {"split": split, "index": i, **meta}}
        out.append(row)
    return out


def load_prompt_rows(path: str | Path) -> list[dict]:
    """Rows of a prompt file (parquet, JSON lines, Flow-GRPO's ``.txt`` and ``*_metadata.jsonl``), read by the
    core's loaders (:func:`from_flow_grpo`) and checked row by row."""
    from polyrl.data.dataset import load_rows

    rows = from_flow_grpo(load_rows(path), path)
    for i, row in enumerate(rows):
        check_prompt_row(row, str(path), i)
    return rows
