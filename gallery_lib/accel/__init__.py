"""The accelerations: fused kernels and the swaps that use them, attention backends, the EMA, precision,
compilation and precompilation, applied in one fixed order by ``accelerate.py``."""
