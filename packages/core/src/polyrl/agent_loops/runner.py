"""Running agent loops concurrently, batching their generation calls, and collating the outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.protocols import AgentLoopOutput, GenerationRequest, GenerationResult, SamplingParams

logger = logging.getLogger(__name__)


class BatchingClient:
    """An ``agenerate`` front for a batch-only rollout: concurrent calls are served by one ``generate``.

    Requests that arrive while the event loop has other ready coroutines are
    collected (up to ``max_batch_size``) and sent together, so N concurrent
    single-turn loops cost one batched generation, not N.
    """

    def __init__(self, rollout: Any, max_batch_size: int = 64) -> None:
        self.rollout = rollout
        self.max_batch_size = max_batch_size
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._flush_scheduled = False

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((request, future))
        if len(self._pending) >= self.max_batch_size:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush_when_idle, 0)
        return await future

    def _flush_when_idle(self, rounds: int) -> None:
        # Give other ready coroutines a few turns to submit before generating.
        if rounds < 3:
            asyncio.get_running_loop().call_soon(self._flush_when_idle, rounds + 1)
            return
        self._flush_scheduled = False
        self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        requests = [r for r, _ in pending]
        try:
            results = self.rollout.generate(self._shared_budgets(requests))
        except Exception as exc:  # every waiting loop sees the error
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc)
            return
        pos = 0
        for request, fut in pending:
            n = request.sampling_params.n
            fut.set_result([_cut(r, request.sampling_params.max_new_tokens) for r in results[pos : pos + n]])
            pos += n

    def _shared_budgets(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Requests that differ only in ``max_new_tokens`` (multi-turn loops: each trajectory has its own
        budget left) get the largest of them, so a rollout that batches equal sampling params batches them
        together; results are cut back to each request's own budget. Only where the rollout states its
        ``max_model_len`` and every merged request still fits it."""
        # declared on Rollout (None: no limit); a rollout written before it was declared may not have it
        limit = getattr(self.rollout, "max_model_len", None)
        if not isinstance(limit, int) or limit <= 0 or len(requests) < 2:
            return requests
        first = requests[0].sampling_params
        if all(r.sampling_params is first or r.sampling_params == first for r in requests):
            return requests  # one sampling setting (single-turn loops): nothing to merge
        largest: dict[Any, int] = {}
        for r in requests:
            key = repr(r.sampling_params.replace(max_new_tokens=0))
            largest[key] = max(largest.get(key, 0), r.sampling_params.max_new_tokens)
        out = []
        for r in requests:
            budget = largest[repr(r.sampling_params.replace(max_new_tokens=0))]
            if budget != r.sampling_params.max_new_tokens and len(r.prompt_ids) + budget <= limit:
                r = dataclasses.replace(r, sampling_params=r.sampling_params.replace(max_new_tokens=budget))
            out.append(r)
        return out


def _cut(result: GenerationResult, budget: int) -> GenerationResult:
    """``result`` limited to ``budget`` tokens (a prefix of a sample is the sample under that budget)."""
    if len(result.response_ids) <= budget:
        return result
    return dataclasses.replace(result, response_ids=list(result.response_ids[:budget]),
                               log_probs=list(result.log_probs[:budget]), finish_reason="length")


