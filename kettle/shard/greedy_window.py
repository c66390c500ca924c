"""Greedy windows: several decode steps of a batch in one call into the CPU kernels.

When the router lets a Decode call run several steps (kettle/router/decode_steps.py), each step still passes
through the host between two forwards: the step's metadata, the sampler, the token through detokenization and
stopping, its proto. On the bundled model that is ~0.5 ms of a ~6 ms single-stream step, two to four times what
the same Python costs in a microbenchmark (the step's weights evict it from the caches), and it is half again
what the bare step's metadata and argmax cost. A batch whose next tokens depend on the logits alone (greedy,
no penalties, grammar, top tokens or adapters) needs none of it between steps: the C loop
(`kettle_greedy_steps`, through `CausalLM.greedy_steps`) embeds each chosen token and runs the next step
itself, and the host then applies the window's tokens one by one, as single steps would. The loop runs the
kernels of a single step in the same order, so the tokens and logprobs are the same.

With `--speculate`, a step with a draft worth verifying (`speculation.drafts_for`) runs as a speculative step;
one without runs a window instead, and the drafters look again at the next call (a quotation that starts inside
a window is drafted from its end). Greedy with drafts gives greedy's tokens, so the outputs stay the same.

The loop ends a window after a step in which some sequence chose an EOS token. A stop string is only seen when
the host applies the tokens: the steps after it are computed and dropped (their K/V rows lie in the request's
own blocks, which it holds until it is released).
"""

from __future__ import annotations

from collections.abc import Sequence

from kettle.shard.batch import RequestState


def window_steps(requests: Sequence[RequestState], window: int, block_size: int) -> int:
    """How many steps `requests` may run as one greedy window, at most `window`: 0 when one of them needs the
    host between steps, and never past a request's max_new_tokens or the blocks it holds."""
    if not all(_logits_alone(r) for r in requests):
        return 0
    left = min(r.stopping.max_new_tokens - r.stopping.current_tokens for r in requests)
    room = min(len(r.blocks) * block_size - r.cache_len for r in requests)
    return max(0, min(window, left, room))


def _logits_alone(request: RequestState) -> bool:
    """Whether the request's next token is the argmax of its logits, with nothing to apply between steps (a
    drafter may wait: the runner takes a window only when this step has no draft worth verifying)."""
    p = request.params
    plain = not (p.sampling or p.watermark or request.grammar is not None)
    unpenalised = p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
    return plain and unpenalised and not request.in_prefill and request.top_n_tokens == 0 and request.adapter < 0
