# flash-attn's attention runners on the GPU machine: install a flash-attn wheel built for this GPU, check every
# backend's forward and gradients against float64 math, and time every backend at the SD and Swin shapes.
#   build the wheel on a machine with the GPU machine's torch and CUDA (ci/install_flash_attn.sh builds for the local
#   GPU; elsewhere: FLASH_ATTN_CUDA_ARCHS=90 pip wheel --no-build-isolation flash-attn), put it in .whl/flash_attn/
#   device run (carry .whl/flash_attn and .whl/test): bash benchmarks/gpu_flash_attn.sh
mkdir -p /tmp/site
# a wheel, or the wheel's files as .tar.xz (the sm90 build compresses from 62 to 13 MB, under the carry limit)
for archive in .whl/flash_attn/*.tar.xz; do [ -e "$archive" ] && tar -C /tmp/site -xJf "$archive"; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/flash_attn/*.whl 2>/dev/null) \
  .whl/test/*.whl 2>&1 | grep -v "already exists"
python3 benchmarks/device_site.py /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name --format=csv,noheader
echo "commit ${GALLERY_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
python3 -c "import flash_attn, torch; print('flash_attn', flash_attn.__version__, 'torch', torch.__version__)" || exit 1
timeout 180 python3 -m pytest -m gpu tests/test_attention.py -v -p no:cacheprovider -rsE > "$out/flash_attn_tests.txt" 2>&1
echo "attention GPU tests rc=$?"; grep -E "PASSED|FAILED|SKIPPED|Error" "$out/flash_attn_tests.txt" | tail -15
timeout 200 python3 benchmarks/bench_ema_compile_attention.py --parts attention --out "$out/attention_flash_attn.json" \
  > "$out/attention_flash_attn.log" 2>&1
echo "attention timing rc=$?"; tail -30 "$out/attention_flash_attn.log"
