"""GGUF's 4-bit blocks decoded into `Q4Linear`'s layout (kettle/quantization/gguf_blocks.py)."""

from __future__ import annotations

import numpy as np
import torch

from kettle.quantization.gguf_blocks import _nibbles
from kettle.quantization.q4 import pack_q4


def test_gguf_4_bit_nibbles_repack_straight_into_q4linear_chunks():
    """Q4_0/Q4_1 nibbles go into `Q4Linear`'s chunks byte by byte: the same as unpacking them one value a byte
    and packing those with `pack_q4`, without the one-a-byte copy (4 rows of 8 blocks of random bytes)."""
    qs = np.random.default_rng(0).integers(0, 256, (4 * 8, 16), dtype=np.uint8)
    one_a_byte = torch.from_numpy(_nibbles(qs, packed=False)).view(4, 8 * 32)
    assert torch.equal(torch.from_numpy(_nibbles(qs, packed=True)).view(4, 8 * 16), pack_q4(one_a_byte))
