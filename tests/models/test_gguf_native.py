"""GGUF files read natively: Kettle's logits against transformers running gguf's own dequantization of the file.

Tiny random Llama, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, StarCoder2, Falcon, GPT-2 and BLOOM models are written with
`gguf.GGUFWriter` in F32, Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K, laid out as llama.cpp's converter lays them out
(tests/gguf_files.py). That layout is checked against transformers' own GGUF loader: reading the F32 file, it
must give the original model's logits. With no `quantize`, Kettle serves the file's own quantization: the 4-bit
types on the int4 kernel with the file's exact values (logits within 1e-4 of the reference; Q4_K within 2e-5 of
the largest logit where its weights sit in lanes with the file's own scales, 1e-3 elsewhere, its scale products
rounded to float16 by the rows layout), Q8_0 on the grouped int8 kernel
with the file's exact values (within 1e-4), Q6_K in lanes on its own kernel with the file's exact values (within
1e-4; without lanes on int8 per channel), Q5_0 requantized to int8 per channel (a stated relative error and
KL). Greedy tokens are identical in every exact case.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kettle.bench.drive import greedy, new_cache, scattered_tables, step
from kettle.hub.gguf import NATIVE_ARCHITECTURES
from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_IQ4L, LINEAR_Q5L, LINEAR_Q6L, LINEAR_Q8L
from kettle.models.registry import load_model
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.iq4 import IQ4Linear
from kettle.quantization.q4 import Q4Linear
from kettle.quantization.q5 import Q5Linear
from kettle.quantization.q6 import Q6Linear
from kettle.quantization.q8 import Q8Linear
from tests.fixtures import add_tuning
from tests.gguf_files import FROM_METADATA, dequantized_reference, tiny_model, write_gguf

PROMPTS = [[1, 5, 9, 33, 2, 70, 41], [3, 4, 88, 12], [60, 61, 62, 7, 7, 30, 11, 95, 20]]
# Q6_K in lanes: measured 3.2-3.4e-5 on llama, qwen2 and qwen3 (float32 activations).
EXACT_ATOL = {T.F32: 1e-4, T.Q4_0: 1e-4, T.Q4_1: 1e-4, T.Q5_0: 1e-4, T.Q5_1: 1e-4, T.Q8_0: 1e-4, T.Q6_K: 1e-4}
# Without Kettle's kernels (no gcc or AVX2, or KETTLE_TUNING=cpu-kernels=off) quantized GGUF tensors run PyTorch's
# packed kernels, which compute in bfloat16: the exact mapping these tests check is the kernels'.
EXACT_NEEDS_KERNELS = "the exact mapping runs on Kettle's CPU kernels (switched off or not built here)"
# Q4_K, relative to the largest logit (random Q4_K blocks make logits of ~100): in lanes, with the file's own
# scales, measured max difference 3e-6 (the products are gguf's); in the rows layout 1.8e-4 (d · sc rounded to
# float16, ≤ 2^-11 relative).
Q4_K_RTOL, Q4_K_ROWS_RTOL = 2e-5, 1e-3
# The lanes types with the kernels' int8 activations, relative to the largest logit of these tiny random models
# (peaked logits: ~1 for Q6_K, ~9 for IQ4_XS, ~120 for a Q4_K_M mix): measured 1.3e-2 (Q6_K), 2.0e-2 (IQ4_XS),
# 3.2e-2 (Q4_K_M); greedy tokens stay transformers' over the dequantized weights.
INT8_ROWS_RTOL = 5e-2


def q4_k_rtol(model) -> float:
    """The bound for a model whose 4-bit layers are Q4_K: the rows layout's where any layer is in it."""
    layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
    return Q4_K_RTOL if all(m.supers is not None for m in layers) else Q4_K_ROWS_RTOL


# Q5_0 requantized to int8 per output channel (the nearest scheme Kettle has), on this tiny random model's peaked
# logits: measured max relative logits error 0.02, mean next-token KL 1.0e-3 (bounds with margin); to Q8_0's
# blocks the error is smaller.
NEAREST_RTOL, NEAREST_KL = 0.05, 3e-3


