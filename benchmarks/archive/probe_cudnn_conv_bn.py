"""Does cuDNN's conv + batch-norm fusion pay for ResNet-50? A probe of that lever for the ResNet-50 goal.

    python benchmarks/archive/probe_cudnn_conv_bn.py --out RESULT.json   (needs a GPU and ``nvidia-cudnn-frontend``)

On the GPU machine, which reaches no registry, carry the frontend as a wheel: ``python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl_probe nvidia-cudnn-frontend``
here, then ``pip install --no-index --no-deps --target /tmp/site .whl_probe/*.whl`` there (its other dependencies
serve the frontend's CuTe kernels, which this probe does not use).

Half of ResNet-50's step is Inductor's batch-norm fusions, at about the bandwidth an H100 streams
(benchmarks/RESULTS.md#resnet50): fewer bytes need the norm folded into the convolutions, as cuDNN's runtime fusion
engines do for MLPerf. In a bottleneck, ``conv2`` and ``conv3`` read ``relu(bn(previous conv's output))``; cuDNN can
apply that scale, bias and ReLU as the convolution loads its input, and sum the output's channels (the next norm's
statistics) as it stores it, so neither the normalized input nor a statistics pass touches memory. This script
times, for each such convolution of ResNet-50 at batch 256 (224 px, channels_last):

- ``inductor``: ``torch.compile`` of ``relu(x * scale + bias)``, the convolution and the output's channel sums, the
  kernels the compiled training step runs for it today;
- ``conv``: the convolution alone on a ready input, the floor without fusion;
- ``cudnn_fused``: one cuDNN graph, scale -> bias -> ReLU -> convolution -> channel sums and sums of squares;
- the weight gradient the same two ways: ``inductor_wgrad`` (the input recomputed, then the convolution's weight
  gradient) and ``cudnn_fused_wgrad`` (scale -> bias -> ReLU -> weight gradient in one graph).

The cuDNN graphs are tried in bf16 first, then in fp16, the type of the frontend's own samples (cuDNN 9.19 on an
H100 declined every bf16 variant); each row records what ran and what was declined. Each output is checked against
the unfused bf16 result. Times are CUDA-event medians over 15 rounds of 10 calls after warm-up, launched one by one
and (``graphed``) replayed as one CUDA graph, as the training step runs them, so that launch gaps do not count; each
cuDNN graph takes the fastest of its first four plans. Whole-network sums weight each shape by how many bottlenecks
run it. The data gradient (dgrad + ReLU backward + the norm's backward reductions) is not probed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

BATCH = 256
MAX_PLANS = 4  # cuDNN ranks its plans; building each runtime-fusion plan compiles kernels, so try the first few
# (name, in channels, out channels, kernel, stride, input side, bottlenecks that run it): conv2 and conv3 of each
# stage of timm's resnet50 (the first block of stages 2-4 strides in conv2).
SHAPES = [
    ("s1_conv2", 64, 64, 3, 1, 56, 3), ("s1_conv3", 64, 256, 1, 1, 56, 3),
    ("s2_conv2_stride", 128, 128, 3, 2, 56, 1), ("s2_conv2", 128, 128, 3, 1, 28, 3),
    ("s2_conv3", 128, 512, 1, 1, 28, 4),
    ("s3_conv2_stride", 256, 256, 3, 2, 28, 1), ("s3_conv2", 256, 256, 3, 1, 14, 5),
    ("s3_conv3", 256, 1024, 1, 1, 14, 6),
    ("s4_conv2_stride", 512, 512, 3, 2, 14, 1), ("s4_conv2", 512, 512, 3, 1, 7, 2), ("s4_conv3", 512, 2048, 1, 1, 7, 3),
]


def timed_ms(fn, calls: int = 10, rounds: int = 15, warmup: int = 3) -> dict:
    """Median, p20 and p80 of one call's time (ms), from CUDA events around ``calls`` calls."""
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    q = statistics.quantiles(per_call, n=10)
    return {"median_ms": statistics.median(per_call), "p20_ms": q[1], "p80_ms": q[7]}


