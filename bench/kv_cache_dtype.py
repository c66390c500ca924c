"""What a float16 / bfloat16 KV cache (`--kv-cache-dtype fp16|bf16`) costs against float32 on the bundled model.

    PYTHONPATH=. .venv/bin/python bench/kv_cache_dtype.py                  # weights as served by default (int4)
    PYTHONPATH=. .venv/bin/python bench/kv_cache_dtype.py --dtype-float32  # the GGUF's weights dequantized

Accuracy: four texts of 189-303 tokens, batched and cut to the shortest; the first 16 tokens of each are
prefilled, every later token is fed as a decode step (teacher-forced), so each next-token distribution is read
through the decode kernel over a growing cache. Prints the mean and max KL(float32 cache ‖ 16-bit cache) over
those positions, the top-1 agreement, and whether free-running greedy decoding (64 tokens after each whole text)
picks the same tokens (where not: float32's gap between its top two logits there).

Speed: median decode step (forward + logits) over a cache of each dtype at a few batch sizes and contexts,
interleaved step by step so all see the same machine load; every cache through the fused CPU decode step (what
serves by default) and layer by layer, each against the float32 cache layer by layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kettle.hub import resolve_model
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache

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
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def scattered_tables(lengths: list[int]) -> tuple[list[list[int]], int]:
    """Block tables of the served block size, drawn shuffled from one pool (block 0 left as padding)."""
    needs = [-(-n // BLOCK_SIZE) for n in lengths]
    pool = (torch.randperm(sum(needs), generator=torch.Generator().manual_seed(0)) + 1).tolist()
    starts = [sum(needs[:i]) for i in range(len(needs))]
    return [pool[a : a + n] for a, n in zip(starts, needs, strict=True)], sum(needs) + 1


def new_cache(model, blocks: int, kv_dtype: torch.dtype) -> KVCache:
    spec = model.spec
    return KVCache(spec.num_layers, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype, "cpu")


def step(model, cache: KVCache, chunks: list[list[int]], cache_lens: list[int], tables: list[list[int]]):
    """One forward as the shard runs it: (logits of every new token, the metadata)."""
    meta = AttentionMetadata.build([len(c) for c in chunks], cache_lens, tables, BLOCK_SIZE, "cpu")
    with torch.inference_mode():
        hidden = model.forward(torch.tensor([t for c in chunks for t in c]), meta.positions, cache, meta)
        return model.compute_logits(hidden), meta


def teacher_forced(model, texts: list[list[int]], kv_dtype: torch.dtype) -> torch.Tensor:
    """Next-token logits [positions, S, V] at every position after PREFIX, the texts cut to one length."""
    length = min(len(t) for t in texts)
    tables, blocks = scattered_tables([length] * len(texts))
    cache = new_cache(model, blocks, kv_dtype)
    logits, meta = step(model, cache, [t[:PREFIX] for t in texts], [0] * len(texts), tables)
    out = [logits[meta.last_token_indices]]
    for position in range(PREFIX, length - 1):
        logits, _ = step(model, cache, [[t[position]] for t in texts], [position] * len(texts), tables)
        out.append(logits)
    return torch.stack(out)


def greedy(model, texts: list[list[int]], kv_dtype: torch.dtype) -> tuple[list[list[int]], torch.Tensor]:
    """GREEDY_TOKENS tokens after each whole text (prefilled in one forward) over a cache of `kv_dtype`, and each
    step's gap between the top two logits [GREEDY_TOKENS, S] (how near a tie each choice was)."""
    tables, blocks = scattered_tables([len(t) + GREEDY_TOKENS for t in texts])
    cache = new_cache(model, blocks, kv_dtype)
    logits, meta = step(model, cache, texts, [0] * len(texts), tables)
    logits, out, gaps = logits[meta.last_token_indices], [], []
    for i in range(GREEDY_TOKENS):
        top = logits.topk(2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
        out.append(logits.argmax(-1).tolist())
        logits, _ = step(model, cache, [[t] for t in out[-1]], [len(t) + i for t in texts], tables)
    return [list(column) for column in zip(*out, strict=True)], torch.stack(gaps)


def accuracy(model, texts: list[list[int]]) -> None:
    reference = teacher_forced(model, texts, torch.float32).flatten(0, 1)
    base_tokens, gaps = greedy(model, texts, torch.float32)
    print(f"accuracy: {len(texts)} texts of {min(map(len, texts))}+ tokens, {len(reference)} decode positions")
    for name, dtype in HALF.items():
        served = teacher_forced(model, texts, dtype).flatten(0, 1)
        kl = (reference.softmax(-1) * (reference.log_softmax(-1) - served.log_softmax(-1))).sum(-1)
        top1 = float((reference.argmax(-1) == served.argmax(-1)).float().mean())
        tokens, _ = greedy(model, texts, dtype)
        same = sum(a == b for a, b in zip(tokens, base_tokens, strict=True))
        # Where a text's greedy run first differs, and float32's gap between its top two logits there.
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None) for a, b in
                  zip(tokens, base_tokens, strict=True)]  # fmt: skip
        where = [
            f"text {s} at token {i} (float32 top-2 gap {gaps[i, s]:.3f})" for s, i in enumerate(firsts) if i is not None
        ]
        print(
            f"  {name}: mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, top-1 agreement {top1:.4f}; greedy "
            f"{GREEDY_TOKENS} tokens identical for {same}/{len(texts)} texts"
            + (f"; differs: {', '.join(where)}" if where else "")
        )
    print(f"  float32 top-2 logit gap over the greedy steps: median {gaps.median():.3f}")


