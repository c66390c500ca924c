"""The per-step token choice of a batch: processors (logits_process), then argmax or seeded sampling per row.

`BatchSampler` is built once per batch composition (the shard rebuilds it when requests join or leave), so
every per-row parameter tensor is made once, not per step. A step is a handful of batched tensor ops with no
host transfer (except watermarked rows, which need their previous token on the host to seed the green list).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kettle.kernels import ops
from kettle.proto import generate_pb2
from kettle.shard.logits_process import (
    NEG_INF,
    FrequencyPenalty,
    PresencePenalty,
    RepetitionPenalty,
    Rows,
    StepInputs,
    Temperature,
    TopK,
    TopP,
    TypicalP,
    Watermark,
)

# top_tokens looks this many ranks past the widest request for values tied with its n-th one; ties beyond that
# are cut so a flat distribution cannot turn one step's answer into the whole vocabulary.
TIE_SLACK = 16


@dataclass(frozen=True)
class SamplingParams:
    """One request's token-choice parameters, with "unset" already resolved to the neutral value."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    presence_penalty: float = 0.0

    @classmethod
    def from_proto(cls, p: generate_pb2.NextTokenChooserParameters) -> SamplingParams:
        """Reads the proto, where a zero float means "unset" (proto3 has no presence for scalars)."""
        return cls(
            temperature=p.temperature or 1.0,
            top_k=p.top_k,
            top_p=p.top_p or 1.0,
            typical_p=p.typical_p or 1.0,
            do_sample=p.do_sample,
            seed=p.seed,
            repetition_penalty=p.repetition_penalty or 1.0,
            frequency_penalty=p.frequency_penalty,
            watermark=p.watermark,
            presence_penalty=p.presence_penalty,
        )

    @property
    def sampling(self) -> bool:
        """Whether the row samples: asked for, or implied by any warper (docs/api.md, Generate parameters)."""
        warped = self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0
        return self.do_sample or warped


@dataclass
class SampleOutput:
    """One step's choice for every row of the batch."""

    next_ids: Tensor  # [B] long
    chosen_logprobs: Tensor  # [B] float32: logprobs at next_ids
    scores: Tensor  # [B, V] float32: the processed scores
    _logprobs: Tensor | None = None

    @property
    def logprobs(self) -> Tensor:
        """[B, V] float32: the log-softmax of the scores, computed on first use (only top tokens need it)."""
        if self._logprobs is None:
            self._logprobs = torch.log_softmax(self.scores, dim=-1)
        return self._logprobs