def graphed_ms(fn, on_stream=None, calls: int = 10, rounds: int = 15) -> dict:
    """As ``timed_ms``, with the ``calls`` calls replayed as one CUDA graph: GPU time alone, no launch gaps (the
    training step replays its kernels as CUDA graphs). ``on_stream(stream)`` points a library's handle at the
    capture stream, and back at the current stream afterwards."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            if on_stream:
                on_stream(side)
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if on_stream:
            on_stream(torch.cuda.current_stream())
        for _ in range(calls):
            fn()
    if on_stream:
        on_stream(torch.cuda.current_stream())
    timing = timed_ms(graph.replay, calls=1, rounds=rounds)
    return {key: value / calls for key, value in timing.items()}


def inputs(cin, cout, k, stride, side):
    cl = torch.channels_last
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(BATCH, cin, side, side, device="cuda", generator=g).to(torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(cout, cin, k, k, device="cuda", generator=g) / (cin * k * k) ** 0.5).to(torch.bfloat16)
    w = w.to(memory_format=cl)
    scale = (1 + 0.1 * torch.randn(1, cin, 1, 1, device="cuda", generator=g)).to(torch.bfloat16).to(memory_format=cl)
    bias = (0.1 * torch.randn(1, cin, 1, 1, device="cuda", generator=g)).to(torch.bfloat16).to(memory_format=cl)
    out_side = (side + 2 * (k // 2) - k) // stride + 1
    dy = torch.randn(BATCH, cout, out_side, out_side, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, scale, bias, dy.to(memory_format=cl)


def torch_paths(k, stride):
    pad = k // 2

    def forward(x, w, scale, bias):
        y = F.conv2d(torch.relu(x * scale + bias), w, stride=stride, padding=pad)
        yf = y.float()
        return y, yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))

    def wgrad(x, w, scale, bias, dy):
        a = torch.relu(x * scale + bias)
        return torch.ops.aten.convolution_backward(dy, a, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0],
                                                   1, [False, True, False])[1]

    return torch.compile(forward), torch.compile(wgrad)


CUDNN_TYPES: dict = {}


def register_cudnn_types(cudnn) -> None:
    """Fills ``CUDNN_TYPES`` (torch dtype -> cuDNN data type) once the frontend is imported."""
    CUDNN_TYPES.update({torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF,
                        torch.float32: cudnn.data_type.FLOAT})


class CudnnGraph:
    """One cuDNN graph built from ``build(graph, tensors)``, its first ``max_plans`` plans ready to run; its I/O type
    is the first input's. ``heur_modes`` (names of ``cudnn.heur_mode``) rank the plans, with A and FALLBACK as the
    fallback where cuDNN does not offer them all."""

    def __init__(self, handle, named: dict, build, intermediate: str, max_plans: int = MAX_PLANS,
                 heur_modes: tuple[str, ...] = ("A", "FALLBACK")):
        import cudnn

        self.handle = handle
        io = CUDNN_TYPES[next(iter(named.values())).dtype]
        self.graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=getattr(cudnn.data_type, intermediate),
                                   compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.inputs = {name: self.graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                                               data_type=CUDNN_TYPES[t.dtype]) for name, t in named.items()}
        self.outputs = build(self.graph, self.inputs)  # name -> (graph tensor, torch buffer)
        self.graph.validate()
        self.graph.build_operation_graph()
        try:
            self.graph.create_execution_plans([getattr(cudnn.heur_mode, mode) for mode in heur_modes])
        except Exception:  # a heuristics mode cuDNN does not offer for this graph
            self.graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.graph.check_support()
        self.graph.build_plans(cudnn.build_plan_policy.ALL)
        self.pack = {self.inputs[n]: t for n, t in named.items()}
        self.pack.update({g: buf for g, buf in self.outputs.values()})
        self.plans = {}
        for index in range(min(max_plans, self.graph.get_execution_plan_count())):
            try:
                size = self.graph.get_workspace_size_plan_at_index(index)
                self.plans[index] = torch.empty(max(size, 1), device="cuda", dtype=torch.uint8)
            except Exception:  # a plan that did not build
                continue

    def run_plan(self, index):
        self.graph.execute_plan_at_index(self.pack, self.plans[index], index, handle=self.handle)

    def time_plans(self, **timing) -> dict:
        """Each built plan's ``timed_ms(**timing)``, or ``{"error": ...}`` for a plan that failed to run."""
        timings = {}
        for index in self.plans:
            try:
                timings[index] = timed_ms(lambda: self.run_plan(index), **timing)
            except Exception as exc:
                timings[index] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return timings

    def fastest(self) -> tuple[int, dict, dict]:
        """The fastest plan's index, its timing, and every plan's median (ms)."""
        timings = self.time_plans(calls=3, rounds=5, warmup=1)
        medians = {index: t["median_ms"] if "median_ms" in t else "failed: " + t["error"].split(":")[0]
                   for index, t in timings.items()}
        ran = [index for index, t in timings.items() if "median_ms" in t]
        if not ran:
            raise RuntimeError(f"no plan ran: {medians}")
        best = min(ran, key=lambda index: medians[index])
        return best, timed_ms(lambda: self.run_plan(best)), medians


