"""The RL dataset (chat-templated prompt ids) and a loader whose position survives a restart."""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.errors import DataError

logger = logging.getLogger(__name__)


def load_rows(path: str | Path, plugins: Any = None) -> list[dict]:
    """Rows of one data file, with the loader registered for its suffix (a folder: HF dataset)."""
    from polyrl.plugins import get_plugin_manager

    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    pm = plugins or get_plugin_manager()
    key = "/" if path.is_dir() else path.suffix
    for entry in pm.registry("dataset").entries():
        if key in entry.metadata.get("suffixes", ()):
            try:
                return list(entry.load()(path, config=None))
            except DataError:
                raise
            except (OSError, ValueError) as exc:  # a corrupt parquet, an unreadable file...
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(f"data file {path} cannot be read by the '{entry.name}' loader: {first}") from None
    known = sorted({s for e in pm.registry("dataset").entries() for s in e.metadata.get("suffixes", ())})
    raise DataError(f"data file {path}: no dataset loader for '{key}' files; known: {', '.join(known)}")


def head_rows(path: str | Path, n: int, plugins: Any = None) -> list[dict]:
    """The first ``n`` rows of a data file; JSON lines and parquet are read only that far, other formats whole
    (:func:`load_rows`, which also gives a broken file's error)."""
    path = Path(path)
    if path.suffix == ".jsonl" and path.is_file():
        import json

        rows: list[dict] = []
        try:
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rows.append(json.loads(line))
                        if len(rows) >= n:
                            break
            return rows
        except (UnicodeDecodeError, ValueError):
            pass  # load_rows names the line
    if path.suffix == ".parquet" and path.is_file():
        try:
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(str(path)).iter_batches(batch_size=n), None)
            return batch.to_pylist() if batch is not None else []
        except Exception:  # a corrupt file: load_rows says so
            pass
    return load_rows(path, plugins)[:n]


#: Columns that usually hold the prompt in other data sets (GSM8K, MATH, Alpaca...), in the order they are suggested.
_PROMPT_COLUMNS = ("question", "problem", "query", "instruction", "input", "messages", "text")


def _prompt_key_hint(row: dict) -> str:
    """What to set when a row has no ``prompt``: ``data.prompt_key=<a column that looks like one>``."""
    for name in _PROMPT_COLUMNS:
        if isinstance(row.get(name), (str, list)) and row[name]:
            return f"set data.prompt_key={name} if that column holds the prompt"
    return "set data.prompt_key to the column that holds the prompt"


def validate_row(row: Any, source: str, i: int) -> None:
    """Raise ``DataError`` naming the file, row and key when ``row`` is not in verl's format."""
    where = f"{source} row {i}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    prompt = row.get("prompt")
    if prompt is None:
        raise DataError(f"{where}: missing key 'prompt' (a list of chat messages); the row has {sorted(row)}: "
                        f"{_prompt_key_hint(row)}")
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"{where}: 'prompt' must be a non-empty list of chat messages or a string")
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DataError(f"{where}: prompt[{j}] must be a mapping with 'role' and 'content'")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise DataError(f"{where}: 'reward_model' must be a mapping with 'ground_truth'")


@dataclass(frozen=True)
class RowColumns:
    """Where a row keeps its prompt, data source and ground truth (``data.prompt_key``, ``data.reward_fn_key``,
    ``data.ground_truth_key``); rows are rewritten into verl's names (``prompt``, ``data_source``,
    ``reward_model.ground_truth``) when they are read."""

    prompt: str = "prompt"
    data_source: str = "data_source"
    ground_truth: str = "reward_model.ground_truth"

    @classmethod
    def from_config(cls, data: Any) -> RowColumns:
        """The columns a ``data`` config block names."""
        return cls(getattr(data, "prompt_key", "prompt"), getattr(data, "reward_fn_key", "data_source"),
                   getattr(data, "ground_truth_key", "reward_model.ground_truth"))

    def normalize(self, row: Any, source: str, i: int) -> Any:
        """``row`` with its columns under verl's names (unchanged when the defaults are used)."""
        if not isinstance(row, dict) or self == RowColumns():
            return row
        row = dict(row)
        if self.prompt != "prompt":
            if self.prompt not in row:
                raise DataError(f"{source} row {i}: missing column '{self.prompt}' (data.prompt_key); the row has "
                                f"{sorted(row)}")
            row["prompt"] = row[self.prompt]
        if self.data_source != "data_source":
            row["data_source"] = row.get(self.data_source)
        if self.ground_truth != "reward_model.ground_truth":
            truth = dotted_get(row, self.ground_truth)
            row["reward_model"] = {**(row.get("reward_model") or {}), "ground_truth": truth}
        return row


def dotted_get(row: Any, key: str, default: Any = None) -> Any:
    """``row["a"]["b"]`` for ``key`` ``a.b`` (``default`` where a part is missing)."""
    node = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


