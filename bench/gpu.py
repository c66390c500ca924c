"""Decode on a CUDA GPU: Kettle against transformers on a Llama-2-7B-shaped model with random bf16 weights.

    python3 -m bench gpu --out $OUT
    KETTLE_TUNING=cuda-fused-kernels=off python3 -m bench gpu --batch 1 32   # without the fused kernels
    python3 -m bench gpu --sampling --batch 1 32   # the shard's sampling step: host sync or none
    python3 -m bench gpu --kv-dtypes fp8_e4m3fn --batch 1 32 --context 2048   # a float8 KV cache
    python3 -m bench gpu --int4-kernels --batch 1 8 16 32 64 128              # int4 kernel against kernel

Method. Measure the device's copy bandwidth first (a 2 GiB device-to-device copy, bytes read + written).
Build transformers' LlamaForCausalLM with random weights on the GPU, then Kettle's own model from the same
tensors (in memory, no checkpoint on disk; `--via-disk` saves a safetensors folder and goes through
`load_model` instead). For each batch size: prefill random prompts of `--context` tokens, then time greedy
decode steps as the shard runs them (host metadata build + forward + logits + argmax, no host sync inside
the loop), eager and with the decode CUDA graph, and the graph replay alone (CUDA events). Achieved
bandwidth = (weights read once + every sequence's KV) / step time; the embedding table is not counted
(a step reads B rows of it). transformers runs the same steps with its DynamicCache at batch 1 and 32.
fp8 (`quantize_fp8`, per-channel weight scales) is timed the same way at batch 1 and 32, and at every `--batch`
the weight-only int8 (per-channel, Triton GEMV) and int4 (groups of 128; PyTorch's tinygemm, or Kettle's Triton
kernel with KETTLE_TUNING=cuda-int4-kernel=triton) models that `--quantize int8|int4` loads (LM head int8,
KETTLE_QUANT_LM_HEAD's default); their %bw counts the bytes of the quantized weights (packed values +
scales/zeros).

`--int4-kernels`: int4 kernel against kernel: Kettle's Triton kernel, PyTorch's tinygemm, and a dense bf16 GEMM
over the weight dequantized for the call, on Llama-2-7B's projections, against bf16 cuBLAS. `--layers` layers'
worth of the four projections (qkv 12288x4096, o 4096x4096, gate_up 22016x4096, down 4096x11008; random weights
quantized with groups of `--group`), so the int4 weights (~200 MB) do not fit the L2 cache and every call streams
them from memory. One timed call runs the projections in order; CUDA events over 30 calls after a warm-up
(Triton's autotuning included), the median of 5 such runs. Achieved bandwidth = bytes of the weights read (int4:
packed values + bf16 scale/zero pairs) / time, against the copy bandwidth. The relative error of each int4 path
is taken against a float32 product with the same dequantized weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kettle import settings
from kettle.bench.drive import SERVED_BLOCK_SIZE as BLOCK_SIZE
from kettle.bench.drive import hf_decode_step, new_cache, scattered_tables
from kettle.bench.timing import interleaved
from kettle.layers.attention import AttentionMetadata, get_backend
from kettle.models.llama import LlamaForCausalLM
from kettle.quantization.int4 import Int4Linear, quantize_int4
from kettle.shard.cuda_graphs import DecodeGraphs
from kettle.tensors import distributed
from kettle.tensors.kv_cache import KVCache

KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LLAMA2_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


class StateDictWeights:
    """Kettle's `Weights` interface over tensors already in memory (here: transformers' own parameters)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, device
        self.quantize = None  # set while a quantized model is built from these tensors
        self.tp = distributed.current()  # one rank: the benchmark measures a single device

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get(name).narrow(dim, start, stop - start)

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def output_embedding(self, embedding: torch.Tensor, name: str, tied: bool) -> torch.Tensor:
        return embedding if tied or not self.has(name) else self.get(name)


