"""The causal fallback: any transformers `AutoModelForCausalLM`, continuously batched with left padding.

A step's requests form one padded batch: each row's past K/V is right-aligned in a [B, heads, P, dim] cache
(P = the longest past), its new tokens right-aligned after it, and a 2-D attention mask plus explicit
`position_ids` hide the padding, as transformers' own `generate` does for left-padded prompts. The padded
cache is kept as is while the batch keeps its composition (the common decode loop costs no copy); a request
that leaves only has its row selected out; when one joins, every row is cut back to its own K/V (kept per
request id) and the step re-pads them together once.

Models whose cache is not plain per-layer K/V (sliding-window or recurrent layers), or whose forward takes no
`position_ids`, run one request per forward instead (`KETTLE_TUNING=fallback-padding=off`: everywhere).

A vision-language model (`images`: `fallback_images.py`) computes a prompt with images whole, in a forward of its
own group that carries its pixel values and token types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kettle import settings
from kettle.shard.batch import RequestState
from kettle.shard.transformers_runner import StepLogits, TransformersRunner


@dataclass
class _Padded:
    """The cache of the last padded step: rows in `ids` order, `mask` marks each row's real columns."""

    ids: tuple[int, ...]
    cache: object  # transformers DynamicCache, [B, heads, mask.shape[1], dim] per layer
    mask: torch.Tensor  # [B, columns] long
    lengths: list[int]


