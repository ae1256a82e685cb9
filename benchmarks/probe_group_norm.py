"""Sweep the GroupNorm+SiLU kernel's loop pipelining and programs per SM on SD-1.5's ResNet-block norms (one GPU).

The kernel's loops over positions run unpipelined (``LOOP_STAGES`` unset: plain ``range``, no ``cp.async`` in the
PTX, `benchmarks/ptx_group_norm.py`): each program waits on every tile's loads, as the window-attention kernels did
before their loops were pipelined (benchmarks/RESULTS.md#window-attention-sweep). For each setting of
``LOOP_STAGES`` and ``PROGRAMS_PER_SM`` in ``gallery_lib/accel/kernels/group_norm.py`` this times the forward and the
backward launchers over the 44 GroupNorm+SiLU calls of one SD-1.5 UNet step at 512 px (channels_last bf16, the
shapes of every ``ResnetBlock2D``'s two norms), each direction captured in one CUDA graph, median of 20 replays with
p20/p80 after 3, and checks every output against the unset setting's.

    python benchmarks/probe_group_norm.py --batch 32 --out $OUT/probe_group_norm_b32.json
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json

import torch
from gpu_timing import graph_ms

from gallery_lib.reports.provenance import result_header

# The module, not the `group_norm` function that `gallery_lib.accel.kernels` exports under the same name.
gn = importlib.import_module("gallery_lib.accel.kernels.group_norm")

GROUPS, EPS = 32, 1e-5


def sd15_resnet_norms(latent: int = 64) -> list[tuple[int, int]]:
    """(channels, side) of the two norms of every ``ResnetBlock2D`` of SD-1.5's UNet, in call order (down, mid, up):
    down block i runs at ``latent >> i``, the mid block at the lowest, up block i at ``lowest << i``."""
    from gallery_lib.models.sd_parts import build_stable_diffusion

    with torch.device("meta"):
        unet = build_stable_diffusion("sd15").unet
    lowest = latent >> (len(unet.down_blocks) - 1)
    stages = ([(b, latent >> i) for i, b in enumerate(unet.down_blocks)] + [(unet.mid_block, lowest)]
              + [(b, lowest << i) for i, b in enumerate(unet.up_blocks)])
    return [(norm.num_channels, side) for block, side in stages for r in block.resnets for norm in (r.norm1, r.norm2)]


def _cases(batch: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for c, side in sd15_resnet_norms():
        x = torch.randn(batch, c, side, side, device="cuda", generator=g).to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        dy = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        w = 1 + 0.1 * torch.randn(c, device="cuda", generator=g)
        b = 0.1 * torch.randn(c, device="cuda", generator=g)
        cases.append((x, dy, w, b))
    return cases


def _run(cases):
    """Every call's forward outputs and backward outputs."""
    outs = []
    for x, dy, w, b in cases:
        y, mean, rstd = gn._fwd(x, w, b, GROUPS, EPS, True)
        outs.append((y, mean, rstd, *gn._bwd(dy, x, w, b, mean, rstd, GROUPS, True)))
    return outs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cases = _cases(args.batch)
    reference = _run(cases)  # the module's settings as committed; its statistics feed every backward below
    report = {**result_header(), "device": torch.cuda.get_device_name(), "batch": args.batch, "calls": len(cases),
              "settings": []}
    for stages, per_sm in itertools.product((None, 2, 3, 4), (4, 2, 8)):
        gn.LOOP_STAGES, gn.PROGRAMS_PER_SM = stages, per_sm
        outs = _run(cases)
        diff = max((a.float() - r.float()).abs().max().item()
                   for o, ref in zip(outs, reference) for a, r in zip(o, ref))
        fwd = graph_ms(lambda: [gn._fwd(x, w, b, GROUPS, EPS, True) for x, dy, w, b in cases])
        bwd = graph_ms(lambda: [gn._bwd(dy, x, w, b, mean, rstd, GROUPS, True)
                                 for (x, dy, w, b), (_, mean, rstd, *_) in zip(cases, reference)])
        row = {"loop_stages": stages, "programs_per_sm": per_sm, "fwd_ms": fwd, "bwd_ms": bwd,
               "max_abs_diff_vs_unset": diff}
        report["settings"].append(row)
        print(f"stages {stages}, {per_sm}/SM: forward {fwd[0]:.3f} [{fwd[1]:.3f}-{fwd[2]:.3f}] ms, backward "
              f"{bwd[0]:.3f} [{bwd[1]:.3f}-{bwd[2]:.3f}] ms, max difference {diff:.2e}", flush=True)
    best = min(report["settings"], key=lambda r: r["fwd_ms"][0] + r["bwd_ms"][0])
    report["best"] = best
    print(f"best: {best}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