def scale_bias_relu(graph, t):
    """The previous norm applied as the convolution loads its input: ``relu(x * scale + bias)``."""
    return graph.relu(input=graph.bias(input=graph.scale(input=t["x"], scale=t["scale"]), bias=t["bias"]))


def cudnn_forward(handle, x, w, scale, bias, k, stride, intermediate):
    pad = k // 2
    out_side = (x.shape[2] + 2 * pad - k) // stride + 1
    y = torch.empty(BATCH, w.shape[0], out_side, out_side, device="cuda", dtype=x.dtype,
                    memory_format=torch.channels_last)
    sums = torch.empty(1, w.shape[0], 1, 1, device="cuda", dtype=torch.float32)
    squares = torch.empty_like(sums)

    def build(graph, t):
        gy = graph.conv_fprop(image=scale_bias_relu(graph, t), weight=t["w"], padding=[pad] * 2,
                              stride=[stride] * 2, dilation=[1, 1])
        gy.set_output(True).set_data_type(CUDNN_TYPES[x.dtype])
        gs, gq = graph.genstats(input=gy)
        gs.set_output(True).set_data_type(CUDNN_TYPES[torch.float32])
        gq.set_output(True).set_data_type(CUDNN_TYPES[torch.float32])
        return {"y": (gy, y), "sum": (gs, sums), "sq": (gq, squares)}

    return CudnnGraph(handle, {"x": x, "w": w, "scale": scale, "bias": bias}, build, intermediate), (y, sums, squares)


def cudnn_wgrad(handle, x, w, scale, bias, dy, k, stride, intermediate):
    pad = k // 2
    dw = torch.empty_like(w)

    def build(graph, t):
        gdw = graph.conv_wgrad(image=scale_bias_relu(graph, t), loss=t["dy"], padding=[pad] * 2,
                               stride=[stride] * 2, dilation=[1, 1])
        gdw.set_output(True).set_dim(list(w.shape)).set_stride(list(w.stride())).set_data_type(
            CUDNN_TYPES[x.dtype])
        return {"dw": (gdw, dw)}

    return CudnnGraph(handle, {"x": x, "scale": scale, "bias": bias, "dy": dy}, build, intermediate), dw


