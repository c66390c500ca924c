"""A decode step in process, as the shard runs it (metadata + forward + logits + argmax), no server.

    .venv/bin/python -m bench decode                                  # the bundled model, batch 1 and 16
    .venv/bin/python -m bench decode $M --quantize int4 --vs transformers
    KETTLE_TUNING=cpu-kernels=off .venv/bin/python -m bench decode $M # PyTorch's ops instead of Kettle's kernels

Method: load the model folder (default: the bundled model) with Kettle, prefill `batch` random prompts of
`--context` tokens in one forward over a cache as a shard keeps it (the served block size and KV dtype), then
time `--steps` greedy decode steps after `--warmup` untimed ones. Prints the median step time, tokens/s
(batch / step time) and the memory bandwidth that implies (weights + KV read once per step); a GGUF serves its
own quantization unless `--dtype-float32` dequantizes it or `--quantize` says otherwise. Every comparison
(`--vs`) runs its sides interleaved step by step in this process, so both see the same machine load, and prints
the ratio:

- `transformers`: the same steps with transformers' own model and DynamicCache (in `--dtype`).
- `layers`: the fused CPU decode step against the layer-by-layer forward (`--family NAME`: a tiny random model of
  that family instead of a folder, 8 layers, hidden 512, 8 heads in 4 KV groups, intermediate 1536, vocabulary
  4096, e.g. `--family qwen3 --quantize int4 --batch 1 8 --vs layers`).
- `float-panels`: gemm.c's integer panels (AVX-512 VNNI; 10 rows and more) against its float32 panels.
- `--switch NAME`: one of the kernels' measurement switches (an int in the C library) at its default against
  `--switch-off` (0 unless given), e.g. `--batch 1 --steps 200 --switch kettle_channel_one`.
- `schemes`: single-stream decode of float32, int8, int4 with an int8 head and int4 with an int4 head, against
  transformers float32 (`--batch 1 --context 16 --steps 128` unless given).
- `gguf`: the bundled GGUF as each start-up choice loads it: dense float32 (`--dtype float32`), the file's own
  quantization (no flags), `--quantize int4`; the median and fastest step, the weight bytes a step reads and
  the GB/s the median implies (`--batch 1 --context 64 --steps 40` unless given).
- `kv-dtypes`: a float16 / bfloat16 KV cache against float32: accuracy (four texts of 189-303 tokens, prefilled 16
  tokens then teacher-forced through decode steps: mean and max KL, top-1 agreement, and whether 64 greedy tokens
  after each whole text match) and speed (one step over a cache of each dtype at each batch and context, through
  the fused step and layer by layer, each against float32 layer by layer; `--context 512 2048 --steps 15` unless
  given). `--dtype-float32`: the GGUF's weights dequantized; `--skip-accuracy`, `--skip-speed`.
- `gguf-types`: how far Kettle's int8 serving of GGUF types without a kernel of their own (`--types Q8_0 Q5_0
  Q5_1`, every 2-D tensor of the bundled GGUF rewritten in the type) is from the file's own dequantization:
  mean and max KL of the next-token distributions over the prompt tokens of a few texts.
- `compile`: `torch.compile` of the forward against eager, with and without Kettle's C kernels (`--variants`,
  `--mode`, `--dynamic`, `--no-freezing`, `--eager-linear`, `--compile-linear`; one thread unless given). Run
  `compiled-kernels` in its own process: with the kernels dynamo breaks the graph at every ctypes call and hits
  its recompile limit on the shared per-layer code objects, which leaves other compiled variants falling back to
  eager. Each compiled variant's greedy tokens are compared with its eager twin's.
- `kernels`: the CPU weight-only kernels over the bundled model's matmul shapes (q/k/v and gate/up fused as
  Kettle loads them), y = x Wᵀ with `--batch` rows: float32 oneDNN-packed weights against int8 per channel and
  int4 groups (`--bf16`, `--fp32-kernels`, `--dense`: more variants), the minimum of `--steps` interleaved calls
  (microseconds: on a shared CPU the median of calls this short measures the neighbours).
- `fallback`: the transformers fallback's throughput, padded batches against one request per forward
  (`KETTLE_TUNING=fallback-padding=off`), with transformers' batched `generate` as the baseline: a random-weight GPT-Neo
  (4 layers x 512) with the tests' tiny tokenizer, `--requests` prompts of 8, 12, ... tokens, `--steps` new
  tokens each, EOS ignored; the best of `--trials` (one thread unless given).
- `grammar-engines`: xgrammar, llguidance and outlines-core on the model's tokenizer for one JSON schema: compile
  time, the first mask, and the median time to build a [B, V] mask at batch 1 and 8 along a fixed valid output.
- `invariance`: what batch invariance costs, `KETTLE_TUNING=batch-invariant=off` (the fast paths) against the default
  on one model (settings are read at each step, so both run interleaved in this process): decode at each `--batch` and
  `--context` (`--steps 40` unless given) and a prefill of each `--prefill` token count (512 unless given, `--trials
  7` rounds); each side's median and fastest, and invariant/fast time round by round. `--layout rows-avx2`: an AVX2
  CPU's kernels on this one (weights in rows, no integer panels, 256-bit one-row channels, GEMM panels and prefill
  attention) where the default is this CPU's own (in lanes on AVX-512 VNNI).
- `invariance-mixed`: the same for one step that mixes a prompt chunk of `--prefill` tokens (256 unless given) with
  `--batch` decodes (8 unless given) at `--context` (metadata, forward, the last tokens' logits and argmax, the
  same cache slots written each round), `--trials 11` rounds unless given, e.g. `--vs invariance-mixed --layout
  rows-avx2`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from kettle.bench.drive import environment, tuning
from kettle.bench.timing import interleaved, ratio_summary, same_round

COMPARISONS = (
    "transformers", "layers", "float-panels", "switch", "schemes", "gguf", "kv-dtypes", "gguf-types", "compile",
    "kernels", "fallback", "grammar-engines", "invariance", "invariance-mixed",
)  # fmt: skip
# What a comparison measures unless told otherwise (batch, context, steps, threads, trials, prefill).
DEFAULTS = {
    "schemes": {"batch": [1], "context": [16], "steps": 128},
    "gguf": {"batch": [1], "context": [64], "steps": 40},
    "kv-dtypes": {"context": [512, 2048], "steps": 15},
    "kernels": {"batch": [1, 16, 128], "steps": 50},
    "compile": {"threads": 1},
    "fallback": {"threads": 1, "steps": 32, "trials": 2},
    "grammar-engines": {"threads": 1},
    "invariance": {"steps": 40},
    "invariance-mixed": {"batch": [8], "prefill": [256], "trials": 11},
}
GENERAL = {"batch": [1, 16], "context": [128], "steps": 20, "threads": None, "trials": 7, "prefill": [512]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", nargs="?", help="a model folder (config.json + weights); default: the bundled model")
    p.add_argument("--vs", choices=COMPARISONS, help="what Kettle's step is compared with (see above)")
    p.add_argument("--family", choices=sorted(FAMILIES), help="a tiny random model of this family instead")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantize", choices=["int8", "int4"], help="Kettle's weights quantized at load")
    p.add_argument("--batch", type=int, nargs="+", help="sequences decoded together (rows, for --vs kernels)")
    p.add_argument("--context", type=int, nargs="+", help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, help="timed steps (new tokens, for --vs fallback)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--switch", help="a kernels' switch (C int) at its default against --switch-off")
    p.add_argument("--switch-off", type=int, default=0, help="the --switch value compared (default 0)")
    p.add_argument("--dtype-float32", action="store_true", help="a GGUF's weights dequantized (dense float32)")
    p.add_argument("--skip-accuracy", action="store_true", help="kv-dtypes: speed only")
    p.add_argument("--skip-speed", action="store_true", help="kv-dtypes: accuracy only")
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q5_0", "Q5_1"], help="gguf-types: GGUF types")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS)[:3], choices=list(VARIANTS), help="compile")
    p.add_argument("--mode", help="compile: torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--dynamic", default="auto", choices=list(DYNAMIC), help="compile: torch.compile's dynamic")
    p.add_argument("--freezing", action=argparse.BooleanOptionalAction, default=True, help="compile: inductor's")
    p.add_argument("--eager-linear", default="onednn", choices=["onednn", "transposed", "dense"], help="compile")
    p.add_argument("--compile-linear", default="onednn", choices=["onednn", "transposed", "dense"], help="compile")
    p.add_argument("--seed", type=int, default=0, help="compile: the prompts' seed")
    p.add_argument("--bf16", action="store_true", help="kernels: also bfloat16 activations")
    p.add_argument("--fp32-kernels", action="store_true", help="kernels: also the packed kernels on float32")
    p.add_argument("--dense", action="store_true", help="kernels: also the dequantize-then-GEMM path")
    p.add_argument("--requests", type=int, default=8, help="fallback: requests in the batch")
    p.add_argument("--trials", type=int, help="fallback: runs of each mode, the best printed (2); invariance: rounds")
    p.add_argument("--prefill", type=int, nargs="+", help="invariance: prompt tokens (-mixed: the chunk's)")
    p.add_argument("--layout", default="lanes", choices=["lanes", "rows-avx2"], help="invariance: whose kernels")
    return p


def decode(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.switch:
        args.vs = "switch"
    for name, general in GENERAL.items():
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS.get(args.vs, {}).get(name, general))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    runs = {
        "schemes": schemes, "gguf": gguf_choices, "kv-dtypes": kv_dtypes, "gguf-types": gguf_types,
        "compile": compiled, "kernels": kernels, "fallback": fallback, "grammar-engines": grammar_engines,
        "invariance": invariance, "invariance-mixed": invariance_mixed,
    }  # fmt: skip
    runs.get(args.vs, steps)(args)


def model_path(args: argparse.Namespace) -> str:
    if args.family:
        return tiny_family(args.family)
    if args.path:
        return args.path
    from kettle.hub.resolve import resolve_model

    return str(resolve_model(None).path)


# ---- the default: Kettle's step, alone or against one other thing ------------------------------------------


def steps(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import DecodeLoop, hf_decode_step, transformers_model
    from kettle.kernels import ops
    from kettle.models.registry import load_model

    dtype, path = getattr(torch, args.dtype), model_path(args)
    dense = args.dtype_float32
    model = load_model(path, dtype, "cpu", quantize=args.quantize, dequantize=dense)
    layers = load_model(path, dtype, "cpu", quantize=args.quantize, dequantize=dense) if args.vs == "layers" else None
    layers = layer_by_layer(layers) if layers is not None else None
    scheme = f" --quantize {args.quantize}" if args.quantize else ""
    fused = "fused step" if getattr(model, "cpu_decoder_step", None) is not None else "layer by layer"
    print(f"{model.spec.model_type} {args.dtype}{scheme}, {torch.get_num_threads()} threads; decode: {fused}")
    if args.vs == "float-panels" and not ops.integer_gemm():
        parser().error("--vs float-panels: no integer panels here (AVX-512 VNNI, KETTLE_TUNING's integer-gemm)")
    hf = transformers_model(path, dtype) if args.vs == "transformers" else None
    total = args.steps + args.warmup
    for batch in args.batch:
        for context in args.context:
            fns = [DecodeLoop(model, batch, context, total)]
            if layers is not None:
                fns.append(DecodeLoop(layers, batch, context, total))
            elif args.vs == "float-panels":
                loop = DecodeLoop(model, batch, context, 2 * total)
                fns = [with_integer_panels(model, True, loop), with_integer_panels(model, False, loop)]
            elif args.vs == "switch":
                loop = DecodeLoop(model, batch, context, 2 * total)
                fns = [with_switch(args.switch, None, loop), with_switch(args.switch, args.switch_off, loop)]
            elif hf is not None:
                fns.append(hf_decode_step(hf, batch, context))
            seconds, *base = (t.median for t in interleaved(fns, args.steps, args.warmup))
            gbps = bytes_per_step(model, batch, context) / seconds / 1e9
            line = f"batch {batch:3d}, context {context:5d}: {seconds * 1e3:8.2f} ms/step  {batch / seconds:8.1f} tok/s"
            line += f"  {gbps:6.2f} GB/s"
            if base:
                other = {"layers": "layer by layer", "transformers": "transformers", "float-panels": "float32 panels"}
                name = f"{args.switch}={args.switch_off}" if args.vs == "switch" else other[args.vs]
                line += f"  | {name} {base[0] * 1e3:8.2f} ms/step  speedup x{base[0] / seconds:.2f}"
            print(line, flush=True)


def _storage_key(tensor) -> int:
    # oneDNN-packed weights are opaque tensors without a data pointer; they are never shared.
    return tensor.data_ptr() if not tensor.is_mkldnn else id(tensor)


# Buffers that hold quantized weights (kettle/quantization): read once per step like parameters.
QUANTIZED_BUFFERS = {"packed", "scales", "mins", "q", "scale", "scale_zero", "weight_bytes", "d", "supers"}


def bytes_per_step(model, batch: int, context: int) -> int:
    """Weights (tied head counted once, quantized ones at their stored width) plus every sequence's KV, each
    read once per step."""
    tensors = list(model.parameters())
    tensors += [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in QUANTIZED_BUFFERS]
    params = {_storage_key(t): t.numel() * t.element_size() for t in tensors}
    return sum(params.values()) + batch * context * model.spec.kv_bytes_per_token


def with_integer_panels(model, on: bool, step):
    """`step` with the integer panels switched on or off around each call (`KETTLE_TUNING=integer-gemm=...`, which
    the op-at-a-time kernels and the fused step read at each call)."""

    def run() -> None:
        with tuning({"integer-gemm": on}):
            step()

    return run


def with_switch(name: str, value: int | None, step):
    """`step` with the C library's int `name` set to `value` around each call (None: its default), then restored."""
    from kettle.kernels import build

    switch = ctypes.c_int.in_dll(build.library(), name)
    default = switch.value

    def run() -> None:
        switch.value = default if value is None else value
        try:
            step()
        finally:
            switch.value = default

    return run


