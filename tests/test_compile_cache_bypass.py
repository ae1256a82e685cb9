"""Why a graph was not cached: a run counts the compile caches' bypasses and keeps their reasons, since such a graph is
compiled again by every run (the caches name the reason only in an INFO log line, which stays hidden)."""

from __future__ import annotations

import torch

from gallery_lib.accel.compile.regional import (cache_bypass_reasons, compile_cache_stats, describe_compile_cache,
                                                watch_cache_bypasses)
from compile_testing import compile_cache_at


def test_a_bypassed_graph_is_counted_with_its_reason_and_the_info_line_stays_hidden(tmp_path, capfd):
    watch_cache_bypasses()
    watch_cache_bypasses()  # once: a second call adds no second filter
    stats, reasons = compile_cache_stats(), cache_bypass_reasons()
    # a post-grad pass that is a plain function, not a CustomGraphPass: Inductor cannot put it in a cache key
    with compile_cache_at(tmp_path), torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: torch.sin(x) * 3 + 1)
        x = torch.randn(7)
        torch.testing.assert_close(compiled(x), torch.sin(x) * 3 + 1)
    now = compile_cache_stats()
    new = cache_bypass_reasons() - reasons
    assert now["fx_graph_bypasses"] - stats["fx_graph_bypasses"] == 1
    assert set(new.values()) == {1} and all("Unsupported post grad custom pass" in reason for reason in new)
    assert any(reason.startswith("Bypassing FX Graph Cache") for reason in new)
    assert "Bypassing" not in capfd.readouterr().err
    described = describe_compile_cache({key: now[key] - stats[key] for key in now})
    assert "FX graph cache 0 hits, 0 misses, 1 bypassed" in described
    assert "bypassed" not in describe_compile_cache({**now, "aot_autograd_bypasses": 0, "fx_graph_bypasses": 0})


def test_a_cached_graph_records_no_bypass(tmp_path):
    watch_cache_bypasses()
    stats, reasons = compile_cache_stats(), cache_bypass_reasons()
    with compile_cache_at(tmp_path):
        torch._dynamo.reset()
        torch.compile(lambda x: torch.cos(x) - 2)(torch.randn(5))
    assert compile_cache_stats()["fx_graph_bypasses"] == stats["fx_graph_bypasses"]
    assert compile_cache_stats()["fx_graph_misses"] == stats["fx_graph_misses"] + 1
    assert not cache_bypass_reasons() - reasons
