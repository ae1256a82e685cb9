"""report_to='tensorboard': the step records become scalars, the summary text, a figure an image; a resumed run
purges the steps after its checkpoint; metrics.jsonl stays the record."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")

from matplotlib.figure import Figure  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from gallery_lib.run.metrics import MetricsWriter, read_metrics  # noqa: E402
from gallery_lib.run.tensorboard import TeeWriter, TensorBoardWriter, log_figure  # noqa: E402


def _step(step: int, loss: float) -> dict:
    return {"type": "step", "step": step, "loss": loss, "lr": 1e-3, "step_time_ms": 10.0, "samples_per_s": 800.0,
            "peak_mem_mb": 1024.0}


def _events(log_dir):
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    events.Reload()
    return events


def test_steps_become_scalars_beside_the_jsonl_and_a_resume_purges_the_superseded_steps(tmp_path):
    tb_dir = tmp_path / "tensorboard"
    writer = TeeWriter(MetricsWriter(tmp_path / "metrics.jsonl"), TensorBoardWriter(tb_dir))
    for step in range(6):
        writer.write(_step(step, 1.0 - 0.1 * step))
    writer.close()
    resumed = TeeWriter(MetricsWriter(tmp_path / "metrics.jsonl", mode="a"), TensorBoardWriter(tb_dir, start_step=4))
    for step in (4, 5):
        resumed.write(_step(step, 5.0))  # the resumed run trains steps 4 and 5 again
    resumed.write({"type": "summary", "steps": 6, "samples_per_s": 800.0, "final_loss": 5.0,
                   "device_name": "CPU"})
    resumed.close()
    losses = {event.step: event.value for event in _events(tb_dir).Scalars("train/loss")}
    assert losses == pytest.approx({0: 1.0, 1: 0.9, 2: 0.8, 3: 0.7, 4: 5.0, 5: 5.0})
    assert "train/samples_per_s" in _events(tb_dir).Tags()["scalars"]
    steps, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["final_loss"] == 5.0 and len(steps) == 8  # the JSONL keeps every line it was given


def test_a_figure_lands_as_an_image(tmp_path):
    figure = Figure()
    figure.subplots().plot([0, 1], [1, 0])
    log_figure(tmp_path / "tb", "report", figure)
    assert _events(tmp_path / "tb").Tags()["images"] == ["report"]


def test_a_run_reports_to_tensorboard_and_its_report_figure_follows(tmp_path):
    """A real (tiny) run with report_to='tensorboard': its steps as scalars beside metrics.jsonl, the report's figure
    in the model folder's tensorboard/; the flag spelled as diffusers spells it."""
    from gallery_lib.app.cli import build_parser, base_from_args
    from gallery_lib.recipes.profiles import base_config
    from gallery_lib.run.train import run
    from gallery_lib.app.workflow import compare, prepare

    args = build_parser().parse_args(["train", "--model", "swin_micro", "--report_to", "tensorboard"])
    assert base_from_args(args).report_to == "tensorboard"
    cfg = base_config("smoke", family="swin_transformer", data_root=str(tmp_path / "data"), steps=4, warmup_steps=1,
                      log_every=2, output_dir=str(tmp_path / "out"), report_to="tensorboard", num_workers=0,
                      recipe="baseline")
    prepare(cfg, progress=False)
    cfg.save(cfg.run_dir / "config.json")  # as the launcher does
    run(cfg)
    steps, _ = read_metrics(cfg.run_dir / "metrics.jsonl")
    scalars = _events(cfg.run_dir / "tensorboard").Scalars("train/loss")
    assert [e.step for e in scalars] == [s["step"] for s in steps]
    assert [e.value for e in scalars] == pytest.approx([s["loss"] for s in steps])
    report = compare(cfg, ["baseline"])
    assert _events(report.paths["tensorboard"]).Tags()["images"] == ["recipe comparison"]


def test_sample_grids_go_to_the_runs_that_report_to_tensorboard(tmp_path):
    import json

    from gallery_lib.run.tensorboard import log_to_run

    figure = Figure()
    figure.subplots().imshow([[0, 1], [1, 0]])
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"report_to": "none"}))
    assert not log_to_run(tmp_path / "plain", "samples", figure) and not (tmp_path / "plain" / "tensorboard").exists()
    (tmp_path / "tracked").mkdir()
    (tmp_path / "tracked" / "config.json").write_text(json.dumps({"report_to": "tensorboard"}))
    assert log_to_run(tmp_path / "tracked", "samples", figure)
    assert _events(tmp_path / "tracked" / "tensorboard").Tags()["images"] == ["samples"]
