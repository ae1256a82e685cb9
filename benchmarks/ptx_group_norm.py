"""The GroupNorm kernels compiled for an H100/H200 (sm90) without a GPU: this tree against a base tree, PTX compared.

Triton compiles to PTX on any machine with its NVIDIA backend (the CUDA wheels of torch ship it). Each kernel variant
SD-1.5's GroupNorm+SiLU runs (the fused plan, the split plan's two launches, forward and backward) is compiled at
three plans as a launch specializes it (16-byte aligned pointers, integers divisible by 16 where they are), from the
``--base`` tree and from this one with ``LOOP_STAGES`` unset, then 1, 2 and 3. It prints whether the unset setting
gives the base tree's PTX (source locations and debug sections aside) and how many ``cp.async`` copies each depth
pipelines.

    python benchmarks/ptx_group_norm.py --base .scratch/base      # a git archive of the commit before
"""

from __future__ import annotations

import argparse

import triton
from kernel_source import kernels_of
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gallery_lib.reports.provenance import result_header

PLANS = ((32, 320, 4096, 32, True), (32, 960, 1024, 32, False), (1, 640, 1024, 32, True))  # n, c, hw, groups, CL
VARIANTS = (("_gn_fwd_kernel", dict(STATS=True, APPLY=False)), ("_gn_fwd_kernel", dict(STATS=False, APPLY=True)),
            ("_gn_fwd_kernel", dict(STATS=True, APPLY=True)),
            ("_gn_bwd_kernel", dict(STATS=True, APPLY=False, BLOCK_R=8)),
            ("_gn_bwd_kernel", dict(STATS=False, APPLY=True, BLOCK_R=8)))


def ptx(module, kernel: str, shape: tuple, flags: dict) -> str:
    fn = getattr(module, kernel)._jit
    n, c, hw, groups, cl = shape
    plan = module._Plan(n, c, hw, groups, cl, 4 * 132, 4096)
    constexprs = {k: v for k, v in plan.meta.items() if k != "num_warps"}
    constexprs.update(HAS_W=True, HAS_B=True, SILU=True, **flags)
    values = dict(C=c, HW=hw, G=groups, Cg=c // groups, SPLIT=plan.split, HW_PER=plan.hw_per, P=n * plan.split * c,
                  R=n * plan.split)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("X", "Y", "W", "B", "DY", "DX"):
            signature[arg] = "*bf16"
        elif arg in ("Part", "Mean", "Rstd", "DWB"):
            signature[arg] = "*fp32"
        else:
            signature[arg] = "fp32" if arg == "eps" else "i32"
        if signature[arg].startswith("*") or values.get(arg, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    text = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=plan.meta["num_warps"])).asm["ptx"]
    text = text[:text.find(".section\t.debug")] if ".section\t.debug" in text else text
    # source locations (file, line) and their labels differ with the line numbers, not with the code
    return "\n".join(line for line in text.splitlines()
                     if not line.strip().startswith((".loc", ".file", "$L__")) and "debug" not in line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a tree holding the base gallery_lib (e.g. from git archive)")
    args = parser.parse_args(argv)
    header = result_header()
    print(f"# {header['command']} | commit {header['commit']} (dirty: {header['dirty']}) | {header['date']} | "
          f"triton {triton.__version__}")
    base, this = kernels_of(args.base, "group_norm"), kernels_of(".", "group_norm")
    same = True
    for shape in PLANS:
        for kernel, flags in VARIANTS:
            before = ptx(base, kernel, shape, flags)
            unset = ptx(this, kernel, shape, dict(flags, STAGES=None)) == before
            same &= unset
            copies = [ptx(this, kernel, shape, dict(flags, STAGES=s)).count("cp.async") for s in (1, 2, 3)]
            print(f"{kernel} {shape} {flags}: unset gives the base PTX: {unset}; cp.async at 1, 2, 3 stages: {copies}")
    print(f"every unset variant compiles to the base tree's PTX: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
