"""The notebooks' form (``gallery_lib.reports.widgets``) and the run's progress bar as a notebook shows them, without
a browser: ipywidgets' models are plain objects here, a value set on them is what a user's edit sets."""

from __future__ import annotations

import builtins

import pytest

from gallery_lib import base_config
from gallery_lib.config.settings import ConfigError
from gallery_lib.reports import widgets

pytest.importorskip("ipywidgets")


@pytest.fixture(autouse=True)
def fresh_kernel():
    """Each test starts as a new kernel would: no form remembered."""
    widgets.forget_forms()
    yield
    widgets.forget_forms()


@pytest.fixture(scope="module")
def configs():
    return {family: base_config("smoke", family=family)
            for family in ("dreambooth", "swin_transformer", "resnet50", "stable_diffusion")}


def test_the_batch_box_accepts_and_keeps_a_batch_of_one(configs):
    base = configs["dreambooth"].replace(batch_size=1)  # DreamBooth's full profile trains one subject picture a step
    form = widgets.config_controls(base, ["baseline"], interactive=True)
    assert form.batch_size.min == 1 and form.batch_size.value == 1 and form.batch_size.step == 1
    assert form.apply(base).batch_size == 1 and form.problem.value == ""

    form = widgets.config_controls(configs["dreambooth"], ["baseline"], interactive=True)  # smoke: 2
    form.batch_size.value = 1  # typed into the box
    assert form.batch_size.value == 1 and form.apply(configs["dreambooth"]).batch_size == 1
    form.batch_size.value = 3  # odd is fine without Mixup
    assert form.apply(configs["dreambooth"]).batch_size == 3 and form.problem.value == ""


def test_an_odd_batch_with_mixup_is_refused_with_the_configs_reason_not_changed(configs):
    swin = configs["swin_transformer"]
    assert swin.mixup_alpha > 0
    form = widgets.config_controls(swin, ["baseline"], interactive=True)
    form.batch_size.value = 3
    assert form.batch_size.value == 3  # the box keeps what was typed
    assert "Mixup/CutMix" in form.problem.value and "even batch size" in form.problem.value  # shown under the boxes
    with pytest.raises(ConfigError, match=r"batch_size=3 is invalid with Mixup/CutMix.*set in the form"):
        form.apply(swin)
    form.batch_size.value = 4
    assert form.problem.value == "" and form.apply(swin).batch_size == 4

    resnet = configs["resnet50"]  # ResNet's recipe trains without Mixup: any batch
    assert resnet.mixup_alpha == 0 and resnet.cutmix_alpha == 0
    form = widgets.config_controls(resnet, ["baseline"], interactive=True)
    form.batch_size.value = 1
    assert form.apply(resnet).batch_size == 1 and form.problem.value == ""


def test_building_the_form_again_in_the_same_kernel_keeps_the_users_values(configs):
    """What Run All does: the cell that builds the form runs again, and the next cell applies it."""
    base = configs["stable_diffusion"]
    form = widgets.config_controls(base, ["baseline", "compiled", "accelerated"], interactive=True)
    form.batch_size.value, form.steps.value, form.recipes.value = 1, 9, ("accelerated",)

    again = widgets.config_controls(base, ["baseline", "compiled", "accelerated"], interactive=True)
    assert again is not form
    assert (again.batch_size.value, again.steps.value, again.recipes.value) == (1, 9, ("accelerated",))
    applied = again.apply(base)
    assert (applied.batch_size, applied.steps) == (1, 9) and again.selected_recipes() == ["accelerated"]

    # An edit of the parameters cell after the form's: that value's new default wins, the form's other edits stay.
    edited = base.replace(batch_size=6)
    third = widgets.config_controls(edited, ["baseline", "compiled", "accelerated"], interactive=True)
    assert (third.batch_size.value, third.steps.value, third.recipes.value) == (6, 9, ("accelerated",))

    # Another notebook's form (another family) is not filled from this one; a new kernel starts from the defaults.
    other = widgets.config_controls(configs["dreambooth"], ["baseline", "compiled", "accelerated"], interactive=True)
    assert other.batch_size.value == configs["dreambooth"].batch_size
    widgets.forget_forms()
    fresh = widgets.config_controls(base, ["baseline", "compiled", "accelerated"], interactive=True)
    assert (fresh.batch_size.value, fresh.steps.value) == (base.batch_size, base.steps)
    assert fresh.recipes.value == ("baseline", "compiled", "accelerated")


def test_a_remembered_odd_batch_is_still_flagged(configs):
    swin = configs["swin_transformer"]
    widgets.config_controls(swin, ["baseline"], interactive=True).batch_size.value = 5
    again = widgets.config_controls(swin, ["baseline"], interactive=True)
    assert again.batch_size.value == 5 and "Mixup/CutMix" in again.problem.value


