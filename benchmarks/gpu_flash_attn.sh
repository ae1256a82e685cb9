#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4) on the GPU machine: install it from carried wheels, run the attention GPU tests
# (FA4 and FA4 padded against exact math, the correctness gate refusing FA4 where its dq is wrong) and time SDPA, FA4
# and FA4 padded at the SD shapes with what auto picks ($OUT/flash_attn_shapes.json, bench_flash_attn_shapes.py).
#
# The CUTLASS DSL's CUDA 13 wheel, which FA4 compiles its kernels with, is larger than one call carries beside the
# working tree (64 MiB together), so the wheels come in two calls to the same machine:
#   here, once, with network:  bash benchmarks/gpu_flash_attn.sh prepare
#     downloads the wheels for the GPU machine's Python 3.12 into .whl/fa4/ (git-ignored), recompresses the CUDA 13
#     wheel's files with LZMA (92 to about 66 MB; still a wheel that pip installs) and cuts it in two: .whl/fa4_part1/
#     and .whl/fa4_part2/, sized so that each call carries about the same
#   device run 1 (carry .whl/fa4 .whl/fa4_part1):  bash benchmarks/gpu_flash_attn.sh stage
#   device run 2 (carry .whl/fa4_part2), at once, while the machine is still warm:
#     GALLERY_COMMIT=<commit> bash benchmarks/gpu_flash_attn.sh
# If the machine was given back between the two calls, the second one says so: run both again.
set -uo pipefail

STAGE=/tmp/fa4
SITE=/tmp/site
FA4_VERSION=${FA4_VERSION:-4.0.0b36}
DSL_VERSION=${DSL_VERSION:-4.8.1}