def nearest_kind() -> type:
    """What a type the kernels do not read here is requantized to (kettle/quantization/gguf_scheme.py
    `_requantized`): Q8_0's blocks in lanes where those are held, else int8 per output channel."""
    return Q8Linear if ops.lanes(LINEAR_Q8L) else Int8Linear


CASES = [
    ("llama", T.F32),
    ("llama", T.Q4_0),
    ("llama", T.Q4_1),
    ("llama", T.Q4_K),
    ("llama", T.Q8_0),
    ("llama", T.Q6_K),
    ("llama", T.Q5_K),
    ("llama", T.IQ4_XS),
    ("qwen2", T.Q4_1),
    ("qwen2", T.Q6_K),
    ("qwen2", T.Q8_0),
    ("qwen2", T.Q5_0),
    ("llama", T.Q5_1),
    ("qwen3", T.Q4_0),
    ("qwen3", T.Q4_K),
    ("qwen3", T.Q5_K),
    ("qwen3", T.IQ4_XS),
    # Random Q4_K blocks make large weights: on the tiny LayerNorm models (StarCoder2, GPT-2) even float32
    # dequantized weights then differ from the reference by 2e-4 of the largest logit, the kernel's float16 scale
    # products by 2e-2. Q4_K runs on the RMSNorm families only (every 4-bit type takes the same path).
    ("phi3", T.F32),
    ("phi3", T.Q4_K),
    ("phi3", T.Q8_0),
    ("gemma2", T.F32),
    ("gemma2", T.Q4_1),
    ("gemma2", T.Q4_K),
    ("gemma3", T.F32),
    ("gemma3", T.Q8_0),
    ("starcoder2", T.F32),
    ("starcoder2", T.Q4_0),
    ("falcon", T.F32),
    ("falcon", T.Q4_1),
    ("gpt2", T.F32),
    ("gpt2", T.Q4_0),
    ("gpt2", T.Q8_0),
    ("bloom", T.F32),
    ("bloom", T.Q4_1),
]


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    # The kernels' quantized activations (int16 or int8 rows) are not what "exact mapping" measures.
    add_tuning(monkeypatch, quantized_activations=False)


def kettle_logits(model) -> torch.Tensor:
    tables, num_blocks = scattered_tables([len(p) for p in PROMPTS])
    logits, _ = step(model, new_cache(model, num_blocks), PROMPTS, [0] * len(PROMPTS), tables)
    return logits


def reference_logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])


