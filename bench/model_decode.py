"""Micro-benchmark of Kettle's model execution core: decode step time at several batch sizes.

Method: load the model folder with Kettle, prefill `batch` random prompts of `--context` tokens in one
forward, then time `--steps` greedy decode steps (metadata build + forward + logits of the last tokens +
argmax), after `--warmup` untimed steps. Reports the median step time, tokens/s (batch / step time) and the
memory bandwidth that implies (weights + KV read once per step). With `--compare-transformers`, times the
same decode steps with transformers (DynamicCache, same batch and context), interleaved step by step with
Kettle's so both see the same machine load, and prints the ratio.

    .venv/bin/python bench/model_decode.py ~/.cache/kettle/<model> --dtype bfloat16 --batch 1 16
    .venv/bin/python bench/model_decode.py ~/.cache/kettle/<model> --quantize int4 --compare-transformers
    KETTLE_CPU_KERNELS=0 .venv/bin/python bench/model_decode.py ...   # PyTorch's ops instead of Kettle's kernels

`--family NAME` times a tiny random model of that family instead of a folder (the same shape for every
family: 8 layers, hidden 512, 8 heads in 4 KV groups, intermediate 1536, vocabulary 4096), and
`--fused-vs-layers` times the fused CPU decode step against the layer-by-layer forward, interleaved:

    .venv/bin/python bench/model_decode.py --family qwen3 --quantize int4 --batch 1 8 --fused-vs-layers

`--integer-vs-float` times the same model's steps with gemm.c's integer panels (AVX-512 VNNI; 16 rows and more)
against its float32 panels, switched step by step:

    .venv/bin/python bench/model_decode.py $M --batch 16 32 --integer-vs-float

`--switch NAME` does the same for one of the kernels' measurement switches (an int in the C library, its default
against `--switch-off`, 0 unless given), e.g. the one-row channel kernels against the tiles' kernels at one row:

    .venv/bin/python bench/model_decode.py $M --batch 1 --steps 200 --switch kettle_channel_one
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from kettle.bench.hf_decode import hf_decode_step
from kettle.kernels import build, ops
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.shard.dtype import choose_kv_dtype
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache


def timed(fns: list, steps: int, warmup: int) -> list[float]:
    """Median seconds of each function over `steps` runs, after `warmup` untimed ones.

    The functions run interleaved (a, b, a, b, ...) so that both see the same machine load: on a shared
    CPU, timing one after the other measures the neighbours as much as the code.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def kettle_decode(model, batch: int, context: int, total_steps: int):
    """A closure running one batched greedy decode step per call, after a one-forward prefill."""
    spec = model.spec
    blocks_per_seq = -(-(context + total_steps + 1) // BLOCK_SIZE)
    # The KV cache in the dtype a shard picks by default (16-bit on the CPU for a float32 model).
    kv_dtype = choose_kv_dtype(None, spec.dtype, torch.device("cpu"))
    cache = KVCache(
        spec.num_layers, batch * blocks_per_seq, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype, "cpu"
    )
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = torch.randint(0, spec.vocab_size, (batch * context,))
    meta = AttentionMetadata.build([context] * batch, [0] * batch, tables, BLOCK_SIZE, "cpu")
    hidden = model.forward(prompts, meta.positions, cache, meta)
    state = {"tokens": model.compute_logits(hidden[meta.last_token_indices]).argmax(-1), "len": context}

    def step() -> None:
        meta = AttentionMetadata.build([1] * batch, [state["len"]] * batch, tables, BLOCK_SIZE, "cpu")
        hidden = model.forward(state["tokens"], meta.positions, cache, meta)
        state["tokens"] = model.compute_logits(hidden).argmax(-1)
        state["len"] += 1

    return step


def transformers_decode(path: str, dtype: torch.dtype, batch: int, context: int):
    """The same decode step with transformers' own model and DynamicCache."""
    from transformers import AutoModelForCausalLM

    from kettle.hub.resolve import float_folder

    return hf_decode_step(AutoModelForCausalLM.from_pretrained(float_folder(path), dtype=dtype).eval(), batch, context)


def _storage_key(tensor: torch.Tensor) -> int:
    # oneDNN-packed weights are opaque tensors without a data pointer; they are never shared.
    return tensor.data_ptr() if tensor.layout == torch.strided and not tensor.is_mkldnn else id(tensor)


# Buffers that hold quantized weights (kettle/quantization): read once per step like parameters.
QUANTIZED_BUFFERS = {"packed", "scales", "mins", "q", "scale", "scale_zero"}


def bytes_per_step(model, batch: int, context: int) -> int:
    """Weights (tied head counted once, quantized ones at their stored width) plus every sequence's KV, each
    read once per step."""
    tensors = list(model.parameters())
    tensors += [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in QUANTIZED_BUFFERS]
    params = {_storage_key(t): t.numel() * t.element_size() for t in tensors}
    return sum(params.values()) + batch * context * model.spec.kv_bytes_per_token


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
    import tempfile

    import transformers

    folder = tempfile.mkdtemp(prefix=f"kettle-{family}-")
    prefix, shape = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**shape)
    torch.manual_seed(0)
    model_cls = getattr(transformers, f"{prefix}LMHeadModel" if prefix == "GPT2" else f"{prefix}ForCausalLM")
    model_cls(config).save_pretrained(folder)
    return folder


