"""With this folder on ``PYTHONPATH``, every Python process started there runs each ``torch.compile`` as ``aot_eager``
(Dynamo's capture and AOTAutograd's joint graph, no Inductor code): a notebook's kernel, the runs it launches and their
precompile workers. For tests of what a notebook shows and wires (``test_notebooks.compiled_without_codegen``), where
a CPU's C++ kernels would cost minutes and check nothing of the notebook's: Inductor's own numerics on the same models
are held by the tests that compile in-process (``compile_testing``)."""

import torch


def aot_eager_compile(compile_for_real):
    """``torch.compile`` (``compile_for_real``) with ``backend="aot_eager"`` in place of the caller's backend, mode
    and options; what ``compile_testing.compile_without_codegen``, ``aot_eager_train.py`` and this folder's processes
    put in its place."""
    def aot_eager(model=None, **kwargs):
        kwargs = {key: value for key, value in kwargs.items() if key not in ("mode", "options", "backend")}
        return compile_for_real(model, backend="aot_eager", **kwargs) if model is not None else (
            lambda fn: compile_for_real(fn, backend="aot_eager", **kwargs))
    return aot_eager


if __name__ == "sitecustomize":  # imported by Python's start-up, not by a test that borrows the function above
    torch.compile = aot_eager_compile(torch.compile)