def build(tmp_path, arch: str, qtype: T):
    hidden = 256 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) else 64  # K-types' super-blocks are 256 wide
    model = tiny_model(arch, hidden)
    folder = write_gguf(model, tmp_path / f"{arch}-{qtype.name}", arch, qtype)
    return folder, dequantized_reference(model, folder, arch)


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_gguf_logits_match_the_files_dequantization(tmp_path, arch, qtype):
    folder, reference = build(tmp_path, arch, qtype)
    model = load_model(str(folder), torch.float32, torch.device("cpu"))
    expected, logits = reference_logits(reference), kettle_logits(model)
    kinds = {type(m) for m in model.modules()}
    if qtype in (T.Q5_0, T.Q5_1) and not ops.lanes(LINEAR_Q5L):  # the nearest scheme without lanes
        assert nearest_kind() in kinds
        kl = (expected.softmax(-1) * (expected.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
        assert float((logits - expected).abs().max() / expected.abs().max()) < NEAREST_RTOL
        assert float(kl.mean()) < NEAREST_KL
        return
    # Every lanes type has AVX2 tiles: in lanes on any CPU the kernels run on, unless lanes are switched off
    lanes = ops.lanes({T.Q6_K: LINEAR_Q6L, T.IQ4_XS: LINEAR_IQ4L}.get(qtype, LINEAR_Q5L))
    if qtype in (T.Q5_K, T.Q6_K, T.IQ4_XS) and not lanes:  # the nearest scheme, as Q5_0, without lanes
        assert nearest_kind() in kinds and not kinds & {Q5Linear, Q6Linear, IQ4Linear}
        return
    if qtype != T.F32 and not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    if qtype == T.Q8_0:
        assert (Q8Linear in kinds) == ops.available()
    elif qtype in (T.Q5_K, T.Q5_0, T.Q5_1, T.Q6_K, T.IQ4_XS):  # in lanes: the file's values, the table's too
        kind = {T.Q6_K: Q6Linear, T.IQ4_XS: IQ4Linear}.get(qtype, Q5Linear)
        assert {type(m) for m in model.modules() if "Linear" in type(m).__name__} == {kind}
        assert isinstance(getattr(model.embed_rows, "__self__", None), kind)
    else:
        assert (Q4Linear in kinds) == (qtype != T.F32 and ops.available())
        # Q4_0 is symmetric (w = d · (q - 8)): its layers keep no minimums, the kernels read them off the scales.
        layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
        assert all((m.mins is None) == (qtype == T.Q4_0) for m in layers)
        # Q4_K in lanes keeps the file's 6-bit scales (as bytes) and super-block scales: its products exactly.
        assert all((m.supers is not None) == (qtype == T.Q4_K and m.lanes) for m in layers)
    if qtype in (T.Q4_K, T.Q5_K, T.IQ4_XS):  # in lanes: their products gguf's (random blocks: large logits)
        atol = (q4_k_rtol(model) if qtype == T.Q4_K else Q4_K_RTOL) * float(expected.abs().max())
    else:
        atol = EXACT_ATOL[qtype]
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    reference.generation_config.eos_token_id = None  # Kettle's `greedy` runs its 8 tokens whatever they are
    with torch.inference_mode():
        hf = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False)
    assert greedy(model, PROMPTS[:1], 8)[0] == hf[0, len(PROMPTS[0]) :].tolist()


def assert_greedy_tokens(model, reference, bound: float) -> None:
    """Kettle's greedy tokens are transformers' over the dequantized weights, up to the first step where transformers'
    two best logits lie within `bound` of each other (int8 rows move a logit by up to that much, so such a near-tie
    may go either way, and the sequences part there)."""
    reference.generation_config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor([PROMPTS[0]])
        hf = reference.generate(
            ids, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    want, got = hf.sequences[0, len(PROMPTS[0]) :].tolist(), greedy(model, PROMPTS[:1], 8)[0]
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            top = hf.scores[i][0].topk(2).values
            assert float(top[0] - top[1]) < 2 * bound, (i, want, got)
            return


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q5_K, T.IQ4_XS], ids=["Q6_K", "Q5_K", "IQ4_XS"])
def test_k_types_in_lanes_run_in_the_fused_decode_step(tmp_path, monkeypatch, qtype):
    """A Q6_K or Q5_K file with the kernels' int8 activations on: every projection, the table and the head run in
    the fused CPU decode step (whose rows carry the sums Q6_K's kernel reads), and its logits and greedy tokens are
    the file's."""
    from kettle.models.decoder_step import DecoderStep

    if not ops.lanes({T.Q6_K: LINEAR_Q6L, T.Q5_K: LINEAR_Q5L, T.IQ4_XS: LINEAR_IQ4L}[qtype]):
        pytest.skip("their kernels need the lanes layout (Q5_K: AVX-512 VNNI)")
    add_tuning(monkeypatch, quantized_activations=True)
    folder, reference = build(tmp_path, "llama", qtype)
    model = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert model.cpu_decoder_step is not None, DecoderStep.why_not
    expected, logits = reference_logits(reference), kettle_logits(model)
    bound = INT8_ROWS_RTOL * float(expected.abs().max())
    torch.testing.assert_close(logits, expected, atol=bound, rtol=0)
    assert_greedy_tokens(model, reference, bound)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_q4_k_m_mix_keeps_every_tensors_own_type(tmp_path, monkeypatch, activations):
    """llama.cpp's Q4_K_M stores some layers' attn_v (and ffn_down) in Q6_K beside Q4_K q and k: the fused q/k/v of
    such a layer stacks a Q4_K part and a Q6_K part, each its file's values (no per-channel int8 requantization),
    in the layer-by-layer forward and the fused decode step alike (one row on two threads too, its element-wise stages
    then in pieces); its logits and greedy tokens are the file's."""
    from kettle.bench.drive import decode_logits
    from kettle.quantization.kernel_weight import StackedWeight

    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    add_tuning(monkeypatch, quantized_activations=activations == "int8")
    model = tiny_model("llama", 256)
    mix = {"blk.0.attn_v.weight": T.Q6_K, "blk.0.ffn_down.weight": T.Q6_K}
    folder = write_gguf(model, tmp_path / "q4_k_m", "llama", T.Q4_K, types=mix)
    reference = dequantized_reference(model, folder, "llama")
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    qkv = loaded.layers[0].attn.qkv
    assert isinstance(qkv, StackedWeight) and not isinstance(loaded.layers[1].attn.qkv, StackedWeight)
    parts = [type(part) for part in qkv.parts]
    assert parts == ([Q4Linear, Q6Linear] if ops.lanes(LINEAR_Q6L) else [Q4Linear, nearest_kind()])
    if not ops.lanes(LINEAR_Q6L):
        return  # Q6_K on the nearest scheme without lanes: the tests above bound that
    assert not any(isinstance(m, Int8Linear) for m in loaded.modules())
    assert torch.equal(qkv.dequantized(), torch.cat([p.dequantized() for p in qkv.parts]))
    expected, logits = reference_logits(reference), kettle_logits(loaded)
    bound = (INT8_ROWS_RTOL if activations == "int8" else q4_k_rtol(loaded)) * float(expected.abs().max())
    torch.testing.assert_close(logits, expected, atol=bound, rtol=0)
    if activations == "int8":  # the fused step reads the stacked parts as the layer-by-layer forward does
        assert loaded.cpu_decoder_step is not None
        fused, layers = (decode_logits(loaded, PROMPTS[:2], fused, steps=4) for fused in (True, False))
        assert torch.equal(fused, layers)
        # One row on two threads: the fused step runs its SiLU and the down projection's int8 rows in pieces, one a
        # thread (decoder_step.c `row_pieces`: two of 256 inputs here), the layer-by-layer forward whole rows.
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            fused, layers = (decode_logits(loaded, PROMPTS[:1], fused, steps=4) for fused in (True, False))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(fused, layers)
    assert_greedy_tokens(loaded, reference, bound)


