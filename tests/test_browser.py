"""The notebooks in a real browser: JupyterLab on 127.0.0.1, each notebook opened in headless Chromium, all its
cells run in the smoke profile, the widget form and the report figure seen in the page. Screenshots go to
``output/browser/``.

Needs Debian's ``chromium`` and the ``playwright`` package (``ci/setup_browser.sh`` installs both; ``ci/test.sh``
calls it). Elsewhere the tests skip, unless ``GALLERY_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes a missing
browser a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_notebooks import AOT_EAGER_SITE, in_its_graph_group

REPO = Path(__file__).resolve().parents[1]
# One notebook of each kind the page shows differently: a recipe notebook with the form (DreamBooth, whose batch of
# 1 the form must keep), the ladder's rungs, and your_model's own loop without a form. The other three recipe
# notebooks build the same form and report through the same code, and test_notebooks.py runs each of them headless
# (CI's time, benchmarks/RESULTS.md#ci).
NOTEBOOKS = [REPO / "notebooks" / f"{name}.ipynb" for name in ("dreambooth", "optimization_ladder", "your_model")]
SCREENSHOTS = REPO / "output" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# What the page must show is the same at any size, and test_notebooks.py runs every recipe and rung headless: the
# copies here run one recipe (sampled in 2 denoising steps) and one rung of the ladder (CI's time, RESULTS.md#ci).
# your_model takes a CNN by its timm name here (timm's smallest ResNet): test_notebooks.py runs its default ViT.
BROWSER_PARAMETERS = {"optimization_ladder": {"rungs": ["tf32"], "steps": 4},
                      "dreambooth": {"recipes": ["baseline"], "sample_steps": 2},
                      "your_model": {"steps": 4, "model_name": "test_resnet"}}


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (bash ci/setup_browser.sh)"
    if CHROMIUM is None:
        return "no chromium executable on PATH (bash ci/setup_browser.sh)"
    return None


def _need_the_browser() -> None:
    missing = _missing()
    if missing:
        if os.environ.get("GALLERY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required but {missing}")
        pytest.skip(missing)


# A laptop's browser window, and the type a repository page sets README in: what a reader sees before scrolling
FIRST_SCREEN = {"width": 1280, "height": 800}
README_STYLE = ("body { font: 16px/1.5 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; max-width: 980px; "
                "margin: 0 auto; padding: 32px; } pre { padding: 16px; font-size: 85%; } h1 { font-size: 2em; }")


def test_readme_shows_its_two_commands_on_the_first_screen():
    """README rendered as a repository page renders it: the gallery's command and the test command are on the
    screen without scrolling."""
    _need_the_browser()
    import mistune
    from playwright.sync_api import sync_playwright

    html = mistune.html((REPO / "README.md").read_text())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=FIRST_SCREEN)
            page.set_content(f"<style>{README_STYLE}</style>{html}")
            for command in ("bash ci/gallery.sh", "bash ci/test.sh"):
                block = page.locator("pre code").filter(has_text=re.compile(rf"^\s*{re.escape(command)}\s*$"))
                box = block.bounding_box()
                assert box is not None, f"README shows no code block with {command!r}"
                assert box["y"] + box["height"] <= FIRST_SCREEN["height"], (
                    f"{command!r} ends {box['y'] + box['height']:.0f} px down, below the first screen's "
                    f"{FIRST_SCREEN['height']} px: move text below the two commands")
        finally:
            browser.close()


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of the notebooks and the examples (their outputs land in the copy),
    token-protected; one per worker for the whole session (xdist interleaves these tests with the headless runs that
    share their graphs, and a module's fixture would start the server again after each)."""
    _need_the_browser()
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "notebooks", root / "notebooks")
    shutil.copytree(REPO / "examples", root / "examples")  # the your_model notebook trains the example family
    for name, parameters in BROWSER_PARAMETERS.items():
        _inject_parameters(root / "notebooks" / f"{name}.ipynb", parameters)
    sys.path.insert(0, str(REPO / "ci"))
    import run_notebooks

    run_notebooks.ensure_kernel()  # the notebooks' python3 kernel is this interpreter
    port, token = _free_port(), "gallery-browser-test"
    settings = root / "lab-settings"  # every cell in the page (no windowing: prompts are read from the DOM), no news
    for plugin, values in {"notebook-extension/tracker": '{"windowingMode": "none", "autoStartDefaultKernel": true}',
                           "apputils-extension/notification": '{"fetchNews": "false"}'}.items():
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(values)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
        stdout=subprocess.DEVNULL, stderr=open(root / "lab.log", "w"),
        # the notebooks' runs compile without Inductor's code, as test_notebooks.py's headless runs of the same do
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(AOT_EAGER_SITE), str(REPO)]),
                 JUPYTERLAB_SETTINGS_DIR=str(settings)))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(f"{url}/api/status?token={token}", server, root / "lab.log")
        yield url, token, root
    finally:
        server.terminate()
        server.wait(timeout=30)