def relative_error(actual, expected) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def probe_shape(handle, name, cin, cout, k, stride, side, count) -> dict:
    torch._dynamo.reset()  # each shape compiles its own graphs, none left over from the last
    row = {"shape": name, "in": cin, "out": cout, "kernel": k, "stride": stride, "side": side, "count": count}
    x, w, scale, bias, dy = inputs(cin, cout, k, stride, side)
    forward, wgrad = torch_paths(k, stride)
    y_ref, s_ref, q_ref = forward(x, w, scale, bias)
    dw_ref = wgrad(x, w, scale, bias, dy)
    a = torch.relu(x * scale + bias)
    for key, fn in (("inductor", lambda: forward(x, w, scale, bias)),
                    ("conv", lambda: F.conv2d(a, w, stride=stride, padding=k // 2)),
                    ("inductor_wgrad", lambda: wgrad(x, w, scale, bias, dy))):
        row[key] = {**timed_ms(fn), "graphed": graphed_ms(fn)}
    half = [t.half() if t.dtype == torch.bfloat16 else t for t in (x, w, scale, bias, dy)]
    half = [t.contiguous(memory_format=torch.channels_last) for t in half]
    attempts = {  # (key, inputs, intermediate type): bf16 first, fp16 (as the frontend's samples) where bf16 fails
        "cudnn_fused": [(cudnn_forward, (x, w, scale, bias), "BFLOAT16"), (cudnn_forward, (x, w, scale, bias), "FLOAT"),
                        (cudnn_forward, half[:4], "HALF")],
        "cudnn_fused_wgrad": [(cudnn_wgrad, (x, w, scale, bias, dy), "FLOAT"),
                              (cudnn_wgrad, (x, w, scale, bias, dy), "BFLOAT16"), (cudnn_wgrad, half, "FLOAT")],
    }
    for key, tries in attempts.items():
        declined = []
        for build, tensors, intermediate in tries:
            try:
                row[key] = dict(run_cudnn(handle, key, build, tensors, intermediate, k, stride, y_ref, s_ref, q_ref,
                                          dw_ref), declined=declined)
                break
            except Exception as exc:  # an unsupported graph is a result too
                declined.append({"dtype": str(tensors[0].dtype), "intermediate": intermediate,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
        else:
            row[key] = {"error": "no variant ran", "declined": declined}
    return row


def run_cudnn(handle, key, build, tensors, intermediate, k, stride, y_ref, s_ref, q_ref, dw_ref) -> dict:
    """Builds one cuDNN graph, times its fastest plan and compares its outputs with the unfused ones."""
    graph, outs = build(handle, *tensors, k, stride, intermediate)
    plan, timing, plans = graph.fastest()
    import cudnn

    try:
        timing["graphed"] = graphed_ms(lambda: graph.run_plan(plan),
                                       on_stream=lambda st: cudnn.set_stream(handle=handle, stream=st.cuda_stream))
    except Exception as exc:
        timing["graphed"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    graph.run_plan(plan)
    torch.cuda.synchronize()
    if key == "cudnn_fused":
        y, sums, squares = outs
        errors = {"y": relative_error(y, y_ref), "sum": relative_error(sums.flatten(), s_ref),
                  "sum_of_squares": relative_error(squares.flatten(), q_ref)}
    else:
        errors = {"dw": relative_error(outs, dw_ref)}
    return {**timing, "plan": plan, "plans_ms": plans, "relative_error": errors, "dtype": str(tensors[0].dtype),
            "intermediate": intermediate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import cudnn

    register_cudnn_types(cudnn)
    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn_backend": torch.backends.cudnn.version(), "cudnn_frontend": getattr(cudnn, "__version__", "?"),
              "batch": BATCH, "rows": []}
    for shape in SHAPES:
        started = time.time()
        row = probe_shape(handle, *shape)
        row["wall_s"] = round(time.time() - started, 1)
        result["rows"].append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                 if kk in ("median_ms", "error", "graphed")})
                          for k, v in row.items()}), flush=True)
    totals = {}
    for key in ("inductor", "conv", "cudnn_fused", "inductor_wgrad", "cudnn_fused_wgrad"):
        for mode, pick in (("launched", lambda t: t), ("graphed", lambda t: t.get("graphed", {}))):
            rows = [pick(r.get(key, {})).get("median_ms") for r in result["rows"]]
            if None not in rows:
                totals[f"{key}_{mode}"] = sum(ms * r["count"] for ms, r in zip(rows, result["rows"]))
    result["whole_network_ms"] = totals
    print("whole network (ms per step, these convolutions):", json.dumps(totals), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
