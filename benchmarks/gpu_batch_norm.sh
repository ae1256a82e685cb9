# ResNet-50 with the fused BatchNorm kernel on the GPU machine: its GPU tests, the kernel against PyTorch at the 53
# batch-norm shapes, then gallery bench peer / accelerated / accelerated with the kernel at batch 256; all in $OUT.
#   bash benchmarks/gpu_batch_norm.sh [NAME]
name=${1:-resnet_b256_fused_bn}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_batch_norm.py 2>&1 | tail -15 > $OUT/gpu_tests_batch_norm.txt
tail -4 $OUT/gpu_tests_batch_norm.txt
timeout 400 python3 benchmarks/bench_batch_norm.py --out $OUT/batch_norm_kernel.json > $OUT/batch_norm_kernel.log 2>&1
tail -40 $OUT/batch_norm_kernel.log | grep -v '^{"channels'
bash benchmarks/gpu_bench.sh $name --models resnet --batch-size 256 --timed-steps 60 \
  --recipes peer,accelerated,accelerated+kernels=true+kernel_ops=batch_norm_relu
