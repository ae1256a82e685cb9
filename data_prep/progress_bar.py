"""A ``tqdm.auto`` bar whose output reads its final state in a static viewer.

In JupyterLab (and under papermill) ``tqdm.auto`` draws a widget. A widget's output also carries a plain-text copy of
the bar, which is what a viewer without the widget's state shows (GitHub, nbconvert's HTML, a notebook reopened after
its kernel is gone). That copy is taken when the bar is first displayed, at 0%; ``close_bar`` displays the bar's output
again in place (``update_display``) so that the copy reads where it ended. In a terminal or a pipe it is tqdm's own
text bar. On the bottom floor: the data writers and the run's step bar share it.
"""

from __future__ import annotations

import sys
from typing import Any


def bar_class() -> type:
    """The class ``tqdm.auto`` picks here (a widget bar in a Jupyter kernel)."""
    from tqdm.auto import tqdm

    return tqdm


def open_bar(**kwargs: Any) -> tuple[Any, Any]:
    """A ``tqdm.auto`` bar and, for a widget bar, the handle of its display (``None`` otherwise)."""
    cls = bar_class()
    if not _is_widget_bar(cls) or kwargs.get("disable"):
        return cls(**kwargs), None
    from IPython.display import display

    bar = cls(display=False, **kwargs)
    return bar, display(bar.container, display_id=True)  # None outside a running IPython: then no update


def close_bar(bar: Any, handle: Any) -> None:
    """Closes ``bar``; a widget bar's output is shown again in place, so that its text copy reads the final state."""
    bar.close()
    if handle is not None:
        handle.update(bar.container)


def _is_widget_bar(cls: type) -> bool:
    notebook = sys.modules.get("tqdm.notebook")  # imported by tqdm.auto when it picked the widget bar
    return notebook is not None and issubclass(cls, notebook.tqdm_notebook)
