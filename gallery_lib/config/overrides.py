"""``--set FIELD=VALUE``: a run's settings named on the command line, flat (``lr``) or dotted (``optimizer.lr``), each
checked against ``RunConfig``'s fields and the tasks' settings before anything runs."""

from __future__ import annotations

import difflib
from typing import Any

from gallery_lib.config.run_config import core_field_names, task_setting_names
from gallery_lib.config.sections import dotted_name, flat_values
from gallery_lib.config.settings import ConfigError, parse_value


def setting_names() -> set[str]:
    """Every name ``--set`` takes: each field's flat and dotted names, the tasks' settings included."""
    flat = core_field_names() - {"options", "extra"} | set(task_setting_names())
    return flat | {dotted_name(name) for name in flat} | {"extra"}


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """``["fused_attention=true", "optimizer.lr=1e-3"]`` -> ``{"fused_attention": True, "lr": 0.001}`` (for
    ``--set``): dotted names come back flat."""
    known = setting_names()
    overrides: dict[str, Any] = {}
    for item in assignments:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep:
            raise ConfigError(f"--set {item!r} is invalid: expected FIELD=VALUE, e.g. --set lr=1e-3.")
        if key not in known:
            close = difflib.get_close_matches(key, [name for name in known if ("." in name) == ("." in key)], n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "`gallery list` and the RunConfig docs list them"
            raise ConfigError(f"--set {item!r}: there is no setting {key!r}; {hint}")
        overrides[key] = parse_value(text)
    return flat_values(overrides)
