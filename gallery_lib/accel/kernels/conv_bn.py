"""A convolution that applies the previous batch norm as it reads its input and sums its output as it writes it.

``scale_bias_relu_conv(x, scale, bias, weight, stride, padding)`` returns ``y = conv2d(relu(x * scale + bias),
weight)`` and ``y``'s per-channel sum and sum of squares in fp32: the next batch norm's statistics. In a ResNet
bottleneck, ``conv2`` and ``conv3`` read ``relu(bn(previous conv's output))``; computed this way neither the
normalized input nor a statistics pass touches memory (`conv_bn_block` beside it builds timm's bottleneck from it).

How a call is served:

* CUDA, float16, channels_last input, with ``nvidia-cudnn-frontend`` installed: one cuDNN runtime-fusion graph
  (scale -> bias -> ReLU -> convolution -> channel sums), built once per shape and checked against the reference
  on its first call. cuDNN 9 offers these fusions in float16 only (benchmarks/RESULTS.md#resnet50-cudnn-conv-bn);
* anything else: the PyTorch reference below, the same math unfused.

The backward is written in aten ops, so ``torch.compile`` traces it and fuses its elementwise work into the
convolution gradients' neighbours: the gradients of the sums fold into ``dy``, the input is recomputed from ``x``.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import warnings

import torch
import torch.nn.functional as F

_CHANNEL = (1, -1, 1, 1)
_PLANS_TRIED = 4  # cuDNN ranks its plans; each runtime-fusion plan compiles kernels, so the first few are timed
_CHECK_TOLERANCE = 2e-2  # relative norm error of a cuDNN graph's first output against the reference: fp16 is 1e-3


@functools.cache
def has_cudnn_frontend() -> bool:
    """Whether ``nvidia-cudnn-frontend`` (``import cudnn``) is installed."""
    return importlib.util.find_spec("cudnn") is not None


def reference(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, stride: int,
              padding: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op unfused: ``x``'s dtype for ``y``, fp32 for the normalization and the sums."""
    a = _activation(x, scale, bias)
    y = F.conv2d(a, weight.to(x.dtype), stride=stride, padding=padding)
    y = y.contiguous(memory_format=torch.channels_last)
    yf = y.float()
    return y, yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))


def _activation(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.float() * scale.float().view(_CHANNEL) + bias.float().view(_CHANNEL)).to(x.dtype)


def _output_shape(x: torch.Tensor, weight: torch.Tensor, stride: int, padding: int) -> tuple[int, int, int, int]:
    k_h, k_w = weight.shape[2:]
    return (x.shape[0], weight.shape[0], (x.shape[2] + 2 * padding - k_h) // stride + 1,
            (x.shape[3] + 2 * padding - k_w) // stride + 1)


class _CudnnGraph:
    """One built cuDNN graph for one shape: its input/output graph tensors and the fastest of its first plans."""

    def __init__(self, cudnn, handle, named: dict[str, torch.Tensor], stride: int, padding: int):
        types = {torch.float16: cudnn.data_type.HALF, torch.float32: cudnn.data_type.FLOAT}
        io_type = types[named["x"].dtype]
        graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.HALF,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.inputs = {n: graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=types[t.dtype])
                       for n, t in named.items()}
        t = self.inputs
        image = graph.relu(input=graph.bias(input=graph.scale(input=t["x"], scale=t["scale"]), bias=t["bias"]))
        y = graph.conv_fprop(image=image, weight=t["w"], padding=[padding] * 2, stride=[stride] * 2,
                             dilation=[1, 1])
        y.set_output(True).set_data_type(io_type)
        sums, squares = graph.genstats(input=y)
        sums.set_output(True).set_data_type(types[torch.float32])
        squares.set_output(True).set_data_type(types[torch.float32])
        self.outputs = (y, sums, squares)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.ALL)
        self.graph, self.handle, self.conv_args = graph, handle, (stride, padding)
        self.plan, self.workspace_bytes = self._fastest_plan(named)

    def run(self, named: dict, plan: int | None = None, workspace_bytes: int | None = None):
        n, c, h, w = _output_shape(named["x"], named["w"], *self.conv_args)
        y = torch.empty(n, c, h, w, device=named["x"].device, dtype=named["x"].dtype,
                        memory_format=torch.channels_last)
        sums = torch.empty(1, c, 1, 1, device=y.device, dtype=torch.float32)
        squares = torch.empty_like(sums)
        pack = {self.inputs[k]: v for k, v in named.items()}
        pack.update(zip(self.outputs, (y, sums, squares)))
        if workspace_bytes is None:
            workspace_bytes = self.workspace_bytes
        workspace = torch.empty(max(workspace_bytes, 1), device=y.device, dtype=torch.uint8)
        self.graph.execute_plan_at_index(pack, workspace, self.plan if plan is None else plan, handle=self.handle)
        return y, sums.view(c), squares.view(c)

    def _fastest_plan(self, named: dict) -> tuple[int, int]:
        medians = {}
        for plan in range(min(_PLANS_TRIED, self.graph.get_execution_plan_count())):
            try:
                size = self.graph.get_workspace_size_plan_at_index(plan)
                self.run(named, plan, size)  # warm-up, and plans that fail to run are skipped
                times = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    self.run(named, plan, size)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                medians[plan] = (statistics.median(times), size)
            except Exception:  # a plan cuDNN listed but cannot run here
                continue
        if not medians:
            raise RuntimeError("cuDNN built no plan that runs for this convolution")
        best = min(medians, key=lambda plan: medians[plan][0])
        return best, medians[best][1]


