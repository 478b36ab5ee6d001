"""The default agent loop: one generation from the chat-templated prompt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyrl.protocols import AgentLoopOutput, GenerationClient, GenerationRequest, SamplingParams


class SingleTurnAgentLoop:
    """Generate once from ``sample["prompt_ids"]`` (and a vision-language model's ``sample["multi_modal_data"]``,
    the row's processed images); every response token is trained on."""

    def __init__(self, *, tokenizer: Any = None, config: Any = None, tools: Any = None) -> None:
        self.tokenizer = tokenizer

    async def run(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                  client: GenerationClient) -> AgentLoopOutput:
        if "prompt_ids" not in sample:
            raise KeyError("single_turn needs sample['prompt_ids'] (the dataset applies the chat template)")
        request = GenerationRequest(prompt_ids=list(sample["prompt_ids"]), sampling_params=sampling_params.replace(n=1),
                                    request_id=str(sample.get("uid", "")), multi_modal=sample.get("multi_modal_data"))
        (result,) = await client.agenerate(request)
        return AgentLoopOutput(
            prompt_ids=list(result.prompt_ids),
            response_ids=list(result.response_ids),
            response_mask=[1] * len(result.response_ids),
            log_probs=list(result.log_probs) or [0.0] * len(result.response_ids),
            num_turns=1,
            finish_reason=result.finish_reason,
            extra=dict(result.extra),  # backend outputs reach the batch (see collate)
        )
