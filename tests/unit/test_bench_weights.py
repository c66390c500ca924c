"""The weight bytes `kettle benchmark` divides by step time: the served width, quantized or not."""

from __future__ import annotations

from kettle.bench.benchmark import parameter_count, weight_bytes
from tests.fixtures import make_tiny_llama


def test_quantized_weights_count_at_their_width(tmp_path):
    path = make_tiny_llama(tmp_path, intermediate_size=256)
    fp32, int8, int4 = (weight_bytes(path, "float32", q) for q in (None, "int8", "int4"))
    assert fp32 == parameter_count(path) * 4
    assert int4 < int8 < fp32 / 3  # projections at 1 and ~0.56 bytes; norms stay float32