def run_agent_loops(samples: Sequence[Mapping[str, Any]], sampling_params: SamplingParams, client: Any,
                    loops: Mapping[str, Any], default: str = "single_turn") -> list[AgentLoopOutput]:
    """One trajectory per sample (a row's ``agent_name`` picks its loop), in input order.

    A loop that returns a list (one output per step: ``stepwise``) contributes each of its outputs, in order;
    then every output carries ``extra["step_index"]`` (0 on the first output of each sample: where a sample's
    rows start, which :func:`sample_of_rows` reads back)."""
    for s in samples:
        name = s.get("agent_name") or default
        if name not in loops:
            raise KeyError(f"unknown agent loop '{name}' (row uid {s.get('uid')}); registered: {', '.join(sorted(loops))}")

    outputs: list[AgentLoopOutput] = []

    async def main() -> None:
        outputs.extend(await asyncio.gather(
            *[loops[s.get("agent_name") or default].run(s, sampling_params, client) for s in samples]
        ))

    # The task returns None, not the outputs: on the main thread asyncio.run's SIGINT bookkeeping
    # (signal.getsignal -> enum lookup of a partial holding the finished task) builds the task's repr, result
    # included; with tensors in the outputs (image rollouts) that repr cost 0.3 s per call.
    asyncio.run(main())
    if not any(isinstance(o, list) for o in outputs):
        return outputs
    flat: list[AgentLoopOutput] = []
    for j, out in enumerate(outputs):
        steps = out if isinstance(out, list) else [out]
        if not steps:
            raise ValueError(f"agent loop '{samples[j].get('agent_name') or default}' returned no output for row uid "
                             f"{samples[j].get('uid')}: a loop returns at least one")
        for t, step in enumerate(steps):
            step.extra.setdefault("step_index", torch.tensor(t, dtype=torch.long))
            flat.append(step)
    return flat


def sample_of_rows(batch: TensorDict, n_samples: int) -> list[int] | None:
    """For a batch generated for ``n_samples`` samples, the sample each row belongs to; None when there is one
    row per sample (the usual case). Rows of one sample are consecutive and the first has ``step_index`` 0
    (:func:`run_agent_loops`)."""
    rows = batch.batch_size[0]
    # a [rows] field only: a diffusion rollout's ``step_index`` is [rows, T], its sampler's steps, one row a sample
    if "step_index" not in batch.keys() or batch["step_index"].dim() != 1:
        if rows != n_samples:
            raise ValueError(f"{rows} rows were generated for {n_samples} samples, and no 'step_index' field says "
                             "which rows belong to which sample")
        return None
    starts = (batch["step_index"] == 0).nonzero().flatten().tolist()
    if len(starts) == rows == n_samples:
        return None
    if len(starts) != n_samples or starts[:1] != [0]:
        raise ValueError(f"{rows} rows for {n_samples} samples, but 'step_index' starts {len(starts)} samples")
    owner = torch.zeros(rows, dtype=torch.long)
    owner[starts[1:]] = 1
    return owner.cumsum(0).tolist()


#: Per-sample agent statistics collated into ``[B]`` tensor fields (0 for loops that do not report them).
#: ``tools_hung`` is the number of synchronous-tool threads stuck in calls that timed out, in the process
#: that ran the loop, when the trajectory ended (see :class:`polyrl.tools.function.ToolThreads`).
AGENT_FIELDS = ("tool_calls", "tool_errors", "tool_time_s", "tool_reward", "truncated", "parse_errors",
                "tool_timeouts", "tools_hung")


def _turn_boundary_cut(mask: Sequence[int], limit: int) -> int:
    """The longest prefix of at most ``limit`` tokens that ends where a segment (model turn or tool
    message) ends; ``limit`` itself when the first segment is already longer."""
    cut = 0
    for i in range(1, min(limit, len(mask)) + 1):
        if i == len(mask) or mask[i] != mask[i - 1]:
            cut = i
    return cut or limit


