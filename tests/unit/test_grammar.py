"""Grammar compilation, the shard's batch token mask, and OpenAI's presence penalty (docs/api.md, Structured output and
tools)."""

from __future__ import annotations

import pytest
import torch

from kettle.grammar import GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX, grammar_text
from kettle.proto import generate_pb2 as pb
from kettle.shard.grammar import Grammars, advance
from kettle.shard.logits_process import PresencePenalty, StepInputs
from kettle.shard.sampling import BatchSampler, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    return Grammars(tiny_tokenizer, frozenset({tiny_tokenizer.eos_token_id}))


def parameters(kind: int, text: str) -> pb.NextTokenChooserParameters:
    return pb.NextTokenChooserParameters(grammar=text, grammar_type=kind)


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (GRAMMAR_TYPE_JSON, "{not json", "the JSON Schema is not valid JSON: Expecting property name"),
        (GRAMMAR_TYPE_JSON, "[1]", "a JSON Schema must be an object"),
        (GRAMMAR_TYPE_JSON, '{"type": "nope"}', "Invalid type: nope"),
        (GRAMMAR_TYPE_REGEX, "a(b", "unclosed group"),
    ],
)
def test_invalid_grammars_name_the_problem(kind, text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        grammar_text(kind, text)


def allowed_texts(tokenizer, row: torch.Tensor) -> set[str]:
    return {tokenizer.decode([i]) for i in row.nonzero().flatten().tolist()}


def test_mask_constrains_only_rows_with_a_grammar(grammars, tiny_tokenizer):
    matcher = grammars.matcher(parameters(GRAMMAR_TYPE_REGEX, "[0-9]{2}"))
    assert grammars.matcher(pb.NextTokenChooserParameters()) is None
    width = len(tiny_tokenizer) + 7  # a padded lm_head
    mask = grammars.mask([None, matcher], width, torch.device("cpu"))
    assert mask.shape == (2, width) and mask.dtype == torch.bool and bool(mask[0].all())
    texts = allowed_texts(tiny_tokenizer, mask[1])
    assert texts and all(t.isdigit() and len(t) <= 2 for t in texts)
    assert not mask[1, len(tiny_tokenizer) :].any()


def test_matcher_advances_until_the_grammar_is_complete(grammars, tiny_tokenizer):
    matcher = grammars.matcher(parameters(GRAMMAR_TYPE_REGEX, "(yes|no)!"))
    ids = tiny_tokenizer.encode("no!", add_special_tokens=False)
    finished = []
    for token in ids:
        assert grammars.mask([matcher], len(tiny_tokenizer), torch.device("cpu"))[0, token]
        finished.append(advance(matcher, token))
    assert finished == [False] * (len(ids) - 1) + [True]


def test_json_schema_mask_follows_the_schema(grammars, tiny_tokenizer):
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    matcher = grammars.matcher(parameters(GRAMMAR_TYPE_JSON, schema))
    for token in tiny_tokenizer.encode('{"ok": ', add_special_tokens=False):
        assert not advance(matcher, token)
    texts = allowed_texts(tiny_tokenizer, grammars.mask([matcher], len(tiny_tokenizer), torch.device("cpu"))[0])
    assert texts and all("true".startswith(t) or "false".startswith(t) for t in texts)


def test_sampler_applies_the_mask_before_choosing(tiny_tokenizer):
    vocab = 50
    sampler = BatchSampler([SamplingParams(), SamplingParams(do_sample=True)], [torch.Generator()] * 2, vocab, "cpu")
    mask = torch.zeros(2, vocab, dtype=torch.bool)
    mask[:, [5, 7]] = True
    for seed in range(5):
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed))
        out = sampler(logits, None, None, torch.zeros(2, dtype=torch.long), mask)
        assert set(out.next_ids.tolist()) <= {5, 7}
        assert torch.isinf(out.logprobs[:, 0]).all()


def reference_presence(scores, history, prompt_lens, penalties):
    """The definition, row by row: each distinct generated token loses the penalty once."""
    out = scores.clone()
    for row, (ids, start, penalty) in enumerate(zip(history.tolist(), prompt_lens, penalties, strict=True)):
        for token in {t for t in ids[start:] if t >= 0}:
            out[row, token] -= penalty
    return out


def test_presence_penalty_counts_generated_tokens_once():
    history = torch.tensor([[1, 2, 3, 3, 4, 4], [1, 2, 5, -1, -1, -1], [6, 6, 7, 8, -1, -1]])
    prompt_lens, penalties = [3, 2, 1], [0.5, 0.0, -1.5]
    scores = torch.randn(3, 10)
    expected = reference_presence(scores, history, prompt_lens, penalties)
    processor = PresencePenalty.build(penalties, "cpu", prompt_lens)
    step = StepInputs(torch.zeros(3, dtype=torch.long), history, torch.tensor([6, 3, 4]))
    torch.testing.assert_close(processor(scores.clone(), step), expected)
    assert PresencePenalty.build([0.0, 0.0], "cpu") is None


def test_sampler_reads_presence_penalty_from_the_proto():
    params = SamplingParams.from_proto(pb.NextTokenChooserParameters(presence_penalty=0.25))
    assert params.presence_penalty == 0.25
    sampler = BatchSampler([params], [torch.Generator()], 10, "cpu", prompt_lens=[2])
    assert sampler.needs_history


def test_matchers_of_one_grammar_are_independent(grammars, tiny_tokenizer):
    first = grammars.matcher(parameters(GRAMMAR_TYPE_REGEX, "ab|cd"))
    for token in tiny_tokenizer.encode("ab", add_special_tokens=False):
        advance(first, token)
    second = grammars.matcher(parameters(GRAMMAR_TYPE_REGEX, "ab|cd"))
    (c,) = tiny_tokenizer.encode("c", add_special_tokens=False)
    assert first.is_stopped() and not second.is_stopped()
    assert grammars.mask([second], len(tiny_tokenizer), torch.device("cpu"))[0, c]
