"""Parallel ahead-of-time compilation of a model's repeated blocks, so regional compilation reaches speed sooner.

Regional compilation (``regional.regional_compile``) compiles each distinct block graph once, but one after the other
in the training process: every distinct graph (block class x parameter shapes x input shapes) costs a Dynamo trace,
AOTAutograd's joint graph and Inductor's lowering and code generation, mostly single-threaded Python.
``precompile_blocks`` spreads those distinct graphs over worker processes that compile them at the same time into
Inductor's on-disk caches (AOTAutograd cache, FX graph cache, Triton kernels); when the training process then
compiles the same blocks, it finds every graph there and only traces and loads.

1. record: the caller's forward runs once eagerly (RNG states restored afterwards) with pre-hooks on the blocks; each
   call's inputs are kept as specs (shape, stride, dtype, requires_grad; other arguments by value) with the autocast
   state of the call.
2. group: calls of the same block class, with the same parameter, buffer and input metadata and the same plain
   attributes (Dynamo guards on those too: SD's mid-block ResNets differ from their neighbours only in
   ``output_scale_factor``), compile to the same graph: one representative each.
3. workers (``python -m gallery_lib.accel.compile.precompile.worker QUEUE DEVICE``, ``CompileWorkers``) start
   before the recording, so that their imports, CUDA context and Inductor compile pool (10-30 s together on a busy
   machine) come up meanwhile; a training run starts them before it even builds the model. Then they all read
   meta-device copies of every representative (real buffers, since index buffers must stay valid), ordered largest
   first. Each worker claims the next unclaimed graph (an exclusive file create: no scheduler, no IPC), runs forward
   and backward on random inputs of the recorded specs through ``module.compile(**compile_kwargs)``, and takes the
   next, so a slow graph never leaves other graphs waiting behind it while a worker sits idle.

   Meanwhile, on a GPU (``warm_kernels``), this process runs each representative once uncompiled on a throwaway copy:
   cuDNN builds its attention and convolution kernels for the GPU on a machine's first use of them, 15-20 s for
   SD-1.5, which loading would otherwise pay after the workers (benchmarks/RESULTS.md#precompile-loading).

4. load as they land (``load=True``): this process then follows the workers' logs, and once a worker has
   exited (its cores are free) it runs each graph done so far, one between looks at the workers, once itself (a
   throwaway copy of the block, random inputs of the recorded specs, RNG states restored). That is the Dynamo trace,
   the cache loads and the first run (cuDNN's autotuning included) that the first training step would otherwise do
   for every graph after the last worker finished. Dynamo keeps compiled code per code object with guards on tensor
   metadata, not on the module object, so the run's own blocks of that graph find it ready. Loading waits for the
   first free cores: beside every busy worker it slowed them more than it saved
   (benchmarks/RESULTS.md#sd15-compile-time).

Numerics are unchanged: a cache hit loads the code the training process would have generated itself, and a graph the
workers missed (or a failed worker) is simply compiled by the training process as usual.

The package: ``record.py`` (steps 1-2, and running one recorded graph), ``worker.py`` (step 3's worker process),
``parallel.py`` (``precompile_blocks``: the workers, the queue, loading as graphs land, the report).
"""

from gallery_lib.accel.compile.precompile.parallel import CompileWorkers, PrecompileReport, precompile_blocks
from gallery_lib.accel.compile.precompile.record import BlockCall, TensorSpec, record_block_calls

__all__ = ["BlockCall", "CompileWorkers", "PrecompileReport", "TensorSpec", "precompile_blocks", "record_block_calls"]
