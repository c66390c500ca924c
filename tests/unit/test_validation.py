"""Validation (docs/api.md, Validation): every message with its exact text, the order of the rules, and the defaults."""

from __future__ import annotations

import asyncio
import copy

import pytest

from kettle.proto import generate_pb2
from kettle.router.schemas import GenerateRequest
from kettle.router.tokenizer import TokenizerPool
from kettle.router.validation import Validation, ValidationError, ValidationLimits

LIMITS = ValidationLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=32, max_total_tokens=64
)
PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def pool(tiny_tokenizer):
    pool = TokenizerPool(lambda: copy.deepcopy(tiny_tokenizer), workers=1)
    yield pool
    pool.close()


@pytest.fixture
def validate(pool):
    """Validates a request given as JSON-like kwargs; `limits` and `stream` are options."""

    def run(inputs: str = PROMPT, parameters: dict | None = None, *, stream: bool = False, **options):
        body = {"inputs": inputs} if parameters is None else {"inputs": inputs, "parameters": parameters}
        validation = Validation(options.pop("limits", LIMITS), pool, **options)
        return asyncio.run(validation.validate(GenerateRequest.model_validate(body), stream=stream))

    return run


def error_of(validate, *args, **kwargs) -> str:
    with pytest.raises(ValidationError) as caught:
        validate(*args, **kwargs)
    return str(caught.value)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"temperature": -1.0}, "`temperature` must be strictly positive"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"frequency_penalty": -2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"top_n_tokens": -1}, "`top_n_tokens` must be >= 0 and <= 5. Given: -1"),
        ({"truncate": 0}, "`truncate` must be strictly positive and less than 32. Given: 0"),
        ({"truncate": 33}, "`truncate` must be strictly positive and less than 32. Given: 33"),
    ],
)
def test_parameter_messages(validate, parameters, message):
    assert error_of(validate, PROMPT, parameters) == message


def test_best_of_disabled_when_the_limit_is_one(validate):
    limits = ValidationLimits(1, 4, 5, 32, 64)
    message = "`best_of` != 1 is not allowed for this endpoint"
    assert error_of(validate, PROMPT, {"best_of": 2, "do_sample": True}, limits=limits) == message


def test_empty_inputs(validate):
    assert error_of(validate, "", {}) == "`inputs` cannot be empty"


def test_total_tokens(validate, tiny_tokenizer):
    n = count_tokens(tiny_tokenizer, PROMPT)
    expected = f"`inputs` tokens + `max_new_tokens` must be <= 64. Given: {n} `inputs` tokens and 60 `max_new_tokens`"
    assert error_of(validate, PROMPT, {"max_new_tokens": 60}) == expected


def test_input_length(validate, tiny_tokenizer):
    long_prompt = "Hello world! " * 10
    n = count_tokens(tiny_tokenizer, long_prompt)
    assert 32 < n < 63
    assert (
        error_of(validate, long_prompt, {"max_new_tokens": 1}) == f"`inputs` must have less than 32 tokens. Given: {n}"
    )
    # As in TGI, max_input_tokens itself is allowed: it is the longest prompt a user may send.
    at_limit = "Hello world! " * 8
    assert validate(at_limit, {"max_new_tokens": 1}).input_length == count_tokens(tiny_tokenizer, at_limit) == 32


def test_streaming_only_rules(validate):
    best_of = {"best_of": 2, "do_sample": True}
    assert error_of(validate, PROMPT, best_of, stream=True) == "`best_of` != 1 is not supported when streaming tokens"
    message = "`decoder_input_details` == true is not supported when streaming tokens"
    assert error_of(validate, PROMPT, {"decoder_input_details": True}, stream=True) == message
    assert validate(PROMPT, best_of).stopping.max_new_tokens > 0  # allowed without streaming