def _inject_parameters(path: Path, parameters: dict) -> None:
    """Papermill's injected-parameters cell, after the parameters cell, in the copy JupyterLab opens."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nbformat.write(parameterize_notebook(load_notebook_node(str(path)), parameters), path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_up(status_url: str, server: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(status_url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"JupyterLab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("path", [in_its_graph_group(path) for path in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab_in_a_real_browser(lab, path):
    from playwright.sync_api import sync_playwright

    url, token, root = lab
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/notebooks/{path.name}?reset&token={token}")  # reset: no earlier tabs
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_timeout(3000)
            if page.locator(".jp-Dialog").count():  # a kernel chooser, should the setting above not apply
                page.locator(".jp-Dialog").get_by_role("button", name="Select").click()
            _wait_for_kernel_idle(page, 180)
            _run_all_cells(page)
            _wait_for_all_cells(page, timeout=1200)
            page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.png"), full_page=True)
            outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
            assert not [text for text in outputs if "Traceback (most recent call last)" in text], outputs[-3:]
            assert page.locator(".jp-OutputArea-output img").count() >= 1  # the report figure, and more
            if path.stem == "your_model":  # no form and no recipe runs: a ladder of the user's own loop
                _check_the_cnn_climbed_its_ladder(root / "output" / "your_model" / "ladder.json", outputs)
            else:
                assert page.locator(".jp-OutputArea-output .widget-select-multiple").count() == 1  # the form
                _check_the_batch_box_keeps_one(page)
                landed = _runs_that_landed(root / "output", path.stem)
                assert landed == _runs_asked_for(path.stem), landed  # the injected parameters took
        finally:
            page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.last.png"))
            browser.close()
            _shut_down_kernels(url, token)  # the next notebook gets the machine's cores


def _check_the_cnn_climbed_its_ladder(ladder: Path, outputs: list[str]) -> None:
    """A CNN in place of the ViT: built at the notebook's image size, its repeated block found and traced in one graph
    (BatchNorm in training refuses the one value per channel that one 32 px image leaves its last stage, so the
    trace's inputs are read in eval mode), and every rung trains the same function."""
    import json

    text = "\n".join(outputs)
    assert "test_resnet at 32 px" in text and "one BasicBlock: 1 graph(s), 0 graph break(s)" in text, text[-2000:]
    record = json.loads(ladder.read_text())
    assert record["model"] == "test_resnet" and len(record["rows"]) == 5
    assert all(row["loss_difference"] < 1e-3 for row in record["rows"][1:]), record["rows"]


def _check_the_batch_box_keeps_one(page) -> None:
    """A batch of 1 typed into the form stays 1 (DreamBooth trains at 1: the box's bounds must not raise it)."""
    box = page.locator(".jp-OutputArea-output .widget-text").filter(has_text="batch/GPU").locator("input")
    box.fill("1")
    box.press("Tab")  # the change reaches the widget's model, which would clamp it to its bounds
    page.wait_for_timeout(1000)
    assert box.input_value() == "1"


def _runs_asked_for(notebook: str) -> list[str]:
    """The run folders the injected parameters name: the ladder's rungs or the recipe notebook's recipes."""
    from gallery_lib.recipes.ladder import recipe_name, rung_named

    parameters = BROWSER_PARAMETERS[notebook]
    if notebook == "optimization_ladder":
        return sorted(recipe_name(rung_named(name)) for name in parameters["rungs"])
    return sorted(parameters["recipes"])


def _runs_that_landed(output: Path, notebook: str) -> list[str]:
    """Run folders with metrics under ``output``; the ladder's rungs land beside the SD notebook's recipes."""
    ladder = notebook == "optimization_ladder"
    runs = output / ("stable_diffusion" if ladder else notebook)
    return sorted(run.name for run in runs.iterdir()
                  if (run / "metrics.jsonl").is_file() and run.name.startswith("ladder-") == ladder)


def _shut_down_kernels(url: str, token: str) -> None:
    import json

    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=30) as response:
        sessions = json.load(response)
    for session in sessions:
        request = urllib.request.Request(f"{url}/api/sessions/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def _kernel_status(page) -> str:
    return page.locator(".jp-Notebook-ExecutionIndicator:visible").first.get_attribute("data-status") or ""


def _wait_for_kernel_idle(page, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _kernel_status(page) != "idle":
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel did not start within {timeout} s (status {_kernel_status(page)!r})")
        time.sleep(1)


def _prompts(page) -> list[str]:
    """The code cells' execution prompts: ``[ ]:`` not run, ``[*]:`` queued or running, ``[3]:`` run."""
    return page.locator(".jp-NotebookPanel:visible .jp-CodeCell .jp-InputArea-prompt").all_inner_texts()


def _run_all_cells(page) -> None:
    """Run > Run All Cells, once more if no cell was queued: on a loaded machine the menu can swallow the click."""
    for _ in range(2):
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            prompts = _prompts(page)
            if any(text.strip() not in ("", "[ ]:") for text in prompts):
                return
            time.sleep(1)
        page.keyboard.press("Escape")  # a menu left open
    raise AssertionError("Run All Cells queued no cell, twice")


def _wait_for_all_cells(page, timeout: float) -> None:
    """Until every code cell has an execution count (none pending ``[*]`` or blank) and the kernel is idle."""
    deadline = time.monotonic() + timeout
    idle_since = None
    while time.monotonic() < deadline:
        prompts = _prompts(page)
        done = prompts and all(text.strip().startswith("[") and text.strip()[1:-2].strip().isdigit()
                               for text in prompts)
        idle = _kernel_status(page) == "idle"
        if done and idle:
            return
        idle_since = (idle_since or time.monotonic()) if idle else None
        if idle_since and time.monotonic() - idle_since > 30:  # "Run All" stops at a failing cell
            outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
            raise AssertionError(f"the kernel went idle with cells not run: {prompts}\n{outputs[-2:]}")
        time.sleep(2)
    raise AssertionError(f"cells still running after {timeout} s: {prompts}")
