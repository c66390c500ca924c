"""How a GGUF checkpoint is served by default: quantized, on the Kettle kernel nearest to each tensor's own type.

With no `--quantize` and no float `--dtype`, a GGUF model's projections load from the file's blocks:
- Q4_0, Q4_1, Q4_K → int4 with groups of 32 (`Q4Linear`), the file's own values (kettle/quantization/gguf_blocks.py;
  Q4_K in lanes with its own 6-bit scales);
- Q8_0 → int8 with a float16 scale per block of 32 (`Q8Linear`), the file's own values;
- Q6_K, Q5_K, Q5_0, Q5_1 and IQ4_XS → their own layouts in lanes (`Q6Linear`, `Q5Linear`, `IQ4Linear`), the file's
  values, packed from its blocks, where weights are held in lanes (as Q4_* and Q8_0): on any CPU the kernels run on
  (AVX-512 VNNI, or AVX2 with kettle/kernels/lanes_avx2.c's tiles);
- elsewhere (a shape the lanes do not fit) those → Q8_0's blocks of 32 in lanes
  (`Q8Linear.from_weight`), requantized from gguf's dequantization, where Q8_0 is held in lanes (its AVX2 tiles and
  integer panels); else int8 with one scale per output channel (`Int8Linear`), the nearest the rows layouts have;
- F32, F16, BF16 → dense, as any float checkpoint.
A fused projection (q/k/v, gate/up) whose parts mix types keeps each part's own type, the parts stacked along the
outputs (`StackedWeight`; Q4_K_M stores some layers' v in Q6_K beside a Q4_K q and k).
The LM head follows the same rule from its own tensor (the embedding's when tied), so a Q4 head stays exact. An
embedding table in Q8_0 or a 4-bit type stays in its blocks, tied or not, its rows dequantized as they are looked
up (`load_vocabulary`, `load_embedding`); one of the other quantized types is held in int8 per row, as the head
of that type is; a float table loads dense.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from kettle.kernels import ops
from kettle.quantization import iq4, q5, q6, q8
from kettle.quantization.gguf_blocks import GROUP, Int4Groups, int4_groups
from kettle.quantization.int4 import Int4Linear
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.iq4 import IQ4Linear
from kettle.quantization.kernel_weight import KernelWeight, StackedWeight
from kettle.quantization.q4 import CHUNK, SUPER_BLOCK, Q4Linear, lanes_fit
from kettle.quantization.q5 import Q5Linear
from kettle.quantization.q6 import Q6Linear
from kettle.quantization.q8 import Q8Linear
from kettle.quantization.qparams import QParams
from kettle.tensors.gguf_file import DENSE, EXACT_INT4, GgufTensors
from kettle.tensors.weights import Weights

logger = logging.getLogger(__name__)
FIVE_BITS = (T.Q5_K, T.Q5_0, T.Q5_1)  # `Q5Linear`'s, from the file's own bits where weights sit in lanes


@dataclass(frozen=True)
class GgufScheme:
    """Load-time quantization straight from GGUF blocks; `method` (int4 or int8) names the kernel most
    projections run on, `types` what the file stores (for /info and the start-up log)."""

    method: str
    types: str
    gguf: GgufTensors = field(repr=False, compare=False)
    head: str | None = None  # `finish`'s generic head quantization stays off: `load_head` reads the file's
    group_size: int = GROUP
    # Each GGUF type's tensors as they load: the kernels' weight types that serve them (`_record`)
    served: dict[str, set[str]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def description(self) -> str:
        """What the file stores and how each of its types is served, e.g. `gguf Q4_K → q4_lanes, Q6_K → q6_k_lanes`
        (`(requantized)`: another type's grid, the nearest the kernels read here), once the weights are loaded;
        before, the scheme."""
        if not self.served:
            return f"gguf {self.types} → {self.method}"
        order = self.types.split("+")
        served = sorted(self.served.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        return "gguf " + ", ".join(f"{qtype} → {' + '.join(sorted(kinds))}" for qtype, kinds in served)

    def _record(self, names: list[str], layer: nn.Module | None) -> nn.Module | None:
        """`layer`, noted as what serves the file's types of `names` (a stacked one's parts are noted as they load)."""
        if layer is not None and not isinstance(layer, StackedWeight):
            if isinstance(layer, Int8Linear):
                kind = "int8 per channel"
            elif isinstance(layer, KernelWeight):
                kind = ops.weight_type(layer.describe())
            else:
                kind = type(layer).__name__
            for name in names:
                qtype = self.gguf.qtype(name)
                requantized = isinstance(layer, Q8Linear) and qtype != T.Q8_0
                self.served.setdefault(qtype.name, set()).add(f"{kind} (requantized)" if requantized else kind)
        return layer

    def load_linear(self, weights: Weights, prefixes: list[str]) -> nn.Module | None:
        """The fused projections `prefixes` from the file's blocks; None leaves dense tensors to `Linear.load`."""
        bias = _fused_bias([weights.get_optional(f"{prefix}.bias") for prefix in prefixes])
        return self._load([f"{prefix}.weight" for prefix in prefixes], bias)

    def quantize_tensor(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """A projection a loader reshaped comes dequantized from the file; it stays dense (re-quantizing it to
        another grid would lose more than the file's own blocks)."""
        return None

    @property
    def tied_head(self) -> bool:
        """Whether the file keeps one table for the embedding and the LM head (no `output.weight`)."""
        return not self.gguf.has("lm_head.weight")

    def load_vocabulary(self, weights: Weights, embed: str, head: str) -> nn.Module | None:
        """A tied quantized table (`_table`) as the LM head, whose rows also serve the embedding (`embed`): no
        dense float32 copy of either is kept, or, for the exact types, made on the way (400 MB and 1 s of a 1.1B
        model's load). None where the file has its own head tensor (`load_embedding`) or the table is a float one:
        those load dense, and `load_head` replaces the head after."""
        return None if self.gguf.has(head) else self._table(embed)

    def load_embedding(self, weights: Weights, embed: str, head: str) -> nn.Module | None:
        """An untied quantized embedding table (the file has its own head tensor), kept quantized (`_table`): the
        model dequantizes the rows it looks up (`embed`), where a dense table holds 4 bytes a value (TinyLlama's
        Q4_K table: 250 MiB against 40). None for a tied table or a float one."""
        return self._table(embed) if self.gguf.has(head) else None

    def _table(self, name: str) -> nn.Module | None:
        return self._record([name], self._vocabulary(name))

    def _vocabulary(self, name: str) -> Q4Linear | Q8Linear | Q6Linear | Int8Linear | None:
        """A vocabulary table from its blocks where the kernels read its type exactly (Q8_0, Q4_0, Q4_1, Q4_K; Q6_K
        in lanes), or requantized as this scheme serves those types' projections (`_requantized`: a quarter of the
        float32 table, within those types' own rounding). None for a float table, which stays dense."""
        qtype = self.gguf.qtype(name)
        if not ops.available() or qtype in DENSE:
            return None
        if qtype == T.Q8_0 and q8.fits(*self.gguf.shape(name)):
            return Q8Linear.from_packed_blocks([self.gguf.blocks(name)])
        if qtype == T.Q8_0:
            return Q8Linear.from_blocks(self.gguf.blocks(name))
        if qtype in EXACT_INT4 and self._packs_q4([name]):
            return Q4Linear.from_blocks([self.gguf.blocks(name)])
        if qtype in EXACT_INT4:
            table = int4_linear(int4_groups(self.gguf.blocks(name)), None)
            return table if isinstance(table, Q4Linear) else None
        if qtype == T.Q6_K and q6.fits(*self.gguf.shape(name)):
            return Q6Linear.from_blocks([self.gguf.blocks(name)])
        if qtype in FIVE_BITS and self._fits_q5(name):
            return Q5Linear.from_blocks([self.gguf.blocks(name)])
        if qtype == T.IQ4_XS and iq4.fits(*self.gguf.shape(name)):
            return IQ4Linear.from_blocks([self.gguf.blocks(name)])
        return self._requantized([name], None)

    def load_head(self, head: nn.Module) -> nn.Module:
        """The LM head from its own tensor in the file (the embedding's when tied); `head` itself when dense."""
        name = "lm_head.weight" if self.gguf.has("lm_head.weight") else "model.embed_tokens.weight"
        bias = getattr(head, "bias", None)
        return self._load([name], None if bias is None else bias.data) or head

    def _load(self, names: list[str], bias: torch.Tensor | None) -> nn.Module | None:
        return self._record(names, self._layer(names, bias))

    def _layer(self, names: list[str], bias: torch.Tensor | None) -> nn.Module | None:
        qtypes = [self.gguf.qtype(name) for name in names]
        if all(qtype in DENSE for qtype in qtypes):
            return None
        if len(set(qtypes)) == 1 and qtypes[0] in EXACT_INT4 and self._packs_q4(names):
            return Q4Linear.from_blocks([self.gguf.blocks(name) for name in names], bias)
        if set(qtypes) == {T.Q8_0} and all(q8.fits(*self.gguf.shape(name)) for name in names):
            return Q8Linear.from_packed_blocks([self.gguf.blocks(name) for name in names], bias)
        if all(qtype in EXACT_INT4 for qtype in qtypes):
            layer = int4_linear(_concat([int4_groups(self.gguf.blocks(name)) for name in names]), bias)
            if layer is not None:
                return layer
        if all(qtype == T.Q8_0 for qtype in qtypes) and ops.available():  # the file's own grid, exactly
            return Q8Linear.concat([Q8Linear.from_blocks(self.gguf.blocks(name)) for name in names], bias)
        if all(qtype == T.Q6_K and q6.fits(*self.gguf.shape(name)) for qtype, name in zip(qtypes, names, strict=True)):
            return Q6Linear.from_blocks([self.gguf.blocks(name) for name in names], bias)
        if len(set(qtypes)) == 1 and qtypes[0] in FIVE_BITS and all(self._fits_q5(name) for name in names):
            return Q5Linear.from_blocks([self.gguf.blocks(name) for name in names], bias)
        if set(qtypes) == {T.IQ4_XS} and all(iq4.fits(*self.gguf.shape(name)) for name in names):
            return IQ4Linear.from_blocks([self.gguf.blocks(name) for name in names], bias)
        if len(set(qtypes)) > 1 and ops.available() and not set(DENSE).intersection(qtypes):
            return self._stacked(names, qtypes, bias)
        return self._requantized(names, bias)

    def _requantized(self, names: list[str], bias: torch.Tensor | None) -> Q8Linear | Int8Linear:
        """Tensors `names` (stacked along the outputs) of a type the kernels do not read here (a tensor whose shape the
        lanes do not fit, a mix with a float part), from gguf's dequantization: in Q8_0's blocks of 32 where Q8_0 is
        held in lanes, whose tiles and integer panels run on any CPU the kernels do (an AVX2 CPU's 1.7B Q6_K file,
        before Q6_K had AVX2 tiles, prefilled at 47 tok/s in int8 per channel, on the float32 panels), and which
        round each weight within its block's range rather than its channel's; else in int8 per channel."""
        parts = [self.gguf.dense(name) for name in names]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)  # a vocabulary table: no copy of 0.4 GB
        if q8.fits(*weight.shape):
            return Q8Linear.from_weight(weight, bias)
        return Int8Linear.from_weight(weight, bias)

    def _fits_q5(self, name: str) -> bool:
        return q5.fits(*self.gguf.shape(name), k_quant=self.gguf.qtype(name) == T.Q5_K)

    def _packs_q4(self, names: list[str]) -> bool:
        """Whether 4-bit tensors load into lanes packed by the kernels (each part's rows a multiple of 16, Q4_K's
        whole super-blocks, the others' whole chunks of 64: `Q4Linear.from_blocks`); else through `int4_groups`."""
        width = SUPER_BLOCK if self.gguf.qtype(names[0]) == T.Q4_K else CHUNK
        shapes = [self.gguf.shape(name) for name in names]
        return ops.available() and all(lanes_fit(rows, GROUP) and cols % width == 0 for rows, cols in shapes)

    def _stacked(self, names: list[str], qtypes: list[T], bias: torch.Tensor | None) -> KernelWeight:
        """A fused projection whose parts the file stores in different types (Q4_K_M's Q6_K v beside a Q4_K q and
        k): each run of parts of one type loads as that type loads alone, and the runs stack along the outputs, so
        every part keeps the file's values (int8 per channel for all of them, before, requantized the q and k)."""
        parts, at = [], 0
        for _, run in itertools.groupby(zip(names, qtypes, strict=True), key=lambda pair: pair[1]):
            run_names = [name for name, _ in run]
            rows = sum(self.gguf.shape(name)[0] for name in run_names)
            parts.append(self._load(run_names, None if bias is None else bias[at : at + rows]))
            at += rows
        if not all(isinstance(part, KernelWeight) for part in parts):  # PyTorch's int4 for some part: one int8
            return self._requantized(names, bias)
        return StackedWeight(parts)