def collate(outputs: Sequence[AgentLoopOutput], *, pad_token_id: int, max_prompt_length: int,
            max_response_length: int) -> TensorDict:
    """A batch (field names of :mod:`polyrl.protocols`) from trajectories.

    Prompts are left-padded to ``max_prompt_length`` (longer ones keep their end);
    responses right-padded to ``max_response_length``. The fixed widths let batches
    from different ranks concatenate; engines trim all-padding columns per micro-batch.
    A response longer than ``max_response_length`` is cut at its last turn boundary
    that fits, flagged in the ``truncated`` field (and the ``agent/truncated`` metric)
    and logged, never cut silently. Agent statistics (``num_turns`` and
    :data:`AGENT_FIELDS`) become ``[B]`` fields.
    """
    prompts = [list(o.prompt_ids)[-max_prompt_length:] for o in outputs]
    for o in outputs:
        if len(o.prompt_ids) > max_prompt_length:
            logger.warning("a prompt of %d tokens (after the agent loop rendered it) is longer than "
                           "data.max_prompt_length=%d: its start is cut", len(o.prompt_ids), max_prompt_length)
    responses = []
    truncated = []
    for o in outputs:
        r = list(o.response_ids)
        cut = len(r) > max_response_length
        if cut:
            keep = _turn_boundary_cut(list(o.response_mask), max_response_length)
            logger.warning("trajectory of %d response tokens is longer than data.max_response_length=%d: cut at a "
                           "turn boundary to %d tokens (finish_reason 'truncated')", len(r), max_response_length, keep)
            r = r[:keep]
            o.finish_reason = "truncated"
        responses.append(r)
        truncated.append(cut or bool(o.metrics.get("truncated", 0.0)) or o.finish_reason in ("length", "max_turns"))
    p_len, r_len = max_prompt_length, max_response_length
    b = len(outputs)
    # padded rows as python lists, one tensor per field (a tensor write per row and field cost 18 ms for 256 rows)
    pad_p = [p_len - len(p) for p in prompts]
    pad_r = [r_len - len(r) for r in responses]
    prompt_t = torch.tensor([[pad_token_id] * k + p for p, k in zip(prompts, pad_p)], dtype=torch.long).view(b, p_len)
    prompt_m = torch.tensor([[0] * k + [1] * (p_len - k) for k in pad_p], dtype=torch.long).view(b, p_len)
    resp_t = torch.tensor([r + [pad_token_id] * k for r, k in zip(responses, pad_r)], dtype=torch.long).view(b, r_len)
    resp_attn = torch.tensor([[1] * (r_len - k) + [0] * k for k in pad_r], dtype=torch.long).view(b, r_len)
    resp_m = torch.tensor([list(o.response_mask)[: len(r)] + [0] * k for o, r, k in zip(outputs, responses, pad_r)],
                          dtype=torch.long).view(b, r_len)
    logps = [list(o.log_probs)[: len(r)] for o, r in zip(outputs, responses)]
    logp = torch.tensor([lp + [0.0] * (r_len - len(lp)) for lp in logps], dtype=torch.float32).view(b, r_len)
    attention = torch.cat([prompt_m, resp_attn], dim=1)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    fields = {
        "prompts": prompt_t,
        "responses": resp_t,
        "response_mask": resp_m,
        "input_ids": torch.cat([prompt_t, resp_t], dim=1),
        "attention_mask": attention,
        "position_ids": position,
        "rollout_log_probs": logp,
        "num_turns": torch.tensor([o.num_turns for o in outputs]),
    }
    for name in AGENT_FIELDS:
        values = [float(o.metrics.get(name, 0.0)) for o in outputs]
        if name == "truncated":
            values = [float(t) for t in truncated]
        fields[name] = torch.tensor(values, dtype=torch.float32)
    batch = TensorDict(fields, batch_size=[b])
    _add_extras(batch, outputs)
    return batch


def _add_extras(batch: TensorDict, outputs: Sequence[AgentLoopOutput]) -> None:
    """``AgentLoopOutput.extra`` into the batch: numbers and same-shape tensors as ``[B, ...]`` fields,
    anything else (or a key some samples lack) as a non-tensor field."""
    from polyrl.batch import set_non_tensor

    keys = sorted({k for o in outputs for k in o.extra})
    for key in keys:
        if key in batch.keys():
            raise ValueError(f"agent loop extra '{key}' would overwrite the batch field of the same name; rename it")
        values = [o.extra.get(key) for o in outputs]
        if all(isinstance(v, (int, float, bool)) and not isinstance(v, str) for v in values):
            batch[key] = torch.tensor([float(v) for v in values])
        elif all(isinstance(v, torch.Tensor) for v in values) and len({tuple(v.shape) for v in values}) == 1:
            batch[key] = torch.stack(values)
        else:
            set_non_tensor(batch, key, values)