AVX2_TYPES = {
    T.Q4_K: Q4Linear, T.Q4_0: Q4Linear, T.Q8_0: Q8Linear, T.IQ4_XS: IQ4Linear, T.Q6_K: Q6Linear, T.Q5_K: Q5Linear,
    T.Q5_0: Q5Linear,
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(AVX2_TYPES), ids=[qtype.name for qtype in AVX2_TYPES])
def test_an_avx2_cpu_serves_the_types_with_avx2_tiles_from_their_own_bits(tmp_path, monkeypatch, qtype):
    """On a CPU without AVX-512 VNNI (this one, told so: `kettle_cpu_vnni512` 0, which Python's `ops.vnni` reads too)
    every lanes type has AVX2 tiles (lanes_avx2.c: Q4_*, Q8_0, IQ4_XS, Q6_K, Q5_*) and still sits in lanes, on those
    tiles: the file's values (Q4_K's own scales), its logits and transformers' greedy tokens, prompts and decode rows
    on the AVX2 tiles (the AVX2 integer panels from 64 rows), the fused step too."""
    from tests.fixtures import kernel_switch

    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    add_tuning(monkeypatch, quantized_activations=True)
    folder, reference = build(tmp_path, "llama", qtype)
    with kernel_switch("kettle_cpu_vnni512", 0):
        assert not ops.vnni() and not ops.lanes() and ops.lanes(LINEAR_Q5L) and ops.lanes(LINEAR_Q6L)
        model = load_model(str(folder), torch.float32, torch.device("cpu"))
        layers = [m for m in model.modules() if "Linear" in type(m).__name__]
        assert {type(m) for m in layers} == {AVX2_TYPES[qtype]}
        assert all(getattr(m, "lanes", True) for m in layers)  # Q4Linear and Q8Linear say which layout they hold
        assert all((m.supers is not None) == (qtype == T.Q4_K) for m in layers if isinstance(m, Q4Linear))
        expected, logits = reference_logits(reference), kettle_logits(model)
        atol = INT8_ROWS_RTOL * float(expected.abs().max())
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
        assert model.cpu_decoder_step is not None
        assert_greedy_tokens(model, reference, atol)