def layer_by_layer(model):
    """`model` with its fused decode step switched off (the cached property overridden)."""
    model.__dict__["cpu_decoder_step"] = None
    return model


SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, head_dim=64)
SHAPE |= dict(num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, pad_token_id=0)
# The same shape as GPT-style configs name it (multi-head attention: as many KV heads as query heads).
GPT_SHAPE = dict(n_embd=512, n_inner=1536, n_layer=8, n_head=8, vocab_size=4096, n_positions=2048)
MHA_SHAPE = {k: v for k, v in SHAPE.items() if k not in ("num_key_value_heads", "head_dim")}
# family → (transformers class prefix, config arguments).
FAMILIES = {
    name: (prefix, SHAPE)
    for name, prefix in [
        ("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("gemma", "Gemma"),
        ("gemma2", "Gemma2"), ("phi3", "Phi3"), ("starcoder2", "Starcoder2"), ("mixtral", "Mixtral"),
    ]
} | {
    "gpt_neox": ("GPTNeoX", MHA_SHAPE),
    "phi": ("Phi", MHA_SHAPE),
    "falcon": ("Falcon", MHA_SHAPE | {"ffn_hidden_size": 1536}),
    "gptj": ("GPTJ", GPT_SHAPE | {"rotary_dim": 32}),
    "gpt2": ("GPT2", GPT_SHAPE),
}  # fmt: skip


def tiny_family(family: str) -> str:
    """A folder holding a random `family` model of SHAPE (safetensors), in a temporary directory."""
    import torch
    import transformers

    folder = tempfile.mkdtemp(prefix=f"kettle-{family}-")
    prefix, shape = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**shape)
    torch.manual_seed(0)
    model_cls = getattr(transformers, f"{prefix}LMHeadModel" if prefix == "GPT2" else f"{prefix}ForCausalLM")
    model_cls(config).save_pretrained(folder)
    return folder