def test_the_form_and_its_title_say_run_all_keeps_it(configs):
    form = widgets.config_controls(configs["resnet50"], ["baseline"], interactive=True)
    assert "Run All" in form.box.children[0].value
    assert widgets.config_controls(configs["resnet50"], ["baseline"], interactive=False) is None


@pytest.fixture
def ipython_shell():
    """An IPython shell whose display outputs are captured, as a kernel would send them; removed afterwards."""
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    added = {name for name in ("__IPYTHON__", "display") if name not in vars(builtins)}
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.display_pub = CapturingDisplayPublisher()
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()
        for name in added:
            vars(builtins).pop(name, None)


def test_the_widget_bar_leaves_its_final_state_as_text(ipython_shell, monkeypatch):
    """A viewer without the widget's state (GitHub, static HTML) shows the output's text/plain: it must read where
    the run ended, not the 0% it read when the bar first showed."""
    import tqdm.notebook

    from data_prep import progress_bar
    from gallery_lib.run import progress

    monkeypatch.setattr(progress_bar, "bar_class", lambda: tqdm.notebook.tqdm)  # what tqdm.auto picks in a kernel
    bar = progress.StepProgress("accelerated", enabled=True, mininterval=0)
    bar.feed("[gallery] step 40/100 | loss 0.1234 | 55.0 img/s | 10.0 ms/step | peak 1.00 GiB | ETA 0:01")
    bar.feed("[gallery] step 100/100 | loss 0.0987 | 56.0 img/s | 9.9 ms/step | peak 1.00 GiB | ETA 0:00")
    bar.close()

    outputs = ipython_shell.display_pub.outputs
    assert len(outputs) == 2 and not outputs[0]["update"] and outputs[1]["update"]
    assert outputs[0]["transient"]["display_id"] == outputs[1]["transient"]["display_id"]  # replaced in place
    first, final = (output["data"] for output in outputs)
    assert "application/vnd.jupyter.widget-view+json" in final  # JupyterLab still shows the widget
    assert " 0%" in first["text/plain"]
    text = final["text/plain"]
    assert "accelerated" in text and "100%" in text and "100/100" in text and "loss 0.0987, 56.0 img/s" in text


def test_a_run_that_stopped_early_leaves_where_it_stopped(ipython_shell, monkeypatch):
    import tqdm.notebook

    from data_prep import progress_bar
    from gallery_lib.run import progress

    monkeypatch.setattr(progress_bar, "bar_class", lambda: tqdm.notebook.tqdm)
    bar = progress.StepProgress("baseline", enabled=True, mininterval=0)
    bar.feed("[gallery] step 30/100 | loss 2.5 | 12.0 img/s | 80.0 ms/step | peak 1.00 GiB | ETA 0:06")
    bar.close()
    text = ipython_shell.display_pub.outputs[-1]["data"]["text/plain"]
    assert "30/100" in text and "30%" in text and "loss 2.5" in text


def test_the_data_writers_bar_leaves_its_final_state_as_text(ipython_shell, monkeypatch, tmp_path):
    import tqdm.notebook

    from data_prep import progress_bar
    from data_prep.manifest import write_dataset

    monkeypatch.setattr(progress_bar, "bar_class", lambda: tqdm.notebook.tqdm)
    files = [(f"{index}.txt", lambda: b"x") for index in range(3)]
    write_dataset(tmp_path, generator="test", version=1, params={}, files=files, desc="mock", progress=True)
    first, final = (output["data"]["text/plain"] for output in ipython_shell.display_pub.outputs)
    assert " 0%" in first and "100%" in final and "3/3" in final


def test_the_text_bar_is_unchanged_outside_a_notebook():
    import io

    from gallery_lib.run.progress import StepProgress

    out = io.StringIO()
    bar = StepProgress("accelerated", enabled=True, file=out, mininterval=0)
    bar.feed("[gallery] step 4/4 | loss 1.0 | 1.0 img/s | 1.0 ms/step | peak 0.1 GiB")
    bar.close()
    assert bar.display is None and "4/4" in out.getvalue() and "100%" in out.getvalue()


def test_the_forms_output_reads_as_text_without_its_widgets(configs):
    from IPython.core.formatters import DisplayFormatter

    form = widgets.config_controls(configs["resnet50"], ["baseline", "accelerated"], interactive=True)
    data, _ = DisplayFormatter().format(form)
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == (f"Run settings: model {configs['resnet50'].model}, batch/GPU "
                                  f"{configs['resnet50'].batch_size}, steps {configs['resnet50'].steps}, "
                                  "recipes baseline, accelerated")