class KettleDecode:
    """Batched greedy decode over Kettle's paged cache (scattered block tables), eager or graphed."""

    def __init__(self, model, batch: int, context: int, max_new: int, kv_dtype: torch.dtype | None = None) -> None:
        self.model, self.batch = model, batch
        self.tables, blocks = scattered_tables([context + max_new] * batch, block_size=BLOCK_SIZE)
        self.num_blocks = blocks - 1  # block 0 is the padding block
        self.cache = new_cache(model, blocks, kv_dtype, BLOCK_SIZE, "cuda")
        self.graphs: DecodeGraphs | None = None
        self.tokens, self.len = self._prefill(context), context

    @torch.inference_mode()
    def _prefill(self, context: int, chunk: int = 16) -> torch.Tensor:
        firsts = []
        for at in range(0, self.batch, chunk):
            tables = self.tables[at : at + chunk]
            meta = AttentionMetadata.build([context] * len(tables), [0] * len(tables), tables, BLOCK_SIZE, "cuda")
            prompts = torch.randint(0, self.model.spec.vocab_size, (meta.num_tokens,), device="cuda")
            hidden = self.model.forward(prompts, meta.positions, self.cache, meta)
            firsts.append(self.model.compute_logits(hidden[meta.last_token_indices]).argmax(-1))
        return torch.cat(firsts)

    def capture(self) -> None:
        self.graphs = DecodeGraphs(self.model, self.cache, self.num_blocks, (self.batch,), with_logits=True)

    @torch.inference_mode()
    def step(self, graphed: bool) -> None:
        meta = AttentionMetadata.build([1] * self.batch, [self.len] * self.batch, self.tables, BLOCK_SIZE, "cuda")
        if graphed:
            logits = self.graphs.run(self.tokens, meta).logits
        else:
            logits = self.model.compute_logits(self.model.forward(self.tokens, meta.positions, self.cache, meta))
        self.tokens = logits.argmax(-1)
        self.len += 1

    def greedy(self, steps: int, graphed: bool) -> list[list[int]]:
        """Tokens of `steps` steps from the current state, which is restored afterwards (for comparisons)."""
        tokens, length, out = self.tokens, self.len, []
        for _ in range(steps):
            self.step(graphed)
            out.append(self.tokens.tolist())
        self.tokens, self.len = tokens, length
        return out

    def replay_seconds(self, steps: int) -> float:
        return event_per_call(lambda: self.graphs.replay(self.batch), steps)


def build_models(args, dtype):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(**LLAMA2_7B)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):
        hf = HFLlama(config).eval()
    torch.set_default_dtype(torch.float32)
    if args.via_disk:
        from kettle.models.registry import load_model

        folder = tempfile.mkdtemp(prefix="kettle-7b-")
        hf.save_pretrained(folder, safe_serialization=True)
        return hf, config, load_model(folder, dtype, "cuda"), folder
    weights = StateDictWeights(dict(hf.state_dict()), dtype, torch.device("cuda"))
    return hf, config, LlamaForCausalLM(config, weights).eval(), weights


def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Kettle's logits of the last prompt token, prefilling `ids` [L] into a fresh cache."""
    blocks = -(-ids.numel() // BLOCK_SIZE)
    cache = new_cache(model, blocks, block_size=BLOCK_SIZE, device="cuda")
    meta = AttentionMetadata.build([ids.numel()], [0], [list(range(blocks))], BLOCK_SIZE, "cuda")
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, meta.positions, cache, meta)[-1:])[0]