def with_integer_panels(model, on: bool, step):
    """`step` with the integer panels switched on or off around each call: ops' switch (the LM head) and the fused
    step's copy of it."""

    def run() -> None:
        ops._INTEGER_GEMM = on
        model.cpu_decoder_step.decoder.integer_gemm = int(on)
        step()

    return run


def with_switch(name: str, value: int | None, step):
    """`step` with the C library's int `name` set to `value` around each call (None: its default), then restored."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="a model folder (config.json + safetensors)")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="a tiny random model of this family instead")
    parser.add_argument("--fused-vs-layers", action="store_true", help="the fused step against layer by layer")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantize", choices=["int8", "int4"], help="Kettle's weights quantized at load")
    parser.add_argument("--compare-transformers", action="store_true", help="against transformers in --dtype")
    parser.add_argument("--integer-vs-float", action="store_true", help="integer panels against float32 ones")
    parser.add_argument("--switch", help="a kernels' switch (C int) at its default against --switch-off")
    parser.add_argument("--switch-off", type=int, default=0, help="the --switch value compared (default 0)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = tiny_family(args.family) if args.family else args.path
    model = load_model(path, dtype, "cpu", quantize=args.quantize)
    layers = layer_by_layer(load_model(path, dtype, "cpu", quantize=args.quantize)) if args.fused_vs_layers else None
    scheme = f" --quantize {args.quantize}" if args.quantize else ""
    fused = "fused step" if getattr(model, "cpu_decoder_step", None) is not None else "layer by layer"
    print(f"{model.spec.model_type} {args.dtype}{scheme}, context {args.context}, {torch.get_num_threads()} threads")
    print(f"decode: {fused}", flush=True)
    if args.integer_vs_float and not ops.integer_gemm():
        parser.error("--integer-vs-float: no integer panels here (AVX-512 VNNI, KETTLE_CPU_INTEGER_GEMM)")
    for batch in args.batch:
        fns = [kettle_decode(model, batch, args.context, args.steps + args.warmup)]
        if layers is not None:
            fns.append(kettle_decode(layers, batch, args.context, args.steps + args.warmup))
        elif args.integer_vs_float:
            step = kettle_decode(model, batch, args.context, 2 * (args.steps + args.warmup))
            fns = [with_integer_panels(model, True, step), with_integer_panels(model, False, step)]
        elif args.switch:
            step = kettle_decode(model, batch, args.context, 2 * (args.steps + args.warmup))
            fns = [with_switch(args.switch, None, step), with_switch(args.switch, args.switch_off, step)]
        elif args.compare_transformers:
            fns.append(transformers_decode(path, dtype, batch, args.context))
        seconds, *base = timed(fns, args.steps, args.warmup)
        gbps = bytes_per_step(model, batch, args.context) / seconds / 1e9
        line = f"batch {batch:3d}: {seconds * 1e3:8.2f} ms/step  {batch / seconds:8.1f} tok/s  {gbps:6.2f} GB/s"
        if base:
            other = "layer by layer" if layers is not None else "transformers"
            other = "float32 panels" if args.integer_vs_float else other
            other = f"{args.switch}={args.switch_off}" if args.switch else other
            line += f"  | {other} {base[0] * 1e3:8.2f} ms/step  speedup x{base[0] / seconds:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
