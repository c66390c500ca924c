"""Speculative decoding (`--speculate N`): drafts verified in one forward, which of them the model accepts.

A request that drafts feeds its last token and its draft tokens d1..dk to one forward, each as its own decode
row over the request's blocks: every layer writes the K/V of all rows before any row attends, so row j sees
the tokens before it, and its logits are those a plain decode step would have computed after d1..dj.

Greedy: d(j+1) is accepted while it is row j's argmax; the model's own choice follows the accepted drafts, so
the output is exactly the plain greedy one. Sampled: row j's token is drawn as a plain step draws it (the next
uniform of the request's own generator through the inverse CDF of p_j), and d(j+1) is accepted when it is that
token. That accepts d(j+1) with probability p_j(d(j+1)), as rejection sampling with the draft as a point-mass
proposal does, and the token emitted at the first mismatch follows p_j without d(j+1), renormalised: every
emitted token has exactly the distribution p of the plain path. And one uniform per emitted token, as the plain
path takes: a seeded request gives the same tokens with drafts or without, however many tokens each step drafts
(which depends on the batch: `drafts_for`), so its answer does not depend on what else the server is doing.

The K/V the forward wrote for rejected drafts is rolled back by not counting it: the request's `cache_len`
advances over its last token and the accepted drafts only, and the next step overwrites the rest.

Drafting has to pay for itself: on the CPU a verified draft token costs about a third of a decode step
(`KETTLE_TUNING`'s `speculate-row-cost`, 0.35 by default: kettle/settings.py), and on a plain chat answer most
n-gram drafts are rejected. So each step decides how many tokens each request drafts (`drafts_for`) from its drafter's
acceptance estimate (`NgramDrafter.acceptance`): a draft token is verified only when its expected yield (the
chance that it and every draft token before it are accepted) beats what the step already gets per unit of cost.
A request that copies drafts up to `--speculate` tokens every step; one whose drafts keep failing stops drafting
until its bad record fades, then probes with a token or two. A step drafts within `step_rows` rows in all: on the
CPU one pass of the integer kernels (4 rows: a single stream's last token and 3 drafts; 8 with the weights in
lanes), on a GPU 7 (a batch of 7 or more is already using the step well). And only requests whose token
choice depends on nothing but the row's logits draft: no grammar, penalties, watermark or top tokens (their
per-row state would have to follow the draft). The others in the same batch decode one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kettle import settings
from kettle.kernels import ops
from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import RequestState
from kettle.shard.ngram import NgramDrafter
from kettle.shard.sampling import BatchSampler, SamplingParams, greedy_choice, inverse_cdf

# Rows (tokens) a CPU step that verifies drafts may feed: one tile of the int4/int8 kernels' integer path
# (`ops.TILE_ROWS`), which reads and unpacks each weight once for all its rows. A fifth row starts a second pass:
# measured on the bundled model (int4, fused step, context 560, one thread) a step of 4 rows cost 2.30 one-row
# steps and one of 5 rows 3.01, so a fourth draft token (worth at most ~0.9 of a token on the copy benchmark)
# cost more than it saved (`python -m bench speculation --in-process`, one thread: copy 1.71x, 1.66x with 7 rows).
# (The kernels leave that path for the float32 tiles or the panels only from 8 and 10 rows on: kettle/kernels/linear.c.)
CPU_STEP_ROWS = ops.TILE_ROWS
# A model whose weights are all in lanes (AVX-512 VNNI: kernels.h's lanes layouts) runs 8 rows a pass
# (`ops.LANES_TILE_ROWS`; the panels only from 128), so `--speculate 4` verifies all 4 drafts of a stream in one pass
# (copy 2.06x against 1.60x with 4 rows, ops.py).
CPU_LANES_STEP_ROWS = ops.LANES_TILE_ROWS
# On a GPU a step's rows cost little until the batch fills the device; a batch of 8 is already using it well.
GPU_STEP_ROWS = 7


def step_rows(device: torch.device, lanes: bool = False) -> int:
    """The rows a step that verifies drafts may feed on `device` (drafts stop there): `KETTLE_TUNING`'s
    `speculate-step-rows` when set, else the device's default (on the CPU, by whether the model's weights are in
    lanes)."""
    chosen = settings.current().speculate_step_rows
    if chosen is not None:
        return chosen
    if device.type != "cpu":
        return GPU_STEP_ROWS
    return CPU_LANES_STEP_ROWS if lanes else CPU_STEP_ROWS


def drafter_for(params: SamplingParams, request: pb.Request, speculate: int) -> NgramDrafter | None:
    """A drafter when `--speculate` is on and the request's tokens depend on its logits alone."""
    plain = not (request.parameters.grammar or request.top_n_tokens or params.watermark)
    unpenalised = params.repetition_penalty == 1.0 and params.frequency_penalty == 0 and params.presence_penalty == 0
    if speculate <= 0 or not plain or not unpenalised:
        return None
    return NgramDrafter(settings.current().speculate_min_ngram)


