"""``search``: Search-R1's question answering with a search engine, over a local corpus and a BM25 index.

Each step the model writes either ``<search>query</search>`` (the observation is the top ``topk`` passages, in
Search-R1's ``<information>Doc 1(Title: ...) ...</information>`` form) or ``<answer>...</answer>`` (the episode
ends with Search-R1's reward: :func:`polyrl.rewards.functions.search_r1_score` against the row's
``reward_model.ground_truth``, the exact match verl's Search-R1 recipe scores with). Text with neither tag is a
malformed action. The question is the row's ``extra_info.question`` (else its last user message).

The corpus is a JSONL file (``env_kwargs.corpus``) of Search-R1's ``{"id", "contents": "\\"Title\\"\\ntext"}``
lines or ``{"title", "text"}`` lines; its BM25 index (the ``rank_bm25`` library, ``pip install 'polyrl[search]'``)
is built once per process and file version and shared by every trajectory.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TOKEN = re.compile(r"\w+")
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)


def tokenize(text: str) -> list[str]:
    """Lower-case word tokens (BM25's terms)."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Passage:
    """One corpus entry."""

    title: str
    text: str


class BM25Index:
    """A BM25 (Okapi) index over passages, through ``rank_bm25``."""

    def __init__(self, passages: list[Passage]) -> None:
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as exc:  # an optional dependency: say how to get it
            raise ImportError("the search environment needs rank_bm25: pip install 'polyrl[search]'") from exc
        if not passages:
            raise ValueError("search: the corpus has no passages")
        self.passages = passages
        self.bm25 = BM25Okapi([tokenize(f"{p.title} {p.text}") or [""] for p in passages])

    def search(self, query: str, topk: int) -> list[Passage]:
        """The ``topk`` passages with the highest BM25 score for ``query`` (ties: corpus order)."""
        scores = self.bm25.get_scores(tokenize(query))
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.passages[i] for i in order[:topk]]


def read_corpus(path: str | Path) -> list[Passage]:
    """The passages of a JSONL corpus (see the module docstring); ``ValueError`` naming the file and line."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                if "contents" in doc:
                    title, _, text = str(doc["contents"]).partition("\n")
                    out.append(Passage(title.strip().strip('"'), text.strip()))
                else:
                    out.append(Passage(str(doc.get("title", "")), str(doc["text"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"search: corpus {path} line {n}: expected a JSON object with 'contents' or "
                                 f"'title' and 'text' ({exc})") from None
    return out


_INDEXES: dict[tuple[str, int, int], BM25Index] = {}
_LOCK = threading.Lock()


def corpus_index(path: str | Path) -> BM25Index:
    """The BM25 index of the corpus file at ``path``, built once per process and file version (size, mtime)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"search: env_kwargs.corpus {path} is not a file")
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        if key not in _INDEXES:
            for old in [k for k in _INDEXES if k[0] == key[0]]:  # an older version of the file: drop it
                del _INDEXES[old]
            _INDEXES[key] = BM25Index(read_corpus(resolved))
        return _INDEXES[key]


def passages_text(passages: list[Passage], max_chars: int) -> str:
    """Search-R1's observation: ``<information>Doc 1(Title: T) text\\n...</information>``, each passage cut at
    ``max_chars`` characters."""
    docs = "".join(f"Doc {i + 1}(Title: {p.title}) {p.text[:max_chars]}\n" for i, p in enumerate(passages))
    return f"<information>{docs.strip()}</information>"


class SearchEnvironment:
    """The ``search`` environment; ``config``: ``corpus`` (a JSONL path, required), ``topk`` (3), ``max_chars``
    (500 per passage), ``data_source`` (``searchR1_nq``: the name Search-R1's reward is called with)."""

    def __init__(self, corpus: str, topk: int = 3, max_chars: int = 500, data_source: str = "searchR1_nq") -> None:
        self.index = corpus_index(corpus)
        self.topk, self.max_chars, self.data_source = int(topk), int(max_chars), data_source
        self.ground_truth: Any = None
        self.done = True

    def reset(self, seed: int, row: Mapping[str, Any]) -> str:
        """The question (``seed`` plays no part: the row is the episode)."""
        self.ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        self.done = False
        question = (row.get("extra_info") or {}).get("question")
        if not question:
            users = [m.get("content", "") for m in row.get("prompt") or [] if isinstance(m, Mapping)
                     and m.get("role") == "user"]
            question = users[-1] if users else ""
        return f"Question: {question}"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """A search (its passages) or an answer (Search-R1's reward; the episode ends)."""
        from polyrl.rewards.functions import search_r1_score

        if self.done:
            raise ValueError("search: step() after the episode ended; call reset()")
        found = _TAG.findall(action)
        if not found:
            raise ValueError(f"search: no <search>...</search> or <answer>...</answer> in {action[:60]!r}")
        kind, content = found[-1]
        if kind == "search":
            return passages_text(self.index.search(content, self.topk), self.max_chars), 0.0, False, {}
        self.done = True
        if self.ground_truth is None:
            return "", 0.0, True, {"success": False}
        result = search_r1_score(self.data_source, f"<answer>{content}</answer>", self.ground_truth)
        return "", float(result["score"]), True, {"success": bool(result["acc"])}


def make_search(config: Mapping[str, Any] | None = None) -> SearchEnvironment:
    """The factory ``register_environments`` names: ``config`` is the row's ``extra_info.env_kwargs``."""
    options = dict(config or {})
    unknown = sorted(set(options) - {"corpus", "topk", "max_chars", "data_source"})
    if unknown or "corpus" not in options:
        raise ValueError(f"search: env_kwargs needs 'corpus' (a JSONL file) and takes topk, max_chars, data_source; "
                         f"got {sorted(options)}")
    return SearchEnvironment(str(options["corpus"]), topk=int(options.get("topk", 3)),
                             max_chars=int(options.get("max_chars", 500)),
                             data_source=str(options.get("data_source", "searchR1_nq")))
