# Swin-T with the window-attention kernel on the GPU machine: its GPU tests (kernel and attention files), then
# gallery bench peer against accelerated at batch 128; everything in $OUT.   bash benchmarks/gpu_window_attention.sh
source "$(dirname "$0")/device_env.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_window_attention.py tests/test_attention.py 2>&1 | tail -15 > $OUT/gpu_tests_window_attention.txt
tail -4 $OUT/gpu_tests_window_attention.txt
bash benchmarks/gpu_bench.sh swin_b128_window_attention --models swin --batch-size 128 --timed-steps 60 --recipes peer,accelerated
