"""Where SD-1.5's training memory goes, phase by phase, on one GPU: eager (no compile), fp32 weights, bf16 autocast,
fused AdamW with clipping, the EMA in the CPU's pinned memory (the gallery's ``ModelEma(offload=True)``), 512 px.
Prints peak allocated and reserved GiB after each phase of the third step, per batch and checkpointing setting.
``--compile``: the UNet compiled whole (``torch.compile``, as ``accelerated`` compiles it when it checkpoints), batch 8
checkpointed with the EMA offloaded, each step's phases (the first step compiles).
    python3 benchmarks/probe_sd_memory.py [--compile] > $OUT/probe_sd_memory.json   (GPU machine, diffusers in reach)"""
import json
import sys

import torch
import torch.nn.functional as F

from gallery_lib.accel.ema import ModelEma
from gallery_lib.models.sd_parts import build_unet
from gallery_lib.reports.provenance import source_version

GIB = 2**30


def probe(batch: int, checkpointing: bool, ema_offload: bool, compiled: bool = False) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    unet = build_unet("sd15").cuda().to(memory_format=torch.channels_last)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    forward = torch.compile(unet) if compiled else unet
    ema = ModelEma(unet, decay=0.9999, offload=ema_offload) if ema_offload is not None else None
    latents = torch.randn(batch, 4, 64, 64, device="cuda").to(memory_format=torch.channels_last)
    text = torch.randn(batch, 77, 768, device="cuda")
    t = torch.randint(0, 1000, (batch,), device="cuda")
    phases = {"weights": torch.cuda.memory_allocated() / GIB}
    for step in range(3):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            out = forward(latents, t, text).sample
            loss = F.mse_loss(out.float(), latents)
        fwd = torch.cuda.max_memory_allocated() / GIB
        loss.backward()
        bwd = torch.cuda.max_memory_allocated() / GIB
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0, foreach=True)
        optimizer.step()
        opt = torch.cuda.max_memory_allocated() / GIB
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(unet)
        torch.cuda.synchronize()
        if compiled:
            phases[f"step{step}"] = {"forward_peak": round(fwd, 2), "backward_peak": round(bwd, 2),
                                     "optimizer_peak": round(opt, 2),
                                     "reserved": round(torch.cuda.max_memory_reserved() / GIB, 2)}
        elif step == 2:
            phases.update(forward_peak=fwd, backward_peak=bwd, optimizer_peak=opt,
                          ema_peak=torch.cuda.max_memory_allocated() / GIB,
                          reserved=torch.cuda.max_memory_reserved() / GIB)
    del unet, forward, optimizer, ema, out, loss
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in phases.items()}


if __name__ == "__main__":
    compiled = "--compile" in sys.argv
    rows = []
    settings = [(8, True, True)] if compiled else [(8, False, None), (8, True, True), (4, True, True), (2, True, True),
                                                   (1, True, True), (1, False, True), (1, False, False)]
    for batch, checkpointing, offload in settings:
        try:
            row = probe(batch, checkpointing, offload, compiled)
        except torch.OutOfMemoryError as exc:
            row = {"error": str(exc)[:200]}
        row.update(batch=batch, checkpointing=checkpointing, compiled=compiled,
                   ema={None: "off", True: "offloaded", False: "gpu"}[offload])
        print(row, file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps({"command": " ".join(["python3 benchmarks/probe_sd_memory.py", *sys.argv[1:]]), **source_version(),
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
