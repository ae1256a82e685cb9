"""The optimizer step with the EMA on SD-1.5's UNet parameters (one GPU): AdamW and the EMA in one pass
(``gallery_lib.accel.adamw_ema.AdamWWithEma``) against torch's fused AdamW followed by ``ModelEma``'s fused update.

Each variant runs as the training loop calls it: the gradient-clipping factor folded in as ``grad_scale``, the
non-finite guard's ``found_inf`` flag, then ``ModelEma.update``. Timed with CUDA events around whole steps (host work
included), median of 20 after 3 warm-up steps, p20/p80:

- ``two passes``: ``torch.optim.AdamW(fused=True)``, then the fused EMA kernel (DreamBooth's recipe before);
- ``AdamW alone``: the main stream's share when the EMA runs on a side stream (SD's recipe before);
- ``one pass``: ``AdamWWithEma``, with the rows' alignment hint (``ALIGNED_ROWS``) on and off.

Where the host is slower than the GPU those steps measure the host. So the kernels alone are timed too, captured in
a CUDA graph (``graph_ms``): torch's fused AdamW kernel then the fused EMA's, against the one-pass kernel, with and
without the hint. It then checks that one pass and two passes leave the same weights, moments and averages.

    python benchmarks/probe_adamw_ema.py --out $OUT/probe_adamw_ema.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from gpu_timing import event_ms, graph_ms

from gallery_lib.accel.adamw_ema import AdamWWithEma
from gallery_lib.accel.clipping import clip_then_step
from gallery_lib.accel.ema import ModelEma
from gallery_lib.accel.kernels import adamw_ema as one_pass
from gallery_lib.reports.provenance import result_header


def _unet() -> torch.nn.Module:
    from gallery_lib.models.sd_parts import build_stable_diffusion

    unet = build_stable_diffusion("sd15").unet.cuda()
    return unet.to(memory_format=torch.channels_last)  # as the recipe trains it


def _setup(unet, one: bool, ema_mode: str = "fused"):
    """An optimizer and an EMA of ``unet`` as the loop builds them, with gradients to step on."""
    torch.manual_seed(0)
    for p in unet.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    cls = AdamWWithEma if one else torch.optim.AdamW
    optimizer = cls(unet.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, fused=True)
    ema = ModelEma(unet, decay=0.9999, ratio_warmup=True, mode=ema_mode)
    if one:
        optimizer.attach_ema(ema, unet)
    flag = torch.zeros((), device="cuda")
    params = list(unet.parameters())

    def step(with_ema: bool = True):
        optimizer.found_inf = flag
        clip_then_step(optimizer, params, 1.0)
        del optimizer.found_inf
        if with_ema:
            ema.update(unet)
    return optimizer, ema, step


def _kernels_alone(unet, report: dict) -> None:
    """The device time of each way, its launches captured in one CUDA graph: no host work between them."""
    scale, flag = torch.tensor(2.0, device="cuda"), torch.zeros((), device="cuda")
    two_optimizer, two_ema, two_step = _setup(unet, False)
    two_step()  # the moments, the step counts and the EMA's tables
    params = list(unet.parameters())
    state = [two_optimizer.state[p] for p in params]

    def two_passes():  # torch's fused AdamW kernel (its step() cannot be captured unless capturable), then the EMA's
        torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in state],
                            [s["exp_avg_sq"] for s in state], [], [s["step"] for s in state], lr=1e-4, beta1=0.9,
                            beta2=0.999, weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale,
                            found_inf=flag)
        two_ema.update(unet)

    optimizer, _, step = _setup(unet, True)
    step()  # the one-pass tables; the gradients stay
    hyper = one_pass.Hyper(lr=1e-4, eps=1e-8, weight_decay=1e-2, ema_weight=1e-4)
    tables = [entry["tables"] for entry in optimizer._tables.values()]

    def one():
        for table in tables:
            one_pass.launch(table, hyper, scale, flag)

    # the hint is read as the graph is captured
    for name, fn, aligned in (("kernels alone: torch's fused AdamW, then the fused EMA", two_passes, True),
                              ("kernels alone: one pass", one, True),
                              ("kernels alone: one pass, no alignment hint", one, False)):
        one_pass.ALIGNED_ROWS = aligned
        ms = graph_ms(fn)
        report["rows"][name] = {"ms": ms}
        print(f"{name}: {ms[0]:.3f} [{ms[1]:.3f}-{ms[2]:.3f}] ms", flush=True)
    one_pass.ALIGNED_ROWS = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    unet = _unet()
    numel = sum(p.numel() for p in unet.parameters())
    report = {**result_header(), "device": torch.cuda.get_device_name(), "parameters": numel,
              "tensors": len(list(unet.parameters())), "rows": {}}
    initial = {k: v.clone() for k, v in unet.state_dict().items()}

    def timed(name: str, one: bool, with_ema: bool = True, moved: int = 9):
        unet.load_state_dict(initial)
        _, _, step = _setup(unet, one)
        ms = event_ms(lambda: step(with_ema))
        report["rows"][name] = {"ms": ms, "tb_per_s": moved * 4 * numel / ms[0] / 1e9}
        print(f"{name}: {ms[0]:.3f} [{ms[1]:.3f}-{ms[2]:.3f}] ms", flush=True)

    timed("two passes (fused AdamW with grad_scale, fused EMA)", False, moved=8 + 3)
    timed("AdamW alone (fused, grad_scale)", False, with_ema=False, moved=8)
    timed("one pass (AdamWWithEma)", True)
    one_pass.ALIGNED_ROWS = False
    timed("one pass, no alignment hint", True)
    one_pass.ALIGNED_ROWS = True
    unet.load_state_dict(initial)
    _kernels_alone(unet, report)

    # the same three steps both ways, from the same state
    results = []
    for one in (False, True):
        unet.load_state_dict(initial)
        optimizer, ema, step = _setup(unet, one)
        for _ in range(3):
            step()
        results.append(([p.detach().clone() for p in unet.parameters()],
                        [optimizer.state[p][k].clone() for p in unet.parameters() for k in ("exp_avg", "exp_avg_sq")],
                        [t.clone() for t in ema.module.parameters()]))
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for kinds in zip(*results) for a, b in zip(*kinds))
    report["max_relative_difference"] = worst
    print(f"one pass against two passes after 3 steps: largest difference {worst:.2e} of a tensor's largest value; "
          f"{numel * 4 / 2**30:.2f} GiB of fp32 weights", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if worst < 1e-4 and math.isfinite(worst) else 1


if __name__ == "__main__":
    raise SystemExit(main())
