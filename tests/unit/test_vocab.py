"""The shard's tokenizer without transformers (`FileTokenizer`): it loads only folders transformers would load
unchanged from tokenizer.json, and there answers every question the shard asks exactly as transformers does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from kettle.grammar import GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX
from kettle.proto import generate_pb2 as pb
from kettle.shard.detokenize import IncrementalDetokenizer, special_token_ids
from kettle.shard.grammar import Grammars, advance
from kettle.shard.vocab import FileTokenizer, Vocab, load_file_tokenizer, load_tokenizer
from tests.fixtures import make_tokenizer
from tests.unit.test_detokenize import PROMPT, TEXTS, sentencepiece_tokenizer  # noqa: F401


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def folder(request, tmp_path_factory):
    """Saved tokenizer folders: the tiny byte-level BPE, and the Llama-style one (Metaspace, byte fallback)."""
    path = tmp_path_factory.mktemp("tokenizer")
    if request.param == "byte-level":
        make_tokenizer(path)
    else:
        request.getfixturevalue("sentencepiece_tokenizer").save_pretrained(path)
    return path


def edited(folder, tmp_path, **changes):
    """A copy of `folder` with `changes` made to tokenizer_config.json (None deletes a key)."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


def test_a_plain_folder_loads_without_transformers_and_answers_like_it(folder):
    tokenizer, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(tokenizer, FileTokenizer)
    assert tokenizer.eos_token_id == reference.eos_token_id
    assert tokenizer.all_special_ids == reference.all_special_ids
    assert special_token_ids(tokenizer) == special_token_ids(reference)
    assert len(tokenizer) == len(reference)
    assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    ids = list(range(len(reference)))
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


@pytest.mark.parametrize("language", TEXTS)
def test_streams_and_final_text_equal_transformers(folder, language):
    tokenizer, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    prompt = reference.encode(PROMPT, add_special_tokens=False)
    generated = [*reference.encode(TEXTS[language], add_special_tokens=False), reference.eos_token_id]
    ours, theirs = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(reference, prompt)
    assert [ours.step(t) for t in generated] == [theirs.step(t) for t in generated]
    for skip in (False, True):
        assert ours.text(skip_special_tokens=skip) == theirs.text(skip_special_tokens=skip)


def test_vocab_loads_the_file_tokenizer_with_the_same_eos_ids(folder):
    vocab = Vocab.load(str(folder))
    reference = Vocab(AutoTokenizer.from_pretrained(folder), vocab.eos_token_ids)
    assert isinstance(vocab.tokenizer, FileTokenizer)
    assert vocab.eos_token_ids == {reference.tokenizer.eos_token_id}
    assert vocab.special_ids == reference.special_ids
    assert [vocab.token_text(i) for i in range(len(reference.tokenizer))] == [
        reference.token_text(i) for i in range(len(reference.tokenizer))
    ]


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer_class": "GPT2Tokenizer"},  # a class that rebuilds the Rust tokenizer
        {"mask_token": "<mask>"},  # a special token the file lacks: transformers adds it
        {"eos_token": "ĠParis"},  # a plain vocabulary token named special: transformers makes it an added token
        {"image_token": "<|im_end|>"},  # a model-specific special token
        {"extra_special_tokens": ["<new>"]},
        {"add_bos_token": True},  # transformers rebuilds the post-processor
        {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
        {"added_tokens_decoder": {"0": {"content": "<other>", "special": True}}},
    ],
)
def test_anything_transformers_would_change_goes_through_transformers(folder, tmp_path, changes):
    path = edited(folder, tmp_path, **changes)
    assert load_file_tokenizer(path) is None


def test_legacy_special_tokens_file_goes_through_transformers(folder, tmp_path):
    path = edited(folder, tmp_path)
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_file_tokenizer(path) is None
    assert load_tokenizer(str(path)).eos_token_id == AutoTokenizer.from_pretrained(path).eos_token_id


def test_the_config_s_own_added_tokens_may_repeat_the_file(folder, tmp_path):
    first = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][0]
    added = {str(first["id"]): {"content": first["content"], "special": True, "lstrip": False, "rstrip": False}}
    assert isinstance(load_file_tokenizer(edited(folder, tmp_path, added_tokens_decoder=added)), FileTokenizer)


def test_grammar_masks_equal_those_over_the_transformers_tokenizer(folder):
    tokenizer, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    eos = frozenset({reference.eos_token_id})
    ours, theirs = Grammars(tokenizer, eos), Grammars(reference, eos)
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    for kind, text, answer in [(GRAMMAR_TYPE_JSON, schema, '{"city": "Paris"}'), (GRAMMAR_TYPE_REGEX, r"\d{3}", "123")]:
        parameters = pb.NextTokenChooserParameters(grammar=text, grammar_type=kind)
        a, b = ours.matcher(parameters), theirs.matcher(parameters)
        for token in reference.encode(answer, add_special_tokens=False):
            cpu = torch.device("cpu")
            assert torch.equal(ours.mask([a, None], 520, cpu), theirs.mask([b, None], 520, cpu))
            assert advance(a, token) == advance(b, token)
