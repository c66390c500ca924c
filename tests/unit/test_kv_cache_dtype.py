"""A KV cache in float16 or bfloat16 under a float32 model (`--kv-cache-dtype`): the C attention kernels and the
PyTorch fallbacks over it, the cache sizing, and the flag's validation."""

from __future__ import annotations

import pytest
import torch

from kettle.kernels import ops
from kettle.launcher.config import LauncherConfig
from kettle.layers.attention import AttentionMetadata
from kettle.layers.sdpa_attention import SdpaBackend, gather_blocks
from kettle.proto import generate_pb2 as pb
from kettle.shard.config import ShardConfig
from kettle.shard.dtype import choose_kv_dtype
from kettle.shard.warmup import plan_kv_cache
from kettle.tensors.kv_cache import FLOAT8, KVCache, to_cache_dtype, write_slots
from tests.fixtures import cpu_kernels, kernels_buildable, vector_width

CAN_BUILD = kernels_buildable()
needs_kernels = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc, an AVX2/FMA/F16C CPU and the kernels on")
HALF = [torch.float16, torch.bfloat16]


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def scattered(lens: list[int], block_size: int, spare: int = 3) -> tuple[list[list[int]], int]:
    blocks = sum(-(-n // block_size) for n in lens) + spare
    order = torch.randperm(blocks).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(order[used : used + -(-n // block_size)])
        used += len(tables[-1])
    return tables, blocks


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("width", [3 * 64, 2 * 80 + 5])  # whole vectors, and a tail the scalar loop rounds
def test_cache_write_rounds_as_torch_does(dtype, width):
    torch.manual_seed(0)
    rows = torch.randn(37, width) * 100
    # Ties, subnormals, overflow to infinity and NaN: the cases where rounding modes differ.
    rows[0, :8] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 1e-7, 7e4, 1e39, float("nan")])
    rows[1, :4] = torch.tensor([float("inf"), -float("inf"), -0.0, 3.4e38])
    k_new, v_new = rows.view(37, 1, width), (-rows).view(37, 1, width)
    slots = torch.randperm(100)[:37]
    k_cache, v_cache = torch.zeros(100, 1, width, dtype=dtype), torch.zeros(100, 1, width, dtype=dtype)
    assert ops.cache_write_fits(k_new, v_new, k_cache, v_cache)
    ops.cache_write(k_new, v_new, slots, k_cache, v_cache)
    expected_k = torch.zeros_like(k_cache).index_copy_(0, slots, k_new.to(dtype))
    expected_v = torch.zeros_like(v_cache).index_copy_(0, slots, v_new.to(dtype))
    # Bit for bit, as `.to(dtype)` rounds (NaN stays NaN; its payload is PyTorch's choice per code path).
    for got, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        nan = expected.isnan()
        assert torch.equal(got.isnan(), nan) and nan.any()
        assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [64, 80, 128])  # the unrolled head sizes and the general path with a remainder
@pytest.mark.parametrize(("lens", "window"), [([5, 40, 130, 17], None), ([100, 50, 7], 32)])
def test_paged_decode_over_a_16_bit_cache_is_float32_math_over_the_rounded_kv(monkeypatch, dtype, dim, lens, window):
    torch.manual_seed(dim + len(lens))
    block_size, heads, kv_heads = 16, 6, 2
    tables, blocks = scattered(lens, block_size)
    k_cache, v_cache = torch.randn(2, blocks * block_size, kv_heads, dim).to(dtype).unbind(0)
    meta = AttentionMetadata.build([1] * len(lens), [n - 1 for n in lens], tables, block_size, "cpu")
    q = torch.randn(len(lens), heads, dim)
    got = SdpaBackend.decode(q, k_cache, v_cache, meta.decode, block_size, dim**-0.5, window)
    # The reference: the kernel over the same (already rounded) K/V held in float32.
    expected = ops.paged_decode(
        q, k_cache.float(), v_cache.float(), meta.decode.block_ids.view(len(lens), -1),
        meta.decode.query_positions.view(-1), block_size, dim**-0.5, window,
    )  # fmt: skip
    assert relative(got, expected) < 1e-5
    monkeypatch.setattr(ops, "available", lambda: False)  # SDPA over gathered blocks, cast on read
    fallback = SdpaBackend.decode(q, k_cache, v_cache, meta.decode, block_size, dim**-0.5, window)
    assert fallback.dtype == torch.float32
    assert relative(got, fallback) < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("tokens", "cache_len", "window"), [(37, 0, None), (40, 19, None), (100, 64, 24)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("avx512", [False, True])
def test_paged_prefill_over_a_16_bit_cache(dtype, tokens, cache_len, window, heads, kv_heads, dim, avx512):
    with vector_width("kettle_attention_avx512", avx512):
        check_paged_prefill_over_a_16_bit_cache(dtype, tokens, cache_len, window, heads, kv_heads, dim)


def check_paged_prefill_over_a_16_bit_cache(dtype, tokens, cache_len, window, heads, kv_heads, dim):
    torch.manual_seed(tokens + dim)
    block_size, context = 16, cache_len + tokens
    blocks = -(-context // block_size)
    table = torch.randperm(blocks + 5)[:blocks]
    k_cache = torch.randn((blocks + 5) * block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    q = qkv[:, :heads]
    assert ops.paged_prefill_fits(q, k_cache, v_cache, block_size)
    got = ops.paged_prefill(q, k_cache, v_cache, table, cache_len, block_size, dim**-0.5, window)
    expected = ops.paged_prefill(q, k_cache.float(), v_cache.float(), table, cache_len, block_size, dim**-0.5, window)
    assert relative(got, expected) < 1e-5


@pytest.mark.parametrize("dtype", [*HALF, *FLOAT8])
def test_the_sdpa_fallback_writes_and_reads_a_narrower_cache(monkeypatch, dtype):
    """Without the kernels: the new K/V are cast on write, the gathered context cast back on read. float8 is
    CUDA's `--kv-cache-dtype fp8_*`, whose prefills take this path there; the same PyTorch ops run here."""
    monkeypatch.setattr(ops, "available", lambda: False)
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    lens = [9, 6]
    tables, blocks = scattered(lens, block_size)
    caches = [torch.zeros(blocks * block_size, kv_heads, dim, dtype=dtype) for _ in "kv"]
    backend = SdpaBackend()
    # A prefill of both prompts (nothing cached: it attends to its new K/V rounded as the cache holds them), then
    # a decode step over the cached prefix; a float32 cache holding the same rounded rows must give the same.
    meta = AttentionMetadata.build([8, 5], [0, 0], tables, block_size, "cpu")
    q, k, v = (torch.randn(13, h, dim) for h in (heads, kv_heads, kv_heads))
    reference = [torch.zeros(blocks * block_size, kv_heads, dim) for _ in "kv"]
    rounded = to_cache_dtype(k, dtype).float(), to_cache_dtype(v, dtype).float()
    expected = backend.forward(q, *rounded, *reference, meta, dim**-0.5, None)
    assert torch.equal(backend.forward(q, k, v, *caches, meta, dim**-0.5, None), expected)
    assert torch.equal(caches[0].float(), to_cache_dtype(reference[0], dtype).float())
    reference = [cache.float() for cache in caches]
    meta = AttentionMetadata.build([1, 1], [8, 5], tables, block_size, "cpu")
    q, k, v = (torch.randn(2, h, dim) for h in (heads, kv_heads, kv_heads))
    got = backend.forward(q, k, v, *caches, meta, dim**-0.5, None)
    assert got.dtype == torch.float32
    rounded = to_cache_dtype(k, dtype).float(), to_cache_dtype(v, dtype).float()
    assert relative(got, backend.forward(q, *rounded, *reference, meta, dim**-0.5, None)) < 1e-5


@pytest.mark.parametrize(("dtype", "kernels"), [(d, False) for d in (*HALF, *FLOAT8)] + [(d, True) for d in HALF])
def test_a_cached_prefix_is_attended_as_a_fresh_prompt(dtype, kernels):
    """A prompt prefilled whole and the same prompt whose first 32 tokens came from the prefix cache: the same
    attention, since both attend to K/V rounded as a narrower cache holds them (a served greedy answer must not
    change with a prefix-cache hit)."""
    if kernels and not CAN_BUILD:
        pytest.skip("needs gcc, an AVX2/FMA/F16C CPU and the kernels on")
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim, n, cached = 16, 4, 2, 16, 40, 32  # whole blocks: the C kernel takes them
    tables, blocks = scattered([n], block_size)
    q, k, v = (torch.randn(n, h, dim) * 3 for h in (heads, kv_heads, kv_heads))
    backend, scale = SdpaBackend(), dim**-0.5

    def prefill(caches, start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata.build([end - start], [start], tables, block_size, "cpu")
        return backend.forward(q[start:end], k[start:end], v[start:end], *caches, meta, scale, None)

    with cpu_kernels(kernels):
        fresh = prefill([torch.zeros(blocks * block_size, kv_heads, dim, dtype=dtype) for _ in "kv"], 0, n)
        caches = [torch.zeros(blocks * block_size, kv_heads, dim, dtype=dtype) for _ in "kv"]
        prefill(caches, 0, cached)
        rest = prefill(caches, cached, n)
    assert relative(rest, fresh[cached:]) < 1e-6


@pytest.mark.parametrize("dtype", FLOAT8)
def test_a_float8_cache_saturates_instead_of_overflowing(dtype):
    """A key beyond float8's range would be NaN (e4m3fn) or infinity (e5m2) and poison its sequence's scores."""
    limit = torch.finfo(dtype).max
    rows = torch.tensor([[1.0, -2.5, 3 * limit, -1e30], [0.1, limit, -limit, float("inf")]]).view(2, 1, 4)
    cache = torch.full((6, 1, 4), 7.0).to(dtype)
    write_slots(cache, torch.tensor([4, 1]), rows)
    expected = torch.tensor([[1.0, -2.5, limit, -limit], [0.1, limit, -limit, limit]]).to(dtype).float()
    assert torch.equal(cache[[4, 1]].float().view(2, 4), expected)
    assert torch.equal(cache[[0, 2, 3, 5]].float(), torch.full((4, 1, 4), 7.0))  # other slots untouched
    gathered = gather_blocks(cache, torch.tensor([1, 0]), 1, 3, torch.float32)  # blocks of 3 slots
    assert torch.equal(gathered[0, :3], cache[3:6].float()) and torch.equal(gathered[0, 3:], cache[:3].float())


def test_a_16_bit_cache_holds_twice_the_tokens(monkeypatch):
    from types import SimpleNamespace

    spec = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert KVCache.bytes_per_token(30, 3, 64, torch.float32) == 46080  # SmolLM2-135M: 45 KiB per token
    monkeypatch.setattr("kettle.shard.warmup._available_bytes", lambda device: 2**30)
    monkeypatch.setenv("KETTLE_TUNING", f"max-kv-tokens={1 << 30}")
    request = pb.WarmupRequest(max_total_tokens=16, max_prefill_tokens=16)
    full = plan_kv_cache(spec, torch.device("cpu"), request, 0.1)
    half = plan_kv_cache(spec, torch.device("cpu"), request, 0.1, kv_dtype=torch.float16)
    assert half.num_blocks in (2 * full.num_blocks, 2 * full.num_blocks + 1)
    assert abs(half.bytes - full.bytes) <= 46080 * 16
    # A float8 cache (CUDA's fp8_*: the same sizing, on the GPU's free memory there) holds four times float32's.
    quarter = plan_kv_cache(spec, torch.device("cpu"), request, 0.1, kv_dtype=torch.float8_e4m3fn)
    assert quarter.num_blocks in range(4 * full.num_blocks, 4 * full.num_blocks + 4)


def test_kv_dtype_choice_per_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # By default a float32 model on the CPU keeps float16 K/V where Kettle's kernels read them, as llama.cpp does.
    assert choose_kv_dtype(None, torch.float32, cpu) == (torch.float16 if ops.available() else torch.float32)
    with cpu_kernels(False):
        assert choose_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert choose_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert choose_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert choose_kv_dtype("fp16", torch.float32, cpu) == torch.float16
    assert choose_kv_dtype("bf16", torch.float32, cpu) == torch.bfloat16
    assert choose_kv_dtype("float32", torch.bfloat16, cpu) == torch.float32
    with pytest.raises(ValueError) as refused:
        choose_kv_dtype("fp8_e5m2", torch.float32, cpu)
    assert str(refused.value) == "--kv-cache-dtype fp8_e5m2 needs a CUDA GPU: on the CPU use fp16 or bf16"
    # On CUDA every value applies; float8 where Triton converts it in hardware (compute capability 8.9+).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_kv_dtype("fp8_e4m3fn", torch.bfloat16, cuda) == torch.float8_e4m3fn
    assert choose_kv_dtype("fp8_e5m2", torch.float16, cuda) == torch.float8_e5m2
    assert choose_kv_dtype("fp16", torch.bfloat16, cuda) == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError) as refused:
        choose_kv_dtype("fp8_e4m3fn", torch.bfloat16, cuda)
    assert str(refused.value) == (
        "--kv-cache-dtype fp8_e4m3fn needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is 8.0: "
        "use the default or fp16/bf16"
    )


def test_the_flag_reaches_the_shard_and_is_validated(monkeypatch):
    from kettle.launcher import config as launcher_config
    from kettle.launcher.specs import shard_spec

    monkeypatch.setattr(launcher_config, "cuda_available", lambda: False)
    spec = shard_spec(LauncherConfig(kv_cache_dtype="fp16"), "/models/m", 0)
    assert spec.argv[spec.argv.index("--kv-cache-dtype") + 1] == "fp16"
    assert LauncherConfig(kv_cache_dtype="bf16").inactive_flags_set() == []
    with pytest.raises(ValueError) as refused:
        LauncherConfig(kv_cache_dtype="fp8_e4m3fn")
    assert str(refused.value) == "--kv-cache-dtype fp8_e4m3fn needs a CUDA GPU: on the CPU use fp16 or bf16"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, fp16, bf16, fp8_e4m3fn"):
        LauncherConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        ShardConfig(model_path="m", kv_cache_dtype="float16")
    # On CUDA TGI's values are accepted and active (the shard checks the GPU's compute capability).
    monkeypatch.setattr(launcher_config, "cuda_available", lambda: True)
    assert LauncherConfig(kv_cache_dtype="fp8_e5m2").inactive_flags_set() == []
