"""polyrl-recipes: verl's recipes as a polyrl plugin (docs/recipes.md).

Each recipe is a trainer (``trainer.name``) built on polyrl's PPO loop through its documented extension
points, with its estimator and loss registered like any third-party plugin's:

- ``remax`` (:mod:`polyrl_recipes.remax`), ``vapo`` (:mod:`polyrl_recipes.vapo`), ``pf_ppo``
  (:mod:`polyrl_recipes.pf_ppo`), ``sppo`` (:mod:`polyrl_recipes.sppo`).
"""

from polyrl_recipes.__about__ import __version__

__all__ = ["__version__"]
