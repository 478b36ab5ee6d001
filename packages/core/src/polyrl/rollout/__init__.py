"""Rollouts: the built-in transformers rollout ``hf``; vLLM and SGLang come as plugins."""
