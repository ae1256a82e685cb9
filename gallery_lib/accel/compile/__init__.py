"""Compilation: what ``torch.compile`` gets and how its graphs reach the run.

- ``regional``: each repeated block of a model compiled in place (``compile_scope='blocks'``), and what the compile
  caches did;
- ``plan``: the compile plan of one run, owned in one place: what is compiled, whether it was precompiled;
- ``precompile/``: worker processes that compile the distinct block graphs before the first step;
- ``backend``: the ``gallery`` backend for ``torch.compile(model, backend="gallery")``;
- ``attention_layout``: the attention's tensors kept in the layout the compiled graphs expect;
- ``cpu_codegen``: Inductor's CPU code width where the AVX-512 path computes wrong values.
"""
