"""Sweep the window-attention kernels' launch settings on Swin-T's shapes (one CUDA GPU), against a base tree's kernels.

For each setting of ``FWD_*`` / ``BWD_*`` in ``gallery_lib/accel/kernels/window_attention.py`` (windows per program,
loop pipeline stages, warps) it times the forward launcher and the backward launcher (kernel, zeroed partials and
their sum) on the four Swin-T stages at the given batch, each shape with and without the shift mask as Swin-T runs
it, CUDA graph replays after warm-up, median of 20 replays of 10 calls with p20/p80. A step's time is the sum over
Swin-T's 12 blocks. The ``--base`` tree's module (e.g. a ``git archive`` of the commit before) runs the same shapes
first; every setting's outputs are checked against it.

    python benchmarks/probe_window_attention.py --base .scratch/base --out $OUT/probe_window_attention.json
"""

import argparse
import itertools
import json

import torch
from gpu_timing import graph_ms
from kernel_source import kernels_of

from gallery_lib.accel.kernels import window_attention as wa
from gallery_lib.reports.provenance import result_header

# Swin-T at 224 px: (windows per image, heads, blocks without shift, blocks with shift) per stage.
SWIN_T_STAGES = ((64, 3, 1, 1), (16, 6, 1, 1), (4, 12, 3, 3), (1, 24, 2, 0))
N, D = 49, 32
FWD_SETTINGS = [(w, s, n) for w, s, n in itertools.product((1, 2, 4, 8), (1, 2, 3), (4,))] + [
    (4, 2, 8), (2, 2, 2), (4, 2, 2), (8, 3, 8)]
BWD_SETTINGS = [(w, s, n) for w, s, n in itertools.product((8, 16, 32), (1, 2), (4, 8))]


def _inputs(batch: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for per_image, heads, plain, shifted in SWIN_T_STAGES:
        windows = batch * per_image
        qkv = torch.randn(windows, N, 3, heads, D, device="cuda", generator=g, dtype=torch.bfloat16)
        bias = torch.randn(heads, N, N, device="cuda", generator=g) * 0.5
        dout = torch.randn(windows, N, heads, D, device="cuda", generator=g, dtype=torch.bfloat16)
        mask = torch.where(torch.rand(per_image, N, N, device="cuda", generator=g) < 0.3, -100.0, 0.0)
        for m, count in ((None, plain), (mask, shifted)):
            if count:
                cases.append(dict(qkv=qkv, bias=bias, mask=m, dout=dout, count=count))
    return cases


def _time(module, cases, scale):
    """Forward and backward ms per Swin-T step (median, p20, p80 summed over blocks), and each case's outputs."""
    fwd, bwd, outputs = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], []
    for c in cases:
        qkv, bias, mask, dout = c["qkv"], c["bias"], c["mask"], c["dout"]
        out, lse = module._fwd(qkv, bias, mask, scale)
        outputs.append((out, *module._bwd(dout, qkv, bias, mask, out, lse, scale)))
        for total, fn in ((fwd, lambda: module._fwd(qkv, bias, mask, scale)),
                          (bwd, lambda: module._bwd(dout, qkv, bias, mask, out, lse, scale))):
            for i, t in enumerate(graph_ms(fn, calls=10)):
                total[i] += c["count"] * t
    return fwd, bwd, outputs


def _max_diff(ours, base):
    return max((a.float() - b.float()).abs().max().item() for o, b_ in zip(ours, base) for a, b in zip(o, b_))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a tree holding the base gallery_lib (e.g. from git archive)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cases, scale = _inputs(args.batch), D ** -0.5
    base_fwd, base_bwd, base_outputs = _time(kernels_of(args.base, "window_attention"), cases, scale)
    report = {**result_header(), "device": torch.cuda.get_device_name(), "batch": args.batch,
              "base": {"fwd_ms": base_fwd, "bwd_ms": base_bwd}, "fwd": [], "bwd": []}
    print(f"base: fwd {base_fwd[0]:.3f} ms, bwd {base_bwd[0]:.3f} ms", flush=True)
    defaults = {k: getattr(wa, k) for k in dir(wa) if k.startswith(("FWD_", "BWD_"))}
    for kind, settings in (("fwd", FWD_SETTINGS), ("bwd", BWD_SETTINGS)):
        for wpp, stages, warps in settings:
            for k, v in defaults.items():
                setattr(wa, k, v)
            prefix = kind.upper()
            setattr(wa, f"{prefix}_WINDOWS_PER_PROGRAM", wpp)
            setattr(wa, f"{prefix}_STAGES", stages)
            setattr(wa, f"{prefix}_WARPS", warps)
            fwd, bwd, outputs = _time(wa, cases, scale)
            ms = fwd if kind == "fwd" else bwd
            row = {"windows_per_program": wpp, "stages": stages, "warps": warps, "ms": ms,
                   "max_abs_diff_vs_base": _max_diff(outputs, base_outputs)}
            report[kind].append(row)
            print(f"{kind} wpp={wpp} stages={stages} warps={warps}: {ms[0]:.3f} [{ms[1]:.3f}-{ms[2]:.3f}] ms, "
                  f"max diff {row['max_abs_diff_vs_base']:.2e}", flush=True)
    for k, v in defaults.items():
        setattr(wa, k, v)
    for kind in ("fwd", "bwd"):
        best = min(report[kind], key=lambda r: r["ms"][0])
        report[f"best_{kind}"] = best
        print(f"best {kind}: {best}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
