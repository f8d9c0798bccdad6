"""Where the connector's two sides meet the engine's parts: three thin wrappers.

    ConnectorScheduler    the phase before's scheduler; before it plans, the waiting requests'
                          prefixes the tier holds become prefix-cache hits (`load_prefix`; one
                          still loading sits this step out); after, the plan carries the step's
                          record (`build_connector_meta`)
    ConnectorModelRunner  the phase before's runner, between `start_load_kv` and `wait_for_save`
    ConnectorAttention    the step's attention; in a step with transfers, each layer's call is
                          wrapped by `wait_for_layer_load` and `save_kv_layer` (vLLM calls them
                          from its attention layer too: vllm/attention/layer.py)

Every other call goes to the wrapped part unchanged, so with nothing to move a step runs as the
phase before's, on its fastest path.
"""

from __future__ import annotations

from phases.p01_naive_attention import SchedulerInterface
from tinyvllm.sequence import Sequence
from tinyvllm.step import SamplerOutput, SchedulerOutput

from .connector import OffloadingConnectorScheduler, OffloadingConnectorWorker


class ConnectorScheduler:
    """The phase before's scheduler with the connector's scheduler side around its plan."""

    def __init__(self, inner: SchedulerInterface, connector: OffloadingConnectorScheduler,
                 worker: OffloadingConnectorWorker):
        self.inner, self.connector, self.worker = inner, connector, worker

    def __getattr__(self, name):   # the rest (allocator, max_num_seqs, ...) is the inner scheduler's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    running = property(lambda self: self.inner.running)
    waiting = property(lambda self: self.inner.waiting)

    def add(self, seq: Sequence) -> None:
        self.inner.add(seq)

    def check_fits(self, num_prompt_tokens: int, params) -> None:
        self.inner.check_fits(num_prompt_tokens, params)

    def schedule(self) -> SchedulerOutput:
        self.connector.invalidate_blocks(self.worker.failed_loads())
        seats = self.inner.max_num_seqs - len(self.inner.running)
        others = bool(self.inner.running)
        loading = [seq for seq in list(self.inner.waiting)[:seats]   # (prompt_logprobs: every position computed)
                   if seq.params.prompt_logprobs is None and not self.connector.load_prefix(seq, others)]
        for seq in loading:   # still loading: not admitted this step
            self.inner.waiting.remove(seq)
        plan = self.inner.schedule()
        self.inner.waiting.extendleft(reversed(loading))
        plan.kv_connector_metadata = self.connector.build_connector_meta(plan)
        return plan

    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None:
        self.inner.update(plan, sampled)
        for seq, _ in plan.scheduled:
            if seq.is_finished:
                self.connector.request_finished(seq)

    def finish(self, seq: Sequence) -> None:
        self.inner.finish(seq)
        self.connector.request_finished(seq)

    def stats(self) -> dict[str, float]:
        return {**self.inner.stats(), **self.connector.stats()}

    def reset_stats(self) -> None:
        self.inner.reset_stats()
        self.connector.reset_stats()


class ConnectorModelRunner:
    """The phase before's runner, with the worker side's loads started before its forward and its
    saves finished after."""

    def __init__(self, inner, worker: OffloadingConnectorWorker):
        self.inner, self.worker = inner, worker

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def execute(self, plan: SchedulerOutput):
        self.worker.start_load_kv(plan.kv_connector_metadata)
        out = self.inner.execute(plan)   # a failure leaves its loads for the next schedule to undo
        self.worker.wait_for_save()
        return out


class LayerwiseAttention:
    """One step's attention, each layer between its load and its save."""

    def __init__(self, backend, worker: OffloadingConnectorWorker):
        self.backend, self.worker = backend, worker

    def __getattr__(self, name):
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __call__(self, layer_idx: int, q, k, v):
        self.worker.wait_for_layer_load(layer_idx)
        out = self.backend(layer_idx, q, k, v)   # writes this layer's K/V of the step, then attends
        self.worker.save_kv_layer(layer_idx)
        return out


class ConnectorAttention:
    """The attention part: the phase before's, wrapped per layer in a step with transfers."""

    def __init__(self, inner, worker: OffloadingConnectorWorker):
        self.inner, self.worker = inner, worker

    def __call__(self, meta):
        backend = self.inner(meta)
        return LayerwiseAttention(backend, self.worker) if self.worker.has_layer_work else backend

    def close(self) -> None:
        if self.worker.remote is not None:
            self.worker.remote.close()
        self.worker.store.close()