def drafts_for(requests: Sequence[RequestState], speculate: int, step_rows: int) -> list[list[int]]:
    """Each request's draft for this step: the draft tokens whose expected yield pays for their row.

    With each request's acceptance estimate a (`NgramDrafter.acceptance`), its j-th draft token yields a token with
    probability a^j (it and the j-1 before it accepted). With c the cost of a row as a share of a one-row step
    (`KETTLE_TUNING`'s `speculate-row-cost`), the step costs 1 + c per row past the first, for one token per
    request; draft tokens are added best first while one's expected yield beats c times the step's current tokens
    per unit of cost (so the step's expected tokens per unit of cost grow with each), within `step_rows` rows. For
    one request that is the draft length that maximises tokens per unit of cost: up to `speculate` tokens when
    a is near 1, none when a is below c. c = 0 drafts in full."""
    rows = sum(len(r.next_query()) for r in requests)
    if rows >= step_rows:  # checked first: a big batch looks nothing up
        return [[] for _ in requests]
    proposals = [proposal(r, speculate) for r in requests]
    rates = [r.drafter.acceptance(len(r.all_ids)) if p else 0.0 for r, p in zip(requests, proposals, strict=True)]
    row_cost = settings.current().speculate_row_cost
    lengths, gains = [0] * len(requests), list(rates)
    tokens, cost = float(len(requests)), 1.0 + row_cost * (rows - 1)
    while rows < step_rows:
        open_ = [i for i, p in enumerate(proposals) if lengths[i] < len(p)]
        best = max(open_, key=gains.__getitem__, default=None)
        if best is None or gains[best] <= row_cost * tokens / cost:
            break
        lengths[best] += 1
        tokens, cost, rows = tokens + gains[best], cost + row_cost, rows + 1
        gains[best] *= rates[best]
    return [p[:n] for p, n in zip(proposals, lengths, strict=True)]


def proposal(request: RequestState, speculate: int) -> list[int]:
    """One request's longest possible draft: at most `speculate` tokens, and never so many that the step could
    pass `max_new_tokens` (so every row writes inside the blocks the router reserved)."""
    if request.drafter is None or request.in_prefill:
        return []
    left = request.stopping.max_new_tokens - request.stopping.current_tokens
    return request.drafter.propose(request.all_ids, min(speculate, left - 1))


def verify_drafts(requests: Sequence[RequestState], drafts: Sequence[list[int]], logits: Tensor) -> Tensor:
    """Verifies each request's draft against its rows of `logits` (k+1 rows per request, in order).

    Returns one flat float64 tensor (one host transfer) holding per request, in order: the number of accepted
    drafts, the model's token, its logprob, then the logprobs of the k drafts."""
    scores = _scores(requests, drafts, logits)
    parts, row = [], 0
    for request, draft in zip(requests, drafts, strict=True):
        rows = slice(row, row + len(draft) + 1)
        ids = torch.tensor(draft, dtype=torch.long, device=logits.device)
        generator = request.generator if request.params.sampling else None
        parts.append(verify(scores[rows], ids, generator))
        row = rows.stop
    return torch.cat(parts)


def _scores(requests: Sequence[RequestState], drafts: Sequence[list[int]], logits: Tensor) -> Tensor:
    """The rows' processed scores: the raw logits when every request is greedy (greedy rows that draft have no
    processor), else through a sampler over the rows' parameters (built per step: drafts change every step)."""
    if not any(r.params.sampling for r in requests):
        return logits.float()
    params = [r.params for r, d in zip(requests, drafts, strict=True) for _ in range(len(d) + 1)]
    generators = [r.generator for r, d in zip(requests, drafts, strict=True) for _ in range(len(d) + 1)]
    return BatchSampler(params, generators, logits.shape[-1], logits.device).scores(logits)


def verify(scores: Tensor, draft: Tensor, generator: torch.Generator | None) -> Tensor:
    """One request: `scores` [k+1, V] processed scores at its last token and at each draft token, `draft` [k].
    Greedy when `generator` is None. See the module docstring; the result is laid out as `verify_drafts` says."""
    k = draft.numel()
    if generator is None:
        return _verify_greedy(scores, draft)
    logprobs = torch.log_softmax(scores, dim=-1)
    draft_logprobs = logprobs[torch.arange(k, device=scores.device), draft]
    # Every row's token from the uniform it would take were it reached (`BatchSampler._uniforms`' draw), then the
    # generator moved on by the rows the step emits only: the next step's first row takes the next uniform.
    state = generator.get_state()
    uniforms = torch.stack([_uniform(generator) for _ in range(k + 1)]).to(scores.device)
    tokens = inverse_cdf(logprobs.exp(), uniforms)
    accepted = (tokens[:k] == draft).long().cumprod(0).sum()
    generator.set_state(state)
    for _ in range(int(accepted) + 1):
        _uniform(generator)
    token = tokens[accepted]
    chosen = logprobs[accepted, token]
    return torch.cat([torch.stack([accepted.double(), token.double(), chosen.double()]), draft_logprobs.double()])


def _uniform(generator: torch.Generator) -> Tensor:
    """The next U[0, 1) draw of a request's generator, as a plain step draws it (`BatchSampler._uniforms`)."""
    return torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)


def _verify_greedy(scores: Tensor, draft: Tensor) -> Tensor:
    """`verify` of a greedy request: each row's choice and logprob as a plain greedy step takes them
    (`greedy_choice`), so bit for bit the same. In place of the drafts' logprobs it lays out each row's choice's:
    the same value wherever the draft was accepted (the draft is the choice), and the rejected ones are never read."""
    k = draft.numel()
    choice, logprobs = greedy_choice(scores)
    accepted = (choice[:k] == draft).long().cumprod(0).sum()
    head = torch.stack([accepted.double(), choice[accepted].double(), logprobs[accepted].double()])
    return torch.cat([head, logprobs[:k].double()])


def accepted_tokens(draft: list[int], row: list[float]) -> tuple[list[int], list[float]]:
    """The host half: the tokens a step emits for one request (accepted drafts, then the model's token) and
    their logprobs, from its part of `verify_drafts`' result."""
    accepted = int(row[0])
    return [*draft[:accepted], int(row[1])], [*row[3 : 3 + accepted], row[2]]
