"""Fault injection for end-to-end tests: test doubles patched into the server's own processes at start-up.

Python imports `sitecustomize` at start-up from the first folder on its path that has one, so a server launched
with this folder first on PYTHONPATH (see `tests/faults.py`) runs with these patches, and production code has
no hooks at all. A request whose prompt contains `FAULT:<stage>` makes that stage raise for it:

- router: validation, tokenization, allocation (its KV blocks), batch (its shard request), delivery (handing its
  tokens to the request channel);
- shard: shard-request (building its state), prefill (the forward that starts it), decode (a later forward),
  sampling, detokenize, stop (stop matching), filter (FilterBatch of a batch that holds it).
"""

from __future__ import annotations

import os
import re

if os.environ.get("KETTLE_TEST_FAULTS") == "1":
    _MARK = re.compile(r"FAULT:([a-z-]+)")
    _by_ids: dict[tuple[int, ...], str] = {}  # router: the prompt ids of each faulty request -> its stage
    _by_request: dict[int, str] = {}  # shard: request id -> stage

    class InjectedFault(RuntimeError):
        pass

    def _stage(text: str) -> str | None:
        match = _MARK.search(text)
        return match.group(1) if match else None

    def _raise_if(stage: str | None, wanted: str) -> None:
        if stage == wanted:
            raise InjectedFault(f"injected fault at {wanted}")

    def _patch_router() -> None:
        from kettle.router import queue, scheduler, tokenizer, validation

        validate = validation.Validation.validate

        async def faulty_validate(self, request, **kwargs):
            _raise_if(_stage(request.inputs), "validation")
            valid = await validate(self, request, **kwargs)
            if (stage := _stage(request.inputs)) is not None:
                _by_ids[tuple(valid.input_ids)] = stage
            return valid

        validation.Validation.validate = faulty_validate

        encode = tokenizer.TokenizerPool.encode

        async def faulty_encode(self, text, *args, **kwargs):
            _raise_if(_stage(text), "tokenization")
            return await encode(self, text, *args, **kwargs)

        tokenizer.TokenizerPool.encode = faulty_encode

        queue_init = queue.Queue.__init__

        def faulty_queue(self, allocator, *args, **kwargs):
            allocate = allocator.allocate

            def faulty_allocate(n_tokens, prompt_ids=(), reuse=True, namespace="", images=()):
                _raise_if(_by_ids.get(tuple(prompt_ids)), "allocation")
                return allocate(n_tokens, prompt_ids, reuse, namespace, images)

            allocator.allocate = faulty_allocate
            queue_init(self, allocator, *args, **kwargs)

        queue.Queue.__init__ = faulty_queue

        to_proto = queue.Entry.to_proto

        def faulty_to_proto(self):
            _raise_if(_by_ids.get(tuple(self.request.input_ids)), "batch")
            return to_proto(self)

        queue.Entry.to_proto = faulty_to_proto

        events = scheduler.generation_events

        def faulty_events(generation, entry):
            _raise_if(_by_ids.get(tuple(entry.request.input_ids)), "delivery")
            return events(generation, entry)

        scheduler.generation_events = faulty_events

    def _patch_shard() -> None:
        from kettle.shard import detokenize, engine, runner, step_outputs, stopping

        state = engine.ShardEngine._state

        def faulty_state(self, request):
            stage = _stage(request.inputs)
            _raise_if(stage, "shard-request")
            built = state(self, request)
            if stage is not None:
                _by_request[request.id] = stage
                built.detokenizer.fault = stage == "detokenize"
                built.stopping.fault = stage == "stop"
            return built

        engine.ShardEngine._state = faulty_state

        # `compute` is the forward of every step, including the one the shard computes ahead (overlap scheduling).
        compute = runner.PagedRunner.compute

        def faulty_compute(self, requests, drafts=None):
            for r in requests:
                _raise_if(_by_request.get(r.id), "prefill" if len(r.all_ids) == r.prompt_len else "decode")
            return compute(self, requests, drafts)

        runner.PagedRunner.compute = faulty_compute

        sample = step_outputs.StepOutputs.sample

        def faulty_sample(self, requests, logits):
            for r in requests:
                _raise_if(_by_request.get(r.id), "sampling")
            return sample(self, requests, logits)

        step_outputs.StepOutputs.sample = faulty_sample

        detokenize_step = detokenize.IncrementalDetokenizer.step

        def faulty_detokenize(self, token_id):
            if getattr(self, "fault", False):
                raise InjectedFault("injected fault at detokenize")
            return detokenize_step(self, token_id)

        detokenize.IncrementalDetokenizer.step = faulty_detokenize

        stop = stopping.StoppingCriteria.__call__

        def faulty_stop(self, token_id, text):
            if getattr(self, "fault", False):
                raise InjectedFault("injected fault at stop")
            return stop(self, token_id, text)

        stopping.StoppingCriteria.__call__ = faulty_stop

        filter_batch = engine.ShardEngine.filter_batch

        def faulty_filter(self, request):
            batch = self.batches.get(request.batch_id)
            for r in batch.requests if batch is not None else ():
                _raise_if(_by_request.get(r.id), "filter")
            return filter_batch(self, request)

        engine.ShardEngine.filter_batch = faulty_filter

    # Each process patches its own side: the launcher starts `kettle serve` (a shard) and `kettle router`.
    import sys

    _command = next((a for a in sys.argv[1:3] if a in ("serve", "router")), "")
    if _command == "serve":
        _patch_shard()
    elif _command == "router":
        _patch_router()
