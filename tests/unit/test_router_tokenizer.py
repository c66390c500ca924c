"""The router's tokenizer: a folder's tokenizer.json read with the `tokenizers` library (no transformers, no
torch in the router), giving the ids, offsets and decodes transformers' tokenizer gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kettle.router.tokenizer import RustTokenizer, _encode, _tokenize, load_tokenizer
from tests.fixtures import make_tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris. 你好，世界 🙂",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and\ttabs\n\nnewlines ",
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_offsets_and_decodes_equal_transformers(folder, add_special_tokens):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, RustTokenizer)
    for text in TEXTS:
        assert _encode(ours, text, None, add_special_tokens) == _encode(theirs, text, None, add_special_tokens)
        assert _encode(ours, text, 3, add_special_tokens) == _encode(theirs, text, 3, add_special_tokens)
        assert _tokenize(ours, text, add_special_tokens) == _tokenize(theirs, text, add_special_tokens)


def test_a_config_asking_for_a_bos_the_file_does_not_add_takes_transformers(folder, tmp_path):
    """transformers rebuilds the post-processor from `add_bos_token`; the router must not skip that."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (folder / name).exists():
            (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text()) | {"add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not isinstance(load_tokenizer(str(tmp_path)), RustTokenizer)


def test_the_router_imports_neither_torch_nor_transformers_to_tokenize(folder):
    code = (
        "import sys; from kettle.router.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(folder)!r})('hi'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
