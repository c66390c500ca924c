"""transformers' own decode step (its model and DynamicCache): the baseline the micro-benchmarks time."""

from __future__ import annotations

from collections.abc import Callable

import torch


def hf_decode_step(model, batch: int, context: int) -> Callable[[], None]:
    """One greedy transformers decode step per call, after a prefill of `batch` random `context`-token prompts."""
    device = next(model.parameters()).device
    prompts = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
    state = {"past": out.past_key_values, "tokens": out.logits[:, -1].argmax(-1, keepdim=True)}

    @torch.inference_mode()
    def step() -> None:
        out = model(state["tokens"], past_key_values=state["past"], use_cache=True)
        state["past"], state["tokens"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    return step
