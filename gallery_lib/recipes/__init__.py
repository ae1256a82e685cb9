"""Policy: what each run switches on, as recipes of one base config, and the presets that size it.

- ``named``: ``baseline``, ``compiled``, ``peer`` and ``accelerated``, and how a recipe name resolves;
- ``ladder``: the optimization ladder, whose rungs register themselves as recipes beside the named ones;
- ``profiles``: ``smoke``, ``full`` and ``auto``, each family's sizes for a machine.

Recipes sit above the run (``gallery_lib.run`` executes a config; it never chooses one) and below the application
(``gallery_lib.app``), which runs them.
"""

from gallery_lib.recipes.named import (RECIPES, accelerated, all_recipes, apply_recipe, baseline, compiled, describe,
                                       peer, precompile_workers_for_machine, recipe_config, register_recipes,
                                       runs_on_gpu)
from gallery_lib.recipes import ladder  # registers the rungs as recipes
from gallery_lib.recipes.profiles import PROFILES, base_config, resolve_profile

__all__ = ["RECIPES", "PROFILES", "accelerated", "all_recipes", "apply_recipe", "base_config", "baseline", "compiled",
           "describe", "ladder", "peer", "precompile_workers_for_machine", "recipe_config", "register_recipes",
           "resolve_profile", "runs_on_gpu"]
