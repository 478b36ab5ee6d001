"""Reward managers: decode finished samples, call the reward function, put the score on the last token.

A reward call that raises, takes longer than ``reward.timeout_s``, or returns anything but a finite number
(or a dict with a finite ``score``) gives its sample ``reward.fallback_score``; ``reward/failures`` counts
such samples and one warning per kind of failure names the function (with the first traceback). When every
sample of a batch fails, an error is logged and ``reward/all_failed`` is 1. Calls run in a pool of
``reward.num_workers`` threads, so slow (remote, sandboxed) rewards overlap.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.batch import non_tensor
from polyrl.protocols import RewardOutput
from polyrl.rewards.config import RewardConfig

log = logging.getLogger("polyrl.rewards")

_TIMED_OUT = object()


class _Failure:
    """Why a call produced no score: ``kind`` (raised / timeout) and the detail to log."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind, self.detail = kind, detail


def run_calls(fn: Callable[..., Any], calls: Sequence[tuple], *, num_workers: int, timeout_s: float) -> list[Any]:
    """``fn(*args)`` for each ``args`` of ``calls``, in order; a call that raised or ran past ``timeout_s`` gives
    a :class:`_Failure`. Calls run on up to ``num_workers`` daemon threads (0: inline, no timeout); a timed-out
    call's thread is abandoned (Python cannot stop it) and replaced, so it never blocks the run or its exit."""
    if num_workers <= 0:
        out: list[Any] = []
        for args in calls:
            try:
                out.append(fn(*args))
            except Exception:
                out.append(_Failure("raised", traceback.format_exc()))
        return out
    n = len(calls)
    results: list[Any] = [_TIMED_OUT] * n
    started: dict[int, float] = {}  # calls running now -> start time
    done = [False] * n
    remaining = [n]
    lock = threading.Lock()
    queue = list(range(n))
    wake = threading.Event()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
                started[i] = time.monotonic()
            try:
                value = fn(*calls[i])
            except BaseException:  # SystemExit, a library's own timeout...: still this call's failure, never a hang
                value = _Failure("raised", traceback.format_exc())
            with lock:
                if done[i]:  # timed out meanwhile: this thread was given up on
                    return
                results[i], done[i] = value, True
                started.pop(i, None)
                remaining[0] -= 1
            wake.set()

    def spawn() -> None:
        threading.Thread(target=worker, name="polyrl-reward", daemon=True).start()

    for _ in range(min(num_workers, n)):
        spawn()
    while True:
        with lock:
            if remaining[0] == 0:
                break
            now = time.monotonic()
            expired = [i for i, t in started.items() if timeout_s > 0 and now - t > timeout_s]
            for i in expired:
                results[i], done[i] = _Failure("timeout", f"took longer than reward.timeout_s={timeout_s}"), True
                started.pop(i)
                remaining[0] -= 1
            nearest = min((t + timeout_s - now for t in started.values()), default=0.05) if timeout_s > 0 else 0.05
        for _ in expired:
            spawn()
        wake.wait(timeout=max(0.005, min(0.05, nearest)))
        wake.clear()
    return results


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)


