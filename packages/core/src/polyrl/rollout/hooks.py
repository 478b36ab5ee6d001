"""Registers the built-in rollout."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_rollouts(register):
    register("hf", "polyrl.rollout.hf:HFRollout", description="transformers generate on token ids")