prepare() {
  set -e
  local python=${PYTHON:-python3}
  local platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64"
  rm -rf .whl/fa4 .whl/fa4_part1 .whl/fa4_part2 .whl/fa4_big
  mkdir -p .whl/fa4 .whl/fa4_part1 .whl/fa4_part2 .whl/fa4_big
  # what flash-attn-4 and the CUTLASS DSL need beyond the machine's packages (einops, cuda-bindings, protobuf,
  # typing-extensions are there); the DSL's CUDA 13 libraries, as torch there is built for CUDA 13
  # shellcheck disable=SC2086
  "$python" -m pip download -q --no-deps $platform -d .whl/fa4 "flash-attn-4==$FA4_VERSION" \
    "nvidia-cutlass-dsl==$DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-core==$DSL_VERSION" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext "quack-kernels>=0.5.3"
  # shellcheck disable=SC2086
  "$python" -m pip download -q --no-deps $platform -d .whl/fa4_big "nvidia-cutlass-dsl-libs-cu13==$DSL_VERSION"
  local big
  big=$(ls .whl/fa4_big/*.whl)
  echo "gpu_flash_attn: recompressing $(basename "$big") with LZMA (a few minutes)"
  "$python" - "$big" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".lzma", "w", zipfile.ZIP_LZMA) as dst:
    for info in src.infolist():
        dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)
os.replace(path + ".lzma", path)
EOF
  local name size small part1
  name=$(basename "$big")
  size=$(stat -c %s "$big")
  small=$(cat .whl/fa4/*.whl | wc -c)
  part1=$(( (size - small) / 2 ))  # call 1 carries part 1 and the small wheels, call 2 part 2: the same size each
  head -c "$part1" "$big" > ".whl/fa4_part1/$name.part1"
  tail -c +"$(( part1 + 1 ))" "$big" > ".whl/fa4_part2/$name.part2"
  (cd .whl/fa4_big && sha256sum "$name") > .whl/fa4_part2/SHA256SUMS
  rm -rf .whl/fa4_big
  du -sh .whl/fa4 .whl/fa4_part1 .whl/fa4_part2
}

stage() {
  if ! ls .whl/fa4/*.whl .whl/fa4_part1/*.part1 >/dev/null 2>&1; then
    echo "gpu_flash_attn: stage needs .whl/fa4 and .whl/fa4_part1 carried (made by: bash" \
      "benchmarks/gpu_flash_attn.sh prepare)"
    exit 2
  fi
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  cp .whl/fa4/*.whl .whl/fa4_part1/*.part1 "$STAGE"/
  ls -l "$STAGE"
  echo "gpu_flash_attn: staged part 1 and $(ls .whl/fa4/*.whl | wc -l) wheels in $STAGE; now, at once, the second" \
    "call (carry .whl/fa4_part2): bash benchmarks/gpu_flash_attn.sh"
}

install() {
  local part2 name
  part2=$(ls .whl/fa4_part2/*.part2 2>/dev/null | head -1)
  if [[ -z "$part2" ]]; then
    echo "gpu_flash_attn: carry .whl/fa4_part2 in this call (made by: bash benchmarks/gpu_flash_attn.sh prepare)"
    exit 2
  fi
  name=$(basename "${part2%.part2}")
  if [[ ! -e "$STAGE/$name.part1" ]]; then
    echo "gpu_flash_attn: $STAGE holds no part 1: this machine was restarted since the stage call (it went back" \
      "when idle). Run the stage call again (carry .whl/fa4 .whl/fa4_part1): bash benchmarks/gpu_flash_attn.sh stage;" \
      "then this call (carry .whl/fa4_part2) right after it"
    exit 3
  fi
  local sums="$PWD/.whl/fa4_part2/SHA256SUMS"
  cat "$STAGE/$name.part1" "$part2" > "$STAGE/$name"
  if ! (cd "$STAGE" && sha256sum --quiet -c "$sums"); then
    echo "gpu_flash_attn: the joined $name does not match its checksum: the parts come from two different prepare" \
      "runs. Carry the .whl/fa4* folders of one prepare run, stage again, then this call"
    exit 3
  fi
  mkdir -p "$SITE"
  # one pip call: the DSL's wheels share the folder nvidia_cutlass_dsl/, which a later --target call would replace
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$STAGE"/*.whl 2>&1 | grep -v "already exists" || true
  python3 benchmarks/device_site.py "$SITE"
}

case "${1:-run}" in
  prepare) prepare; exit ;;
  stage) stage; exit ;;
  run) ;;
  *) echo "usage: bash benchmarks/gpu_flash_attn.sh [prepare|stage]"; exit 2 ;;
esac

start=$SECONDS
install
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
export GALLERY_COMMAND="bash benchmarks/gpu_flash_attn.sh stage, then bash benchmarks/gpu_flash_attn.sh"
# FA4 compiles each kernel the first time a process runs it: keep them for the later processes of this call
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernels
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit ${GALLERY_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
if ! python3 -c "
import importlib.metadata as m, torch
from gallery_lib.accel.attention import BACKENDS
print('torch', torch.__version__, '| flash-attn-4', m.version('flash-attn-4'),
      '| cutlass dsl', m.version('nvidia-cutlass-dsl-libs-base'))
assert BACKENDS['flash_attn4'].installed, 'the registry did not import flash_attn.cute'
"; then
  echo "gpu_flash_attn: FA4 does not import; the import itself says why:"
  PYTHONPATH=$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH python3 -c "from flash_attn.cute import flash_attn_func"
  exit 1
fi
# the check imports flash_attn.cute itself: the CUTLASS DSL's folder on the path, as its .pth file would put it
PYTHONPATH=$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH PYTHON=python3 timeout 150 bash ci/install_flash_attn.sh \
  check 2>&1 | tee "$out/flash_attn_check.txt"
echo "install check rc=${PIPESTATUS[0]} at $(( SECONDS - start )) s"
timeout 220 python3 -m pytest -m gpu tests/test_attention.py tests/test_attention_gate.py -v -s -p no:cacheprovider \
  -rsE > "$out/flash_attn_tests.txt" 2>&1
echo "attention GPU tests rc=$? at $(( SECONDS - start )) s"
grep -E "PASSED|FAILED|SKIPPED|Error|^flash_attn4" "$out/flash_attn_tests.txt" | tail -25
left=$(( 575 - SECONDS ))
(( left > 60 )) || left=60
timeout "$left" python3 benchmarks/bench_flash_attn_shapes.py --out "$out/flash_attn_shapes.json"
echo "shape table rc=$? at $(( SECONDS - start )) s"
