"""RL algorithms: advantage estimators, policy losses, KL, loss aggregation."""