@dataclass
class _Own:
    """One request's K/V outside a padded batch: per-layer (keys, values) [1, heads, length, dim], or the
    model's own cache object in per-request mode."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    cache: object | None = None


class FallbackRunner(TransformersRunner):
    """Runs steps of a `TransformersCausalLM` over per-request transformers caches."""

    def __init__(self, model, vocab, device: torch.device, watermark: tuple[float, float]) -> None:
        super().__init__(model, vocab, device, watermark)
        self.padding = settings.current().fallback_padding and _plain_cache(model)
        self._own: dict[int, _Own] = {}
        self._padded: _Padded | None = None
        self.images = None  # FallbackImages of a vision-language model (set by the server)

    # --- state ----------------------------------------------------------------------------------------

    def _past(self, request_id: int) -> int:
        if self._padded is not None and request_id in self._padded.ids:
            return self._padded.lengths[self._padded.ids.index(request_id)]
        own = self._own.get(request_id)
        return own.length if own is not None else 0

    def _drop(self, request_ids: set[int] | None) -> None:
        if request_ids is None:
            self._own.clear()
            self._padded = None
            return
        if self._padded is not None and request_ids & set(self._padded.ids):
            self._padded = _without(self._padded, request_ids)
        for request_id in request_ids:
            self._own.pop(request_id, None)

    def _unpad(self) -> None:
        """Cuts every row of the padded cache back to its own K/V (the batch is changing composition)."""
        padded, self._padded = self._padded, None
        if padded is None:
            return
        layers = list(_layers(padded.cache))
        for row, request_id in enumerate(padded.ids):
            columns = padded.mask[row].nonzero().squeeze(1)
            own = [
                (k[row : row + 1].index_select(2, columns), v[row : row + 1].index_select(2, columns))
                for k, v in layers
            ]
            self._own[request_id] = _Own(padded.lengths[row], own)

    # --- forward --------------------------------------------------------------------------------------

    def _logits(self, requests: list[RequestState], ends: list[int]) -> StepLogits:
        if self.images is not None:  # a prompt with images waits for the chunk that completes it
            requests, ends = self.images.ready(requests, ends)
        pasts = [self._past(r.id) for r in requests]
        tokens = [r.all_ids[past:end] for r, past, end in zip(requests, pasts, ends, strict=True)]
        prompt = [self._wants_prompt_logprobs(r, p, e) for r, p, e in zip(requests, pasts, ends, strict=True)]
        if self.padding:
            rows = self._grouped_forward(requests, pasts, tokens, keep_all=any(prompt))
        else:
            rows = [self._single_forward(r, past, t) for r, past, t in zip(requests, pasts, tokens, strict=True)]
        result = StepLogits({r.id: row[-1] for r, row in zip(requests, rows, strict=True)}, {})
        for request, row, wanted in zip(requests, rows, prompt, strict=True):
            if wanted:
                result.prefill[request.id] = self._prompt_logprobs(request, row[:-1])
        return result

    def _grouped_forward(self, requests, pasts: list[int], tokens: list[list[int]], keep_all: bool) -> list:
        """New prompts in one padded forward (those with images in another), continuing requests in one per query
        length.

        Within a group every row's real tokens stay contiguous at the right ([pads][past][new]): padding never
        sits between a past and its new tokens, so position-indexed masks (local windows) stay exact.
        """
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (past, query) in enumerate(zip(pasts, tokens, strict=True)):
            key = (0, bool(requests[i].images)) if past == 0 else (len(query), False)
            groups.setdefault(key, []).append(i)
        rows: list = [None] * len(requests)
        for members in groups.values():
            picked = [requests[i] for i in members]
            out = self._padded_forward(picked, [pasts[i] for i in members], [tokens[i] for i in members], keep_all)
            for i, row in zip(members, out, strict=True):
                rows[i] = row
        return rows

    def _padded_forward(
        self, requests, pasts: list[int], tokens: list[list[int]], keep_all: bool
    ) -> list[torch.Tensor]:
        """One forward over all rows; returns each row's logits for its new tokens (or the last one only)."""
        ids = tuple(r.id for r in requests)
        if self._padded is None or self._padded.ids != ids:
            self._unpad()
            self._padded = self._pad(ids, pasts)
        width = max(len(t) for t in tokens)
        device = self.device
        input_ids = torch.tensor([[self.model.pad_token_id] * (width - len(t)) + t for t in tokens], device=device)
        new_mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in tokens], device=device)
        start = self.model.position_offset
        positions = torch.tensor(
            [
                [1] * (width - len(t)) + list(range(start + p, start + p + len(t)))
                for p, t in zip(pasts, tokens, strict=True)
            ],
            device=device,
        )
        mask = torch.cat([self._padded.mask, new_mask], dim=1)
        kwargs = {"position_ids": positions} if self.model.takes_positions else {}
        if self.images is not None:
            kwargs |= self.images.inputs(requests, pasts, tokens, width)
        if not keep_all and self.model.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model.model(
            input_ids=input_ids, attention_mask=mask, past_key_values=self._padded.cache, use_cache=True, **kwargs
        )
        lengths = [p + len(t) for p, t in zip(pasts, tokens, strict=True)]
        self._padded = _Padded(ids, out.past_key_values, mask, lengths)
        logits = out.logits
        return [logits[i, logits.shape[1] - min(len(t), logits.shape[1]) :] for i, t in enumerate(tokens)]

    def _pad(self, ids: tuple[int, ...], pasts: list[int]) -> _Padded:
        """A padded cache of the rows' own K/V, each right-aligned in the longest past."""
        from transformers import DynamicCache

        width = max(pasts)
        owns = [self._own.pop(i, None) for i in ids]
        mask = torch.tensor([[0] * (width - p) + [1] * p for p in pasts], dtype=torch.long, device=self.device)
        if width == 0:
            return _Padded(ids, DynamicCache(config=self.model.config), mask, list(pasts))
        template = next(o for o in owns if o is not None and o.length > 0).layers
        layers = []
        for index, (k0, v0) in enumerate(template):
            keys = k0.new_zeros((len(ids), k0.shape[1], width, k0.shape[3]))
            values = v0.new_zeros((len(ids), v0.shape[1], width, v0.shape[3]))
            for row, (own, past) in enumerate(zip(owns, pasts, strict=True)):
                if own is not None and past > 0:
                    keys[row, :, width - past :] = own.layers[index][0][0]
                    values[row, :, width - past :] = own.layers[index][1][0]
            layers.append((keys, values))
        return _Padded(ids, DynamicCache(layers, config=self.model.config), mask, list(pasts))

    def _single_forward(self, request: RequestState, past: int, tokens: list[int]) -> torch.Tensor:
        """One request alone through the model and its own cache object (no padding to get wrong)."""
        request_id = request.id
        own = self._own.get(request_id)
        input_ids = torch.tensor([tokens], device=self.device)
        kwargs = {} if self.images is None else self.images.inputs([request], [past], [tokens], len(tokens))
        if self.model.takes_positions:
            start = past + self.model.position_offset
            kwargs["position_ids"] = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        out = self.model.model(
            input_ids=input_ids,
            attention_mask=torch.ones((1, past + len(tokens)), dtype=torch.long, device=self.device),
            past_key_values=own.cache if own is not None else None,
            use_cache=True,
            **kwargs,
        )
        self._own[request_id] = _Own(past + len(tokens), cache=out.past_key_values)
        return out.logits[0]


def _without(padded: _Padded, request_ids: set[int]) -> _Padded | None:
    """The padded batch minus `request_ids` (rows selected in place: the batch that goes on needs no re-pad),
    with the columns no remaining row uses cut off the left."""
    keep = [row for row, i in enumerate(padded.ids) if i not in request_ids]
    if not keep:
        return None
    rows = torch.tensor(keep, device=padded.mask.device)
    mask = padded.mask.index_select(0, rows)
    first = int((mask.sum(0) > 0).nonzero()[0]) if bool(mask.any()) else mask.shape[1]
    for layer in padded.cache.layers:
        layer.keys = layer.keys.index_select(0, rows)[:, :, first:]
        layer.values = layer.values.index_select(0, rows)[:, :, first:]
    ids = tuple(padded.ids[row] for row in keep)
    return _Padded(ids, padded.cache, mask[:, first:], [padded.lengths[row] for row in keep])


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _plain_cache(model) -> bool:
    """Whether padded batching is safe: every cache layer plain K/V, and positions can be passed."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if not model.takes_positions:
        return False
    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # a config transformers cannot map to cache layers: stay on the safe path
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)
