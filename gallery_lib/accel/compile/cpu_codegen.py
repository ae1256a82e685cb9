"""Inductor's C++ on AVX-512 CPUs: a check that this machine's compiler builds ATen's bf16 tile transpose right, and
AVX2-width vectors where it does not.

Where a bf16 tensor in channels-last layout meets a contiguous one (the group-norm backward after the 1x1
convolution of every diffusers transformer block), Inductor's AVX-512 kernels transpose 32 x 32 tiles with ATen's
``transpose_mxn<BFloat16>``. GCC 11 and 12 at ``-O3`` miscompile a kernel that holds two of them: the tiles come back
scrambled, and the gradients hold garbage or NaN (``benchmarks/RESULTS.md#cpu-avx512-transpose``). Clang, ``-O2``
and AVX2 code are right.

``use_safe_cpu_codegen()`` compiles such a kernel once per process with Inductor's own C++ builder and flags (about
a second; the precompiled header it builds is the one Inductor's first kernel needs anyway) and, where the tiles come
back wrong, sets ``torch._inductor.config.cpp.simdlen = 256``: Inductor then emits AVX2 code for the CPU, whose
transposes take no such path. A ``simdlen`` the user set, and CPUs without AVX-512 (or
``ATEN_CPU_CAPABILITY=avx2``), are left alone.
"""

from __future__ import annotations

import functools

import torch

_SAFE_SIMDLEN = 256

# Two 32 x 32 tiles of a 64-wide bf16 matrix transposed back to back, as Inductor's tiled kernels do.
_PROBE_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const at::BFloat16* in_ptr0, at::BFloat16* out_ptr0)
{
    for (int64_t tile = 0; tile < 2; tile++) {
        alignas(64) at::BFloat16 tmp0[32*32];
        transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr0 + 32*tile, 64, tmp0, 32);
        alignas(64) at::BFloat16 tmp1[32*32];
        transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr0 + 2048 + 32*tile, 64, tmp1, 32);
        for (int64_t i = 0; i < 1024; i++) {
            out_ptr0[2048*tile + i] = tmp0[i];
            out_ptr0[2048*tile + 1024 + i] = tmp1[i];
        }
    }
}
"""


def avx512_codegen() -> bool:
    """True when Inductor would emit AVX-512 C++ here: an AVX-512 CPU, ``ATEN_CPU_CAPABILITY`` not lower, and no
    ``simdlen`` chosen."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is not None:
        return False
    isa = pick_vec_isa()
    return bool(isa) and isa.bit_width() == 512


def tiles_transpose_right() -> bool:
    """Whether the C++ compiler Inductor uses transposes two bf16 tiles in one kernel right (compiled and run once)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel = CppPythonBindingsCodeCache.load_pybinding(["const at::BFloat16*", "at::BFloat16*"], _PROBE_SOURCE)
    source = (torch.arange(4096) % 251).to(torch.bfloat16)  # integers below 256: exact in bf16
    out = torch.empty_like(source)
    kernel(source, out)
    blocks = source.view(2, 32, 64)
    expected = torch.cat([blocks[b, :, 32 * t:32 * t + 32].t().reshape(-1) for t in range(2) for b in range(2)])
    return torch.equal(out, expected)


@functools.cache
def use_safe_cpu_codegen() -> str | None:
    """Sets AVX2-width CPU code generation where this machine's compiler gets AVX-512 tile transposes wrong; returns
    the log line saying so, or ``None`` when nothing changed. Once per process: the setting is process-wide."""
    if not avx512_codegen():
        return None
    from torch._inductor import config

    try:
        right = tiles_transpose_right()
        why = "its AVX-512 bf16 tile transposes came back wrong"
    except Exception as exc:  # no compiler, or an Inductor without this API: keep the code path known to be right
        right, why = False, f"the check of its AVX-512 bf16 tile transposes failed ({type(exc).__name__})"
    if right:
        return None
    config.cpp.simdlen = _SAFE_SIMDLEN
    return (f"CPU code generation: {config.cpp.cxx[-1]} was checked and {why}; Inductor emits AVX2 code "
            f"(cpp.simdlen={_SAFE_SIMDLEN}) so that compiled graphs compute what eager does")
