"""The base layer: what a run is, checked before it starts. It imports nothing else of the library, so every other
layer may import it.

- ``settings``: ``setting(...)`` (a field's default and rules, declared beside it) and ``ConfigError``;
- ``sections``: ``RunConfig``'s sections (job, data, training, optimizer, precision, compile, kernels, parallel,
  ema, checkpoint, metrics), each field's rules beside it and each section's own rules in it, and the alias table
  from flat field names (``lr``) to dotted ones (``optimizer.lr``);
- ``run_config``: ``RunConfig``, the one typed, frozen description of a training run: the sections, the task's
  settings and the rules that tie them together; ``config.json`` in and out;
- ``overrides``: the ``--set FIELD=VALUE`` parser (flat or dotted names);
- ``machine``: the checks that depend on this machine (device, process count, GPU-only options);
- ``gpu_check``: a GPU that this torch cannot use is an error (also run by ``ci/setup_env.sh`` before torch exists);
- ``quiet``: the library messages a user cannot act on, dropped by their exact origin;
- ``step_size``: the intents a recipe states by the size of a step (``compile_mode='auto'``, ``kernel_ops='auto'``:
  CUDA graphs, a family's large-step kernels), resolved from the config's own batch size wherever they are read.
"""

from gallery_lib.config.machine import resolve_device, validate_for_machine, visible_cuda_devices
from gallery_lib.config.overrides import parse_overrides
from gallery_lib.config.run_config import (AMP_DTYPES, AMP_LEVELS, COMPILE_MODES, COMPILE_SCOPES,
                                           CUDA_GRAPH_COMPILE_MODES, DATA_PARALLEL_MODES, DDP_GRAD_COMPRESSION,
                                           DEVICES, EMA_MODES, KERNEL_OPS, OPTIMIZERS, REPORT_TO, TRITON_KERNEL_OPS,
                                           RunConfig)
from gallery_lib.config.settings import ConfigError

__all__ = ["AMP_DTYPES", "AMP_LEVELS", "COMPILE_MODES", "COMPILE_SCOPES", "CUDA_GRAPH_COMPILE_MODES",
           "DATA_PARALLEL_MODES", "DDP_GRAD_COMPRESSION", "DEVICES", "EMA_MODES", "KERNEL_OPS", "OPTIMIZERS",
           "REPORT_TO", "TRITON_KERNEL_OPS", "ConfigError", "RunConfig", "parse_overrides", "resolve_device",
           "validate_for_machine", "visible_cuda_devices"]
