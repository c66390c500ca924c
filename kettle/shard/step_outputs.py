"""What every runner does with the logits of a step: sample, stop, detokenize and build the `Generation` messages.

The paged runner (`runner.py`) and the transformers runners (`transformers_runner.py`) differ only in how they get
the logits; both hand them to one `StepOutputs`, so sampling, stopping and the answers they send cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import RequestState
from kettle.shard.grammar import Grammars, advance
from kettle.shard.logits_process import device_tensor
from kettle.shard.sampling import BatchSampler, SampleOutput, top_token_table, top_tokens_from_rows
from kettle.shard.vocab import Vocab

# Token history for the repetition and frequency penalties: ids padded with -1, and each row's length.
History = Callable[[list[RequestState]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepResult:
    """What one step produced: a generation per request that made progress, and the ids that finished."""

    generations: list[pb.Generation]
    finished: set[int]
    forward_ns: int
    decode_ns: int
    steps: int = 1  # decode steps run (a greedy window runs several)


class StepOutputs:
    """Sampling, stopping, detokenization and the step's `Generation` messages, for one runner's requests.

    `history` gives the token history the penalties read; by default each request's prompt and output (a
    seq2seq runner passes its decoder's tokens instead)."""

    def __init__(
        self, vocab: Vocab, device: torch.device, watermark: tuple[float, float], history: History | None = None
    ) -> None:
        self.vocab = vocab
        self.device = device
        self.watermark_gamma, self.watermark_delta = watermark
        self.grammars = Grammars(vocab.tokenizer, vocab.eos_token_ids)
        self.history = history or (lambda requests: prompt_and_output(requests, device))
        self._sampler_requests: tuple[RequestState, ...] = ()
        self._sampler: BatchSampler | None = None

    def sample(self, requests: list[RequestState], logits: torch.Tensor) -> SampleOutput:
        """One token for each of `requests` from its row of `logits`, with its logits processors and grammar."""
        sampler = self._batch_sampler(requests, logits.shape[-1])
        # Built without a host sync (device_tensor): the forward is queued, the sampler's kernels queue behind it.
        last = device_tensor([r.all_ids[-1] for r in requests], torch.long, self.device)
        history = lens = None
        if sampler.needs_history:
            history, lens = self.history(requests)
        # Grammar masks are built for the whole batch in one go, only when some request has a grammar.
        grammars = [r.grammar for r in requests]
        mask = None
        if any(g is not None for g in grammars):
            mask = self.grammars.mask(grammars, logits.shape[-1], logits.device)
        return sampler(logits, history, lens, last, mask)

    def _batch_sampler(self, requests: list[RequestState], vocab_size: int) -> BatchSampler:
        # Rebuilt only when the batch composition changes: parameter tensors are built once per batch. The same
        # request objects, not the same ids: ids restart from 0 after warmup, and a new request reusing an old
        # id must not inherit the old one's parameters and generator.
        same = len(requests) == len(self._sampler_requests) and all(
            new is old for new, old in zip(requests, self._sampler_requests, strict=True)
        )
        if not same or self._sampler is None:
            self._sampler = BatchSampler(
                [r.params for r in requests],
                [r.generator for r in requests],
                vocab_size,
                self.device,
                watermark_gamma=self.watermark_gamma,
                watermark_delta=self.watermark_delta,
                prompt_lens=[r.prompt_len for r in requests],
            )
            self._sampler_requests = tuple(requests)
        return self._sampler

    def apply(self, requests: list[RequestState], sampled: SampleOutput, prefill: dict[int, pb.Tokens]) -> StepResult:
        """Appends the chosen tokens, applies stopping and detokenizes: the only per-request Python loop."""
        # One host transfer for the chosen ids, their logprobs (float64 holds every id exactly) and the top
        # tokens the requests asked for: the step's only device→host sync.
        counts = [r.top_n_tokens for r in requests]
        table = top_token_table(sampled.logprobs, counts) if any(counts) else None
        columns = [sampled.next_ids.double().unsqueeze(1), sampled.chosen_logprobs.double().unsqueeze(1)]
        host = torch.cat(columns if table is None else [*columns, table], dim=1).tolist()
        ids, logprobs = [int(row[0]) for row in host], [row[1] for row in host]
        tops = self._top_tokens(counts, [row[2:] for row in host] if table is not None else [])
        generations, finished = [], set()
        for i, request in enumerate(requests):
            generation = self.advance(request, [ids[i]], [logprobs[i]], tops[i])
            if request.id in prefill:
                generation.prefill_tokens.CopyFrom(prefill[request.id])
            if generation.HasField("generated_text"):
                finished.add(request.id)
            generations.append(generation)
        return StepResult(generations, finished, 0, 0)

    def advance(
        self, request: RequestState, tokens: list[int], logprobs: list[float], top: list[pb.Tokens]
    ) -> pb.Generation:
        """Appends the step's tokens one by one (several when drafts were accepted) until one ends the request."""
        texts, reason = [], None
        for token in tokens:
            request.all_ids.append(token)
            texts.append(request.detokenizer.step(token))
            reason = request.stopping(token, texts[-1])
            if request.grammar is not None and advance(request.grammar, token) and reason is None:
                reason = pb.FINISH_REASON_EOS_TOKEN  # the grammar is complete: nothing more may be generated
            if reason is not None:
                break
        n = len(texts)
        generation = pb.Generation(
            request_id=request.id, tokens=self.tokens(tokens[:n], logprobs[:n], texts), top_tokens=top
        )
        if reason is not None:
            # The stream's last piece also takes the whole characters held back with an incomplete one.
            generation.tokens.texts[-1] += request.detokenizer.flush()
            generation.generated_text.CopyFrom(
                pb.GeneratedText(
                    text=request.detokenizer.text(skip_special_tokens=True),
                    generated_tokens=len(request.detokenizer.generated),
                    finish_reason=reason,
                    seed=request.seed,
                )
            )
        return generation

    def _top_tokens(self, counts: list[int], rows: list[list[float]]) -> list[list[pb.Tokens]]:
        """Each request's top tokens from its row of `top_token_table` (no rows: nobody asked)."""
        if not rows:
            return [[] for _ in counts]
        tops = top_tokens_from_rows(rows, counts)
        return [[self.tokens(ids, values)] if ids else [] for ids, values in tops]

    def tokens(self, ids: list[int], logprobs: list[float], texts: list[str] | None = None) -> pb.Tokens:
        """Token ids with their logprobs, texts and special flags, as the router receives them."""
        texts = [self.vocab.token_text(i) for i in ids] if texts is None else texts
        special = [self.vocab.is_special(i) for i in ids]
        return pb.Tokens(ids=ids, logprobs=logprobs, texts=texts, is_special=special)

    def prompt_tokens(self, request: RequestState, logprobs: list[float]) -> pb.Tokens:
        """The prompt's tokens for decoder_input_details: the first has no logprob (NaN), then `logprobs`."""
        return self.tokens(request.all_ids[: request.prompt_len], [float("nan"), *logprobs])


def prompt_and_output(requests: list[RequestState], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + output ids padded with -1, for the repetition and frequency penalties, and each row's length."""
    width = max(len(r.all_ids) for r in requests)
    rows = [r.all_ids + [-1] * (width - len(r.all_ids)) for r in requests]
    history = device_tensor(rows, torch.long, device)
    lens = device_tensor([len(r.all_ids) for r in requests], torch.long, device)
    return history, lens
