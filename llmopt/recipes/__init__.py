"""Recipes: one YAML file for the whole quantize -> eval -> bench -> serve workflow (`llmopt run`).

`load_recipe(path, overrides)` reads a file, resolves `extends`, applies `--set KEY=VALUE`
overrides and validates the result (`schema.Recipe`); `builtin_defaults()` is the default eval
settings and gates that `llmopt eval` uses (`default-gates.yaml`, shipped in this package).
"""

from llmopt.recipes.loader import builtin_defaults, load_recipe
from llmopt.recipes.schema import Recipe

__all__ = ["Recipe", "builtin_defaults", "load_recipe"]
