"""polyrl-rollout-vllm: the vLLM rollout (registered as rollout ``vllm``)."""
