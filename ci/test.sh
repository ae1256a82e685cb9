#!/usr/bin/env bash
# The gallery's test command: set up the environment with the test extras, then run pytest.
#
#   bash ci/test.sh [PYTEST ARGS...]      e.g. bash ci/test.sh -m "not slow and not notebook and not browser"
#
# Without a GPU the tests run in pytest-xdist workers, one per core up to 4 (GALLERY_TEST_WORKERS=N to change, 0 for
# none), the longest first (tests/durations.json). GPU tests carry the `gpu` marker and skip without a CUDA device.
# Exit code 5 ("no tests collected") is an error here: a test command that tests nothing must not pass. Where the
# CPU's default kernels are AVX-512, the tests marked `isa` run a second time as on an AVX2 CPU (ATen's kernels under
# ATEN_CPU_CAPABILITY=avx2, oneDNN's under ONEDNN_MAX_CPU_ISA=AVX2), so that both vector code paths are checked. The end says how long it
# all took, with a warning past 35 minutes (the budget CI keeps to).
set -uo pipefail
start=$SECONDS
repo=$(cd "$(dirname "$0")/.." && pwd)
# chromium (apt) downloads beside the Python packages; then playwright, in the environment (the browser tests skip
# without them)
bash "$repo/ci/setup_browser.sh" chromium &
browser=$!
bash "$repo/ci/setup_env.sh" notebooks,sd,lab,test || exit 1
wait "$browser"
bash "$repo/ci/setup_browser.sh"
venv=${GALLERY_VENV:-$repo/.venv}
cd "$repo"
set_up=$((SECONDS - start))
# the stack the tests run on, named in the log that records them
echo "[test] $("$venv/bin/python" -c "import platform, torch; print(f'torch {torch.__version__}, Python '
  f'{platform.python_version()}, CPU kernels {torch.backends.cpu.get_cpu_capability()}')" 2>/dev/null)"
# One compile cache for both passes below (tests/conftest.py): the AVX2 pass loads the graphs the first one compiled.
if [ -z "${GALLERY_TEST_COMPILE_CACHE:-}" ]; then
  GALLERY_TEST_COMPILE_CACHE=$(mktemp -d -t gallery-test-compile-cache.XXXXXX)
  trap 'rm -rf "$GALLERY_TEST_COMPILE_CACHE"' EXIT
  export GALLERY_TEST_COMPILE_CACHE
fi
workers=${GALLERY_TEST_WORKERS:-$("$venv/bin/python" -c "
import os, torch
print(0 if torch.cuda.is_available() else min(4, os.cpu_count() or 1))" 2>/dev/null || echo 0)}
xdist=()
if [ "$workers" -gt 1 ] && [[ " $* " != *" -n "* ]]; then
  # the tests of one xdist_group run in one worker (they share a fixture or a compile), in tests/conftest.py's order
  xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
"$venv/bin/python" -m pytest "${xdist[@]}" "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
default_isa=$("$venv/bin/python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null)
if [ "$code" -eq 0 ] && [ -z "${ATEN_CPU_CAPABILITY:-}" ] && [[ "$default_isa" == AVX512* ]]; then
  echo "[test] this CPU runs $default_isa kernels: the tests marked isa again with AVX2 kernels"
  # oneDNN must not see AMX either: ATen's AVX2 build of bf16 attention has no VNNI packing for it to ask for
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "$venv/bin/python" -m pytest "${xdist[@]}" "$@" --isa-only
  code=$?
  [ "$code" -eq 5 ] && code=0  # the selection held no isa test
fi
total=$((SECONDS - start))
echo "[test] $((total / 60)) min $((total % 60)) s in all: set-up $((set_up / 60)) min $((set_up % 60)) s, tests the rest"
if [ "$total" -gt 2100 ]; then
  echo "[test] WARNING: past 35 minutes, CI's budget: make new tests cheaper or pay for them elsewhere" >&2
fi
exit "$code"
