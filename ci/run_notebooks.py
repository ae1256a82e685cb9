"""Executes the gallery notebooks headless with papermill and keeps every executed copy.

    python ci/run_notebooks.py --profile auto [--only swin_transformer] [--output output] [--jobs N]

Each notebook runs with its ``parameters`` cell overridden (``profile``, ``output_dir``,
``interactive=False``), a per-cell timeout, the ``python3`` kernel of this environment and the
notebook folder as working directory. The executed notebook is written to
``<output>/notebooks/<name>.ipynb`` even when a cell fails (papermill marks the failing cell), and
the run fails if any notebook fails: none may fail silently.

Without a GPU, two notebooks run at a time (``--jobs``; each in its own process, its lines prefixed with its name):
a CPU run spends much of its time in single-threaded compilation and start-up, so a second notebook fills the other
core. The longest notebook starts first, and those that can load its compiled graphs come last. With a GPU they run
one after another, each with the whole GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
# The order in lanes: the ladder first (a rung per process: the longest on a CPU), then the notebooks that share no
# compiled graph with it, then the SD UNet's other two, which by then load the graphs its rungs compiled instead of
# compiling the same ones beside it. Notebooks not named here come after these.
LANE_ORDER = ("optimization_ladder", "resnet50", "swin_transformer", "your_model", "dreambooth", "stable_diffusion")
# What the runner passes to every notebook that declares it; a notebook without one (your_model has no data set and
# no widgets) simply does not get it. Only a parameter the user asked for with -p is worth a line when dropped.
INJECTED = ("profile", "output_dir", "data_root", "interactive")


def ensure_kernel() -> str:
    """Installs the ``python3`` kernelspec for this interpreter when Jupyter cannot find one."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve() or spec.argv[0] in ("python", "python3"):
            return "python3"
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(prefix=sys.prefix, kernel_name="python3")
    return "python3"


