"""Two steps in flight: the engine core's step when `async_scheduling` is on.

    main thread (the core's loop)                      model thread (one worker)
    schedule N+1 ahead (placeholders)                   execute N, sample N
    wait for N  ........................................ fill N+1's placeholders from N's tokens
    land N: tokens in, stops, free; send N's outputs    execute N+1, sample N+1
    schedule N+2 ahead                                  ...

vLLM's `EngineCore.step_with_batch_queue` (vllm/v1/engine/core.py): schedule and submit while
the queue has room (here two batches: one running, one waiting behind it), then wait for the
oldest and update from it. The worker runs one batch at a time, in order, so a batch's
placeholders are filled from the batch just before it as soon as that one has sampled, without
waiting for the loop (as vLLM's GPU stream orders its steps). On a CPU the worker is a thread:
torch releases the GIL inside its operators, so the loop's Python runs beside the forward.

A step that cannot run ahead (`AsyncScheduler.sync_reason`) waits for the batches in flight to
land, then is phase 8's synchronous `Engine.step`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from tinyvllm.errors import StepError
from tinyvllm.outputs import RequestOutput
from tinyvllm.step import SamplerOutput

from .async_scheduler import Batch, fill_placeholders

MAX_IN_FLIGHT = 2   # vLLM's batch queue size with async scheduling


class BatchQueue:
    """Steps `engine` (phase 1's `Engine`, whose scheduler is an `AsyncScheduler`) with up to two
    batches in flight. `step()` has `Engine.step`'s contract: the outputs of the requests that got
    tokens (here, those of the batch that landed), a `StepError` naming failed requests."""

    def __init__(self, engine):
        self.engine, self.scheduler = engine, engine.scheduler
        self.queue: deque[Batch] = deque()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-model")
        self.num_ahead = 0   # steps scheduled while the one before was still in flight
        self.num_sync = 0    # synchronous steps (a request that cannot run ahead)

    def step(self) -> list[RequestOutput]:
        if self.scheduler.sync_reason() is not None:
            if self.queue:
                return self.land(self.queue.popleft())
            self.num_sync += 1
            return self.engine.step()
        submitted = False
        if len(self.queue) < MAX_IN_FLIGHT:
            batch = self.scheduler.schedule_ahead()
            if batch.plan.scheduled:
                self.num_ahead += bool(self.queue)
                before = self.queue[-1] if self.queue else None
                batch.future = self.worker.submit(self.run, batch, before)
                self.queue.append(batch)
                submitted = True
        if not self.queue or (submitted and len(self.queue) < MAX_IN_FLIGHT):
            return []   # the first batch runs: plan the next before waiting for it
        outputs = self.land(self.queue.popleft())
        while self.queue and not self.engine.has_unfinished_requests():
            self.land(self.queue.popleft())   # a batch behind the last request, which ended: nothing in it
        return outputs

    @torch.inference_mode()
    def run(self, batch: Batch, before: Batch | None) -> SamplerOutput:
        """In the model thread: fill the placeholders from the batch before (done by now: the
        thread runs one batch at a time), run the model, sample."""
        if before is not None:
            fill_placeholders(batch.view, before.future.result())
        return self.engine.sampler.sample(self.engine.runner.execute(batch.view))

    def land(self, batch: Batch) -> list[RequestOutput]:
        """Wait for `batch`, move its tokens into the requests; their outputs, placeholders cut."""
        try:
            sampled = self.scheduler.land(batch, batch.future.result())
        except Exception as e:   # the batches behind it filled their placeholders from it: they fail too
            failed = batch.plan.request_ids()
            while self.queue:
                later = self.queue.popleft()
                later.future.exception()
                failed += later.plan.request_ids()
            failed = list(dict.fromkeys(failed))
            self.engine.abort_request(failed)
            raise StepError(failed, e) from e
        outputs = self.engine.outputs(sampled)
        for out in outputs:
            group = self.engine.groups.get(out.request_id)
            for c in out.outputs if group is not None else ():
                pending = self.scheduler.pending(group.seqs[c.index])
                if pending:
                    c.token_ids = c.token_ids[:-pending]
        return outputs

    def close(self) -> None:
        """Wait for what is in flight, and end the model thread."""
        self.worker.shutdown(wait=True, cancel_futures=True)
