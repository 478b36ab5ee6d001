"""Registers the built-in judge-output parsers (kind ``judge_parser``)."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_judge_parsers(register):
    register("score", "polyrl.reward_models.parsers:parse_score_line", description="the last 'Score: N'")
    register("boxed", "polyrl.reward_models.parsers:parse_boxed", description="the number in the last \\boxed{}")
    register("json", "polyrl.reward_models.parsers:parse_json",
             description="the 'score' of the last JSON object that has one")