class NaiveRewardManager:
    """One ``compute_score`` call per sample (verl's ``naive``)."""

    def __init__(self, *, tokenizer: Any, compute_score: Any, config: RewardConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.config = config or RewardConfig()
        self._warned: set[str] = set()

    def _decode(self, batch: TensorDict) -> tuple[list[str], torch.Tensor]:
        """Response texts and the length of each valid response (its last valid token is at ``length - 1``).

        Valid = non-padding (the response part of ``attention_mask``; ``response_mask`` without it), so
        tool tokens between model turns are decoded too.
        """
        responses, mask = batch["responses"], batch["response_mask"]
        valid = batch["attention_mask"][:, -responses.shape[1]:] if "attention_mask" in batch.keys() else mask
        valid = valid.long()
        # position of the last valid token + 1 (0 for an empty response)
        lengths = torch.where(valid.any(-1), valid.cumsum(-1).argmax(-1) + 1, torch.zeros_like(valid[:, 0]))
        texts = [
            self.tokenizer.decode(responses[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
            for i in range(responses.shape[0])
        ]
        return texts, lengths

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message + " (shown once)", *args)

    def _to_score(self, result: Any) -> tuple[float, dict, bool]:
        """``(score, extra fields, failed)`` of one reward result; anything but a finite number is a failure."""
        name, fallback = _describe(self.compute_score), self.config.fallback_score
        if isinstance(result, _Failure):
            what = "raised" if result.kind == "raised" else "timed out"
            self._warn_once(result.kind, "reward function %s %s; its samples get reward.fallback_score=%s:\n%s",
                            name, what, fallback, result.detail)
            return fallback, {}, True
        extra = dict(result) if isinstance(result, dict) else {}
        value = extra.pop("score", None) if isinstance(result, dict) else result
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            return float(value), extra, False
        shown = "a dict without 'score'" if isinstance(result, dict) and "score" not in result else \
            f"{value!r} ({type(value).__name__})"
        self._warn_once("bad_value", "reward function %s returned %s, not a finite number; such samples get "
                        "reward.fallback_score=%s", name, shown, fallback)
        return fallback, extra, True

    def _score_all(self, results: Sequence[Any], n: int) -> tuple[list[float], dict[str, list], int]:
        scores, extras, failures = [], [], 0
        for result in results:
            score, extra, failed = self._to_score(result)
            scores.append(score)
            extras.append(extra)
            failures += failed
        return scores, _columns(extras, n), failures

    def _scores(self, batch: TensorDict, texts: list[str]) -> tuple[list[float], dict[str, list], int]:
        sources = non_tensor(batch, "data_source", "")
        truths = non_tensor(batch, "ground_truth", None)
        infos = non_tensor(batch, "extra_info", None)
        calls = [(sources[i], text, truths[i], infos[i] or {}) for i, text in enumerate(texts)]
        results = run_calls(self.compute_score, calls, num_workers=self.config.num_workers,
                            timeout_s=self.config.timeout_s)
        return self._score_all(results, len(texts))

    def __call__(self, batch: TensorDict) -> RewardOutput:
        texts, lengths = self._decode(batch)
        scores, extra, failures = self._scores(batch, texts)
        scores_t = torch.tensor(scores, dtype=torch.float32)
        token_scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        rows = torch.arange(len(scores))
        last = (lengths - 1).clamp(min=0)
        token_scores[rows, last] = torch.where(lengths > 0, scores_t, torch.zeros_like(scores_t))
        extra["score"] = scores
        all_failed = bool(scores) and failures == len(scores)
        if all_failed:
            log.error("every sample of this batch (%d) failed in reward function %s and got reward.fallback_score=%s:"
                      " the step learns nothing from rewards. Check the warnings above.", len(scores),
                      _describe(self.compute_score), self.config.fallback_score)
        return RewardOutput(token_scores, extra, {"reward/failures": float(failures),
                                                  "reward/all_failed": float(all_failed)})


class BatchRewardManager(NaiveRewardManager):
    """One call for the whole batch: ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)``
    returning a list of floats or dicts (for batched or remote scoring)."""

    def _scores(self, batch: TensorDict, texts: list[str]) -> tuple[list[float], dict[str, list], int]:
        args = (non_tensor(batch, "data_source", ""), texts, non_tensor(batch, "ground_truth", None),
                non_tensor(batch, "extra_info", None))
        n = len(texts)
        (result,) = run_calls(self.compute_score, [args], num_workers=min(1, self.config.num_workers),
                              timeout_s=self.config.timeout_s)
        if isinstance(result, _Failure):
            self._to_score(result)  # warns once
            return [self.config.fallback_score] * n, {}, n
        try:
            results = list(result)
        except TypeError:
            results = []
        if len(results) != n:
            self._warn_once("bad_length", "batch reward function %s returned %s for %d samples, not a list of %d "
                            "scores; every sample gets reward.fallback_score=%s", _describe(self.compute_score),
                            type(result).__name__, n, n, self.config.fallback_score)
            return [self.config.fallback_score] * n, {}, n
        return self._score_all(results, n)


class DAPORewardManager(NaiveRewardManager):
    """``naive`` plus DAPO's overlong penalty: responses within ``overlong_buffer_len`` tokens of the
    budget lose up to ``overlong_penalty_factor``, linearly."""

    def __call__(self, batch: TensorDict) -> RewardOutput:
        out = super().__call__(batch)
        cfg = self.config
        if not cfg.overlong_buffer_enable:
            return out
        budget = cfg.max_response_length or batch["responses"].shape[1]
        expected = budget - cfg.overlong_buffer_len
        _, valid_lengths = self._decode(batch)
        lengths = valid_lengths.float()
        penalty = (-(lengths - expected) / cfg.overlong_buffer_len * cfg.overlong_penalty_factor).clamp(max=0)
        last = (valid_lengths - 1).clamp(min=0)
        out.token_level_scores[torch.arange(len(last)), last] += penalty
        out.extra["overlong_penalty"] = penalty.tolist()
        out.metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        return out


def _columns(extras: list[dict], n: int) -> dict[str, list]:
    """Per-sample extra fields as columns. A sample without a field (a failed call returns none) gets 0.0 in ``acc``
    (it is not correct) and None in any other column (shown as missing, not as a made-up 0.0; the trainer reads a
    None reward component as 0.0)."""
    keys = {k for e in extras for k in e}
    return {k: [e.get(k, 0.0 if k == "acc" else None) for e in extras] for k in keys}
