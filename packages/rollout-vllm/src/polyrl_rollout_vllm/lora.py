"""LoRA adapter sync of the vLLM rollout. The implementation is shared with the SGLang rollout and lives in the
core (:mod:`polyrl.rollout.lora_adapter`); this module keeps the old import path working."""

from polyrl.rollout.lora_adapter import PEFT_PREFIX, LoRAAdapterSync

__all__ = ["PEFT_PREFIX", "LoRAAdapterSync"]
