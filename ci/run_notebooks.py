"""Executes the gallery notebooks headless with papermill and keeps every executed copy.

    python ci/run_notebooks.py --profile auto [--only swin_transformer] [--output output]

Each notebook runs with its ``parameters`` cell overridden (``profile``, ``output_dir``,
``interactive=False``), a per-cell timeout, the ``python3`` kernel of this environment and the
notebook folder as working directory. The executed notebook is written to
``<output>/notebooks/<name>.ipynb`` even when a cell fails (papermill marks the failing cell), and
the run fails if any notebook fails: none may fail silently.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


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
    # stdout_file/stderr_file: each cell output is written (and flushed) as it arrives, so a long training cell
    # shows its runs' progress; log_output would hand it to papermill's logger, which prints nothing unconfigured.
    pm.execute_notebook(str(path), str(out_path), parameters=parameters, kernel_name=ensure_kernel(),
                        cwd=str(path.parent), execution_timeout=cell_timeout, stdout_file=sys.stdout,
                        stderr_file=sys.stderr, progress_bar=False, start_timeout=120)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="auto", choices=("auto", "smoke", "full"))
    parser.add_argument("--output", default=str(REPO / "output"), help="output root (default: <repo>/output)")
    parser.add_argument("--only", action="append", help="notebook name(s) to run (default: all)")
    parser.add_argument("--cell-timeout", type=int, default=1800, help="seconds per cell (default: 1800)")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=JSON",
                        help='extra notebook parameter, the value in JSON (e.g. -p steps=40 -p \'recipes=["baseline"]\')')
    args = parser.parse_args(argv)

    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if nb.stem in args.only]
        missing = set(args.only) - {nb.stem for nb in notebooks}
        if missing:
            parser.error(f"no notebook named {sorted(missing)} in {NOTEBOOKS}")
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
    failures = []
    for nb in notebooks:
        start = time.perf_counter()
        params = {"profile": args.profile, "output_dir": str(output), "data_root": str(REPO / "data"),
                  "interactive": False, **extra}
        print(f"[notebooks] running {nb.name} with {params}", flush=True)
        try:
            out = run_notebook(nb, output / "notebooks", params, args.cell_timeout)
            print(f"[notebooks] {nb.name} ok in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
        except Exception as exc:  # keep going so every notebook's result is known
            failures.append(nb.name)
            print(f"[notebooks] {nb.name} FAILED after {time.perf_counter() - start:.0f} s: "
                  f"{type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    print(f"[notebooks] {len(notebooks) - len(failures)} passed, {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
