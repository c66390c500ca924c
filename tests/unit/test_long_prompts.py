"""Long prompts in validation: refused by their length before the tokenizer runs when no tokenizing could bring
them within the limits ("at least" in TGI's messages), counted exactly otherwise, and cut from their tail under
`truncate`."""

from __future__ import annotations

import asyncio

import pytest

from kettle.router.schemas import GenerateRequest
from kettle.router.tokenizer import LONG_TEXT_CHARS, TokenizerPool, load_tokenizer
from kettle.router.validation import Validation, ValidationError, ValidationLimits
from tests.fixtures import make_tokenizer

LIMITS = ValidationLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=4095, max_total_tokens=4096
)
WORDS = "the kettle boils water for tea in a small kitchen at dawn "


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def pool(folder):
    pool = TokenizerPool.from_path(str(folder), workers=1)
    asyncio.run(pool.warm())  # the bound is read from the first tokenizer a worker loads
    yield pool
    pool.close()


def validate(pool: TokenizerPool, inputs: str, **parameters):
    request = GenerateRequest.model_validate({"inputs": inputs, "parameters": parameters})
    return asyncio.run(Validation(LIMITS, pool).validate(request))


def error_of(pool: TokenizerPool, inputs: str, **parameters) -> str:
    with pytest.raises(ValidationError) as caught:
        validate(pool, inputs, **parameters)
    return str(caught.value)


def test_a_prompt_over_the_limits_by_its_length_is_refused_with_its_fewest_tokens(pool):
    per_token = pool.bound.chars_per_token
    assert per_token is not None
    prompt = (WORDS * (2_000_000 // len(WORDS)))[:1_900_000]
    fewest = -(-len(prompt) // per_token)
    assert fewest > LIMITS.max_total_tokens
    assert error_of(pool, prompt, max_new_tokens=10) == (
        f"`inputs` tokens + `max_new_tokens` must be <= 4096. Given: at least {fewest} `inputs` tokens "
        "and 10 `max_new_tokens`"
    )
    assert error_of(pool, prompt) == (
        f"`inputs` tokens + `max_new_tokens` must be <= 4096. Given: at least {fewest} `inputs` tokens "
        "and 0 `max_new_tokens`"
    )
    # Over max_input_tokens by its length, yet not over the total: the other rule, with the same honesty.
    just_over = "x" * (per_token * 4095 + 1)
    assert len(just_over) > LONG_TEXT_CHARS
    assert error_of(pool, just_over) == "`inputs` must have less than 4095 tokens. Given: at least 4096"


def test_a_long_prompt_within_the_bound_gets_its_exact_count(pool, folder):
    prompt = WORDS * (LONG_TEXT_CHARS // len(WORDS) + 1)
    count = len(load_tokenizer(str(folder))(prompt)["input_ids"])
    assert count > LIMITS.max_input_tokens and pool.bound.fewest_tokens(prompt) <= LIMITS.max_input_tokens
    assert error_of(pool, prompt, max_new_tokens=1) == (
        f"`inputs` tokens + `max_new_tokens` must be <= 4096. Given: {count} `inputs` tokens and 1 `max_new_tokens`"
    )


def test_a_long_prompt_under_truncate_keeps_its_last_tokens(pool, folder):
    prompt = WORDS * (4 * LONG_TEXT_CHARS // len(WORDS))
    valid = validate(pool, prompt, truncate=50, max_new_tokens=5)
    ids = load_tokenizer(str(folder))(prompt)["input_ids"]
    assert valid.input_ids == tuple(ids[-50:])
    assert prompt.endswith(valid.inputs)
