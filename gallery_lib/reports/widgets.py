"""Optional ipywidgets controls that fill a notebook's run config.

They only edit values; they never start work or wait for a click, so a notebook runs the same
headless under papermill (where ``interactive=False`` skips them) as in JupyterLab. Without
ipywidgets installed, ``config_controls`` says so and returns ``None``.
"""

from __future__ import annotations

from typing import Sequence

from gallery_lib.config import RunConfig


class ConfigControls:
    """Dropdowns/sliders bound to a few RunConfig fields; ``apply(cfg)`` returns cfg with their values."""

    def __init__(self, cfg: RunConfig, recipes: Sequence[str], choices: Sequence[str] | None = None):
        import ipywidgets as w

        from gallery_lib.recipes import RECIPES

        family_models = cfg.model_family.model_names()
        self.model = w.Dropdown(options=family_models, value=cfg.model, description="model")
        self.batch_size = w.BoundedIntText(value=cfg.batch_size, min=2, max=4096, step=2, description="batch/GPU")
        self.steps = w.BoundedIntText(value=cfg.steps, min=cfg.warmup_steps + 1, max=100000, description="steps")
        self.recipes = w.SelectMultiple(options=list(choices or RECIPES), value=tuple(recipes), description="recipes")
        self.box = w.VBox([w.HTML("<b>Run settings</b> (change them, then run the next cells)"),
                           self.model, self.batch_size, self.steps, self.recipes])

    def apply(self, cfg: RunConfig) -> RunConfig:
        return cfg.replace(model=self.model.value, batch_size=int(self.batch_size.value), steps=int(self.steps.value))

    def selected_recipes(self) -> list[str]:
        return list(self.recipes.value)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)


def config_controls(cfg: RunConfig, recipes: Sequence[str], interactive: bool,
                    choices: Sequence[str] | None = None) -> ConfigControls | None:
    """The controls, with ``recipes`` selected among ``choices`` (default: the gallery's recipes); ``None`` when not
    ``interactive``."""
    if not interactive:
        return None
    try:
        return ConfigControls(cfg, recipes, choices)
    except ImportError:
        print("ipywidgets is not installed: edit the parameters cell instead (pip install ipywidgets).")
        return None
