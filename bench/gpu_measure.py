"""GPU measurement primitives for bench/gpu_decode.py: copy bandwidth, step timers, kernel bandwidth.

Timers follow the method in the bench's docstring: warm up first; wall-clock over back-to-back calls with one
synchronize at the end (what a serving loop sees), or CUDA events around graph replays (GPU time alone).
"""

from __future__ import annotations

import statistics
import time

import torch

from kettle.tensors.kv_cache import BLOCK_SIZE


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    src = torch.randint(0, 255, (gib << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(dst[:1024], src[:1024])
    return 2 * src.numel() / statistics.median(times)


def wall_per_call(fn, steps: int, warmup: int) -> float:
    """Seconds per call over `steps` back-to-back calls (one sync at the end: host and GPU overlap)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def event_per_call(fn, steps: int) -> float:
    """GPU seconds per call, from CUDA events around `steps` back-to-back calls."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def attention_bandwidth(spec, batch: int, context: int) -> tuple[float, float]:
    """(seconds, bytes/s) of one layer's fused decode attention alone: K and V of every context read once."""
    from kettle.layers.cuda_attention import paged_decode

    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    pool = torch.randperm(batch * per_seq, device="cuda")
    cache = [torch.randn(batch * per_seq * BLOCK_SIZE, kv_heads, dim, device="cuda", dtype=spec.dtype) for _ in "kv"]
    table = pool.view(batch, per_seq)
    positions = torch.full((batch,), context, device="cuda")
    slots = table[:, -1] * BLOCK_SIZE + context % BLOCK_SIZE
    q = torch.randn(batch, heads, dim, device="cuda", dtype=spec.dtype)
    k_new, v_new = (torch.randn(batch, kv_heads, dim, device="cuda", dtype=spec.dtype) for _ in "kv")
    scale = dim**-0.5

    def call():
        paged_decode(q, cache[0], cache[1], table, positions, BLOCK_SIZE, scale, None, (k_new, v_new, slots))

    call()  # tunes and compiles; then 10 calls in one graph, so launch costs stay out of the time
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    seconds = event_per_call(graph.replay, 20) / 10
    return seconds, 2 * batch * (context + 1) * kv_heads * dim * cache[0].element_size() / seconds


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: every parameter once, except the embedding table."""
    embed = model.embed_tokens.data_ptr()
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if p.data_ptr() != embed}
    return sum(seen.values())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
