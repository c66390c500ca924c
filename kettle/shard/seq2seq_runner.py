"""Steps of an encoder-decoder model: the encoder once per prompt, then one decoder token per step.

New prompts of a step are encoded together (right-padded, masked: the encoder is bidirectional, so padding at
the end is exact). Decoders run in groups of requests at the same decoder length, so their self-attention
caches stack with no padding at all and no model's position scheme can be confused by it; only the encoder
side (cross-attention K/V and its mask) is padded. Requests that arrive together stay in one group for their
whole life; a request joining mid-batch runs in its own group until its neighbours finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import RequestState
from kettle.shard.detokenize import IncrementalDetokenizer
from kettle.shard.transformers_runner import StepLogits, TransformersRunner

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Seq:
    """One request's encoder output [1, S, d] and decoder caches (self: T tokens, cross: S tokens)."""

    encoded: torch.Tensor
    length: int = 0  # decoder tokens in the self-attention cache
    self_layers: Layers = field(default_factory=list)
    cross_layers: Layers = field(default_factory=list)


class Seq2SeqRunner(TransformersRunner):
    """Runs steps of a `TransformersSeq2SeqLM`."""

    def __init__(self, model, vocab, device: torch.device, watermark: tuple[float, float]) -> None:
        super().__init__(model, vocab, device, watermark)
        self._seqs: dict[int, _Seq] = {}

    def _drop(self, request_ids: set[int] | None) -> None:
        if request_ids is None:
            self._seqs.clear()
        for request_id in request_ids or ():
            self._seqs.pop(request_id, None)

    def _logits(self, requests: list[RequestState], ends: list[int]) -> StepLogits:
        # A prompt chunk that does not complete the prompt waits: the encoder needs the whole prompt.
        ready = [r for r, end in zip(requests, ends, strict=True) if end >= r.prompt_len]
        self._encode([r for r in ready if r.id not in self._seqs])
        result = StepLogits({}, {})
        ready.sort(key=lambda r: self._seqs[r.id].length)
        for _length, group in groupby(ready, key=lambda r: self._seqs[r.id].length):
            members = list(group)
            for request, row in zip(members, self._decode(members), strict=True):
                result.last[request.id] = row
        for request in ready:
            if request.prefill_logprobs and self._seqs[request.id].length == 1:
                result.prefill[request.id] = self._start_tokens()
        return result

    def _encode(self, requests: list[RequestState]) -> None:
        """Encodes new prompts in one padded forward; their decoders start from the start token."""
        if not requests:
            return
        prompts = [r.all_ids[: r.prompt_len] for r in requests]
        input_ids, mask = self._right_padded(prompts, self.model.pad_token_id)
        encoded = self.model.encode(input_ids, mask)
        start = self.model.decoder_start_token_id
        for row, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
            self._seqs[request.id] = _Seq(encoded[row : row + 1, : len(prompt)])
            # The text is the decoder's alone: detokenize in the context of the start token, not the prompt.
            request.detokenizer = IncrementalDetokenizer(self.vocab.tokenizer, [start])

    def _decode(self, requests: list[RequestState]) -> list[torch.Tensor]:
        """One decoder token for requests at the same decoder length; returns each one's logits [vocab]."""
        from transformers.modeling_outputs import BaseModelOutput

        seqs = [self._seqs[r.id] for r in requests]
        lengths = [s.encoded.shape[1] for s in seqs]
        width = max(lengths)
        encoded = seqs[0].encoded.new_zeros((len(seqs), width, seqs[0].encoded.shape[2]))
        for row, seq in enumerate(seqs):
            encoded[row, : seq.encoded.shape[1]] = seq.encoded[0]
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.long, device=self.device)
        last = [
            self.model.decoder_start_token_id if s.length == 0 else r.all_ids[-1]
            for r, s in zip(requests, seqs, strict=True)
        ]
        out = self.model.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
            attention_mask=mask,
            decoder_input_ids=torch.tensor([[t] for t in last], device=self.device),
            past_key_values=self._stacked_cache(seqs, width),
            use_cache=True,
        )
        self._split(seqs, lengths, out.past_key_values)
        return list(out.logits[:, -1])

    def _stacked_cache(self, seqs: list[_Seq], width: int):
        """The group's caches as one EncoderDecoderCache (None on the first decoder step: transformers builds
        it, computing the cross-attention K/V from the encoder output)."""
        from transformers import DynamicCache, EncoderDecoderCache

        if seqs[0].length == 0:
            return None
        self_layers = [_stack([s.self_layers[i] for s in seqs]) for i in range(len(seqs[0].self_layers))]
        cross_layers = [_stack([s.cross_layers[i] for s in seqs], width) for i in range(len(seqs[0].cross_layers))]
        config = self.model.config
        return EncoderDecoderCache(DynamicCache(self_layers, config=config), DynamicCache(cross_layers, config=config))

    def _split(self, seqs: list[_Seq], lengths: list[int], cache) -> None:
        own = [(layer.keys, layer.values) for layer in cache.self_attention_cache.layers]
        cross = [(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers]
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            seq.self_layers = [(k[row : row + 1], v[row : row + 1]) for k, v in own]
            seq.cross_layers = [(k[row : row + 1, :, :n], v[row : row + 1, :, :n]) for k, v in cross]
            seq.length += 1

    def _history(self, requests: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The penalties' token history: the decoder's ids only (start token + output), as transformers and TGI
        penalize an encoder-decoder's decoder input, not its prompt. Laid out where the sampler expects the
        prompt + output layout (-1, ignored, where the prompt was), so the presence penalty still counts the
        output only; lengths are the decoder's (the frequency penalty's denominator)."""
        start = self.model.decoder_start_token_id
        rows = [[-1] * (r.prompt_len - 1) + [start] + r.all_ids[r.prompt_len :] for r in requests]
        width = max(len(row) for row in rows)
        history = torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.long, device=self.device)
        decoded = [1 + len(r.all_ids) - r.prompt_len for r in requests]
        return history, torch.tensor(decoded, dtype=torch.long, device=self.device)

    def _right_padded(self, rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        return ids, mask

    def _start_tokens(self) -> pb.Tokens:
        """decoder_input_details of a seq2seq request: its decoder prompt is the start token alone (as TGI)."""
        return self.outputs.tokens([self.model.decoder_start_token_id], [float("nan")])


def _stack(pairs: Layers, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks [1, H, n, D] K/V rows into [B, H, width, D], zero-padding on the right (cross-attention)."""
    if width is None:
        return torch.cat([k for k, _ in pairs]), torch.cat([v for _, v in pairs])
    pad = [(0, 0, 0, width - k.shape[2]) for k, _ in pairs]
    keys = torch.cat([torch.nn.functional.pad(k, p) for (k, _), p in zip(pairs, pad, strict=True)])
    values = torch.cat([torch.nn.functional.pad(v, p) for (_, v), p in zip(pairs, pad, strict=True)])
    return keys, values
