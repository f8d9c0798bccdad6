"""An AsyncLLM-style front for a phase's engine.

The engine's `step` runs a model forward pass: seconds on a CPU. The web server's event loop
must never wait on it, so one background thread owns the engine: it takes new requests and
aborts from an inbox, steps while any request is unfinished, and hands each `RequestOutput` to
the asyncio queue of its request through `loop.call_soon_threadsafe`. Only that thread touches
the engine's queues; after each step it publishes a snapshot of the engine's state (requests,
blocks, counters) that /metrics and the live page read without touching the engine.

A failed step does not stop the server: the engine aborts the requests it was running and names
them (`StepError`), their clients get the error, and the thread goes on with the others. An
error outside any request's step aborts every request (their clients get it) and goes on too.
Only an error the engine cannot recover from (abort itself failing, a BaseException, or
`EngineDeadError`: phase 9's engine core process died, which the engine's `check_health` also
notices while no request runs) stops the thread; every waiting client gets it, and `on_dead` is
called, so the server can exit non-zero for a supervisor to restart it, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from tinyvllm.errors import EngineDeadError, StepError
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-num-waiting allows."""


class _Mailbox:
    """A request's latest output: outputs are cumulative (each holds all the text so far), so a
    slow reader needs only the newest, not every step's (memory stays one output a request)."""

    def __init__(self):
        self.latest: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out) -> None:   # on the event loop (call_soon_threadsafe)
        if not isinstance(self.latest, BaseException):   # an error is never overwritten
            self.latest = out
        self.ready.set()

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        out, self.latest = self.latest, None
        return out


class AsyncEngine:
    """One engine stepped by one thread; requests come in and out through asyncio queues.

    Args:
        engine: any phase's engine (the one loop: add_request, step, abort_request).
        max_num_waiting: refuse a request (QueueFullError) when its sequences (n of them) would
            make more than this many wait for a seat; None: no bound.
        on_dead: called (from the engine thread) once the engine has stopped for good.
    """

    def __init__(self, engine: Any, max_num_waiting: int | None = None, on_dead=None):
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # ("add", group, q, loop) | ("abort", id)
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self.on_dead = on_dead
        self._step_started: float | None = None                 # monotonic time the running step began
        self.num_failed_steps = 0                             # steps that failed and were survived
        self.num_pending = 0                                  # sequences accepted, not yet in the engine
        self._lock = threading.Lock()                         # num_pending: two threads change it
        self._tokens_per_s = 0.0
        self.generation_tokens = 0                            # tokens made since start
        self._num_tokens: dict[str, int] = {}                 # request id -> its tokens so far
        self.state: dict = self._snapshot(0.0)
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def step_seconds(self) -> float:
        """How long the engine's current step has run (0 between steps): /health reports a stuck one."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def check_alive(self) -> None:
        if self.error is not None or self._stopping:
            raise EngineDeadError(f"the engine has stopped: {self.error or 'shutting down'}")

    async def generate(self, request_id: str, prompt: Any,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine makes them, the last one finished. Raises
        ValueError/TypeError on bad input before anything is queued; if the caller stops
        iterating (a client disconnected), the request is aborted and its blocks freed."""
        self.check_alive()
        num_seqs = params.n   # the bound counts sequences: a request of n=128 holds 128 places
        if self.max_num_waiting is not None and num_seqs > self.max_num_waiting:
            raise ValueError(f"n ({num_seqs}) is more sequences than may wait at once "
                             f"({self.max_num_waiting}, --max-num-waiting)")
        with self._lock:  # the bound counts sequences still being tokenized: reserve places first
            if self.max_num_waiting is not None and (
                    self.state["num_waiting"] + self.num_pending + num_seqs > self.max_num_waiting):
                raise QueueFullError(f"the server has {self.max_num_waiting} sequences waiting "
                                     f"(--max-num-waiting); try again later")
            self.num_pending += num_seqs
        try:
            # tokenizing a long prompt takes a while: not on the event loop
            group = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params,
                                            arrival_time=time.perf_counter())
            self.check_alive()
        except BaseException:
            with self._lock:
                self.num_pending -= num_seqs
            raise
        q = _Mailbox()
        self._queues[request_id] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", group))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, StepError):
                    finished = True       # the engine aborted it already
                    raise out
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine has stopped: {out}") from out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request at the engine thread's next turn (it frees the blocks)."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step (unfinished requests are aborted), then let
        go of what the engine holds outside this process (a tensor-parallel engine's ranks)."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():   # never while a step still runs on the thread
            self.engine.shutdown()

    # -- the engine thread -----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                live = item.request_id in self._queues   # not cancelled while it sat in the inbox
                if live:
                    self.engine.add_group(item)
                with self._lock:  # counted by the engine's waiting queue from now on
                    self.num_pending -= item.params.n
                    if live:
                        self.state = self._snapshot(self._tokens_per_s)
            else:
                self.engine.abort_request(item)
                self._num_tokens.pop(item, None)

    def _run(self) -> None:
        engine = self.engine
        last = time.perf_counter()
        tokens_per_s = 0.0
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    engine.check_health()
                    self.state = self._snapshot(0.0)
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._step_started = time.monotonic()
                try:
                    outputs = engine.step()
                except EngineDeadError:       # nothing can run any more: below, every client hears it
                    raise
                except StepError as e:       # its requests are aborted: tell their clients
                    self._fail(e.request_ids, e)
                    continue
                except Exception as e:       # no request named: abort them all, and go on
                    ids = engine.unfinished_request_ids()
                    engine.abort_request(ids)
                    self._fail(ids, StepError(ids, e))
                    continue
                finally:
                    self._step_started = None
                now = time.perf_counter()
                made = 0
                for out in outputs:
                    n = sum(len(c.token_ids) for c in out.outputs)
                    made += n - self._num_tokens.get(out.request_id, 0)
                    if out.finished:
                        self._num_tokens.pop(out.request_id, None)
                    else:
                        self._num_tokens[out.request_id] = n
                self.generation_tokens += made
                # a smoothed rate (about the last ten steps), for the live page
                tokens_per_s = 0.8 * tokens_per_s + 0.2 * made / max(now - last, 1e-6)
                self._tokens_per_s = tokens_per_s
                last = now
                self.state = self._snapshot(tokens_per_s)
                for out in outputs:
                    entry = self._queues.get(out.request_id)
                    if entry is not None:
                        entry[0].call_soon_threadsafe(entry[1].put, out)
        except BaseException as e:  # every waiting client must hear of it
            self.error = e
            for loop, q in list(self._queues.values()):
                loop.call_soon_threadsafe(q.put, e)
            raise
        finally:
            try:
                self._drain_inbox()
                if engine.has_unfinished_requests():
                    engine.abort_request(engine.unfinished_request_ids())
            finally:
                if self.error is not None and self.on_dead is not None:
                    self.on_dead()

    def _fail(self, request_ids: list[str], error: StepError) -> None:
        """A survived failure: the named requests' clients get the error."""
        self.num_failed_steps += 1
        for rid in request_ids:
            self._num_tokens.pop(rid, None)
            entry = self._queues.get(rid)
            if entry is not None:
                entry[0].call_soon_threadsafe(entry[1].put, error)
        self.state = self._snapshot(0.0)

    def _snapshot(self, tokens_per_s: float) -> dict:
        """The engine's state as plain data (`engine.snapshot()`) with the server's rates: read
        by /metrics and GET /v1/engine/state."""
        return {**self.engine.snapshot(), "generation_tokens": self.generation_tokens,
                "tokens_per_s": tokens_per_s}
