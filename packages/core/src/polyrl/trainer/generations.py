"""What a run generated, kept: one JSONL per training step / validation, and rows for the trackers' tables.

``trainer.rollout_data_dir`` (off by default) gets ``<step>.jsonl`` for every training step,
``trainer.validation_data_dir`` (``auto``: ``RUN_DIR/generations/validation``) one for every validation. Each
line is one sample, what was trained on token for token::

    {"step": 3, "kind": "train", "sample_id": "0-5/2", "uid": "0-5-ab12", "data_source": "gsm8k",
     "prompt": "<|user|>...", "response": "... #### 42<|eos|>", "response_length": 17, "ground_truth": "42",
     "score": 1.0, "reward": 1.0, "advantage": 0.87, "reward_extra": {"acc": 1.0}}

``prompt`` and ``response`` are the decoded tokens (special tokens kept, padding dropped); a multi-turn sample
also has ``turns``: the response cut where the loss mask changes, each piece marked ``assistant`` (trained) or
``tool`` (environment tokens, not trained).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops

#: The columns of the trackers' tables, in this order, when the rows have them.
TABLE_COLUMNS = ("step", "sample_id", "data_source", "prompt", "response", "ground_truth", "score", "acc")


def sample_ids(rows: Sequence[dict], n: int) -> list[str]:
    """``<prompt id>/<j>`` for the ``n`` samples of each row: the loader's uid without its random suffix."""
    out = []
    for row in rows:
        uid = str(row.get("uid", ""))
        head, _, _ = uid.rpartition("-")
        out += [f"{head or uid}/{j}" for j in range(n)]
    return out


def generation_rows(batch: TensorDict, tokenizer: Any, *, step: int, kind: str,
                    keep: Sequence[bool] | None = None) -> list[dict]:
    """One JSON-ready dict per sample of a text ``batch`` (see the module docstring); rows where ``keep`` is False
    (validation padding) are left out."""
    responses = batch["responses"]
    width = responses.shape[1]
    attn = batch["attention_mask"] if "attention_mask" in batch.keys() else None
    prompts = batch["prompts"] if "prompts" in batch.keys() else None
    valid = attn[:, -width:].bool() if attn is not None else batch["response_mask"].bool()
    trained = batch["response_mask"].bool()
    fields = {k: batch_ops.non_tensor(batch, k, None) for k in
              ("uid", "sample_id", "data_source", "ground_truth", "reward_extra")}
    scores = batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch.keys() else None
    rewards = batch["token_level_rewards"].sum(-1).tolist() if "token_level_rewards" in batch.keys() else None
    advantages = None
    if "advantages" in batch.keys():
        mask = trained.float()
        advantages = ((batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    out = []
    for i in range(responses.shape[0]):
        if keep is not None and not keep[i]:
            continue
        ids = responses[i][valid[i]].tolist()
        row: dict[str, Any] = {"step": step, "kind": kind, "sample_id": fields["sample_id"][i], "uid": fields["uid"][i],
                               "data_source": fields["data_source"][i]}
        if prompts is not None:
            p_mask = attn[i, : prompts.shape[1]].bool() if attn is not None else torch.ones_like(prompts[i], dtype=torch.bool)
            row["prompt"] = tokenizer.decode(prompts[i][p_mask].tolist(), skip_special_tokens=False)
        row["response"] = tokenizer.decode(ids, skip_special_tokens=False)
        row["response_length"] = len(ids)
        turns = _turns(responses[i], valid[i], trained[i], tokenizer)
        if turns is not None:
            row["turns"] = turns
        row["ground_truth"] = fields["ground_truth"][i]
        if scores is not None:
            row["score"] = scores[i]
        if rewards is not None:
            row["reward"] = rewards[i]
        if advantages is not None:
            row["advantage"] = advantages[i]
        extra = fields["reward_extra"][i]
        if extra:
            row["reward_extra"] = dict(extra)
        out.append(row)
    return out


def _turns(tokens: torch.Tensor, valid: torch.Tensor, trained: torch.Tensor, tokenizer: Any) -> list[dict] | None:
    """The response split where the loss mask changes (assistant / tool pieces); None for a single-turn sample."""
    idx = valid.nonzero().flatten().tolist()
    if not idx or all(bool(trained[j]) for j in idx):
        return None
    pieces: list[dict] = []
    start = 0
    for k in range(1, len(idx) + 1):
        if k == len(idx) or bool(trained[idx[k]]) != bool(trained[idx[start]]):
            ids = [int(tokens[j]) for j in idx[start:k]]
            role = "assistant" if bool(trained[idx[start]]) else "tool"
            pieces.append({"role": role, "text": tokenizer.decode(ids, skip_special_tokens=False), "tokens": len(ids)})
            start = k
    return pieces


def reward_extras(extra: dict[str, Sequence[Any]], n: int) -> list[dict]:
    """Per-sample dicts of a reward output's extra columns (``acc``, ``pred``...; ``score`` left out, and a column the
    sample has no value in: a missing ``pred`` is not shown as ``pred: 0.0``)."""
    cols = {k: v for k, v in extra.items() if k != "score" and isinstance(v, (list, tuple)) and len(v) == n}
    return [{k: _plain(v[i]) for k, v in cols.items() if v[i] is not None} for i in range(n)]


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data (numpy / torch scalars as numbers, anything else unknown as text)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def _json_default(value: Any) -> Any:
    return _plain(value)


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    """Write ``rows`` to ``path`` (replacing it: a resumed run that repeats a step rewrites its file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a generations file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def resolve_dir(setting: str, run_dir: Path, auto: str) -> Path | None:
    """The folder a ``trainer.*_data_dir`` setting names: empty -> None (off), ``auto`` -> ``run_dir / auto``,
    a relative path -> under ``run_dir``."""
    text = (setting or "").strip()
    if not text:
        return None
    if text == "auto":
        return run_dir / auto
    path = Path(text).expanduser()
    return path if path.is_absolute() else run_dir / path


def table(rows: Sequence[dict]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, data)`` of the trackers' table for ``rows`` (the :data:`TABLE_COLUMNS` the rows have)."""
    flat = [{**r, **{k: v for k, v in (r.get("reward_extra") or {}).items() if k not in r}} for r in rows]
    columns = [c for c in TABLE_COLUMNS if any(c in r for r in flat)]
    data = [[_cell(r.get(c)) for c in columns] for r in flat]
    return columns, data


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, default=_json_default)