# ---- schemes: weight-only quantization against float32 and transformers ------------------------------------

# (label, --quantize, KETTLE_QUANT_LM_HEAD)
SCHEMES = [
    ("kettle fp32", None, None),
    ("kettle int8", "int8", None),
    ("kettle int4 (int8 head)", "int4", "int8"),
    ("kettle int4 (int4 head)", "int4", "int4"),
]


def schemes(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import DecodeLoop, hf_decode_step, transformers_model
    from kettle.models.registry import load_model

    path, total = model_path(args), args.steps + args.warmup
    for batch in args.batch:
        for context in args.context:
            labels, fns = [], []
            for label, quantize, head in SCHEMES:
                with environment(KETTLE_QUANT_LM_HEAD=head):  # float32: dense weights, a GGUF's dequantized
                    model = load_model(path, torch.float32, "cpu", quantize=quantize, dequantize=quantize is None)
                labels.append(label)
                fns.append(DecodeLoop(model, batch, context, total))
            labels.append("transformers fp32")
            fns.append(hf_decode_step(transformers_model(path, torch.float32), batch, context))
            seconds = [t.median for t in interleaved(fns, args.steps, args.warmup)]
            base = seconds[-1]
            threads = torch.get_num_threads()
            print(f"batch {batch}, context {context}, {threads} threads, median of {args.steps} interleaved steps")
            for label, s in zip(labels, seconds, strict=True):
                print(
                    f"{label:26s} {s * 1e3:8.2f} ms/step {batch / s:8.1f} tok/s  x{base / s:.2f} vs transformers fp32"
                )


# ---- invariance: batch invariance's cost, KETTLE_TUNING=batch-invariant=off against the default -------------

# The C library's vector-width choices (-1: the CPU's answer) that `--layout rows-avx2` sets to 256 bits.
AVX512_CHOICES = ("kettle_channel_avx512", "kettle_gemm_avx512", "kettle_attention_avx512")
INVARIANCE = ("on", "off")  # KETTLE_TUNING's batch-invariant values, the default first


def invariant(value: str):
    """A loop's `around`: the settings read again with KETTLE_TUNING's batch-invariant=`value` for each call."""
    return functools.partial(tuning, {"batch-invariant": value})


def invariance_model(args: argparse.Namespace):
    """The model the invariance modes time, loaded after `--layout` has picked the kernels (a weight's layout is
    chosen at load), and a line saying what runs."""
    import torch

    from kettle import settings
    from kettle.kernels import build, ops
    from kettle.models.registry import load_model

    if args.layout == "rows-avx2":  # an AVX2 CPU's kernels on this one, for the rest of the process
        off = {"lanes": False, "integer-gemm": False}
        os.environ["KETTLE_TUNING"] = settings.merge_tuning(os.environ.get("KETTLE_TUNING"), off)
        settings.reload()
        for name in AVX512_CHOICES:
            ctypes.c_int.in_dll(build.library(), name).value = 0
    model = load_model(model_path(args), torch.float32, "cpu", quantize=args.quantize, dequantize=args.dtype_float32)
    lanes = any(getattr(m, "lanes", False) for m in model.modules())
    weights = getattr(model, "quantization", None) or args.quantize or "float32"
    kernels = f"weights in lanes: {lanes}, integer panels: {ops.integer_gemm()}"
    print(f"{model.spec.model_type} {weights}, --layout {args.layout} ({kernels}), {torch.get_num_threads()} threads")
    print("batch-invariant=on (the default, 'invariant') against =off ('fast'), interleaved in this process")
    return model


def invariance_line(label: str, tokens: int, invariant_time, fast_time) -> str:
    """Each side's median and fastest call, then invariant/fast time round by round (its median and spread)."""
    ratios = same_round(invariant_time.samples, fast_time.samples)
    if len(ratios) > 12:  # decode steps: the median and quartiles, not every round
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        spread = f"{statistics.median(ratios):.2f}x (quartiles {q1:.2f}-{q3:.2f}, {len(ratios)} rounds)"
    else:
        spread = ratio_summary(ratios)
    sides = [
        f"{name} {t.median * 1e3:.2f} ms (fastest {t.minimum * 1e3:.2f}, {tokens / t.median:.1f} tok/s)"
        for name, t in (("invariant", invariant_time), ("fast", fast_time))
    ]
    return f"{label}: {'  '.join(sides)}  | invariant/fast time {spread}"


def invariance(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import DecodeLoop, PrefillLoop

    model = invariance_model(args)
    for batch in args.batch:
        for context in args.context:
            total = args.steps + args.warmup
            loops = [DecodeLoop(model, batch, context, total, around=invariant(v), seed=1) for v in INVARIANCE]
            timings = interleaved(loops, args.steps, args.warmup)
            print(invariance_line(f"decode batch {batch:3d}, context {context:5d}", batch, *timings), flush=True)
    for tokens in args.prefill:
        ids = torch.randint(0, model.spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(2))
        loops = [PrefillLoop(model, ids, around=invariant(v)) for v in INVARIANCE]
        print(invariance_line(f"prefill {tokens:5d} tokens", tokens, *interleaved(loops, args.trials, 1)), flush=True)


def mixed_step(model, chunk: int, decodes: int, context: int, around):
    """A step as a shard runs a prompt chunk beside decodes, one per call inside `around()`: `decodes` sequences of
    one new token over `context` cached ones, then a `chunk`-token prompt from position 0, each over its own
    contiguous blocks of one served cache (the same slots written each call); metadata, forward, the last tokens'
    logits and argmax."""
    import torch

    from kettle.bench.drive import SERVED_BLOCK_SIZE, served_cache
    from kettle.kernels import ops
    from kettle.layers.attention import AttentionMetadata

    block = SERVED_BLOCK_SIZE
    sizes = [-(-(context + 1) // block)] * decodes + [-(-chunk // block)]
    tables = [list(range(at, at + n)) for at, n in zip(itertools.accumulate([0, *sizes]), sizes, strict=False)]
    cache = served_cache(model, sum(sizes))
    ids = torch.randint(0, model.spec.vocab_size, (decodes + chunk,), generator=torch.Generator().manual_seed(3))
    query_lens, cache_lens = [1] * decodes + [chunk], [context] * decodes + [0]

    def run() -> None:
        with around(), torch.inference_mode():
            prompts = [False] * decodes + [True] if ops.batch_invariant() else None  # as the shard's runner says
            meta = AttentionMetadata.build(query_lens, cache_lens, tables, block, cache.device, prompts)
            hidden = model.forward(ids, meta.positions, cache, meta)
            model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)

    return run


def invariance_mixed(args: argparse.Namespace) -> None:
    model = invariance_model(args)
    for decodes in args.batch:
        for context in args.context:
            for chunk in args.prefill:
                steps = [mixed_step(model, chunk, decodes, context, invariant(v)) for v in INVARIANCE]
                label = f"mixed step, a {chunk}-token chunk beside {decodes} decodes at context {context}"
                print(invariance_line(label, chunk + decodes, *interleaved(steps, args.trials, 1)), flush=True)


# ---- gguf: the bundled GGUF as each start-up choice loads it ------------------------------------------------

CHOICES = {"dense float32": {"dequantize": True}, "gguf default": {}, "--quantize int4": {"quantize": "int4"}}


def gguf_choices(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import DecodeLoop
    from kettle.models.registry import load_model

    path = model_path(args)
    models = {name: load_model(path, torch.float32, "cpu", **kwargs) for name, kwargs in CHOICES.items()}
    for batch in args.batch:
        for context in args.context:
            loops = [DecodeLoop(model, batch, context, args.steps + args.warmup) for model in models.values()]
            timings = dict(zip(models, interleaved(loops, args.steps, args.warmup), strict=True))
            base = timings["dense float32"].median
            print(f"batch {batch}, context {context}, {args.steps} interleaved steps")
            for name, model in models.items():
                median, best, size = timings[name].median, timings[name].minimum, gguf_step_bytes(model)
                print(f"{name}: median {median * 1e3:.1f} ms ({batch / median:.1f} tok/s), fastest {best * 1e3:.1f} "
                      f"ms ({batch / best:.1f} tok/s), weights {size / 2**20:.0f} MiB a step, "
                      f"{size / median / 1e9:.2f} GB/s at the median, {base / median:.2f}x dense")  # fmt: skip


def gguf_step_bytes(model) -> int:
    """Bytes of every parameter and buffer but the embedding table (one row of it is read a step)."""
    tensors = {_storage_key(t): t for t in [*model.parameters(), *model.buffers()]}
    embed = model.embed_tokens  # None where a quantized table serves both (the head reads all of it every step)
    head = {t.data_ptr() for t in [*model.lm_head.parameters(), *model.lm_head.buffers()] if not t.is_mkldnn}
    skip = set() if embed is None or embed.data_ptr() in head else {embed.data_ptr()}
    return sum(t.numel() * t.element_size() for p, t in tensors.items() if p not in skip)


# ---- kv-dtypes: a 16-bit KV cache against float32 ------------------------------------------------------------

TEXTS = [
    "The history of the lighthouse is, in many ways, the history of coastal trade. Long before electric lamps "
    "and automated beacons, communities along dangerous shores lit fires on hilltops to warn sailors of rocks and "
    "shallow water. The ancient Pharos of Alexandria, built in the third century before the common era, was "
    "among the tallest structures of its time and guided ships into one of the busiest harbours of the "
    "Mediterranean. In later centuries, towers of stone and brick spread along the coasts of Europe, each with "
    "its own keeper, who trimmed wicks, polished lenses and logged the weather through long winter nights. The "
    "invention of the Fresnel lens in the early nineteenth century changed everything: by bending light through "
    "concentric rings of glass, a modest flame could be seen more than twenty miles out to sea. Governments "
    "began to coordinate the placement of lights, assigning each a distinctive pattern of flashes so that a "
    "navigator could tell one headland from the next. Today most lighthouses run without keepers, and satellite "
    "navigation has made many of them redundant, yet they remain",
    'def merge_sorted(left, right):\n    """Merge two sorted lists into one sorted list."""\n    result = []\n'
    "    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n            i += 1\n        else:\n            result.append(right[j])\n"
    "            j += 1\n    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n\n\n"
    'def merge_sort(items):\n    """Sort a list with merge sort and return a new list."""\n'
    "    if len(items) <= 1:\n        return list(items)\n    middle = len(items) // 2\n"
    "    return merge_sorted(merge_sort(items[:middle]), merge_sort(items[middle:]))\n\n\n"
    'class Inventory:\n    """Counts of items in a small shop."""\n\n    def __init__(self):\n'
    "        self.counts = {}\n\n    def add(self, name, quantity=1):\n"
    "        self.counts[name] = self.counts.get(name, 0) + quantity\n\n    def remove(self, name, quantity=1):\n"
    "        if self.counts.get(name, 0) < quantity:\n            raise ValueError(f'not enough {name}')\n"
    "        self.counts[name] -= quantity\n\n    def most_common(self, n):\n",
    "Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical energy. It "
    "takes place mostly in the leaves, inside small structures called chloroplasts, which contain the green "
    "pigment chlorophyll. Chlorophyll absorbs red and blue light strongly and reflects green light, which is why "
    "most plants look green to us. The process has two main stages. In the light-dependent reactions, energy "
    "from sunlight splits water molecules, releasing oxygen as a by-product and producing energy carriers. In "
    "the second stage, often called the Calvin cycle, those carriers power the conversion of carbon dioxide "
    "from the air into sugars. These sugars feed the plant's growth and, through food chains, nearly every "
    "other living thing on land. Photosynthesis also shaped the planet itself: over billions of years it filled "
    "the atmosphere with oxygen, which allowed complex animal life to evolve. Scientists today study the "
    "process closely, hoping to improve crop yields and to design artificial systems that could",
    "Dear Ms. Alvarez,\n\nThank you for your letter of March 3rd regarding the delayed shipment of your order. "
    "I am sorry for the inconvenience this has caused. After looking into the matter, we found that the parcel "
    "was held at a regional sorting centre because of an incomplete address label. Our warehouse team has since "
    "corrected the label and the parcel left the centre yesterday morning. You should receive it within three "
    "working days. As a gesture of goodwill, we have refunded the shipping cost to your original method of "
    "payment; the refund may take up to five days to appear on your statement. We have also added a note to "
    "your account so that future orders are checked by a member of staff before dispatch. If the parcel has "
    "not arrived by the end of next week, or if any item is damaged, please reply to this letter or call our "
    "customer service line, and we will arrange a replacement at no cost to you. Once again, please accept our "
    "apologies. We value your custom and hope to continue serving you in the future.\n\nKind regards,\n\n",
]
PREFIX = 16  # prefilled tokens of each text; the rest are fed one decode step at a time
GREEDY_TOKENS = 64


def kv_dtypes(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from kettle.models.registry import load_model

    path = model_path(args)
    model = load_model(path, torch.float32, "cpu", dequantize=args.dtype_float32)
    print(f"model: {Path(path).name}, weights {getattr(model, 'quantization', None) or 'float32'}")
    if not args.skip_accuracy:
        tokenizer = AutoTokenizer.from_pretrained(path)
        kv_accuracy(model, [tokenizer(text).input_ids for text in TEXTS])
    if not args.skip_speed:
        kv_speed(model, args.batch, args.context, args.steps)


def _half():
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}


def _served_tables(lengths: list[int]):
    from kettle.bench.drive import SERVED_BLOCK_SIZE, scattered_tables

    return scattered_tables(lengths, block_size=SERVED_BLOCK_SIZE)


def teacher_forced(model, texts: list[list[int]], kv_dtype):
    """Next-token logits [positions, S, V] at every position after PREFIX, the texts cut to one length."""
    import torch

    from kettle.bench.drive import SERVED_BLOCK_SIZE, new_cache, step

    length = min(len(t) for t in texts)
    tables, blocks = _served_tables([length] * len(texts))
    cache = new_cache(model, blocks, kv_dtype, SERVED_BLOCK_SIZE)
    logits, meta = step(model, cache, [t[:PREFIX] for t in texts], [0] * len(texts), tables)
    out = [logits[meta.last_token_indices]]
    for position in range(PREFIX, length - 1):
        logits, _ = step(model, cache, [[t[position]] for t in texts], [position] * len(texts), tables)
        out.append(logits)
    return torch.stack(out)


def greedy_with_gaps(model, texts: list[list[int]], kv_dtype):
    """GREEDY_TOKENS tokens after each whole text (prefilled in one forward) over a cache of `kv_dtype`, and each
    step's gap between the top two logits [GREEDY_TOKENS, S] (how near a tie each choice was)."""
    import torch

    from kettle.bench.drive import SERVED_BLOCK_SIZE, new_cache, step

    tables, blocks = _served_tables([len(t) + GREEDY_TOKENS for t in texts])
    cache = new_cache(model, blocks, kv_dtype, SERVED_BLOCK_SIZE)
    logits, meta = step(model, cache, texts, [0] * len(texts), tables)
    logits, out, gaps = logits[meta.last_token_indices], [], []
    for i in range(GREEDY_TOKENS):
        top = logits.topk(2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
        out.append(logits.argmax(-1).tolist())
        logits, _ = step(model, cache, [[t] for t in out[-1]], [len(t) + i for t in texts], tables)
    return [list(column) for column in zip(*out, strict=True)], torch.stack(gaps)


def kl(reference, served):
    """KL(reference ‖ served) of each row's next-token distribution."""
    return (reference.softmax(-1) * (reference.log_softmax(-1) - served.log_softmax(-1))).sum(-1)


def kv_accuracy(model, texts: list[list[int]]) -> None:
    import torch

    reference = teacher_forced(model, texts, torch.float32).flatten(0, 1)
    base_tokens, gaps = greedy_with_gaps(model, texts, torch.float32)
    print(f"accuracy: {len(texts)} texts of {min(map(len, texts))}+ tokens, {len(reference)} decode positions")
    for name, dtype in _half().items():
        served = teacher_forced(model, texts, dtype).flatten(0, 1)
        divergence = kl(reference, served)
        top1 = float((reference.argmax(-1) == served.argmax(-1)).float().mean())
        tokens, _ = greedy_with_gaps(model, texts, dtype)
        same = sum(a == b for a, b in zip(tokens, base_tokens, strict=True))
        # Where a text's greedy run first differs, and float32's gap between its top two logits there.
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None) for a, b in
                  zip(tokens, base_tokens, strict=True)]  # fmt: skip
        where = [
            f"text {s} at token {i} (float32 top-2 gap {gaps[i, s]:.3f})" for s, i in enumerate(firsts) if i is not None
        ]
        print(
            f"  {name}: mean KL {divergence.mean():.2e}, max KL {divergence.max():.2e}, top-1 agreement {top1:.4f}; "
            f"greedy {GREEDY_TOKENS} tokens identical for {same}/{len(texts)} texts"
            + (f"; differs: {', '.join(where)}" if where else "")
        )
    print(f"  float32 top-2 logit gap over the greedy steps: median {gaps.median():.3f}")


def kv_speed(model, batches: list[int], contexts: list[int], rounds: int) -> None:
    import torch

    from kettle.bench.drive import SERVED_BLOCK_SIZE, new_cache

    fused = model.__dict__.get("cpu_decoder_step", model.cpu_decoder_step)
    print(f"speed: median decode step in ms over {rounds} interleaved rounds ({torch.get_num_threads()} threads)")
    for batch in batches:
        for context in contexts:
            tables, blocks = _served_tables([context + 1] * batch)
            kinds = {"float32": (torch.float32, None)}  # layer by layer, the ratios' reference
            kinds |= {f"{name} layers": (dtype, None) for name, dtype in _half().items()}
            if fused is not None:
                kinds |= {"float32 fused": (torch.float32, fused)}
                kinds |= {f"{name} fused": (dtype, fused) for name, dtype in _half().items()}
            caches = {name: new_cache(model, blocks, dtype, SERVED_BLOCK_SIZE) for name, (dtype, _) in kinds.items()}
            tokens = [[int(t)] for t in torch.randint(100, 1000, (batch,))]

            lens = [context] * batch
            fns = [_kv_step(model, path, caches[name], tokens, lens, tables) for name, (_, path) in kinds.items()]
            medians = {n: t.median for n, t in zip(kinds, interleaved(fns, rounds, warmup=2), strict=True)}
            cells = [f"{n} {m * 1e3:.1f} ({m / medians['float32']:.2f}x)" for n, m in medians.items()]
            print(f"  batch {batch:2d}, context {context:4d}: " + ", ".join(cells))
    model.__dict__["cpu_decoder_step"] = fused


def _kv_step(model, path, cache, tokens, lens, tables):
    """One decode step over `cache` through `path` (the fused step, or None: layer by layer)."""
    from kettle.bench.drive import step

    def run() -> None:
        model.__dict__["cpu_decoder_step"] = path
        step(model, cache, tokens, lens, tables)

    return run


# ---- gguf-types: int8 serving of GGUF types without a kernel of their own ----------------------------------

KL_TEXTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants use sunlight to",
]


def gguf_types(args: argparse.Namespace) -> None:
    import torch
    from gguf import GGMLQuantizationType as T
    from transformers import AutoTokenizer

    from kettle.bench.drive import SERVED_BLOCK_SIZE, new_cache, scattered_tables, step
    from kettle.models.registry import load_model

    folder = Path(model_path(args))
    prompts = [AutoTokenizer.from_pretrained(folder)(text).input_ids for text in KL_TEXTS]

    def logits(model) -> torch.Tensor:
        tables, blocks = scattered_tables([len(p) for p in prompts], block_size=SERVED_BLOCK_SIZE)
        cache = new_cache(model, blocks, block_size=SERVED_BLOCK_SIZE)
        return step(model, cache, prompts, [0] * len(prompts), tables)[0]

    for name in args.types:
        with tempfile.TemporaryDirectory() as temp:
            path = str(requantized(folder, Path(temp) / name, T[name]))
            reference = logits(load_model(path, torch.float32, "cpu", dequantize=True))
            served = logits(load_model(path, torch.float32, "cpu"))
        divergence = kl(reference, served)
        top1 = (reference.argmax(-1) == served.argmax(-1)).float().mean()
        print(f"{name}: mean KL {divergence.mean():.2e}, max KL {divergence.max():.2e}, top-1 agreement {top1:.3f}, "
              f"{len(divergence)} tokens")  # fmt: skip


def requantized(folder: Path, out: Path, qtype) -> Path:
    """The model with every 2-D tensor of its GGUF rewritten as `qtype` (norms stay F32)."""
    import shutil

    import gguf
    import numpy as np

    from kettle.hub.gguf_header import read_header

    source = folder / "model.gguf"
    fields = read_header(source).fields
    reader = gguf.GGUFReader(source)
    out.mkdir(parents=True)
    writer = gguf.GGUFWriter(out / "model.gguf", "llama")
    for key in ("block_count", "attention.head_count", "attention.head_count_kv"):
        writer.add_uint32(f"llama.{key}", fields[f"llama.{key}"])
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if values.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


# ---- compile: torch.compile against eager, with and without the C kernels ----------------------------------

DYNAMIC = {"true": True, "false": False, "auto": None}
# name: (compiled, with kernels).
VARIANTS = {
    "eager-kernels": (False, True),
    "eager-nokernels": (False, False),
    "compiled-nokernels": (True, False),
    "compiled-kernels": (True, True),
}


def kernels_switch(on: bool):
    """A context with Kettle's C kernels on or off for the calls inside (what `KETTLE_TUNING=cpu-kernels=off` does
    at start-up)."""
    from kettle.kernels import ops

    real = ops.library

    @contextlib.contextmanager
    def switched():
        ops.library = real if on else (lambda: None)
        try:
            yield
        finally:
            ops.library = real

    return switched


def compiled(args: argparse.Namespace) -> None:
    import functools

    import torch
    from torch._dynamo.utils import counters

    from kettle.bench.drive import DecodeLoop
    from kettle.models.registry import load_model

    torch._inductor.config.freezing = args.freezing
    path = model_path(args)
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    weights = f"--quantize {args.quantize}" if args.quantize else "the checkpoint's weights"
    print(f"{weights}, {args.threads} threads, load average {load_avg}")
    for batch in args.batch:
        for context in args.context:
            torch._dynamo.reset()
            counters.clear()
            total = args.steps + 2 * args.warmup  # compiled variants run their warm-up twice
            models: dict = {}  # one per (kernels, linear layout): each op picks its implementation once
            loops, compile_s = [], []
            for name in args.variants:
                is_compiled, with_kernels = VARIANTS[name]
                linear = args.compile_linear if is_compiled else args.eager_linear
                key = (with_kernels, linear)
                if key not in models:
                    with tuning({"cpu-linear": linear}), kernels_switch(with_kernels)():
                        models[key] = load_model(
                            path, torch.float32, "cpu", quantize=args.quantize, dequantize=args.dtype_float32
                        )
                model = models[key]
                forward = model.forward
                if is_compiled:
                    # The undecorated forward (the loop enters inference mode itself): tracing through the
                    # decorator's mode switch fails in AOTAutograd ("Cannot set version_counter for inference tensor").
                    plain = functools.partial(type(model).forward.__wrapped__, model)
                    forward = torch.compile(plain, dynamic=DYNAMIC[args.dynamic], mode=args.mode)
                loop = DecodeLoop(
                    model, batch, context, total, kv_dtype=model.spec.dtype, forward=forward,
                    around=kernels_switch(with_kernels), seed=args.seed,
                )  # fmt: skip
                seconds = None
                if is_compiled:  # compile outside the timing: the first steps trace (and recompile)
                    start = time.perf_counter()
                    for _ in range(args.warmup):
                        loop()
                    seconds = time.perf_counter() - start
                loops.append(loop)
                compile_s.append(seconds)
            seconds = [t.median for t in interleaved(loops, args.steps, args.warmup)]
            tokens = [loop.tokens() for loop in loops]
            for i, (name, s, c) in enumerate(zip(args.variants, seconds, compile_s, strict=True)):
                line = (
                    f"batch {batch:3d} {name:18s} {s * 1e3:8.2f} ms/step {batch / s:8.1f} tok/s  x{seconds[0] / s:.2f}"
                )
                if c is not None:
                    line += f"  compile+warmup {c:5.1f} s  {same_tokens(args.variants, tokens, i)}"
                print(line, flush=True)
            breaks = sum(counters["graph_break"].values())
            print(f"  dynamo: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks", flush=True)


def same_tokens(names: list[str], tokens: list, i: int) -> str:
    """Whether variant i's greedy tokens match those of the eager variant with its kernel setting."""
    import torch

    for j, name in enumerate(names):
        if not VARIANTS[name][0] and VARIANTS[name][1] == VARIANTS[names[i]][1] and j != i:
            n = min(tokens[i].shape[1], tokens[j].shape[1])
            return "same tokens" if torch.equal(tokens[i][:, :n], tokens[j][:, :n]) else "TOKENS DIFFER"
    return "no eager twin"


# ---- kernels: the weight-only kernels per matmul -------------------------------------------------------------

# (name, out_features, in_features) of SmolLM2-135M's matmuls, fused the way Kettle loads them.
MATMULS = [
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def kernels(args: argparse.Namespace) -> None:
    import torch

    from kettle.layers.linear import Linear
    from kettle.quantization.int4 import Int4Linear
    from kettle.quantization.int8 import Int8Linear

    print(f"threads={torch.get_num_threads()}; minimum us per matmul (speed-up vs fp32 oneDNN)")
    for name, out_features, in_features in MATMULS:
        weight = torch.randn(out_features, in_features) * 0.02
        layers = {"fp32": (Linear(weight.clone()), torch.float32)}
        if args.fp32_kernels:
            layers["int8"] = (Int8Linear.from_weight(weight), torch.float32)
            layers["int4"] = (Int4Linear.from_weight(weight), torch.float32)
        if args.bf16:
            layers["int8-bf16"] = (Int8Linear.from_weight(weight, act_dtype=torch.bfloat16), torch.bfloat16)
            layers["int4-bf16"] = (Int4Linear.from_weight(weight, act_dtype=torch.bfloat16), torch.bfloat16)
        if args.dense:  # the same layers forced onto the dense path (weight dequantized per call, float32 GEMM)
            for kind, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
                layer = cls.from_weight(weight)
                layer.dense_rows = 0
                layers[f"{kind}-dense"] = (layer, torch.float32)
        for rows in args.batch:
            x = torch.randn(rows, in_features)
            inputs = [(layer, x.to(dt)) for layer, dt in layers.values()]
            fns = [(lambda layer=layer, xi=xi: layer(xi)) for layer, xi in inputs]
            with torch.inference_mode():
                times = [t.minimum * 1e6 for t in interleaved(fns, max(5, args.steps // max(1, rows // 16)))]
            cells = "  ".join(f"{k}={t:8.1f} ({times[0] / t:4.2f}x)" for k, t in zip(layers, times, strict=True))
            print(f"{name:8s} {out_features:5d}x{in_features:<5d} rows={rows:<4d} {cells}", flush=True)


# ---- fallback: the transformers fallback's padded batches ------------------------------------------------------


def fallback(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import engine_run, shard_engine

    path = Path(tempfile.mkdtemp(prefix="kettle-bench-fallback-"))
    build_gpt_neo(path)
    prompts = [[5 + i] * (8 + 4 * i) for i in range(args.requests)]

    def kettle_seconds(padding: str) -> float:
        with tuning({"fallback-padding": padding}):
            engine = shard_engine(str(path), max_tokens=256, dtype="float32", kv_cache_dtype="float32")
            run = engine_run(engine, prompts, args.steps, ignore_eos=True)
        return run.prefill_s + run.decode_s

    def transformers_seconds() -> float:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False
            )
        return time.perf_counter() - start

    modes = {
        "kettle fallback, padded batch": lambda: kettle_seconds("1"),
        "kettle fallback, one request per forward": lambda: kettle_seconds("0"),
        "transformers generate (left-padded batch)": transformers_seconds,
    }
    best = {name: min(run() for _ in range(args.trials)) for name, run in modes.items()}
    generated = args.requests * args.steps
    base = best["transformers generate (left-padded batch)"]
    for name, seconds in best.items():
        print(f"{name:45s} {generated / seconds:8.1f} tokens/s  ({seconds:.2f} s, {base / seconds:.2f}x transformers)")


def build_gpt_neo(path: Path) -> None:
    """A random-weight GPT-Neo of 4 layers x 512 (no native implementation in Kettle: the fallback serves it) with
    the tests' tiny tokenizer."""
    import torch
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from tests.fixtures import make_tokenizer

    tokenizer = make_tokenizer(path)
    config = GPTNeoConfig(
        vocab_size=len(tokenizer), hidden_size=512, num_layers=4, num_heads=8, attention_types=[[["global"], 4]],
        max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    GPTNeoForCausalLM(config).save_pretrained(path)


# ---- grammar-engines: building a token mask per step ----------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
OUTPUT = '{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["math","poet"],"active":true}'


def grammar_engines(args: argparse.Namespace) -> None:
    """One markdown row per engine (an engine that fails, or is not installed, prints its error in its row)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    folder = model_path(args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    print(f"model {Path(folder).name}, vocabulary {len(tokenizer)}, {len(output_ids)} output tokens")
    print("| engine | tokenizer setup (ms) | schema compile (ms) | first mask (ms) | mask/token B=1 (µs) "
          "| mask/step B=8 (µs) |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, engine in (("xgrammar", XGrammar), ("llguidance", LLGuidance), ("outlines-core", OutlinesCore)):
        try:
            print(grammar_row(name, engine, tokenizer, output_ids), flush=True)
        except Exception as exc:  # one engine failing must not hide the others' numbers
            print(f"| {name} | failed: {exc!r} |", flush=True)


def grammar_row(name: str, engine_cls, tokenizer, output_ids: list[int]) -> str:
    """One engine's row: tokenizer set-up, schema compile (cold), first mask, median mask time at B=1 and 8."""
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    start = time.perf_counter()
    engine = engine_cls(tokenizer, vocab, eos)
    setup = time.perf_counter() - start
    compile_s = statistics.median(_seconds(engine.compile) for _ in range(3))
    grammar = engine.compile()
    per_token, first = {}, {}
    for batch in (1, 8):
        matchers, bitmask, times = engine.matchers(grammar, batch), engine.alloc(batch, vocab), []
        for token in output_ids:
            start = time.perf_counter()
            mask = unpack(engine.fill(matchers, bitmask), vocab)
            times.append(time.perf_counter() - start)
            assert bool(mask[0, token]), f"{name}: token {token} masked out"
            for matcher in matchers:
                engine.advance(matcher, token)
        per_token[batch], first[batch] = statistics.median(times), times[0]
    return (f"| {name} | {setup * 1e3:.0f} | {compile_s * 1e3:.1f} | {first[1] * 1e3:.1f} | "
            f"{per_token[1] * 1e6:.0f} | {per_token[8] * 1e6:.0f} |")  # fmt: skip


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def unpack(bitmask, vocab: int):
    """int32 bitmask [B, ceil(V/32)] → bool [B, V]; one tensor op for the batch."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab].bool()


class XGrammar:
    def __init__(self, tokenizer, vocab_size, eos):
        import xgrammar as xgr

        self.xgr = xgr
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def alloc(self, n, vocab):
        return self.xgr.allocate_token_bitmask(n, vocab)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class LLGuidance:
    def __init__(self, tokenizer, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        )
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n):
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def fill(self, matchers, bitmask):
        self.ll.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def alloc(self, n, vocab):
        return self.ll.torch.allocate_token_bitmask(n, vocab)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore:
    def __init__(self, tokenizer, vocab_size, eos):
        from outlines_core import Vocabulary

        decoder = {v: k for k, v in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for text, i in tokenizer.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(decoder[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(eos[0], tokens)

    def compile(self):
        from outlines_core import Index, json_schema

        regex = json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        return Index(regex, self.vocabulary)

    def matchers(self, index, n):
        from outlines_core import Guide

        return [Guide(index) for _ in range(n)]

    def fill(self, guides, bitmask):
        from outlines_core.kernels.torch import fill_next_token_bitmask

        for i, guide in enumerate(guides):
            fill_next_token_bitmask(guide, bitmask[i : i + 1])
        return bitmask

    def alloc(self, n, vocab):
        from outlines_core.kernels.torch import allocate_token_bitmask

        return allocate_token_bitmask(vocab).repeat(n, 1)

    def advance(self, guide, token):
        guide.advance(token)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table (byte-level BPE token spelling)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