def bench_kettle(model, batch: int, args, variants: tuple[str, ...]) -> dict:
    steps = args.steps if batch <= 32 else max(10, args.steps // 3)
    run = KettleDecode(model, batch, args.context, 3 * (steps + args.warmup) + 64)
    result: dict = {"batch": batch}
    if "graph" in variants:
        run.capture()
        if batch == 8:
            result["graph_tokens_match_eager"] = run.greedy(16, True) == run.greedy(16, False)
        context_mid = run.len + (steps + args.warmup) // 2
        result["graph_s"] = wall_per_call(lambda: run.step(True), steps, args.warmup)
        result["replay_s"] = run.replay_seconds(steps)
        result["context"] = context_mid
    if "eager" in variants:
        result["eager_s"] = wall_per_call(lambda: run.step(False), steps, args.warmup)
        result.setdefault("context", run.len - (steps + args.warmup) // 2)
    return result


def bench_hf(hf, batch: int, args) -> float:
    seconds = wall_per_call(hf_decode_step(hf, batch, args.context), args.hf_steps, args.warmup)
    torch.cuda.empty_cache()
    return seconds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (--int4-kernels: rows); 1 8 32 128")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hf-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--weight-only", nargs="*", default=["int8", "int4"], choices=["int8", "int4"], help="none: skip")
    p.add_argument("--profile", action="store_true", help="only: GPU time per kernel of the graphed steps")
    p.add_argument("--sampling", action="store_true", help="only: the sampling step, with and without sync")
    p.add_argument("--via-disk", action="store_true", help="save safetensors and load with load_model")
    p.add_argument("--kv-dtypes", nargs="+", choices=sorted(KV_DTYPES), help="only: graphed steps over each dtype")
    p.add_argument("--int4-kernels", action="store_true", help="only: the int4 kernels against bf16 (see above)")
    p.add_argument("--layers", type=int, default=2, help="--int4-kernels: layers of projections per call")
    p.add_argument("--group", type=int, default=128, help="--int4-kernels: int4 group size")
    p.add_argument("--out", default=None, help="folder for the JSON results")
    return p


def gpu(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.int4_kernels:
        args.batch = args.batch or [1, 8, 16, 32, 64, 128]
        return int4_kernels(args)
    args.batch = args.batch or [1, 8, 32, 128]
    dtype = torch.bfloat16
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    # The fused norm/RoPE/SiLU kernels are on unless KETTLE_TUNING=cuda-fused-kernels=off: record which way.
    results["fused_kernels"] = settings.current().cuda_fused_kernels
    copy_bw = copy_bandwidth()
    results["copy_bw"] = copy_bw
    print(f"{results['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    start = time.perf_counter()
    hf, config, model, _keep = build_models(args, dtype)
    if args.profile:
        return profile_kernels(model, args)
    if args.sampling:
        results["sampling"] = bench_sampling(model, args)
        return save(results, args.out)
    if args.kv_dtypes:
        del hf  # room for long contexts' caches
        results["kv_dtypes"] = bench_kv_dtypes(model, args, weight_bytes(model), copy_bw)
        return save(results, args.out)
    backend = get_backend(device_type="cuda").name
    print(f"models built in {time.perf_counter() - start:.1f} s; attention backend {backend}", flush=True)
    results["attention"] = {}
    for batch in args.batch:
        seconds, bandwidth = attention_bandwidth(model.spec, batch, args.context + 32)
        results["attention"][batch] = (seconds, bandwidth)
        print(
            f"attention alone, batch {batch:3d}: {seconds * 1e6:7.1f} us/layer {bandwidth / 1e9:7.1f} GB/s", flush=True
        )
    ids = torch.randint(0, config.vocab_size, (args.context,), device="cuda")
    with torch.inference_mode():
        hf_logits = hf(ids[None]).logits[0, -1]
    results["kettle_vs_hf_logits_rel_err"] = relative_error(last_logits(model, ids), hf_logits)
    wbytes, kv_token = weight_bytes(model), model.spec.kv_bytes_per_token
    results["weight_bytes"] = wbytes
    results["kettle"] = []
    for batch in args.batch:
        results["kettle"].append(bench_kettle(model, batch, args, ("graph", "eager")))
        torch.cuda.empty_cache()  # the batch's KV cache and graphs are gone
        print("\n".join(describe("bf16", results["kettle"][-1], wbytes, kv_token, copy_bw)), flush=True)
    results["hf"] = {b: bench_hf(hf, b, args) for b in (1, 32) if b in args.batch}
    for b, s in results["hf"].items():
        print(f"transformers batch {b:3d}: {s * 1e3:8.3f} ms/step {b / s:9.1f} tok/s", flush=True)
    if not args.no_fp8:
        results.update(bench_fp8(model, config, _keep, ids, args, copy_bw))
        torch.cuda.empty_cache()
    for method in args.weight_only:
        results[method] = bench_weight_only(method, model, config, _keep, ids, args, copy_bw)
        torch.cuda.empty_cache()
    del hf
    summarize(results, wbytes, kv_token, copy_bw)
    summarize_weight_only(results, args.weight_only, kv_token, copy_bw)
    save(results, args.out)


def profile_kernels(model, args) -> None:
    """GPU time per kernel (torch.profiler) over 10 graph replays at each batch size, per step."""
    from torch.profiler import ProfilerActivity, profile

    for batch in args.batch:
        run = KettleDecode(model, batch, args.context, 64)
        run.capture()
        run.step(True)
        torch.cuda.synchronize()
        for graphed in (True, False):
            label = "graph replay" if graphed else "eager step"
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    run.graphs.replay(batch) if graphed else run.step(False)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in events) / 10
            print(f"\nbatch {batch}, {label}: kernels take {total / 1e3:.3f} ms of GPU time per step")
            for e in sorted(events, key=lambda e: -e.device_time_total)[:16]:
                print(f"{e.device_time_total / 10 / 1e3:7.3f} ms {e.count / 10:6.1f}x  {e.key[:90]}")


def bench_sampling(model, args) -> dict:
    """A graphed decode step followed by the shard's sampling (temperature 0.8, top-p 0.9, one seeded CUDA
    generator per row) and the step's one device→host copy, at batch 1 and 32. The previous tokens the sampler
    reads are built either with a blocking host→device copy, as the runner did (the host waits for the forward
    before it can queue the sampler), or pinned and non-blocking (`device_tensor`, what it does now)."""
    out = {}
    for batch in (b for b in (1, 32) if b in args.batch):
        out[batch] = sampling_at(model, batch, args)
        torch.cuda.empty_cache()
    return out


def sampling_at(model, batch: int, args) -> dict:
    from kettle.shard.logits_process import device_tensor
    from kettle.shard.sampling import BatchSampler, SamplingParams

    run = KettleDecode(model, batch, args.context, 4 * (args.steps + args.warmup) + 64)
    run.capture()
    params = [SamplingParams(temperature=0.8, top_p=0.9, do_sample=True, seed=i) for i in range(batch)]
    generators = [torch.Generator(device="cuda").manual_seed(i) for i in range(batch)]
    sampler = BatchSampler(params, generators, model.spec.vocab_size, "cuda")
    previous = list(range(batch))

    @torch.inference_mode()
    def step(blocking: bool) -> None:
        meta = AttentionMetadata.build([1] * batch, [run.len] * batch, run.tables, BLOCK_SIZE, "cuda")
        logits = run.graphs.run(run.tokens, meta).logits
        if blocking:
            last = torch.tensor(previous, dtype=torch.long, device="cuda")
        else:
            last = device_tensor(previous, torch.long, "cuda")
        sampled = sampler(logits, None, None, last)
        torch.stack([sampled.next_ids.double(), sampled.chosen_logprobs.double()]).tolist()
        run.tokens, run.len = sampled.next_ids, run.len + 1

    result = {
        "blocking_s": wall_per_call(lambda: step(True), args.steps, args.warmup),
        "async_s": wall_per_call(lambda: step(False), args.steps, args.warmup),
        "blocking_again_s": wall_per_call(lambda: step(True), args.steps, args.warmup),
        "graph_only_s": wall_per_call(lambda: run.step(True), args.steps, args.warmup),
    }
    print(
        f"sampling batch {batch:3d}: graph step + argmax {result['graph_only_s'] * 1e3:.3f} ms; + sampling, "
        f"blocking H2D {result['blocking_s'] * 1e3:.3f} / {result['blocking_again_s'] * 1e3:.3f} ms, "
        f"non-blocking {result['async_s'] * 1e3:.3f} ms",
        flush=True,
    )
    return result


def bench_kv_dtypes(model, args, wbytes: int, copy_bw: float) -> list[dict]:
    """Graphed decode steps over a bf16 cache and over each `--kv-dtypes` one (`--kv-cache-dtype`), same batch
    and context: a long context makes the step read more KV than weights, which a float8 cache halves."""
    out, spec = [], model.spec
    for batch in args.batch:
        base = None
        for name in ("bf16", *args.kv_dtypes):
            run = KettleDecode(model, batch, args.context, args.steps + args.warmup + 16, KV_DTYPES[name])
            run.capture()
            seconds = wall_per_call(lambda run=run: run.step(True), args.steps, args.warmup)
            per_token = KVCache.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, KV_DTYPES[name])
            kv_bytes = batch * run.len * per_token
            base = base or seconds
            row = {"batch": batch, "kv": name, "context": run.len, "step_s": seconds, "kv_bytes": kv_bytes}
            out.append(row | {"speedup": base / seconds, "bw": (wbytes + kv_bytes) / seconds / copy_bw})
            print(
                f"kv {name:11s} batch {batch:3d} context {run.len:5d}: {seconds * 1e3:7.3f} ms/step "
                f"{batch / seconds:8.1f} tok/s  KV {kv_bytes / 1e9:5.2f} GB  {100 * out[-1]['bw']:5.1f}% of copy bw  "
                f"{out[-1]['speedup']:.2f}x bf16",
                flush=True,
            )
            del run
            torch.cuda.empty_cache()
    return out


def save(results: dict, out: str | None) -> None:
    if out:
        Path(out, "gpu_decode.json").write_text(json.dumps(results, indent=2, default=str))


def bench_fp8(model, config, source, ids, args, copy_bw: float) -> dict:
    from kettle.quantization.fp8 import quantize_fp8

    if isinstance(source, str):
        from kettle.models.registry import load_model

        fp8 = load_model(source, torch.bfloat16, "cuda", quantize="fp8")
    else:
        fp8 = quantize_fp8(LlamaForCausalLM(config, source).eval())
    out = {"fp8_logits_rel_err": relative_error(last_logits(fp8, ids), last_logits(model, ids))}
    # One layer on the same input: the quantization error itself, before 32 random layers amplify it.
    x = torch.randn(4, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        out["fp8_qkv_rel_err"] = relative_error(fp8.layers[0].attn.qkv(x), model.layers[0].attn.qkv(x))
    out["fp8_weight_bytes"] = weight_bytes(fp8)
    out["fp8"] = [bench_kettle(fp8, b, args, ("graph", "eager")) for b in (1, 32) if b in args.batch]
    for r in out["fp8"]:
        print("\n".join(describe("fp8", r, out["fp8_weight_bytes"], model.spec.kv_bytes_per_token, copy_bw)))
    return out


def quantized_weight_bytes(model) -> int:
    """`weight_bytes` plus what the weight-only layers keep as buffers and read each step: packed values and
    scales (int4: scale/zero pairs), not the int8 layers' CPU-kernel copy of the scales."""
    from kettle.quantization.int4 import Int4Linear
    from kettle.quantization.int8 import Int8Linear

    total = weight_bytes(model)
    for module in model.modules():
        if isinstance(module, Int4Linear):
            tensors = (module.packed, module.scale_zero)
        elif isinstance(module, Int8Linear):
            tensors = (module.q, module.scale)
        else:
            continue
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def load_weight_only(method: str, config, source):
    """The model `--quantize method` serves: through load_model from disk, else quantized as it is built."""
    if isinstance(source, str):
        from kettle.models.registry import load_model

        return load_model(source, torch.bfloat16, "cuda", quantize=method)
    from kettle.quantization.config import lm_head_scheme
    from kettle.quantization.loading import Scheme, finish

    scheme = Scheme(method, None, head=lm_head_scheme(method))
    source.quantize = scheme
    model = LlamaForCausalLM(config, source).eval()
    source.quantize = None
    return finish(model, scheme)


def bench_weight_only(method: str, model, config, source, ids, args, copy_bw: float) -> dict:
    start = time.perf_counter()
    quantized = load_weight_only(method, config, source)
    out: dict = {"load_s": time.perf_counter() - start, "weight_bytes": quantized_weight_bytes(quantized)}
    out["logits_rel_err"] = relative_error(last_logits(quantized, ids), last_logits(model, ids))
    x = torch.randn(4, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        out["qkv_rel_err"] = relative_error(quantized.layers[0].attn.qkv(x), model.layers[0].attn.qkv(x))
    out["runs"] = [bench_kettle(quantized, b, args, ("graph", "eager")) for b in args.batch]
    for r in out["runs"]:
        print("\n".join(describe(method, r, out["weight_bytes"], model.spec.kv_bytes_per_token, copy_bw)), flush=True)
    return out


def summarize_weight_only(results: dict, methods: list[str], kv_token: int, copy_bw: float) -> None:
    by_batch = {r["batch"]: r for r in results["kettle"]}
    for method in methods:
        q = results[method]
        print(
            f"{method}: weights {q['weight_bytes'] / 1e9:.2f} GB (bf16 {results['weight_bytes'] / 1e9:.2f}), "
            f"rel err vs bf16: qkv {q['qkv_rel_err']:.4f}, logits after 32 random layers {q['logits_rel_err']:.3f}"
        )
        print("batch | eager ms | graph ms | replay ms | graph tok/s | graph %bw | replay %bw | bf16/quant graph")
        for r in q["runs"]:
            batch, step_bytes = r["batch"], q["weight_bytes"] + r["batch"] * r["context"] * kv_token
            base = by_batch.get(batch)
            ratio = f"{base['graph_s'] / r['graph_s']:.2f}x" if base else "-"
            print(
                f"{batch:5d} | {r['eager_s'] * 1e3:8.2f} | {r['graph_s'] * 1e3:8.2f} | {r['replay_s'] * 1e3:9.2f} | "
                f"{batch / r['graph_s']:11.1f} | {100 * step_bytes / r['graph_s'] / copy_bw:9.1f} | "
                f"{100 * step_bytes / r['replay_s'] / copy_bw:10.1f} | {ratio}"
            )


# ---- measurement primitives: a CUDA step is timed across one synchronize, or by CUDA events ----------------


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


# ---- the printed report ------------------------------------------------------------------------------------


def describe(name: str, r: dict, wbytes: int, kv_per_token: int, copy_bw: float) -> list[str]:
    lines, batch = [], r["batch"]
    step_bytes = wbytes + batch * r["context"] * kv_per_token
    for key, label in (("eager_s", "eager"), ("graph_s", "graph"), ("replay_s", "replay")):
        if key in r:
            s = r[key]
            bw = step_bytes / s
            lines.append(
                f"{name:5s} {label:6s} batch {batch:3d}: {s * 1e3:8.3f} ms/step {batch / s:9.1f} tok/s "
                f"{bw / 1e9:7.1f} GB/s ({100 * bw / copy_bw:5.1f}% of copy bw)"
            )
    return lines


def summarize(results: dict, wbytes: int, kv_token: int, copy_bw: float) -> None:
    print("\n=== summary ===")
    print(f"device {results['device']}, torch {results['torch']}, copy bw {copy_bw / 1e9:.0f} GB/s")
    print(
        f"Kettle vs transformers logits (bf16, last prompt token) rel err {results['kettle_vs_hf_logits_rel_err']:.2e}"
    )
    by_batch = {r["batch"]: r for r in results["kettle"]}
    print("batch | eager ms | graph ms | replay ms | graph tok/s | graph %bw | replay %bw | hf ms | x hf")
    for batch, r in by_batch.items():
        step_bytes = wbytes + batch * r["context"] * kv_token
        hf = results["hf"].get(batch)
        print(
            f"{batch:5d} | {r['eager_s'] * 1e3:8.2f} | {r['graph_s'] * 1e3:8.2f} | {r['replay_s'] * 1e3:9.2f} | "
            f"{batch / r['graph_s']:11.1f} | {100 * step_bytes / r['graph_s'] / copy_bw:9.1f} | "
            f"{100 * step_bytes / r['replay_s'] / copy_bw:10.1f} | "
            + (f"{hf * 1e3:5.1f} | {hf / r['graph_s']:5.2f}" if hf else "    - |     -")
        )
    if 8 in by_batch:
        print(f"graph greedy tokens == eager (batch 8, 16 steps): {by_batch[8].get('graph_tokens_match_eager')}")
    if "fp8" in results:
        print(
            f"fp8 vs bf16 rel err: one layer (qkv) {results['fp8_qkv_rel_err']:.4f}, "
            f"logits after 32 random layers {results['fp8_logits_rel_err']:.3f}"
        )
        for r in results["fp8"]:
            base = by_batch.get(r["batch"])
            ratio = f"  bf16/fp8 graph {base['graph_s'] / r['graph_s']:.2f}x" if base else ""
            print(
                f"fp8 batch {r['batch']:3d}: eager {r['eager_s'] * 1e3:.2f} ms, graph {r['graph_s'] * 1e3:.2f} ms, "
                f"replay {r['replay_s'] * 1e3:.2f} ms{ratio}"
            )
    for batch, (seconds, bandwidth) in results["attention"].items():
        share = 100 * bandwidth / copy_bw
        print(f"attention kernel alone, batch {batch:3d}: {seconds * 1e6:.1f} us/layer, {share:.1f}% of copy bw")


# ---- --int4-kernels ---------------------------------------------------------------------------------------

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
KERNELS = ("triton", "tinygemm", "dense")


def build(layers: int, group: int) -> tuple[list[torch.Tensor], dict[str, list[Int4Linear]]]:
    """bf16 weights and, per int4 kernel, the same weights quantized (the dense path reads the Triton layout)."""
    dense, quantized = [], {"triton": [], "tinygemm": []}
    for _ in range(layers):
        for n, k in SHAPES.values():
            weight = torch.randn(n, k, device="cuda") * 0.02
            dense.append(weight.bfloat16())
            q, scale, zero = quantize_int4(weight, group)
            for kernel, built in quantized.items():
                built.append(Int4Linear(q, scale, zero, group, cuda_kernel=kernel))
    return dense, quantized


def timed(fn, calls: int = 30, runs: int = 5) -> float:
    """Seconds per call: the median of `runs` readings of CUDA events around `calls` back-to-back calls."""
    return interleaved([fn], runs, measure=lambda f: event_per_call(f, calls))[0].median


def int4_error(layer: Int4Linear, y: torch.Tensor, x: torch.Tensor) -> float:
    expected = F.linear(x.float(), layer.dequantized())
    return float((y.float() - expected).norm() / expected.norm())


def int4_kernels(args: argparse.Namespace) -> None:
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    dense, quantized = build(args.layers, args.group)
    int4_bytes = sum(t.numel() * t.element_size() for m in quantized["triton"] for t in (m.packed, m.scale_zero))
    bf16_bytes = sum(w.numel() * 2 for w in dense)
    print(f"weights read per call: bf16 {bf16_bytes / 1e6:.0f} MB, int4 {int4_bytes / 1e6:.0f} MB")
    print("rows | bf16 ms | triton ms | tinygemm ms | dense ms | triton %bw | bf16/triton | bf16/tinygemm | err triton")
    with torch.inference_mode():
        for rows in args.batch:
            xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in SHAPES.values()}}
            ms = {"bf16": timed(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense])}
            for kernel in KERNELS:
                layers = quantized["tinygemm" if kernel == "tinygemm" else "triton"]
                for layer in layers:
                    layer.dense_rows = -1 if kernel == "dense" else 10**9
                ms[kernel] = timed(lambda layers=layers, xs=xs: [m(xs[m.in_features]) for m in layers])
            triton_layers = quantized["triton"]
            for layer in triton_layers:
                layer.dense_rows = 10**9
            error = max(int4_error(m, m(xs[m.in_features]), xs[m.in_features]) for m in triton_layers[:4])
            print(
                f"{rows:4d} | {ms['bf16'] * 1e3:7.3f} | {ms['triton'] * 1e3:9.3f} | {ms['tinygemm'] * 1e3:11.3f} | "
                f"{ms['dense'] * 1e3:8.3f} | {100 * int4_bytes / ms['triton'] / copy_bw:10.1f} | "
                f"{ms['bf16'] / ms['triton']:11.2f} | {ms['bf16'] / ms['tinygemm']:13.2f} | {error:.2e}",
                flush=True,
            )