@pytest.mark.parametrize("choice", ["avx2", "avx-vnni"])
def test_cpu_isa_runs_a_q4_k_m_mix_as_an_avx2_cpu_does_with_the_same_bits(tmp_path, monkeypatch, choice):
    """`KETTLE_TUNING=cpu-isa=avx2|avx-vnni` (kettle/kernels/isa.py) is how an AVX2 CPU's speed is measured on one with
    AVX-512: loaded under it, a Q4_K_M mix is laid out as on such a CPU and runs on its kernels (the AVX2 tiles, and
    from 64 prompt rows the AVX2 integer panels), and every logit has the bits of the default's: a prompt of 130 rows,
    three short ones, and fused decode steps."""
    import ctypes

    from kettle.bench.drive import decode_logits
    from kettle.kernels import build, isa
    from tests.fixtures import cpu_isa

    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    if choice == "avx-vnni" and not ctypes.c_int.in_dll(build.library(), "kettle_cpu_vnni256").value:
        pytest.skip("no 256-bit VNNI here")
    add_tuning(monkeypatch, quantized_activations=True)
    model = tiny_model("llama", 256)
    mix = {"blk.0.attn_v.weight": T.Q6_K, "blk.1.ffn_down.weight": T.Q6_K}
    folder = write_gguf(model, tmp_path / "q4_k_m", "llama", T.Q4_K, types=mix)
    long_prompt = [(7 * i + 3) % 90 for i in range(130)]

    def outputs() -> list[torch.Tensor]:
        loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
        tables, num_blocks = scattered_tables([len(long_prompt)])
        prompt, _ = step(loaded, new_cache(loaded, num_blocks), [long_prompt], [0], tables)
        return [prompt, kettle_logits(loaded), decode_logits(loaded, PROMPTS, fused=True, steps=4)]

    expected = outputs()
    with cpu_isa(choice):
        assert not ops.vnni() and isa.describe(build.library()) == ("AVX2" if choice == "avx2" else "AVX2 + VNNI")
        limited = outputs()
    for got, want in zip(limited, expected, strict=True):
        assert torch.equal(got, want)


