"""Optional ipywidgets controls that fill a notebook's run config.

They only edit values; they never start work or wait for a click, so a notebook runs the same
headless under papermill (where ``interactive=False`` skips them) as in JupyterLab. Without
ipywidgets installed, ``config_controls`` says so and returns ``None``.

The form survives "Run All": running the cell that builds it again in the same kernel (Run All does) builds it with
the values last set in it, not with the defaults. A value whose default changed meanwhile (the parameters cell was
edited, or another profile picked) takes the new default: whichever the user edited last wins. A new kernel (a
restart) starts from the parameters cell again.

The form checks its values with the run config's own rules as they change (an odd batch with Mixup/CutMix, say) and
shows what is wrong under the boxes; it never changes a value itself. ``apply`` raises the same ``ConfigError``.
"""

from __future__ import annotations

import html
from collections.abc import Hashable, Sequence
from typing import Any

from gallery_lib.config import RunConfig
from gallery_lib.config.settings import ConfigError

MAX_BATCH = 4096
TITLE = ("<b>Run settings</b>: change them, then run the cells below (or Run All: this form keeps your values "
         "until the kernel restarts)")

_FORMS: dict[Hashable, ConfigControls] = {}
"""The last form built for each key in this kernel: what a re-run of its cell starts from."""


class ConfigControls:
    """Dropdowns/sliders bound to a few RunConfig fields; ``apply(cfg)`` returns cfg with their values.

    ``key`` names the form among those of this kernel (default: the model family and the recipe choices); a form
    built again under the same key starts from the values set in the previous one.
    """

    def __init__(self, cfg: RunConfig, recipes: Sequence[str], choices: Sequence[str] | None = None, *,
                 key: Hashable | None = None):
        import ipywidgets as w

        from gallery_lib.recipes import RECIPES

        options = list(choices or RECIPES)
        self.cfg = cfg
        self.key = (cfg.family, tuple(options)) if key is None else key
        self.defaults: dict[str, Any] = {"model": cfg.model, "batch_size": cfg.batch_size, "steps": cfg.steps,
                                         "recipes": tuple(recipes)}
        family_models = cfg.model_family.model_names()
        min_steps = cfg.warmup_steps + 1
        valid = {"model": lambda v: v in family_models, "batch_size": lambda v: 1 <= v <= MAX_BATCH,
                 "steps": lambda v: min_steps <= v <= 100000, "recipes": lambda v: set(v) <= set(options)}
        values = _remembered(_FORMS.get(self.key), self.defaults, valid)
        self.model = w.Dropdown(options=family_models, value=values["model"], description="model")
        # Any batch of 1 or more: DreamBooth trains at 1. Whether a family needs an even one (Mixup/CutMix pair the
        # images of a batch) is the run config's rule, checked below, not the box's.
        self.batch_size = w.BoundedIntText(value=values["batch_size"], min=1, max=MAX_BATCH, step=1,
                                           description="batch/GPU")
        self.steps = w.BoundedIntText(value=values["steps"], min=min_steps, max=100000, description="steps")
        self.recipes = w.SelectMultiple(options=options, value=tuple(values["recipes"]), description="recipes")
        self.problem = w.HTML()
        for box in (self.model, self.batch_size, self.steps):
            box.observe(self._show_problem, names="value")
        self._show_problem()
        self.box = w.VBox([w.HTML(TITLE), self.model, self.batch_size, self.steps, self.recipes, self.problem])
        _FORMS[self.key] = self

    def values(self) -> dict[str, Any]:
        """What the form holds now."""
        return {"model": self.model.value, "batch_size": int(self.batch_size.value), "steps": int(self.steps.value),
                "recipes": tuple(self.recipes.value)}

    def check(self, cfg: RunConfig | None = None) -> str | None:
        """Why ``apply(cfg)`` would refuse the form's values (the run config's message), or ``None``."""
        try:
            self._applied(cfg or self.cfg)
        except ConfigError as error:
            return str(error)
        return None

    def apply(self, cfg: RunConfig) -> RunConfig:
        try:
            return self._applied(cfg)
        except ConfigError as error:
            raise ConfigError(f"{error} (a value set in the form: change it there, then run this cell again)") from None

    def _applied(self, cfg: RunConfig) -> RunConfig:
        values = self.values()
        return cfg.replace(model=values["model"], batch_size=values["batch_size"], steps=values["steps"])

    def selected_recipes(self) -> list[str]:
        return list(self.recipes.value)

    def _show_problem(self, _change: Any = None) -> None:
        problem = self.check()
        self.problem.value = "" if problem is None else f'<span style="color:#b00020">{html.escape(problem)}</span>'

    def summary(self) -> str:
        """The form's values as one line: its output's text, which a viewer without the widgets shows."""
        values = self.values()
        return (f"Run settings: model {values['model']}, batch/GPU {values['batch_size']}, steps {values['steps']}, "
                f"recipes {', '.join(values['recipes']) or 'none'}")

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.box._repr_mimebundle_(**kwargs), "text/plain": self.summary()}


def _remembered(previous: ConfigControls | None, defaults: dict[str, Any], valid: dict[str, Any]) -> dict[str, Any]:
    """The values a form starts from: the previous form's (of the same key, in this kernel) where its default is
    still the default, else the default."""
    if previous is None:
        return dict(defaults)
    held = previous.values()
    return {name: held[name] if previous.defaults[name] == default and valid[name](held[name]) else default
            for name, default in defaults.items()}


def forget_forms() -> None:
    """Forget the values set in this kernel's forms: the next ones start from their defaults."""
    _FORMS.clear()


def config_controls(cfg: RunConfig, recipes: Sequence[str], interactive: bool,
                    choices: Sequence[str] | None = None, *, key: Hashable | None = None) -> ConfigControls | None:
    """The controls, with ``recipes`` selected among ``choices`` (default: the gallery's recipes); ``None`` when not
    ``interactive``. Built again in the same kernel (Run All), they keep the values set in them (``ConfigControls``).
    """
    if not interactive:
        return None
    try:
        return ConfigControls(cfg, recipes, choices, key=key)
    except ImportError:
        print("ipywidgets is not installed: edit the parameters cell instead (pip install ipywidgets).")
        return None
