"""Parity of one model family against transformers: the check every family test runs.

A family test builds a tiny random model from the transformers config class (2 layers, small hidden size,
the tiny tokenizer's vocabulary), saves it with `save_tiny`, and calls `assert_parity`: Kettle's batched paged
forward over three prompts of different lengths must give logits close to transformers' per-prompt logits
(float32), and greedy generation of the three prompts in one batch must be token-identical, with Kettle's
CPU kernels and without them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kettle.bench.drive import greedy, new_cache, scattered_tables, step
from kettle.models.registry import load_model
from tests.fixtures import cpu_kernels, make_tokenizer, tiny_config

# Three prompts of different lengths (3, ~12 and ~30 tokens with the tiny tokenizer).
PARITY_PROMPTS = [
    "Hi",
    "The capital of France is Paris. The capital of",
    "def add(a, b):\n    return a + b\n Large language models generate text one token at a time. 你好",
]
LOGITS_ATOL = 1e-4
NEW_TOKENS = 12

# Largest logits difference measured per family, written next to the test run for the closing note's table.
MEASURED_FILE = Path(__file__).parent / ".family_parity.json"


def tiny_settings(path: Path) -> dict:
    """The tiny tokenizer saved into `path`, and the shared tiny shape (names as Llama configs spell them)."""
    return tiny_config(make_tokenizer(path))


def save_tiny(path: Path, config, model_cls, seed: int = 0, random_biases: bool = True) -> Path:
    """Saves a random `model_cls(config)` (safetensors) next to the tiny tokenizer already in `path`.

    Biases and norm weights (every 1-D parameter) are initialised to zeros/ones by transformers; perturbing
    them makes sure they are really loaded and applied.
    """
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if random_biases:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 1:  # biases and norm weights
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(p).input_ids for p in PARITY_PROMPTS]


def assert_parity(path: Path, family: str, atol: float = LOGITS_ATOL) -> float:
    """Logits of the three prompts in one batch within `atol` of transformers, and identical greedy tokens, with
    Kettle's CPU kernels and again without them (`KETTLE_TUNING=cpu-kernels=off`: the path of machines without gcc or
    AVX2).

    Returns the largest absolute logits difference with the kernels (also recorded in MEASURED_FILE).
    """
    reference, prompts = _reference(path), _prompts(path)
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([p])).logits[0] for p in prompts])
    reference.generation_config.eos_token_id = None  # always NEW_TOKENS tokens, so whole sequences compare
    with torch.no_grad():
        tokens = [
            reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            for p in prompts
        ]
    expected_tokens = [out[0, len(p) :].tolist() for p, out in zip(prompts, tokens, strict=True)]
    diffs = []
    for on in (True, False):
        with cpu_kernels(on):  # each op picks its backend when the model loads
            kettle = load_model(str(path), torch.float32, "cpu")
            diffs.append(_check(kettle, prompts, expected, expected_tokens, atol, f"{family} (kernels {on})"))
    _record(family, diffs[0])
    return diffs[0]


def _check(kettle, prompts, expected: torch.Tensor, expected_tokens: list[list[int]], atol: float, name: str) -> float:
    """Kettle's batched logits against `expected`, its greedy tokens against `expected_tokens`; the largest
    logits difference."""
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    logits, _ = step(kettle, new_cache(kettle, num_blocks), prompts, [0] * len(prompts), tables)
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
    assert greedy(kettle, prompts, max_new_tokens=NEW_TOKENS) == expected_tokens, f"{name}: greedy tokens differ"
    return float((logits - expected).abs().max())


def _record(family: str, diff: float) -> None:
    try:
        measured = json.loads(MEASURED_FILE.read_text()) if MEASURED_FILE.exists() else {}
        measured[family] = diff
        MEASURED_FILE.write_text(json.dumps(measured, indent=1, sort_keys=True))
    except (OSError, ValueError):
        pass  # a record for the note, never a reason to fail


def assert_prompt_logits(logits, reference, all_inputs: list[dict], chunks: list) -> None:
    """A batch's logits, prompt after prompt, each within LOGITS_ATOL of the reference model's on that prompt's
    inputs alone (a vision model's processor outputs: pixels beside the ids)."""
    at = 0
    for inputs, chunk in zip(all_inputs, chunks, strict=True):
        with torch.no_grad():
            expected = reference(**inputs).logits[0]
        got = logits[at : at + len(chunk)]
        assert torch.allclose(got, expected, atol=LOGITS_ATOL), (got - expected).abs().max()
        at += len(chunk)