class RLDataset:
    """Prompts ready for generation: rows plus ``prompt_ids`` after the chat template.

    ``truncation``: ``error`` (raise naming the row), ``left`` / ``right`` (cut the
    prompt), ``filter`` (drop the row). ``stats`` counts what was filtered or truncated.

    A prompt far longer than ``max_prompt_length`` is never tokenized whole (a 10 MB line took 4 GB): a row
    with more than :func:`char_clip` characters of content is first tokenized from a clip of that many
    characters (its start, or its end for ``left``), which already holds more tokens than the limit; the
    row's fate is decided from that. Rows below the clip length are tokenized exactly as before.

    Rows with images (``image_key``, verl's ``images`` column; :mod:`polyrl.data.multimodal`) need the
    vision-language model's ``processor``: their ``prompt_ids`` are what the processor makes of the prompt
    rendered with its chat template, their image paths are resolved (relative to the data file's folder,
    else the working directory). A row whose images cannot be used (a file that does not exist or is not
    an image, more or fewer ``<image>`` placeholders than images, an image the processor refuses) is a
    ``DataError`` naming the file, row and image with ``on_bad_row="error"``, or skipped and counted
    (``stats["bad_rows"]``) with ``"skip"``. A prompt with images is never cut: over the length limit it is
    filtered (or an error with ``truncation="error"``). Images larger than the processor keeps are resized
    down by it and counted (``stats["images_downscaled"]``).
    """

    def __init__(self, files: Sequence[str | Path], tokenizer: Any, *, max_prompt_length: int,
                 truncation: str = "error", chat_template: bool = True, columns: RowColumns | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, processor: Any = None,
                 image_key: str = "images", on_bad_row: str = "error") -> None:
        if truncation not in ("error", "left", "right", "filter"):
            raise DataError(f"data.truncation={truncation!r}: choose error, left, right or filter")
        if on_bad_row not in ("error", "skip"):
            raise DataError(f"data.on_bad_row={on_bad_row!r}: choose error or skip")
        self.rows: list[dict] = []
        self.stats = {"rows": 0, "filtered": 0, "truncated": 0}
        self.processor, self.image_key, self.on_bad_row = processor, image_key, on_bad_row
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        columns = columns or RowColumns()
        clip = char_clip(tokenizer, max_prompt_length)
        for file in files:
            for i, row in enumerate(load_rows(file)):
                row = columns.normalize(row, str(file), i)
                validate_row(row, str(file), i)
                if self._has_images(row, file, i):
                    self._add_image_row(row, file, i, max_prompt_length, truncation, chat_template)
                    continue
                if chat_template and not isinstance(row["prompt"], str) and not getattr(tokenizer, "chat_template", None):
                    raise DataError(
                        f"{file} row {i}: the prompt is chat messages but the model's tokenizer has no chat template "
                        "(data.apply_chat_template=true): use a model that has one (an Instruct or Chat model), point "
                        "actor.model.tokenizer_path at a tokenizer with one, or set data.apply_chat_template=false to "
                        "give the model the messages' text joined by newlines")
                ids, over = _bounded_prompt_ids(row["prompt"], tokenizer, chat_template, clip, max_prompt_length,
                                                keep_end=truncation == "left", kwargs=chat_template_kwargs)
                self.stats["rows"] += 1
                if over or len(ids) > max_prompt_length:
                    if truncation == "error":
                        size = f"at least {len(ids)} tokens (from a clip of its {clip} first characters)" if over \
                            else f"{len(ids)} tokens"
                        raise DataError(
                            f"{file} row {i}: prompt is {size}, over data.max_prompt_length="
                            f"{max_prompt_length}; raise it or set data.truncation to filter/left/right"
                        )
                    if truncation == "filter":
                        self.stats["filtered"] += 1
                        continue
                    ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                    self.stats["truncated"] += 1
                self.rows.append(dict(row, prompt_ids=ids))
        if self.stats["filtered"] or self.stats["truncated"]:
            logger.warning("data: %d over-long prompts filtered, %d truncated (of %d)", self.stats["filtered"],
                           self.stats["truncated"], self.stats["rows"])
        if self.stats.get("bad_rows"):
            logger.warning("data: %d rows with unusable images skipped (data.on_bad_row=skip) of %d",
                           self.stats["bad_rows"], self.stats["rows"])
        if self.stats.get("images_downscaled"):
            logger.info("data: %d images larger than the processor keeps are resized down by it",
                        self.stats["images_downscaled"])

    # ------------------------------------------------------------------ rows with images
    def _has_images(self, row: dict, file: str | Path, i: int) -> bool:
        """Whether ``row`` takes the image path: it has images, or (with a processor) ``<image>`` placeholders."""
        from polyrl.data.multimodal import count_placeholders, row_images

        if row_images(row, self.image_key):
            if self.processor is None:
                raise DataError(
                    f"{file} row {i} has images ('{self.image_key}') but the model is text-only (it has no image "
                    "processor): train a vision-language model (Qwen2-VL, Qwen2.5-VL), or drop the images column "
                    "(data.image_key names it)")
            return True
        return self.processor is not None and count_placeholders(row["prompt"]) > 0

    def _add_image_row(self, row: dict, file: str | Path, i: int, max_prompt_length: int, truncation: str,
                       chat_template: bool) -> None:
        from polyrl.data.multimodal import encode_image_prompt, row_images

        self.stats["rows"] += 1
        for key in ("bad_rows", "images", "images_downscaled"):
            self.stats.setdefault(key, 0)
        if not chat_template:
            raise DataError(f"{file} row {i} has images, which need the processor's chat template: set "
                            "data.apply_chat_template=true")
        images = row_images(row, self.image_key)
        try:
            ids, resolved, downscaled = encode_image_prompt(row["prompt"], images, self.processor,
                                                            base_dir=Path(file).resolve().parent,
                                                            chat_template_kwargs=self.chat_template_kwargs)
        except ValueError as exc:
            message = f"{file} row {i}: {exc}"
            if self.on_bad_row == "error":
                raise DataError(f"{message}. Fix the row, or set data.on_bad_row=skip to skip such rows") from None
            logger.warning("%s; row skipped (data.on_bad_row=skip)", message)
            self.stats["bad_rows"] += 1
            return
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise DataError(f"{file} row {i}: prompt is {len(ids)} tokens with its images, over "
                                f"data.max_prompt_length={max_prompt_length}; raise it, or set data.truncation=filter")
            if truncation in ("left", "right"):  # cutting would cut an image's tokens: the row is dropped instead
                logger.warning("%s row %d: a prompt with images (%d tokens) is never cut; filtered instead "
                               "(data.truncation=%s)", file, i, len(ids), truncation)
            self.stats["filtered"] += 1
            return
        self.stats["images"] += len(resolved)
        self.stats["images_downscaled"] += downscaled
        self.rows.append(dict(row, prompt_ids=ids, **{self.image_key: resolved}))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