def test_a_projection_mixing_a_float_part_is_requantized_to_q8_0s_blocks(tmp_path, monkeypatch):
    """A fused q/k/v whose v the file stores in F16 beside Q5_K q and k has no one kernel type: its parts are
    requantized from gguf's dequantization to Q8_0's blocks of 32, exactly as gguf's own Q8_0 quantizer rounds those
    values, and held in lanes (`_requantized`); the other layers keep Q5_K's own bits; the logits stay within the
    nearest scheme's bounds."""
    import numpy as np
    from gguf import quants

    from kettle.tensors.gguf_file import GgufTensors

    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    add_tuning(monkeypatch, quantized_activations=True)
    model = tiny_model("llama", 256)
    folder = write_gguf(model, tmp_path / "mixed", "llama", T.Q5_K, types={"blk.0.attn_v.weight": T.F16})
    reference = dequantized_reference(model, folder, "llama")
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    qkv = loaded.layers[0].attn.qkv
    assert isinstance(qkv, nearest_kind()) and isinstance(loaded.layers[1].attn.qkv, Q5Linear)
    if isinstance(qkv, Q8Linear):
        file = GgufTensors(folder / "model.gguf")
        names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        dense = np.concatenate([file.dense(name).numpy() for name in names])
        grid = quants.dequantize(quants.quantize(dense, T.Q8_0), T.Q8_0)
        assert np.array_equal(qkv.dequantized().numpy(), grid)
    expected, logits = reference_logits(reference), kettle_logits(loaded)
    kl = (expected.softmax(-1) * (expected.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
    assert float((logits - expected).abs().max() / expected.abs().max()) < NEAREST_RTOL
    assert float(kl.mean()) < NEAREST_KL


def test_phi3_long_context_factors_come_from_the_file(tmp_path):
    """A Phi-3 128k-style file: longrope factors as tensors, the trained length (8 here) as metadata. The prompt of
    9 tokens runs on the long factors, the shorter ones on the short factors, in one batch."""
    longrope = {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    }  # fmt: skip
    model = tiny_model("phi3", 64, original_max_position_embeddings=8, rope_parameters=longrope)
    folder = write_gguf(model, tmp_path / "phi3-128k", "phi3", T.F32)
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    torch.testing.assert_close(kettle_logits(loaded), reference_logits(model), atol=1e-4, rtol=0)


def test_gemma2_27b_scales_queries_by_hidden_over_heads():
    from kettle.hub.gguf import gemma2_query_scalar

    assert gemma2_query_scalar(46, 4608, 32, 128) == 144  # the 27B
    assert gemma2_query_scalar(42, 3584, 16, 256) == 256  # the 9B (and the 2B, 26 layers)
    assert gemma2_query_scalar(62, 5376, 32, 128, "gemma3") == 168  # Gemma 3's 27B
    assert gemma2_query_scalar(34, 2560, 8, 256, "gemma3") == 256  # its 4B (and the 1B, 12B)


@pytest.mark.parametrize("arch", FROM_METADATA)
def test_the_files_layout_is_what_transformers_gguf_loader_reads(tmp_path, arch):
    """The tiny file's layout, read back by transformers' own GGUF loader (its implementation of llama.cpp's
    conventions), gives the original model's logits: the writer is right, independently of Kettle. The config
    is the one Kettle prepares from the metadata (transformers' own reading of it, plus what that leaves out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny_model(arch, 64)
    folder = write_gguf(model, tmp_path / arch, arch, T.F32)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="model.gguf", config=AutoConfig.from_pretrained(folder), dtype=torch.float32
    ).eval()
    torch.testing.assert_close(reference_logits(loaded), reference_logits(model), atol=1e-5, rtol=0)


@pytest.mark.parametrize("norms", [2, 1], ids=["40B-two-norms", "11B-one-norm"])
def test_falcon_with_grouped_kv_heads(tmp_path, norms):
    """Falcon 40B/180B (and 11B, one norm): llama.cpp regroups the grouped query_key_value into [q | k | v] and
    transformers' reader takes every Falcon GGUF for the 7B; Kettle reads the layout from the metadata and puts
    the rows back. (transformers' loader cannot check this layout: it loads it wrongly.)"""
    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    overrides = {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": norms}
    model = tiny_model("falcon", 64, **overrides)
    folder = write_gguf(model, tmp_path / "falcon", "falcon", T.Q4_0)
    reference = dequantized_reference(model, folder, "falcon")
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert loaded.spec.num_kv_heads == 2
    torch.testing.assert_close(kettle_logits(loaded), reference_logits(reference), atol=1e-4, rtol=0)


def test_every_native_architecture_is_tested():
    assert set(NATIVE_ARCHITECTURES) == {arch for arch, _ in CASES}


def test_float_dtype_asks_for_dequantized_weights(tmp_path):
    folder, reference = build(tmp_path, "llama", T.Q4_1)
    model = load_model(str(folder), torch.float32, torch.device("cpu"), dequantize=True)
    assert not any(isinstance(m, Q4Linear | Int8Linear) for m in model.modules())
    torch.testing.assert_close(kettle_logits(model), reference_logits(reference), atol=1e-4, rtol=0)


def test_quantize_overrides_the_files_scheme(tmp_path):
    folder, _ = build(tmp_path, "llama", T.Q4_1)
    model = load_model(str(folder), torch.float32, torch.device("cpu"), quantize="int8")
    assert not any(isinstance(m, Q4Linear) for m in model.modules())


def test_an_unsupported_type_is_refused_in_one_line(tmp_path):
    folder, _ = build(tmp_path, "llama", T.F32)
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(folder / "model.gguf").tensors if t.name == "blk.0.attn_q.weight")
    from kettle.tensors import gguf_file

    with pytest.raises(ValueError, match=r"stored as IQ2_XXS.*F32, F16, BF16, Q4_0"):
        gguf_file.check_supported(T.IQ2_XXS, tensor.name)


# (architecture, tied, the layers' type, the table's type). Tied: Llama's names, a scaled embedding (Gemma 2),
# GPT-2's names; untied, each type the kernels read exactly, one under a Q8_0 head (the greedy C loop then embeds
# from the 4-bit table).
VOCABULARY_CASES = [
    ("llama", True, T.Q4_0, T.Q8_0),
    ("gemma2", True, T.Q4_0, T.Q8_0),
    ("gpt2", True, T.Q4_0, T.Q8_0),
    ("gpt2", True, T.Q4_0, T.Q4_0),
    ("gemma2", True, T.Q4_1, T.Q4_1),
    ("llama", False, T.Q4_0, T.Q4_0),
    ("llama", False, T.Q4_K, T.Q4_K),
    ("qwen2", False, T.Q4_1, T.Q8_0),
    ("llama", False, T.Q8_0, T.Q4_0),
    ("qwen2", True, T.Q4_0, T.Q5_0),  # its own bits in lanes; elsewhere int8 per row, as a head of that type
    ("llama", False, T.Q8_0, T.Q5_0),
    ("llama", True, T.Q4_K, T.Q6_K),  # a small Q4_K_M file's tied table: Q6_K's kernel where lanes are, else int8
]


@pytest.mark.parametrize(
    ("arch", "tied", "layers", "table"),
    VOCABULARY_CASES,
    ids=[f"{a}-{'tied' if t else 'untied'}-{w.name}-{e.name}" for a, t, w, e in VOCABULARY_CASES],
)
def test_a_quantized_vocabulary_table_loads_without_a_float_copy(tmp_path, monkeypatch, arch, tied, layers, table):
    """The file's embedding table stays in its blocks, its rows dequantized as they are looked up: tied, it is
    the LM head too; untied, the head loads from its own tensor's blocks. No float32 copy of either is made (a
    1.1B model's table: 384 MiB resident, and a second of its load), and the logits and greedy tokens are the
    file's."""
    from kettle.models.decoder_step import _embedding_and_head
    from kettle.tensors.gguf_file import GgufTensors

    if not ops.available():
        pytest.skip(EXACT_NEEDS_KERNELS)
    model = tiny_model(arch, 256 if {T.Q4_K, T.Q6_K} & {layers, table} else 64, tie_word_embeddings=tied)
    folder = write_gguf(model, tmp_path / "model", arch, layers, embedding=table)
    dense, read = GgufTensors.dense, []
    monkeypatch.setattr(GgufTensors, "dense", lambda self, name: read.append(name) or dense(self, name))
    kettle = load_model(str(folder), torch.float32, torch.device("cpu"))
    rows_from = getattr(kettle.embed_rows, "__self__", None)
    in_lanes = {T.Q5_0: Q5Linear, T.Q6_K: Q6Linear}
    lanes = {T.Q5_0: ops.lanes(LINEAR_Q5L), T.Q6_K: ops.lanes(LINEAR_Q6L)}
    requantized = table in in_lanes and not lanes[table]
    kind = nearest_kind() if requantized else {T.Q8_0: Q8Linear, **in_lanes}.get(table, Q4Linear)
    assert kettle.embed_tokens is None and isinstance(rows_from, kind)
    assert (rows_from is kettle.lm_head) == tied
    # Neither is read dense, but for a type without a kernel, whose table is requantized from gguf's values.
    vocabulary = ("embed_tokens.weight", "wte.weight", "lm_head.weight")
    dense_reads = [name for name in read if name.endswith(vocabulary)]
    assert dense_reads == (["model.embed_tokens.weight"] if requantized else [])
    if layers == T.Q8_0 or kind in (Q5Linear, Q6Linear):  # such a head: the greedy steps run in one C call, embedding
        assert _embedding_and_head(kettle) is not None  # from the table
    reference = dequantized_reference(model, folder, arch)
    expected, logits = reference_logits(reference), kettle_logits(kettle)
    if requantized:  # the nearest scheme: within its stated bounds
        kl = (expected.softmax(-1) * (expected.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
        assert float((logits - expected).abs().max() / expected.abs().max()) < NEAREST_RTOL
        assert float(kl.mean()) < NEAREST_KL
        return
    # Q4_K's bound is relative to its random blocks' large logits; beside a Q6_K table they stay small: 1e-4 then.
    atol = max(q4_k_rtol(kettle) * float(expected.abs().max()), 1e-4) if T.Q4_K in (layers, table) else 1e-4
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    reference.generation_config.eos_token_id = None
    with torch.inference_mode():
        hf = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False)
    assert greedy(kettle, PROMPTS[:1], 8)[0] == hf[0, len(PROMPTS[0]) :].tolist()
