# Sourced by the GPU machine's scripts: the carried wheels (.whl: diffusers, importlib_metadata; where carried,
# .whl/cudnn: cuDNN's frontend, which ResNet-50's conv-bn fusion needs, .whl/test: the test suite's extras) installed
# into /tmp/site, this tree's entry points registered there, and both on PYTHONPATH.
#   source "$(dirname "$0")/device_env.sh"
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$_root"/.whl/*.whl $(ls "$_root"/.whl/cudnn/*.whl "$_root"/.whl/test/*.whl 2>/dev/null)
python3 "$_root/benchmarks/device_site.py" /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