def run_notebook(path: Path, out_dir: Path, parameters: dict, cell_timeout: int) -> Path:
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / path.name
    declared = pm.inspect_notebook(str(path))  # a notebook without a data set declares no data_root: not passed
    dropped = sorted(set(parameters) - set(declared) - set(INJECTED))
    if dropped:
        print(f"[notebooks] {path.name} takes no parameter {', '.join(dropped)}: not passed", flush=True)
    parameters = {name: value for name, value in parameters.items() if name in declared}
    # stdout_file/stderr_file: each cell output is written (and flushed) as it arrives, so a long training cell
    # shows its runs' progress; log_output would hand it to papermill's logger, which prints nothing unconfigured.
    # The kernel's own log only says that it talks over local TCP and, now and then, that the shutdown's interrupt
    # (jupyter_client sends one before every shutdown) found it busy: an "ERROR" line after a notebook that passed.
    # A cell's error still reaches the notebook's outputs and papermill's exception.
    pm.execute_notebook(str(path), str(out_path), parameters=parameters, kernel_name=ensure_kernel(),
                        cwd=str(path.parent), execution_timeout=cell_timeout, stdout_file=sys.stdout,
                        stderr_file=sys.stderr, progress_bar=False, start_timeout=120,
                        extra_arguments=["--IPKernelApp.log_level=CRITICAL"])
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="auto", choices=("auto", "smoke", "full"))
    parser.add_argument("--output", default=str(REPO / "output"), help="output root (default: <repo>/output)")
    parser.add_argument("--notebooks", default=str(NOTEBOOKS), help="the folder of notebooks (default: notebooks/)")
    parser.add_argument("--only", action="append", help="notebook name(s) to run (default: all)")
    parser.add_argument("--cell-timeout", type=int, default=1800, help="seconds per cell (default: 1800)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="notebooks run at a time (default: 2 without a GPU on two cores or more, else 1)")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=JSON",
                        help="extra notebook parameter, the value in JSON "
                             "(e.g. -p steps=40 -p 'recipes=[\"baseline\"]')")
    args = parser.parse_args(argv)

    folder = Path(args.notebooks)
    notebooks = sorted(folder.glob("*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if nb.stem in args.only]
        missing = set(args.only) - {nb.stem for nb in notebooks}
        if missing:
            parser.error(f"no notebook named {sorted(missing)} in {folder}")
    output = Path(args.output).resolve()
    extra = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        try:
            extra[name] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"-p {item!r}: the value must be JSON, e.g. 40, true, \"text\" or [\"a\", \"b\"]")
        if not sep or not name:
            parser.error(f"-p {item!r}: expected NAME=JSON")
    params = {"profile": args.profile, "output_dir": str(output), "data_root": str(REPO / "data"),
              "interactive": False, **extra}
    compile_for_smoke(args.profile)
    jobs = args.jobs or default_jobs()
    if jobs > 1 and len(notebooks) > 1:
        failures = run_in_lanes(notebooks, jobs, argv if argv is not None else sys.argv[1:])
    else:
        failures = [nb.name for nb in notebooks if not run_one(nb, output, params, args.cell_timeout)]
    print(f"[notebooks] {len(notebooks) - len(failures)} passed, {len(failures)} failed"
          + (f": {', '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


def run_one(nb: Path, output: Path, params: dict, cell_timeout: int) -> bool:
    start = time.perf_counter()
    print(f"[notebooks] running {nb.name} with {params}", flush=True)
    try:
        out = run_notebook(nb, output / "notebooks", params, cell_timeout)
        print(f"[notebooks] {nb.name} ok in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
        return True
    except Exception as exc:  # keep going so every notebook's result is known
        print(f"[notebooks] {nb.name} FAILED after {time.perf_counter() - start:.0f} s: "
              f"{type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return False


def compile_for_smoke(profile: str) -> None:
    """Where the notebooks run their smoke profile (a CPU), Inductor emits scalar C++ unless the environment says
    otherwise: the smoke runs show the code paths, their time is mostly compilation, and vector code compiles about a
    quarter slower (benchmarks/RESULTS.md#cpu-gallery). ``TORCHINDUCTOR_VEC_ISA_OK=1`` keeps it. Torch is imported
    only to resolve ``auto`` where nothing decided yet (a lane's process inherits its runner's setting)."""
    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ or profile == "full":
        return
    if profile == "auto":
        import torch

        if torch.cuda.is_available():
            return
    os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"


def default_jobs() -> int:
    """Two lanes on a machine without a visible GPU and with two cores or more, else one."""
    import torch

    return 1 if torch.cuda.is_available() or (os.cpu_count() or 1) < 2 else 2


def run_in_lanes(notebooks: list[Path], jobs: int, argv: list[str]) -> list[str]:
    """Runs each notebook in a child process of this script, ``jobs`` at a time, in ``LANE_ORDER``; returns the
    names of those that failed. Each child's lines are printed as they come, prefixed with its notebook's name."""
    ordered = sorted(notebooks, key=lambda nb: LANE_ORDER.index(nb.stem) if nb.stem in LANE_ORDER else len(LANE_ORDER))
    todo: queue.Queue[Path] = queue.Queue()
    for nb in ordered:
        todo.put(nb)
    ensure_kernel()  # once, before the children look for it
    failures: list[str] = []
    print_lock = threading.Lock()
    child_argv = _without_options(argv, ("--only", "--jobs"))

    def lane() -> None:
        while True:
            try:
                nb = todo.get_nowait()
            except queue.Empty:
                return
            # One core per lane: a training run would otherwise start a thread per core in each lane.
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            child = subprocess.Popen([sys.executable, __file__, *child_argv, "--only", nb.stem, "--jobs", "1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
            assert child.stdout is not None
            for line in child.stdout:
                with print_lock:
                    print(f"[{nb.stem}] {line}", end="", flush=True)
            if child.wait() != 0:
                failures.append(nb.name)

    lanes = [threading.Thread(target=lane) for _ in range(min(jobs, len(notebooks)))]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    return sorted(failures)


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` and their values (``--only x`` or ``--only=x``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in names)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    sys.exit(main())
