"""polyrl-rollout-sglang: the SGLang rollout (registered as rollout ``sglang``)."""