@pytest.mark.parametrize(
    ("inputs", "parameters", "message"),
    [
        # Rule 1 before rule 2, rule 2 before 5 and 12.
        (PROMPT, {"best_of": 3, "temperature": 0.0}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ("", {"temperature": 0.0, "top_p": 1.0}, "`temperature` must be strictly positive"),
        (PROMPT, {"top_p": 1.0, "top_k": 0, "max_new_tokens": 0}, "`top_p` must be > 0.0 and < 1.0"),
        (PROMPT, {"top_k": 0, "max_new_tokens": 0}, "`top_k` must be strictly positive"),
        (PROMPT, {"stop": ["x"] * 5, "top_n_tokens": 9}, "`stop` supports up to 4 stop sequences. Given: 5"),
        (PROMPT, {"best_of": 2, "top_k": 5, "seed": 3, "top_n_tokens": 9}, "`seed` must not be set when `best_of` > 1"),
        ("", {"top_n_tokens": 9, "truncate": 0}, "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
        ("", {"truncate": 0}, "`inputs` cannot be empty"),
    ],
)
def test_the_first_broken_rule_wins(validate, inputs, parameters, message):
    assert error_of(validate, inputs, parameters) == message


def test_length_rules_come_before_streaming_rules(validate):
    message = error_of(validate, PROMPT, {"best_of": 2, "do_sample": True, "max_new_tokens": 64}, stream=True)
    assert message.startswith("`inputs` tokens + `max_new_tokens` must be <= 64.")


def test_max_new_tokens_defaults_to_the_rest_of_the_budget(validate, tiny_tokenizer):
    valid = validate(PROMPT, {})
    assert valid.input_length == count_tokens(tiny_tokenizer, PROMPT)
    assert valid.stopping.max_new_tokens == 64 - valid.input_length
    assert validate(PROMPT, {"max_new_tokens": 7}).stopping.max_new_tokens == 7


@pytest.mark.parametrize(
    ("parameters", "sampling"),
    [
        (None, True),  # TGI's quirk: no `parameters` object at all means sampling
        ({}, False),
        ({"do_sample": True}, True),
        ({"temperature": 1.0}, False),
        ({"temperature": 0.5}, True),
        ({"top_k": 5}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.9}, True),
        ({"repetition_penalty": 1.2}, False),
    ],
)
def test_sampling_switch(validate, parameters, sampling):
    assert validate(PROMPT, parameters).parameters.do_sample is sampling


def test_null_parameters_are_absent(validate):
    valid = validate(PROMPT, {"details": None, "temperature": None, "max_new_tokens": None})
    assert valid.parameters.temperature == 1.0 and not valid.parameters.do_sample


def test_parameter_values_and_defaults(validate):
    parameters = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "seed": 2**64 - 1, "stop": ["!"], "watermark": True}
    valid = validate(PROMPT, parameters | {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "top_n_tokens": 2})
    p = valid.parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p, p.seed) == (0.5, 3, 0.9, 1.0, 2**64 - 1)
    assert (p.repetition_penalty, p.frequency_penalty, p.watermark) == (1.1, 0.5, True)
    assert valid.stopping.stop_sequences == ("!",) and valid.top_n_tokens == 2
    defaults = validate(PROMPT, {}).parameters
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty) == (1.0, 0, 1.0, 1.0)


def test_absent_seed_is_random_uint64(validate):
    seeds = {validate(PROMPT, {"do_sample": True}).parameters.seed for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= s < 2**64 for s in seeds)


def test_truncate_keeps_the_last_tokens(validate, tiny_tokenizer):
    ids = tiny_tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    valid = validate(PROMPT, {"truncate": 3})
    assert valid.input_ids == tuple(ids[-3:])
    assert valid.inputs == tiny_tokenizer.decode(ids[-3:]) and PROMPT.endswith(valid.inputs)
    assert valid.truncate == 3
    assert valid.stopping.max_new_tokens == 64 - 3  # the budget counts the kept tokens


def test_truncate_longer_than_the_prompt_keeps_it(validate):
    valid = validate(PROMPT, {"truncate": 32})
    assert valid.inputs == PROMPT and valid.input_length < 32


def test_grammar(validate):
    schema = {"type": "object", "properties": {}}
    text = '{"type": "object", "properties": {}}'
    json_grammar = validate(PROMPT, {"grammar": {"type": "json", "value": schema}}).parameters
    assert (json_grammar.grammar_type, json_grammar.grammar) == (generate_pb2.GRAMMAR_TYPE_JSON, text)
    wrapped = validate(PROMPT, {"grammar": {"type": "json_schema", "value": {"name": "x", "schema": schema}}})
    assert wrapped.parameters.grammar == text
    regex = validate(PROMPT, {"grammar": {"type": "regex", "value": "[0-9]+"}}).parameters
    assert (regex.grammar_type, regex.grammar) == (generate_pb2.GRAMMAR_TYPE_REGEX, "[0-9]+")
    message = error_of(validate, PROMPT, {"grammar": {"type": "regex", "value": "a"}}, grammar_support=False)
    assert message == "grammar is not supported"
