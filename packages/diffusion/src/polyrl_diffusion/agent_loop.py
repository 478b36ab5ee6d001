"""Agent loop ``diffusion``: one text-to-image generation per sample, the prompt sent as text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyrl.protocols import AgentLoopOutput, GenerationClient, GenerationRequest, SamplingParams


def prompt_text(prompt: Any) -> str:
    """A row's ``prompt``: a string, or verl's chat messages (the last user message's content)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt:
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        last = (users or [m for m in prompt if isinstance(m, Mapping)] or [{}])[-1]
        return str(last.get("content", ""))
    return "" if prompt is None else str(prompt)


class DiffusionAgentLoop:
    """Send ``sample["prompt"]`` (and ``negative_prompt``) as text in ``multi_modal``; no tokens.

    The flow_grpo trainer adds ``_train_step`` (MixGRPO's window moves with it) and ``_validate`` (ODE
    sampling with the evaluation step count) to each row.
    """

    def __init__(self, *, tokenizer: Any = None, config: Any = None, tools: Any = None) -> None:
        self.tokenizer = tokenizer

    async def run(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                  client: GenerationClient) -> AgentLoopOutput:
        if "prompt" not in sample:
            raise KeyError(f"the diffusion agent loop needs sample['prompt'] (row uid {sample.get('uid')})")
        request = GenerationRequest(
            prompt_ids=[], sampling_params=sampling_params.replace(n=1), request_id=str(sample.get("uid", "")),
            multi_modal={"prompt": prompt_text(sample["prompt"]), "negative_prompt": sample.get("negative_prompt"),
                         "train_step": int(sample.get("_train_step", 0)), "validate": bool(sample.get("_validate")),
                         # the sample's identity for its random streams (set by the flow_grpo worker)
                         "sample_key": sample.get("_sample_key"), "repeat": sample.get("_repeat")})
        (result,) = await client.agenerate(request)
        return AgentLoopOutput(prompt_ids=[], response_ids=[], response_mask=[], log_probs=[], num_turns=1,
                               finish_reason=result.finish_reason, extra=dict(result.extra))
