"""Running agent loops concurrently, batching their generation calls, and collating the outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.protocols import AgentLoopOutput, GenerationRequest, GenerationResult, SamplingParams


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
        try:
            results = self.rollout.generate([r for r, _ in pending])
        except Exception as exc:  # every waiting loop sees the error
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc)
            return
        pos = 0
        for request, fut in pending:
            n = request.sampling_params.n
            fut.set_result(results[pos : pos + n])
            pos += n


def run_agent_loops(samples: Sequence[Mapping[str, Any]], sampling_params: SamplingParams, client: Any,
                    loops: Mapping[str, Any], default: str = "single_turn") -> list[AgentLoopOutput]:
    """One trajectory per sample (a row's ``agent_name`` picks its loop), in input order."""
    for s in samples:
        name = s.get("agent_name") or default
        if name not in loops:
            raise KeyError(f"unknown agent loop '{name}' (row uid {s.get('uid')}); registered: {', '.join(sorted(loops))}")

    async def main() -> list[AgentLoopOutput]:
        return await asyncio.gather(
            *[loops[s.get("agent_name") or default].run(s, sampling_params, client) for s in samples]
        )

    return asyncio.run(main())


def collate(outputs: Sequence[AgentLoopOutput], *, pad_token_id: int, max_prompt_length: int,
            max_response_length: int) -> TensorDict:
    """A batch (field names of :mod:`polyrl.protocols`) from trajectories.

    Prompts are left-padded to ``max_prompt_length`` (longer ones keep their end);
    responses right-padded to ``max_response_length``. The fixed widths let batches
    from different ranks concatenate; engines trim all-padding columns per micro-batch.
    """
    prompts = [list(o.prompt_ids)[-max_prompt_length:] for o in outputs]
    responses = [list(o.response_ids)[:max_response_length] for o in outputs]
    p_len, r_len = max_prompt_length, max_response_length
    b = len(outputs)
    prompt_t = torch.full((b, p_len), pad_token_id, dtype=torch.long)
    prompt_m = torch.zeros((b, p_len), dtype=torch.long)
    resp_t = torch.full((b, r_len), pad_token_id, dtype=torch.long)
    resp_attn = torch.zeros((b, r_len), dtype=torch.long)
    resp_m = torch.zeros((b, r_len), dtype=torch.long)
    logp = torch.zeros((b, r_len), dtype=torch.float32)
    for i, (o, p, r) in enumerate(zip(outputs, prompts, responses)):
        if p:
            prompt_t[i, p_len - len(p):] = torch.tensor(p)
            prompt_m[i, p_len - len(p):] = 1
        if r:
            resp_t[i, : len(r)] = torch.tensor(r)
            resp_attn[i, : len(r)] = 1
            resp_m[i, : len(r)] = torch.tensor(list(o.response_mask)[: len(r)])
            lp = list(o.log_probs)[: len(r)]
            logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    attention = torch.cat([prompt_m, resp_attn], dim=1)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    return TensorDict(
        {
            "prompts": prompt_t,
            "responses": resp_t,
            "response_mask": resp_m,
            "input_ids": torch.cat([prompt_t, resp_t], dim=1),
            "attention_mask": attention,
            "position_ids": position,
            "rollout_log_probs": logp,
            "num_turns": torch.tensor([o.num_turns for o in outputs]),
        },
        batch_size=[b],
    )
