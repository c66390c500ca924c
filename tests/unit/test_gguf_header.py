"""Kettle's one-pass GGUF header reader against gguf's own `GGUFReader`."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants

from kettle.hub.gguf_header import read_header


def test_header_matches_gguf_reader(tmp_path):
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(3)
    writer.add_token_list(["a", "bb", "ccc"] * 50)  # string arrays are stepped over
    writer.add_token_scores([0.5] * 150)
    writer.add_tensor("one", np.arange(8, dtype=np.float32))
    weight = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("two", quants.quantize(weight, T.Q4_1), raw_dtype=T.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header, reference = read_header(path), GGUFReader(path)
    assert header.fields["general.architecture"] == "llama"
    assert header.fields["llama.block_count"] == 3
    assert header.fields["tokenizer.ggml.tokens"] is None
    for mine, theirs in zip(header.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.dims, mine.qtype, mine.offset) == (
            theirs.name, tuple(int(d) for d in theirs.shape), int(theirs.tensor_type), theirs.data_offset
        )  # fmt: skip


def _write(path, blocks: int) -> None:
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    writer.add_tensor("one", np.arange(8 * blocks, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_header_is_parsed_once_while_its_file_is_unchanged(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path, 2)
    first = read_header(path)
    assert read_header(path) is first
    _write(path, 3)  # rewritten: another size
    again = read_header(path)
    assert again is not first and again.fields["llama.block_count"] == 3 and again.tensors[0].dims == (24,)
