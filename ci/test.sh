#!/usr/bin/env bash
# The gallery's test command: set up the environment with the test extras, then run pytest.
#
#   bash ci/test.sh [PYTEST ARGS...]      e.g. bash ci/test.sh -m "not notebook"
#
# GPU tests carry the `gpu` marker and skip without a CUDA device. Exit code 5 ("no tests collected") is an error
# here: a test command that tests nothing must not pass. Where the CPU's default kernels are AVX-512, the tests
# marked `isa` run a second time under ATEN_CPU_CAPABILITY=avx2, so that both vector code paths are checked.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/ci/setup_env.sh" notebooks,sd,lab,test || exit 1
bash "$repo/ci/setup_browser.sh"  # chromium + playwright for the browser tests (they skip without them)
venv=${GALLERY_VENV:-$repo/.venv}
cd "$repo"
"$venv/bin/python" -m pytest "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
default_isa=$("$venv/bin/python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null)
if [ "$code" -eq 0 ] && [ -z "${ATEN_CPU_CAPABILITY:-}" ] && [[ "$default_isa" == AVX512* ]]; then
  echo "[test] this CPU runs $default_isa kernels: the tests marked isa again under ATEN_CPU_CAPABILITY=avx2"
  ATEN_CPU_CAPABILITY=avx2 "$venv/bin/python" -m pytest "$@" --isa-only
  code=$?
  [ "$code" -eq 5 ] && code=0  # the selection held no isa test
fi
exit "$code"