def speed(model, batches: list[int], contexts: list[int], rounds: int) -> None:
    fused = model.__dict__.get("cpu_decoder_step", model.cpu_decoder_step)
    print(f"speed: median decode step in ms over {rounds} interleaved rounds ({torch.get_num_threads()} threads)")
    for batch in batches:
        for context in contexts:
            tables, blocks = scattered_tables([context + 1] * batch)
            kinds = {"float32": (torch.float32, None)}  # layer by layer, the ratios' reference
            kinds |= {f"{name} layers": (dtype, None) for name, dtype in HALF.items()}
            if fused is not None:
                kinds |= {"float32 fused": (torch.float32, fused)}
                kinds |= {f"{name} fused": (dtype, fused) for name, dtype in HALF.items()}
            caches = {name: new_cache(model, blocks, dtype) for name, (dtype, _) in kinds.items()}
            times: dict[str, list[float]] = {name: [] for name in kinds}
            tokens = [[int(t)] for t in torch.randint(100, 1000, (batch,))]
            for round_ in range(rounds + 2):
                for name, (_, step_) in kinds.items():
                    model.__dict__["cpu_decoder_step"] = step_  # None: layer by layer
                    start = time.perf_counter()
                    step(model, caches[name], tokens, [context] * batch, tables)
                    if round_ >= 2:
                        times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(values) for name, values in times.items()}
            cells = [f"{n} {m * 1e3:.1f} ({m / medians['float32']:.2f}x)" for n, m in medians.items()]
            print(f"  batch {batch:2d}, context {context:4d}: " + ", ".join(cells))
    model.__dict__["cpu_decoder_step"] = fused


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype-float32", action="store_true", help="the GGUF's weights dequantized to float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    print("command:", " ".join(["PYTHONPATH=. .venv/bin/python", *sys.argv]))
    folder = resolve_model().path
    model = load_model(str(folder), torch.float32, "cpu", dequantize=args.dtype_float32)
    print(f"model: {folder.name}, weights {getattr(model, 'quantization', None) or 'float32'}")
    if not args.skip_accuracy:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        accuracy(model, [tokenizer(text).input_ids for text in TEXTS])
    if not args.skip_speed:
        speed(model, args.batch, args.context, args.rounds)


if __name__ == "__main__":
    main()
