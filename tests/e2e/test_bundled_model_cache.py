"""The bundled model's one-time GGUF preparation, into the real Kettle cache.

This deliberately uses the default `KETTLE_CACHE` (not a temporary one): the first run writes the config and
tokenizer (the weights stay in the GGUF) and leaves the folder that the bundled end-to-end tests and
`make serve` reuse.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kettle.hub import BUNDLED_MODEL_ID, resolve_model
from kettle.hub.gguf import GGUF_LINK


@pytest.fixture(scope="module")
def bundled():
    return resolve_model()


def test_the_bundled_model_resolves_to_a_complete_folder(bundled):
    assert bundled.display_id == BUNDLED_MODEL_ID
    names = {path.name for path in bundled.path.iterdir()}
    expected = {"config.json", "generation_config.json", "model.gguf", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= names
    assert not any(name.startswith(".tmp") for name in names)


def test_no_float_weight_copy_is_written(bundled):
    from kettle.hub.resolve import bundled_gguf

    written = sum(path.stat().st_size for path in bundled.path.iterdir() if not path.is_symlink())
    assert written <= 5 * 2**20  # config and tokenizer only: the weights are read from the GGUF itself
    assert (bundled.path / "model.gguf").resolve() == bundled_gguf().resolve()


def test_the_folder_records_the_file_it_was_prepared_from(bundled):
    """So that a later preparation can remove it once that file is gone (a deleted virtual environment)."""
    from kettle.hub.cache import SOURCES_FILE
    from kettle.hub.resolve import bundled_gguf

    assert json.loads((bundled.path / SOURCES_FILE).read_text()) == [str(bundled_gguf().resolve())]


def test_the_metadata_parse_over_a_plain_array_reads_what_gguf_s_own_reader_reads():
    """The preparation hands gguf's reader an ndarray view of the mapping instead of an np.memmap, and cuts its
    arrays into items in one pass (together 4x faster on the bundled file's vocabulary, token types and merges);
    transformers' parse of the file must come out the same."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kettle.hub.gguf import _plain_arrays
    from kettle.hub.resolve import bundled_gguf

    path = str(bundled_gguf())
    with _plain_arrays():
        fast = load_gguf_checkpoint(path, return_tensors=False)
    assert fast == load_gguf_checkpoint(path, return_tensors=False)
    assert len(fast["tokenizer"]["tokens"]) == 49152 and len(fast["tokenizer"]["merges"]) > 40000


def test_chat_template_and_special_tokens_survive(bundled):
    tokenizer_config = json.loads((bundled.path / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert tokenizer_config["model_max_length"] == 8192
    assert (bundled.path / "chat_template.jinja").exists()
    vocab = json.loads((bundled.path / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    config = json.loads((bundled.path / "config.json").read_text())
    generation = json.loads((bundled.path / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == ids["<|im_end|>"]
    assert config["bos_token_id"] == ids["<|im_start|>"]
    assert "quantization_config" not in config


def test_a_second_resolution_reuses_the_cache(bundled):
    started = time.monotonic()
    again = resolve_model()
    assert again == bundled
    assert time.monotonic() - started < 2.0


def test_the_float32_conversion_for_transformers_answers_sensibly(bundled):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled.path)
    from kettle.hub.resolve import float_folder

    # The float32 conversion benchmarks hand to transformers (and CTranslate2), built once beside the GGUF folder.
    model = AutoModelForCausalLM.from_pretrained(float_folder(bundled.path), dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_the_router_reads_the_bundled_tokenizer_without_transformers(bundled):
    """The bundled tokenizer.json is read with `tokenizers` directly and tokenizes as transformers does."""
    from transformers import AutoTokenizer

    from kettle.router.tokenizer import RustTokenizer, _encode, _tokenize, load_tokenizer

    ours, theirs = load_tokenizer(str(bundled.path)), AutoTokenizer.from_pretrained(bundled.path)
    assert isinstance(ours, RustTokenizer)
    for text in ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", "naïve café 東京 🙂  x"]:
        assert _encode(ours, text, None, True) == _encode(theirs, text, None, True)
        assert _tokenize(ours, text, False) == _tokenize(theirs, text, False)


def test_the_preparation_process_writes_the_same_folder_without_the_distributed_imports(bundled, tmp_path):
    """The preparation's own process (`preparation_process.set_up`: no cyclic collection, torch.distributed reported
    unavailable from transformers' first import on) writes the folder this process wrote, byte for byte, and
    transformers leaves torch's distributed tensor stack (and sympy) out of its imports there."""
    from kettle.hub.resolve import bundled_gguf

    code = (
        "import gc, sys\n"
        "from pathlib import Path\n"
        "from kettle.hub import preparation_process\n"
        "preparation_process.set_up()\n"
        "from kettle.hub.gguf import prepare_gguf\n"
        f"prepare_gguf(Path({str(bundled_gguf())!r}), Path({str(tmp_path)!r}))\n"
        "assert 'transformers' in sys.modules and not gc.isenabled()\n"
        "assert 'torch.distributed.tensor' not in sys.modules and 'sympy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    written = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= written
    for name in written - {GGUF_LINK}:
        assert (tmp_path / name).read_bytes() == (bundled.path / name).read_bytes(), name


def test_a_later_start_s_look_up_in_the_preparation_process_imports_neither_torch_nor_transformers(bundled):
    """`set_up` only arms a hook: a look-up that finds the folder prepared (a later start) stays a light Python."""
    code = (
        "import sys\n"
        "from kettle.hub import preparation_process, resolve_model\n"
        "preparation_process.set_up()\n"
        f"assert str(resolve_model().path) == {str(bundled.path)!r}\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
