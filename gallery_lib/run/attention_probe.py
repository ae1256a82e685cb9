"""The attention probe: what attention kernels a run's model calls, for its log and summary.

For a model without the attention registry's hook, one eager forward without gradients reads what PyTorch's own
SDPA dispatch runs per attention call (nothing in the run changes). With the hook, the registry's selector says at the
end what ``auto`` ran. The probe is a report: a forward that fails in it leaves the first step to meet the problem.
"""

from __future__ import annotations

import time
from typing import Any


def attention_choices(accelerated, task, batch, precision) -> dict[str, str]:
    """PyTorch's SDPA choice per attention call of ``accelerated.module`` (empty with the registry's hook)."""
    if accelerated.attention is not None:
        return {}
    from gallery_lib.accel.attention import record_sdpa_choices

    try:
        return record_sdpa_choices(accelerated.module, lambda: task.loss(accelerated.module, batch, precision))
    except Exception as exc:  # noqa: BLE001 - a report: a real problem (out of memory, say) shows in the first step
        return {"not recorded": f"the probe's forward failed: {type(exc).__name__}: {str(exc).strip()[:200]}"}


class AttentionProbe:
    """Called once (on its own, or while precompile workers compile); then holds ``choices`` and ``seconds``."""

    def __init__(self, accelerated, task, batch, precision) -> None:
        self._args = (accelerated, task, batch, precision)
        self.choices: dict[str, str] = {}
        self.seconds = 0.0

    def __call__(self) -> None:
        start = time.perf_counter()
        self.choices = attention_choices(*self._args)
        self.seconds = time.perf_counter() - start

    def report(self, log) -> dict[str, Any]:
        """The summary's ``attention`` record (what ran, known once the steps have run) and its log lines."""
        accelerated = self._args[0]
        chosen = dict(accelerated.attention.selector.chosen) if accelerated.attention is not None else self.choices
        if not chosen:
            if accelerated.attention is not None:  # hooked, yet no registry call
                log("[gallery] attention: the hooked modules ran their own kernel (Swin's window attention on a GPU, "
                    "timm's own attention compiled on a CPU); no scaled_dot_product_attention call")
            else:  # timm's Swin by default, and convnets: there is no attention kernel to choose
                log("[gallery] attention: no scaled_dot_product_attention call (the model has no attention, or "
                    "computes it with its own matmul and softmax)")
            return {}
        for key, choice in chosen.items():
            log(f"[gallery] attention {key}: {choice}")
        return {"attention": chosen}