def agent_metrics(batch: TensorDict) -> dict[str, float]:
    """``agent/*`` metrics of a collated batch: turns, tool calls / errors / time, tool use, truncations,
    malformed calls (``parse_errors``), timed-out calls, and synchronous-tool threads hanging; with step rows
    (the ``stepwise`` loop), :func:`environment_metrics` too."""
    if "tool_calls" not in batch.keys():
        return environment_metrics(batch)
    calls = batch["tool_calls"].float()
    turns = batch["num_turns"].float()
    return {
        "agent/turns/mean": float(turns.mean()),
        "agent/turns/max": float(turns.max()),
        "agent/tool_calls/mean": float(calls.mean()),
        "agent/tool_calls/total": float(calls.sum()),
        "agent/tool_use_rate": float((calls > 0).float().mean()),
        "agent/tool_errors/total": float(batch["tool_errors"].sum()),
        "agent/tool_error_rate": float(batch["tool_errors"].sum() / calls.sum().clamp(min=1)),
        "agent/tool_time_s/mean": float(batch["tool_time_s"].mean()),
        "agent/tool_reward/mean": float(batch["tool_reward"].mean()),
        "agent/truncated": float(batch["truncated"].mean()),
        **({"agent/parse_errors/total": float(batch["parse_errors"].sum()),
            "agent/tool_timeouts/total": float(batch["tool_timeouts"].sum()),
            "agent/tools_hung": float(batch["tools_hung"].max())} if "tools_hung" in batch.keys() else {}),
        **loop_counters(batch),
        **environment_metrics(batch),
    }


def loop_counters(batch: TensorDict) -> dict[str, float]:
    """A loop's own counters: a numeric ``AgentLoopOutput.extra`` named ``agent_<name>`` is summed over the batch's
    rows into ``agent/<name>/total`` (the rows that pad a batch of step rows, ``step_padding`` 1, left out)."""
    keep = (1.0 - batch["step_padding"].float()) if "step_padding" in batch.keys() else None
    out = {}
    for key in sorted(batch.keys()):
        if isinstance(key, str) and key.startswith("agent_") and batch[key].dim() == 1:
            values = batch[key].float()
            out[f"agent/{key[6:]}/total"] = float((values * keep if keep is not None else values).sum())
    return out


def environment_metrics(batch: TensorDict) -> dict[str, float]:
    """``env/*`` metrics of a batch of step rows (the ``stepwise`` loop): per episode (its last row) the success
    rate, return and steps; the totals of malformed actions and of environment failures (errors, timeouts,
    non-finite rewards, unhashable state keys, prompts grown past ``data.max_prompt_length``)."""
    if "episode_end" not in batch.keys():
        return {}
    from polyrl.agent_loops.stepwise import EPISODE_COUNTS

    ends = batch["episode_end"].float()
    episodes = ends.sum().clamp(min=1)
    out = {"env/episodes": float(ends.sum()),
           "env/success_rate": float((batch["episode_success"].float() * ends).sum() / episodes),
           "env/steps/mean": float((batch["episode_steps"].float() * ends).sum() / episodes),
           "env/step_rows": float(batch.batch_size[0])}
    if "tool_reward" in batch.keys():
        out["env/return/mean"] = float((batch["tool_reward"].float() * ends).sum() / episodes)
    for name in EPISODE_COUNTS:
        if name in batch.keys():
            out[f"env/{name}"] = float((batch[name].float() * ends).sum())
    return out


def fold_tool_rewards(batch: TensorDict, config: Any) -> None:
    """Add the tools' rewards (``ToolResult.reward``, summed per sample) to ``token_level_scores``.

    ``config`` is the ``agent`` block: ``tool_reward`` ``sum`` adds ``tool_reward_coef`` times the sum
    at the last response token (where outcome rewards sit); ``none`` leaves the scores alone.
    """
    mode = getattr(config, "tool_reward", "sum")
    if mode == "none" or "tool_reward" not in batch.keys():
        return
    if mode != "sum":
        raise ValueError(f"agent.tool_reward={mode!r}: choose 'sum' or 'none'")
    rewards = batch["tool_reward"].float() * float(getattr(config, "tool_reward_coef", 1.0))
    if not bool((rewards != 0).any()):
        return
    r_len = batch["responses"].shape[1]
    last = (batch["attention_mask"][:, -r_len:].sum(-1) - 1).clamp(min=0)
    scores = batch["token_level_scores"].clone()
    scores[torch.arange(scores.shape[0]), last] += rewards.to(scores.dtype)
    batch["token_level_scores"] = scores
