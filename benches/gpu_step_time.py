"""Check the step-time model's roofline constants on a GPU (torch only, no vLLM).

    python benches/gpu_step_time.py [--out calib.json]

``hybrid_alloc/step_time.py`` charges a step ``max(FLOPs / (peak x mfu), bytes / (HBM x
bandwidth efficiency))`` plus a fixed part, with an H100 SXM's data-sheet peaks (989 TFLOP/s
bf16, 3.35 TB/s) and mfu 0.55 / bandwidth efficiency 0.85. This times what dominates a
step of a Qwen3.5-27B-shaped model on the GPU at hand: the dense projections of 64 layers
(a GDN-style mixer's input and output projections, a gated MLP; 24.5 B bf16 parameters) at
T tokens per step, eagerly and as a CUDA-graph replay (T <= 512, as vLLM decodes), and
grouped-query decode attention's KV reads; each against the roofline without its fixed
part. The constants are this file's (the package needs its compiled module, which a GPU
machine without the wheel does not have): keep them equal to ``step_time.H100``.
Not covered: GDN/Mamba recurrences, attention prefill, sampling, the fixed part.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

PEAK_FLOPS, HBM_BYTES_PER_S, MFU, BANDWIDTH_EFFICIENCY = 989e12, 3.35e12, 0.55, 0.85
HIDDEN, INTERMEDIATE, LAYERS = 5120, 17408, 64
MIXER_IN, MIXER_OUT = 16384, 6144  # q, k, v, z (and gates) in; the value heads out
TOKENS = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192)
GRAPH_MAX_TOKENS = 512


def median_seconds(fn: Callable[[], Any], iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def hbm(out: dict[str, Any]) -> None:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    out["copy_GBps"] = 2 * x.numel() / median_seconds(lambda: y.copy_(x)) / 1e9
    floats = x.view(torch.float32).uniform_()
    out["read_GBps"] = x.numel() / median_seconds(lambda: floats.sum()) / 1e9


def layer_stack() -> tuple[list[list[torch.Tensor]], int]:
    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
        return w.uniform_(-0.01, 0.01)

    shapes = ((HIDDEN, MIXER_IN), (MIXER_OUT, HIDDEN), (HIDDEN, 2 * INTERMEDIATE))
    shapes += ((INTERMEDIATE, HIDDEN),)
    layers = [[weight(r, c) for r, c in shapes] for _ in range(LAYERS)]
    return layers, LAYERS * sum(r * c for r, c in shapes)


def forward(layers: list[list[torch.Tensor]], h: torch.Tensor) -> torch.Tensor:
    for w_in, w_out, w_up, w_down in layers:
        h = h + (h @ w_in)[:, :MIXER_OUT] @ w_out
        m = h @ w_up
        h = h + (F.silu(m[:, :INTERMEDIATE]) * m[:, INTERMEDIATE:]) @ w_down
    return h


def graph_seconds(layers: list[list[torch.Tensor]], x: torch.Tensor) -> float:
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(layers, x)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        forward(layers, x)
    return median_seconds(graph.replay)


def projections(out: dict[str, Any]) -> None:
    layers, params = layer_stack()
    out["stack_params_b"] = params / 1e9
    rows = []
    for tokens in TOKENS:
        x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        with torch.no_grad():
            eager = median_seconds(
                lambda x=x: forward(layers, x), iters=5 if tokens >= 4096 else 10
            )
            graph = graph_seconds(layers, x) if tokens <= GRAPH_MAX_TOKENS else None
        seconds = min(eager, graph) if graph is not None else eager
        flops, weight_bytes = 2 * params * tokens, 2 * params
        model = max(
            flops / (PEAK_FLOPS * MFU), weight_bytes / (HBM_BYTES_PER_S * BANDWIDTH_EFFICIENCY)
        )
        rows.append(
            {
                "tokens": tokens,
                "eager_ms": eager * 1e3,
                "graph_ms": None if graph is None else graph * 1e3,
                "mfu": flops / seconds / PEAK_FLOPS,
                "bandwidth_efficiency": weight_bytes / seconds / HBM_BYTES_PER_S,
                "model_ms": model * 1e3,
                "measured_over_model": seconds / model,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out["projections"] = rows


def decode_attention(out: dict[str, Any]) -> None:
    rows = []
    for batch, context in ((64, 4096), (256, 2048), (32, 32768)):
        q = torch.empty(batch, 24, 1, 256, dtype=torch.bfloat16, device="cuda").uniform_()
        k = torch.empty(batch, 4, context, 256, dtype=torch.bfloat16, device="cuda").uniform_()
        v = torch.empty_like(k).uniform_()
        seconds = median_seconds(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        )
        kv_bytes = 2 * k.numel() * k.element_size()
        rows.append(
            {
                "batch": batch,
                "context": context,
                "ms": seconds * 1e3,
                "bandwidth_efficiency": kv_bytes / seconds / HBM_BYTES_PER_S,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out["decode_attention"] = rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this bench runs on a GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    hbm(out)
    torch.cuda.empty_cache()
    projections(out)
    torch.cuda.empty_cache()
    decode_attention(out)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