def gguf_scheme(gguf: GgufTensors) -> GgufScheme | None:
    """The default scheme for a GGUF file: int4 when most of its 2-D weights are 4-bit types, int8 when they
    are other quantized types, None (dense) when they are floats."""
    counts = Counter(gguf.qtypes)
    quantized = {qtype: n for qtype, n in counts.items() if qtype not in DENSE}
    if not quantized:
        return None
    int4 = sum(n for qtype, n in quantized.items() if qtype in EXACT_INT4)
    method = "int4" if int4 * 2 >= sum(quantized.values()) else "int8"
    types = "+".join(qtype.name for qtype, _ in Counter(quantized).most_common())
    scheme = GgufScheme(method, types, gguf)
    # Only what the file stores: how each type is served is known once the weights load (loading.py `finish` logs
    # it, e.g. `gguf Q4_K → q4_lanes, Q6_K → q6_k_lanes`), and a guess here would read as a requantization.
    logger.info("Serving the file's own quantization, gguf %s (--dtype float32 dequantizes)", types)
    return scheme


def int4_linear(groups: Int4Groups, bias: torch.Tensor | None) -> nn.Module | None:
    """Kettle's int4 kernel layout when the shape fits it, else PyTorch's packed int4, else None."""
    n = groups.values.shape[0]
    if ops.available() and groups.packed and groups.q4k is not None:
        return Q4Linear(groups.values, groups.q4k[0], groups.q4k[1], GROUP, bias, groups.q4k[2])
    if ops.available() and groups.packed:
        return Q4Linear.from_groups(groups.values, groups.scales, groups.mins, GROUP, bias)
    if n % 16 == 0:
        scale = groups.scales.t().contiguous()
        zero = (groups.mins + 8 * groups.scales).t().contiguous()
        qparams = QParams(groups.q.to(torch.int32), scale, zero, GROUP)
        return Int4Linear.from_qparams(qparams.q, qparams.scale, qparams.zero, GROUP, bias)
    return None


def _concat(parts: list[Int4Groups]) -> Int4Groups:
    tensors = (torch.cat([getattr(p, key) for p in parts]) for key in ("values", "scales", "mins"))
    q4k = None  # Q4_K's own scales only where every part has them (a Q4_K q with a Q4_0 k takes the products)
    if all(p.q4k is not None for p in parts):
        q4k = tuple(torch.cat([p.q4k[i] for p in parts]) for i in range(3))
    return Int4Groups(*tensors, parts[0].packed, q4k)  # the parts of a fused projection share their input width


def _fused_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(bias is None for bias in biases):
        return None
    if any(bias is None for bias in biases):
        raise ValueError("quantized fused projections with a bias on only some of them are not supported")
    return torch.cat(biases).float()
