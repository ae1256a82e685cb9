"""Test-only entry point that torchrun runs in place of ``gallery_lib.run.train``: the training module, with every
``torch.compile`` call run as ``aot_eager`` (Dynamo's capture and AOTAutograd, no Inductor code), for the processes
of tests that check what is wired around the compiler (``compile_testing.compile_without_codegen`` in-process)."""

import runpy

import torch

from aot_eager_site.sitecustomize import aot_eager_compile

torch.compile = aot_eager_compile(torch.compile)
runpy.run_module("gallery_lib.run.train", run_name="__main__", alter_sys=True)