class _CudnnRunner:
    """The frontend's handles (one per device) and, per input shape, a `_CudnnGraph` with the dtype it reads the norm's
    scale and bias in (fp32 where cuDNN has an engine for it, else fp16); ``None`` marks a shape cuDNN declined or got
    wrong, which then runs the reference."""

    def __init__(self):
        import cudnn

        self.cudnn = cudnn
        self.handles: dict[int, object] = {}
        self.graphs: dict[tuple, tuple[_CudnnGraph, torch.dtype] | None] = {}
        self.declined: dict[tuple, str] = {}

    def __call__(self, x, scale, bias, weight, stride: int, padding: int):
        key = (x.device.index, stride, padding, tuple(x.shape), x.stride(), tuple(weight.shape))
        handle = self._handle(x.device)
        self.cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(x.device).cuda_stream)
        if key not in self.graphs:
            self.graphs[key] = self._build(key, handle, (x, scale, bias, weight), stride, padding)
        built = self.graphs[key]
        if built is None:
            return reference(x, scale, bias, weight, stride, padding)
        graph, affine_dtype = built
        return graph.run(_graph_inputs(x, scale, bias, weight, affine_dtype))

    def _handle(self, device: torch.device):
        if device.index not in self.handles:
            with torch.cuda.device(device):
                self.handles[device.index] = self.cudnn.create_handle()
        return self.handles[device.index]

    def _build(self, key, handle, args, stride, padding) -> tuple[_CudnnGraph, torch.dtype] | None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("scale_bias_relu_conv met a new input shape while a CUDA graph was being captured: "
                               "run the shape once outside capture first (torch.compile's CUDA graphs warm up so)")
        expected = reference(*args, stride, padding)
        failures = []
        for affine_dtype in (torch.float32, torch.float16):
            named = _graph_inputs(*args, affine_dtype)
            try:
                graph = _CudnnGraph(self.cudnn, handle, named, stride, padding)
                got = graph.run(named)
            except Exception as exc:  # cuDNN declines some fusions (dtypes, GPUs, versions)
                failures.append(f"{affine_dtype}: {type(exc).__name__}: {exc}"[:300])
                continue
            errors = [((g.float() - e.float()).norm() / e.float().norm().clamp_min(1e-12)).item()
                      for g, e in zip(got, expected)]
            if max(errors) <= _CHECK_TOLERANCE:
                return graph, affine_dtype
            failures.append(f"{affine_dtype}: relative error {max(errors):.2e} against the reference")
        self.declined[key] = "; ".join(failures)
        warnings.warn(f"cuDNN's fused conv + batch norm is not used for input {key[3]}, weight {key[5]} (stride "
                      f"{stride}): {self.declined[key]}. PyTorch's unfused ops run there instead, more slowly.",
                      stacklevel=3)
        return None


def _graph_inputs(x, scale, bias, weight, affine_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The graph's inputs: the norm's scale and bias as ``(1, C, 1, 1)`` in ``affine_dtype``, the weight in ``x``'s."""
    def per_channel(t):
        return t.to(affine_dtype).view(_CHANNEL).contiguous(memory_format=torch.channels_last)

    return {"x": x, "scale": per_channel(scale), "bias": per_channel(bias),
            "w": weight.to(x.dtype).contiguous(memory_format=torch.channels_last)}


_RUNNER: _CudnnRunner | None = None


def _runs_on_cudnn(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.float16 and x.is_contiguous(memory_format=torch.channels_last)
            and has_cudnn_frontend())


def cudnn_runner() -> _CudnnRunner:
    """The process's runner (built on first use): ``cudnn_runner().declined`` says which shapes ran the reference."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = _CudnnRunner()
    return _RUNNER


@torch.library.custom_op("gallery::scale_bias_relu_conv", mutates_args=())
def scale_bias_relu_conv(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor,
                         stride: int, padding: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``conv2d(relu(x * scale + bias), weight)`` (``scale`` and ``bias`` per input channel, shape ``(C,)``) and the
    output's per-channel sum and sum of squares in fp32."""
    if _runs_on_cudnn(x):
        return cudnn_runner()(x, scale, bias, weight, stride, padding)
    return reference(x, scale, bias, weight, stride, padding)


@scale_bias_relu_conv.register_fake
def _(x, scale, bias, weight, stride, padding):
    n, c, h, w = _output_shape(x, weight, stride, padding)
    y = torch.empty((n, c, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    return y, x.new_empty((c,), dtype=torch.float32), x.new_empty((c,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, scale, bias, weight, stride, padding = inputs
    ctx.conv_args = (stride, padding)
    ctx.save_for_backward(x, scale, bias, weight, output[0])


def _backward(ctx, dy, dsums, dsquares):
    x, scale, bias, weight, y = ctx.saved_tensors
    stride, padding = ctx.conv_args
    # The sums' gradients join y's: d(sum y)/dy = 1, d(sum y^2)/dy = 2y.
    grad = dy.float() if dy is not None else torch.zeros_like(y, dtype=torch.float32)
    if dsums is not None:
        grad = grad + dsums.view(_CHANNEL)
    if dsquares is not None:
        grad = grad + 2 * y.float() * dsquares.view(_CHANNEL)
    a = _activation(x, scale, bias)
    w = weight.to(x.dtype)
    da, dw, _ = torch.ops.aten.convolution_backward(grad.to(y.dtype), a, w, None, [stride] * 2, [padding] * 2,
                                                    [1, 1], False, [0, 0], 1, [True, True, False])
    da = da.float() * (a > 0)
    dx = (da * scale.float().view(_CHANNEL)).to(x.dtype)
    dscale = (da * x.float()).sum((0, 2, 3)).to(scale.dtype)
    dbias = da.sum((0, 2, 3)).to(bias.dtype)
    return dx, dscale, dbias, dw.to(weight.dtype), None, None


scale_bias_relu_conv.register_autograd(_backward, setup_context=_setup_context)
