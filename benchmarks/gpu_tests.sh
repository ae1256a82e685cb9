# Every gpu-marked test on the GPU machine; results under $OUT/gpu_tests.txt. The whole set takes about 700 s on an
# H200, more than one call's 600 s, so run it in two calls (carry .whl with diffusers, pytest and cudnn frontend):
#   device run: bash benchmarks/gpu_tests.sh first    (every test file up to tests/test_kernels_group_norm.py)
#   device run: bash benchmarks/gpu_tests.sh second   (the files after it)
#   device run: bash benchmarks/gpu_tests.sh tests/test_ema.py ...   (the files named)
source "$(dirname "$0")/device_env.sh"
files=$(ls tests/test_*.py | grep -v -e test_notebooks.py -e test_browser.py)
split=tests/test_kernels_group_norm.py
case "${1:-all}" in
  all) ;;
  first) files=$(echo "$files" | awk -v s=$split '{print} $0 == s {exit}') ;;
  second) files=$(echo "$files" | awk -v s=$split 'found {print} $0 == s {found=1}') ;;
  *) files="$*" ;;
esac
nvidia-smi --query-gpu=name --format=csv,noheader
echo "commit ${GALLERY_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
# the stack the suite ran on, at the head of its result file
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" | tee $OUT/stack.txt
start=$(date +%s)
cp $OUT/stack.txt $OUT/gpu_tests.txt
# -v: a test per line as it ends, so a call cut short still says which passed
timeout 560 python3 -m pytest -m gpu $files -v -p no:cacheprovider -rsE --durations=12 >> $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -25 $OUT/gpu_tests.txt