#: Tokens of slack between a clip's and the whole prompt's count (the template's closing text, the cut token).
_CLIP_SLACK = 64


def char_clip(tokenizer: Any, max_prompt_length: int) -> int:
    """How many characters of prompt content certainly make more than ``max_prompt_length`` tokens (plus
    slack): no token of ``tokenizer`` spells more than its longest vocabulary entry, so ``n`` tokens cover at
    most ``n * longest`` characters. Twice that, for normalizers that merge characters."""
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=16)
    except Exception:  # a tokenizer without a vocabulary listing
        longest = 64
    return 2 * (max_prompt_length + _CLIP_SLACK) * max(longest, 1)


def _bounded_prompt_ids(prompt: Any, tokenizer: Any, chat_template: bool, clip: int, max_prompt_length: int,
                        *, keep_end: bool, kwargs: dict[str, Any] | None = None) -> tuple[list[int], bool]:
    """``(ids, certainly_over)``: the prompt's ids, or for a prompt longer than ``clip`` characters the ids of
    a clip of it (its end with ``keep_end``) when those alone exceed the limit."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    contents = [m.get("content") for m in messages]
    if all(isinstance(c, str) for c in contents) and sum(len(c) for c in contents) > clip:
        ids = _prompt_ids(_clip_messages(messages, clip, keep_end), tokenizer, chat_template, kwargs)
        if len(ids) > max_prompt_length + _CLIP_SLACK:
            return ids, True
    return _prompt_ids(messages, tokenizer, chat_template, kwargs), False


def _clip_messages(messages: list[dict], chars: int, keep_end: bool) -> list[dict]:
    """The first (or with ``keep_end`` the last) ``chars`` characters of the messages' contents, in order."""
    out: list[dict] = []
    left = chars
    for m in (reversed(messages) if keep_end else messages):
        if left <= 0:
            break
        content = m["content"]
        part = content[-left:] if keep_end else content[:left]
        left -= len(part)
        out.append(dict(m, content=part))
    return list(reversed(out)) if keep_end else out


def _prompt_ids(prompt: Any, tokenizer: Any, chat_template: bool, kwargs: dict[str, Any] | None = None) -> list[int]:
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, **(kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in prompt)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


class RLDataLoader:
    """Batches of rows (each with a fresh ``uid``) in a seeded order; ``state_dict`` records the position.

    The order of epoch ``e`` depends only on ``seed`` and ``e``, so a loader restored
    from ``state_dict()`` yields exactly the batches an uninterrupted one would.
    """

    def __init__(self, dataset: RLDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.dataset, self.batch_size, self.shuffle, self.seed, self.drop_last = dataset, batch_size, shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0  # batches already yielded in this epoch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[dict]]:
        """The rest of the current epoch; iterate again for the next one."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            idx = order[start : start + self.batch_size]
            self.position += 1
            yield [dict(self.dataset[i], uid=f"{self.epoch}-{start + k}-{uuid.uuid4().hex[:8]}")
                   for k, i in enumerate(idx)]

    def state_dict(self) -> dict[str, int]:
        """Epoch and batches consumed in it."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
