"""Registers the built-in advantage estimators and policy losses."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_advantage_estimators(register):
    pass


@hookimpl
def register_policy_losses(register):
    pass
