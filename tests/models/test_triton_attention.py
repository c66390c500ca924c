"""The Triton attention kernels of the CUDA backend (kettle/layers/cuda_attention.py, cuda_prefill.py) against SDPA.

On a GPU they run compiled. Without one, the conftest turns on Triton's interpreter (TRITON_INTERPRET=1), which
runs the same kernels on CPU tensors, so they are checked on every machine with Triton installed (it is among
the test extras). The interpreter multiplies bfloat16 tiles as their raw bits (Triton 3.9's `tl.dot`), so there the
prefill kernel is checked in float16 and float32, and bfloat16 waits for a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from kettle.bench.drive import BLOCK_SIZE, new_cache, scattered_tables, step
from kettle.layers.attention import AttentionMetadata, get_backend
from kettle.layers.sdpa_attention import SdpaBackend
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import FLOAT8

triton = pytest.importorskip("triton")
cuda_attention = pytest.importorskip("kettle.layers.cuda_attention")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(
    not (ON_GPU or cuda_attention.INTERPRET), reason="needs a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)"
)

# A cache in the queries' dtype (None), or a `--kv-cache-dtype` one: float8 where Triton converts it in hardware
# (compute capability 8.9+), or in the interpreter.
FLOAT8_OK = not ON_GPU or torch.cuda.get_device_capability() >= (8, 9)
needs_float8 = pytest.mark.skipif(not FLOAT8_OK, reason="float8 needs compute capability 8.9+")
CACHE_DTYPES = [
    None,
    pytest.param(torch.float8_e4m3fn, marks=needs_float8),
    pytest.param(torch.float8_e5m2, marks=needs_float8),
    torch.float16,
]
CACHE_IDS = ["same", "fp8_e4m3fn", "fp8_e5m2", "fp16"]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.float16: 10}
HALF = torch.bfloat16 if ON_GPU else torch.float16  # see the module's docstring
# The interpreter runs each program in Python: shorter contexts keep its tests to seconds (a few tiles each, still
# split and merged).
LONGEST = 300 if ON_GPU else 100
BIG_BATCH = 40 if ON_GPU else 12  # on a GPU, past 32 sequences: another tuning class of the decode kernel


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "heads", "kv_heads", "head_dim", "window"), [(1, 8, 8, 128, None), (5, 8, 2, 80, 7)])
def test_paged_decode_kernel_matches_sdpa(cache_dtype, dtype, seqs, heads, kv_heads, head_dim, window):
    """The kernel's float32 math over the cache as stored (the queries' dtype, or a narrower `--kv-cache-dtype`
    that it widens as it reads) equals SDPA over the same values held in float32."""
    from kettle.layers.cuda_attention import paged_decode

    rng = random.Random(seqs)
    cache_lens = [rng.randint(0, LONGEST) for _ in range(seqs)]
    tables, num_blocks = scattered_tables([c + 1 for c in cache_lens])
    k_cache, v_cache = (
        torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=DEVICE).to(cache_dtype or dtype)
        for _ in "kv"
    )
    meta = AttentionMetadata.build([1] * seqs, cache_lens, tables, BLOCK_SIZE, DEVICE)
    q = torch.randn(seqs, heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    expected = SdpaBackend.decode(q.float(), k_cache.float(), v_cache.float(), meta.decode, BLOCK_SIZE, scale, window)
    table = meta.decode.block_ids.view(seqs, -1)
    out = paged_decode(q, k_cache, v_cache, table, meta.decode.query_positions.view(-1), BLOCK_SIZE, scale, window)
    error = (out.float() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize(("seqs", "kv_heads", "window"), [(1, 8, None), (6, 2, 9), (BIG_BATCH, 4, None)])
def test_fused_decode_step_matches_sdpa_backend(cache_dtype, seqs, kv_heads, window):
    """Decode-only steps write the new K/V inside the kernel: the same cache and output as SDPA's. Into a narrower
    cache both round (float8 saturates) and attend to the rounded values; the two conversions may break a tie
    differently, so those caches agree within one step of the cache's type."""
    from kettle.layers.cuda_attention import CudaBackend

    if cache_dtype in FLOAT8 and not ON_GPU:
        pytest.skip("Triton's interpreter rounds to float8 by its own rule (a truncation), not the hardware's")
    rng = random.Random(seqs)
    cache_lens = [rng.randint(0, LONGEST) for _ in range(seqs)]
    tables, num_blocks = scattered_tables([c + 1 for c in cache_lens])
    meta = AttentionMetadata.build([1] * seqs, cache_lens, tables, BLOCK_SIZE, DEVICE)
    caches = [
        torch.randn(num_blocks * BLOCK_SIZE, kv_heads, 64, device=DEVICE).to(cache_dtype or torch.float32) for _ in "kv"
    ]
    q, k_new, v_new = (torch.randn(seqs, n, 64, device=DEVICE) for n in (8, kv_heads, kv_heads))
    if cache_dtype in FLOAT8:
        k_new[:, :, 0], v_new[:, :, 1] = 1000.0, -1000.0  # beyond e4m3fn's 448: saturates instead of NaN
    reference_caches = [c.clone() for c in caches]
    expected = SdpaBackend().forward(q, k_new, v_new, *reference_caches, meta, 0.125, window)
    out = CudaBackend().forward(q, k_new, v_new, *caches, meta, 0.125, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for got, want in zip(caches, reference_caches, strict=True):
        assert torch.equal(got, want) if cache_dtype is None else within_one_step(got, want, cache_dtype)


def within_one_step(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every element of `got` within one unit in the last place of `dtype` of `want`."""
    g, w = got.float(), want.float()
    unit = 2.0 ** -MANTISSA_BITS[dtype]
    return bool(((g - w).abs() <= w.abs() * unit + torch.finfo(dtype).smallest_normal * unit).all())


def random_caches(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, device=DEVICE).to(dtype) for _ in "kv"]


PREFILL_SHAPES = [(4, 4, 64, None), (8, 2, 80, 23), (4, 1, 128, None), (2, 1, 256, 7)]  # heads, kv heads, dim, window


def prefill_cases() -> list:
    """Every shape in every cache type on a GPU. Under the interpreter (~1.5 s a case) the narrower caches take the
    first shape only, which keeps `make test-fast` within its two minutes: a cache's type changes how the kernel loads
    a tile, not the shapes' masks and tiles."""
    cases = []
    for cache, name in zip(CACHE_DTYPES, CACHE_IDS, strict=True):
        value, marks = (cache.values[0], cache.marks) if hasattr(cache, "values") else (cache, ())
        for dtype in (torch.float32, HALF):
            for shape in PREFILL_SHAPES if ON_GPU or value is None else PREFILL_SHAPES[:1]:
                label = f"{name}-{str(dtype).removeprefix('torch.')}-{'-'.join(map(str, shape))}"
                cases.append(pytest.param(value, dtype, shape, marks=marks, id=label))
    return cases


@pytest.mark.parametrize(("cache_dtype", "dtype", "shape"), prefill_cases())
def test_paged_prefill_matches_sdpa(cache_dtype, dtype, shape):
    """A step of prefills with and without a cached prefix (one longer than a tile of queries, one shorter than
    a block) and a decode among them: the kernels' result equals SDPA's float32 attention over the cache's values,
    the new tokens' K/V included as the cache rounds them."""
    heads, kv_heads, head_dim, window = shape
    query_lens, cache_lens = [37, 1, 70, 5, 130], [0, 40, 33, 101, 0]
    tables, num_blocks = scattered_tables([c + q for c, q in zip(cache_lens, query_lens, strict=True)])
    meta = AttentionMetadata.build(query_lens, cache_lens, tables, BLOCK_SIZE, DEVICE)
    tokens = sum(query_lens)
    q, k_new, v_new = (
        torch.randn(tokens, n, head_dim, device=DEVICE, dtype=dtype) for n in (heads, kv_heads, kv_heads)
    )
    caches = random_caches(num_blocks, kv_heads, head_dim, cache_dtype or dtype)
    out = cuda_attention.CudaBackend().forward(q, k_new, v_new, *caches, meta, head_dim**-0.5, window)
    # The reference: SDPA in float32 over the cache as the kernels left it (writing those values again is a no-op).
    held = [c.float() for c in caches]
    k_held, v_held = (c[meta.slots] for c in held)
    expected = SdpaBackend().forward(q.float(), k_held, v_held, *held, meta, head_dim**-0.5, window)
    error = (out.float() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 2e-3)
    written = [c[meta.slots].float() for c in caches]
    rounded = [x.to(cache_dtype or dtype).float() for x in (k_new, v_new)]
    for got, want in zip(written, rounded, strict=True):
        assert torch.equal(got, want) if cache_dtype is None else within_one_step(got, want, cache_dtype)


def test_prefills_go_to_the_kernel_in_one_launch(monkeypatch):
    """Every prefill of a step, cached prefix or not, takes the one varlen launch; none goes through SDPA."""
    from kettle.layers import cuda_prefill

    launches = []
    monkeypatch.setattr(cuda_prefill, "paged_prefill", lambda *args: launches.append(args[3]))
    monkeypatch.setattr(SdpaBackend, "prefill", staticmethod(lambda *args, **kwargs: pytest.fail("SDPA prefill")))
    meta = AttentionMetadata.build([6, 9, 1], [0, 12, 3], [[1, 2], [3, 4, 5, 6, 7, 8], [9]], BLOCK_SIZE, DEVICE)
    q, k, v = (torch.randn(16, 2, 16, device=DEVICE) for _ in "qkv")
    cuda_attention.CudaBackend().forward(q, k, v, *random_caches(10, 2, 16, torch.float32), meta, 0.25, None)
    (batch,) = launches
    assert batch.starts.tolist() == [0, 6] and batch.query_lens.tolist() == [6, 9]
    assert batch.cache_lens.tolist() == [0, 12] and batch.max_query_len == 9
    assert batch.tables.tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def backends_models(tiny_llama_path):
    """The tiny Llama in float32 twice: attending through the SDPA backend and through the CUDA one."""
    from kettle.models.decoder import Attention

    models = {}
    for name in ("sdpa", "cuda"):
        models[name] = load_model(str(tiny_llama_path), torch.float32, DEVICE)
        for layer in models[name].modules():
            if isinstance(layer, Attention):
                layer.backend = get_backend(name)
    return models


def chunked_generation(model, prompts: list[list[int]], chunk: int, decodes: int):
    """Prompts prefilled in chunks of `chunk` tokens, each chunk over the cached ones, while the prompts already in
    decode; then `decodes` greedy tokens for every prompt. Returns every step's logits and the greedy tokens."""
    steps = -(-max(map(len, prompts)) // chunk) + decodes
    tables, num_blocks = scattered_tables([len(p) + steps for p in prompts])
    cache, lens, logits = new_cache(model, num_blocks), [0] * len(prompts), []
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        chunks = [p[n : n + chunk] or t[-1:] for p, n, t in zip(prompts, lens, tokens, strict=True)]
        step_logits, meta = step(model, cache, chunks, lens, tables)
        logits.append(step_logits)
        lens = [n + len(c) for n, c in zip(lens, chunks, strict=True)]
        for i, token in enumerate(step_logits[meta.last_token_indices].argmax(-1).tolist()):
            if lens[i] >= len(prompts[i]):
                tokens[i].append(token)
    return logits, tokens


def test_chunked_prompts_and_decodes_through_the_cuda_backend_match_sdpa(backends_models):
    """Through the whole model: prompts prefilled in chunks over their cached prefixes beside decodes, then
    decoded. The CUDA backend's logits at every step equal the SDPA backend's, and so do the greedy tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (45, 7, 90)]
    (got, got_tokens), (want, want_tokens) = (
        chunked_generation(backends_models[name], prompts, chunk=32, decodes=4) for name in ("cuda", "sdpa")
    )
    assert got_tokens == want_tokens and min(map(len, got_tokens)) >= 4
    for got_step, want_step in zip(got, want, strict=True):
        torch.testing.assert_close(got_step, want_step, atol=1e-4, rtol=1e-4)


def test_speculative_greedy_through_the_cuda_backend_equals_plain_greedy(tiny_llama_path, engine, monkeypatch):
    """--speculate through the shard engine on the CUDA backend: a drafting request's rows read each other's new
    K/V, so those (chained) steps write the cache before the decode kernel runs, never inside it (in one launch a
    row could read a slot before its writer ran: the interpreter runs programs in order and would not show it).
    The tokens equal plain greedy on SDPA."""
    from tests.models.engine_driver import warm_engine
    from tests.models.test_speculation import run

    tuning = "speculate-min-ngram=1,speculate-row-cost=0,speculate-step-rows=7"
    monkeypatch.setenv("KETTLE_TUNING", tuning)
    plain, _, _ = run(engine, 0, max_new_tokens=20)
    monkeypatch.setenv("KETTLE_TUNING", f"attention=cuda,{tuning}")
    steps, fused = [], []
    decode, forward = cuda_attention.paged_decode, cuda_attention.CudaBackend.forward

    def spy_decode(*args):
        fused.append(len(args) > 8 and args[8] is not None)  # `new_kv`: the kernel writes the cache itself
        return decode(*args)

    def spy_forward(self, q, k_new, v_new, k_cache, v_cache, meta, *rest):
        before = len(fused)
        out = forward(self, q, k_new, v_new, k_cache, v_cache, meta, *rest)
        steps.append((meta.chained, any(fused[before:])))
        return out

    monkeypatch.setattr(cuda_attention, "paged_decode", spy_decode)
    monkeypatch.setattr(cuda_attention.CudaBackend, "forward", spy_forward)
    cuda_engine, _ = warm_engine(tiny_llama_path)
    speculative, drafted, accepted = run(cuda_engine, 4, max_new_tokens=20)
    assert drafted > 0 and accepted > 0
    assert {i: r[0] for i, r in speculative.items()} == {i: r[0] for i, r in plain.items()}
    assert (True, False) in steps and (False, True) in steps and (True, True) not in steps