class BatchSampler:
    """Processes a batch's logits and chooses one token per row.

    `prompt_lens` (per row) is needed only when a row has a presence penalty, which counts generated tokens only.

    Greedy rows take the argmax; sampling rows draw from the softmax of their processed scores with their own
    generator (seeded with the request's seed and kept across steps by the caller), by inverse-CDF with one
    uniform per row: a row's draw depends only on its own scores and generator, never on its batch mates.
    `logits` may be modified in place.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        vocab_size: int,
        device: torch.device | str,
        watermark_gamma: float = 0.5,
        watermark_delta: float = 2.0,
        prompt_lens: Sequence[int] | None = None,
    ) -> None:
        if len(generators) != len(params):
            raise ValueError(f"{len(params)} requests but {len(generators)} generators")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.needs_history = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        )
        watermark = Watermark.build([p.watermark for p in params], vocab_size, device, watermark_gamma, watermark_delta)
        # The grammar mask goes between these two groups.
        self._before_mask = _present(
            watermark,
            RepetitionPenalty.build([p.repetition_penalty for p in params], device),
            FrequencyPenalty.build([p.frequency_penalty for p in params], device),
            PresencePenalty.build([p.presence_penalty for p in params], device, prompt_lens),
        )
        self._after_mask = _present(
            Temperature.build([p.temperature for p in params], device),
            TopK.build([p.top_k for p in params], device),
            TopP.build([p.top_p for p in params], device),
            TypicalP.build([p.typical_p for p in params], device),
        )
        sampling = [p.sampling for p in params]
        self._sample_rows = Rows(sampling, device)
        self._generators = [g for g, on in zip(generators, sampling, strict=True) if on]

    def __call__(
        self,
        logits: Tensor,
        history: Tensor | None,
        history_lens: Tensor | None,
        last_token_ids: Tensor,
        token_mask: Tensor | None = None,
    ) -> SampleOutput:
        """One step. `history` ([B, L] prompt + output ids, -1 padded) and `history_lens` are needed only when
        `needs_history`; `token_mask` ([B, V] bool, True = allowed) is the optional grammar mask."""
        if self.needs_history and (history is None or history_lens is None):
            raise ValueError("this batch has repetition or frequency penalties: pass the token history")
        scores = self._process(logits, StepInputs(last_token_ids, history, history_lens), token_mask)
        if self._sample_rows.count == 0:
            return SampleOutput(*greedy_choice(scores), scores)
        logprobs = torch.log_softmax(scores, dim=-1)
        next_ids = self._choose(scores, logprobs)
        chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        return SampleOutput(next_ids, chosen, scores, logprobs)

    def scores(self, logits: Tensor) -> Tensor:
        """The processed scores alone, for rows whose processors read no history, previous token or mask
        (speculative verification chooses the tokens itself)."""
        if self.needs_history:
            raise ValueError("scores() is for batches without penalties")
        unused = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # no processor reads it
        return self._process(logits, StepInputs(unused), None)

    def _process(self, logits: Tensor, step: StepInputs, token_mask: Tensor | None) -> Tensor:
        # Columns past the tokenizer's vocabulary (a padded lm_head) are never candidates.
        scores = logits[:, : self.vocab_size].float()
        for processor in self._before_mask:
            scores = processor(scores, step)
        if token_mask is not None:
            scores = scores.masked_fill_(~token_mask[:, : self.vocab_size], NEG_INF)
        for processor in self._after_mask:
            scores = processor(scores, step)
        if self._before_mask or self._after_mask:
            # A tiny temperature or penalty can overflow a score to +inf, and log_softmax then makes the row NaN
            # (inf - inf): capped, the row keeps its most likely tokens and one request cannot fail the batch.
            scores = scores.clamp_(max=_FLOAT32_MAX)
        return scores

    def _choose(self, scores: Tensor, logprobs: Tensor) -> Tensor:
        next_ids = scores.argmax(dim=-1)
        if self._sample_rows.count == 0:
            return next_ids
        index = self._sample_rows.index
        rows_logprobs = logprobs if index is None else logprobs.index_select(0, index)
        drawn = inverse_cdf(rows_logprobs.exp(), self._uniforms())
        return drawn if index is None else next_ids.index_copy_(0, index, drawn)

    def _uniforms(self) -> Tensor:
        """One U[0, 1) draw per sampling row, each from that row's own generator."""
        draws = [torch.rand((), generator=g, device=g.device, dtype=torch.float64) for g in self._generators]
        return torch.stack([d.to(self.device, non_blocking=True) for d in draws])


Processor = Callable[[Tensor, StepInputs], Tensor]
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _present(*processors: Processor | None) -> list[Processor]:
    return [p for p in processors if p is not None]


def greedy_choice(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's argmax [B] and its logprob [B]: on the CPU in one kernel pass with no [B, V] log-softmax (ops.greedy:
    3x faster on a 49,152-token vocabulary), elsewhere through PyTorch's log-softmax."""
    if ops.greedy_fits(scores):
        return ops.greedy(scores)
    next_ids = scores.argmax(dim=-1)
    return next_ids, torch.log_softmax(scores, dim=-1).gather(1, next_ids.unsqueeze(1)).squeeze(1)


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the first token whose cumulative probability exceeds u × total (float64 for long vocabularies)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the pick is a token with non-zero probability even after rounding.
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def top_tokens(logprobs: Tensor, n: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Per row, its n most likely (id, logprob) pairs, best first, plus the tokens tied with the n-th value
    (up to TIE_SLACK extra); n = 0 gives empty lists and -inf entries are never listed.

    One topk over the widest request and one host transfer for the whole batch."""
    table = top_token_table(logprobs, n)
    return top_tokens_from_rows([] if table is None else table.tolist(), n)


def top_token_table(logprobs: Tensor, n: Sequence[int]) -> Tensor | None:
    """The device half of `top_tokens`: [B, 2k] float64, each row's k best logprobs then their ids (float64
    holds both exactly, so one transfer carries both, and it can share the step's one transfer); None when no
    row asks."""
    widest = min(max(n, default=0), logprobs.shape[-1])
    if widest == 0:
        return None
    k = min(widest + TIE_SLACK, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1)
    return torch.cat([values.double(), ids.double()], dim=1)


def top_tokens_from_rows(rows: list[list[float]], n: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """The host half of `top_tokens`, from the rows of `top_token_table` (an empty list when it was None)."""
    if not rows:
        return [([], []) for _ in n]
    k = len(rows[0]) // 2
    return [_row_top(row[:k], row[k:], count) for row, count in zip(rows, n, strict=True)]


def _row_top(values: list[float], ids: list[float], n: int) -> tuple[list[int], list[float]]:
    if n == 0:
        return [], []
    nth = values[min(n, len(values)) - 1]
    keep = [j for j, v in enumerate(values) if v >= nth and v != -math.inf]
    return [int(ids[j]) for j in keep], [values[j] for j in keep]
