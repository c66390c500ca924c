"""The serving benchmark's request mix: 1,000 (input tokens, output tokens) pairs shaped like ShareGPT's
conversations, written once to bench/data/sharegpt_lengths.json so that every run sends the same requests.

    .venv/bin/python -m bench.serving_mix          # writes the file again (it must come out byte for byte the same)

Shape. ShareGPT's prompts and answers (as the serving benchmarks of vLLM and TGI sample them, Llama tokens) are
long-tailed: most prompts are a few hundred tokens, a few run to thousands; answers are a little shorter and
tail off the same way. Both are drawn here from log-normal distributions (the median and sigma below, the
log-normal's parameters being ln(median) and sigma) and clipped to the ranges a benchmark request keeps: inputs
50-1,500 tokens, outputs 50-800. Python's own `random.Random(SEED)` draws them (its log-normal is stable across
Python versions, unlike numpy's streams across numpy versions), input then output for each pair.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).parent / "data" / "sharegpt_lengths.json"
SEED = 20261129
COUNT = 1000
# (median, sigma, low, high) of each side's log-normal, clipped to [low, high].
INPUT = (250, 0.9, 50, 1500)
OUTPUT = (180, 0.75, 50, 800)


@dataclass(frozen=True)
class Request:
    """One request of the mix: its prompt's length and the tokens it asks for, in tokens."""

    input_tokens: int
    output_tokens: int


def draw(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def generate(seed: int = SEED, count: int = COUNT) -> list[Request]:
    """The mix as the parameters above draw it."""
    rng = random.Random(seed)
    return [Request(draw(rng, *INPUT), draw(rng, *OUTPUT)) for _ in range(count)]


def document(requests: list[Request]) -> str:
    """The data file's text: the parameters that drew it, then one [input, output] pair per line."""
    header = {
        "about": "ShareGPT-like request lengths for `python -m bench serving`, drawn by bench/serving_mix.py",
        "seed": SEED,
        "input": dict(zip(("median", "sigma", "low", "high"), INPUT, strict=True)),
        "output": dict(zip(("median", "sigma", "low", "high"), OUTPUT, strict=True)),
    }
    pairs = ",\n".join(f"    [{r.input_tokens}, {r.output_tokens}]" for r in requests)
    head = json.dumps(header, indent=2)[:-2]  # the header's fields, then the pairs in the same object
    return f'{head},\n  "pairs": [\n{pairs}\n  ]\n}}\n'


def load(path: Path = PATH) -> list[Request]:
    """The committed mix."""
    return [Request(i, o) for i, o in json.loads(path.read_text())["pairs"]]


def scaled(requests: list[Request], max_input: int | None, max_output: int | None) -> list[Request]:
    """The mix with each side scaled so its longest is at most `max_input` / `max_output` (None: as it is),
    keeping the shape: a quick run on a small model keeps long and short requests in the same proportions."""

    def scale(values: list[int], most: int | None) -> list[int]:
        top = max(values)
        if most is None or top <= most:
            return values
        return [max(1, round(v * most / top)) for v in values]

    inputs = scale([r.input_tokens for r in requests], max_input)
    outputs = scale([r.output_tokens for r in requests], max_output)
    return [Request(i, o) for i, o in zip(inputs, outputs, strict=True)]


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(document(generate()))
    print(f"wrote {len(load())} pairs to {PATH}")
