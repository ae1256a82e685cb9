"""benchmarks/bench_kernels.py on CPU: its CLI, byte counts and row logic, with fake timers standing in for the GPU."""


import pytest
import torch
from script_testing import load_script

bench = load_script("benchmarks/bench_kernels.py")


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--graph-ms" in capsys.readouterr().out


def test_unknown_provider_is_an_error():
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--out", "x.json", "--providers", "eager,triton"])
    assert exc.value.code == 2


def test_bytes_add_params_only_when_not_negligible():
    gn = bench._gn_case(32, 320, 64, True, torch.bfloat16)
    assert gn.bytes("forward") == (2 * 32 * 320 * 64 * 64 * 2, 8 * 320)
    assert gn.bytes("backward") == (3 * 32 * 320 * 64 * 64 * 2, 16 * 320)
    tiny = bench._ln_case(4, 8, torch.float32)  # 16 fp32 params per 32 activations: far above 1%
    assert tiny.bytes("forward") == (2 * 4 * 8 * 4 + 8 * 8, 8 * 8)


def test_input_sets_stream_twice_the_l2():
    l2 = 50 << 20
    assert bench.input_sets(10 * l2, l2) == 2  # one other set between two uses of a set
    assert bench.input_sets(l2 // 2, l2) == 5
    assert bench.input_sets(1000, l2) == 256  # capped
    assert all(bench.input_sets(n, l2) * n >= 2 * l2 for n in (l2 // 7, l2 // 3, l2))


class FakeGpu:
    """Runs every call it is given (so the built calls are exercised) and reports a fixed time."""

    def __init__(self, ms=0.5, fail=False):
        self.ms, self.fail, self.calls = ms, fail, []

    def __call__(self, build, n_sets):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        calls = build(n_sets)
        self.calls += [(call, call(), call()) for call in calls]  # twice: backward must retain its graph
        return self.ms


def test_rows_take_bandwidth_from_gpu_ms_and_backward_leaves_grad_alone():
    case = bench._ln_case(6, 8, torch.float32)
    gpu = FakeGpu(ms=0.5)
    timers = bench.Timers(call_ms=lambda call: (call(), 2.0)[1], gpu_ms=gpu)
    rows = bench.time_case(case, torch.float32, timers, copy_gbs=1000.0, l2_bytes=1 << 10,
                           providers=("eager", "ours"), device="cpu")
    assert [(r["provider"], r["mode"]) for r in rows] == [(p, m) for p in ("eager", "ours") for m in bench.MODES]
    for r in rows:
        nbytes, _ = case.bytes(r["mode"])
        assert (r["gpu_ms"], r["call_ms"], r["gpu_ms_method"], r["bytes"]) == (0.5, 2.0, "cudagraph", nbytes)
        assert r["fraction_of_copy_bw"] == pytest.approx(nbytes / 0.5 / 1e6 / 1000.0)
        assert r["input_sets"] == bench.input_sets(nbytes, 1 << 10) > 1
    backward = [c for c in gpu.calls if c[0].func is torch.autograd.grad]
    assert len(backward) == 2 * bench.input_sets(case.bytes("backward")[0], 1 << 10)
    for call, first, second in backward:
        leaves = call.args[1]
        assert all(leaf.grad is None for leaf in leaves)  # autograd.grad returns, never accumulates
        assert [g.shape for g in first] == [leaf.shape for leaf in leaves]
        torch.testing.assert_close(first, second)


def test_failed_capture_falls_back_to_call_time_and_says_so():
    case = bench._geglu_case(4, 6, torch.float32)
    timers = bench.Timers(call_ms=lambda call: 3.0, gpu_ms=FakeGpu(fail=True))
    rows = bench.time_case(case, torch.float32, timers, copy_gbs=1000.0, l2_bytes=1 << 10, providers=("eager",),
                           device="cpu")
    assert {(r["gpu_ms"], r["gpu_ms_method"]) for r in rows} == {(3.0, "do_bench")}
    assert all("RuntimeError" in r["gpu_ms_note"] for r in rows)
    assert "*" in "\n".join(bench.format_rows(rows, ("eager",)))
