"""The front process's side: `EngineCoreClient`, an object with the engine's public methods whose
engine runs in a child process (core.py).

    LLM / the server  ->  EngineCoreClient.make_request   tokenize (parse_prompt) here; ask the
                                                          core the checks only it can answer
                          EngineCoreClient.add_group      AddRequest --> core (with the next message)
                          EngineCoreClient.step           the Outputs that came, as RequestOutputs
                          EngineCoreClient.abort_request  Abort --> core

`LLM.generate`'s loop and the server's engine thread run unchanged on it: `step()` waits for the
next outputs while requests are open (polling the process, so a dead core is noticed within
`POLL_MS`) and returns them as the in-process engine's `RequestOutput`s, built here from the core's
deltas: new token ids and logprobs, of which the front makes the text and finds the stop strings
(output_processor.py), aborting in the core a request a stop string ended.

Requests are checked before they are queued, as in one process: the prompt is tokenized and its
ids, length and the sampling params' ids checked here (`parse_prompt`, `check_vocab`: they need
only the tokenizer and the model's config); the pool's size (`scheduler.check_fits`) and a
structured output's grammar need the core's parts, so `make_request` asks the core
(`check_request`, one round trip) and raises its ValueError or TypeError. A request id still open
is refused here. `add_group` only queues its AddRequest: the requests added between two steps
reach the core as one message, so they start in one step, as in one process.

The core is a `python -m phases.p09_engine_core` subprocess in a session of its own (a Ctrl-C at
the terminal reaches the front, which stops it), not a `multiprocessing` child: spawn and
forkserver import the caller's main script again in the child (a script that calls `LLM()` at its
top, without a main guard, would run twice), and a fork after PyTorch started its threads is not
safe. The price is the child's own interpreter importing PyTorch, about a second, which the
front's reading of the config and tokenizer overlaps (tools/start_cost.py measures it).

When the core dies (killed, out of memory, a bug), the next call raises `EngineDeadError` naming
the engine core, its pid and how it ended; every open request failed with it, and
`has_unfinished_requests` is False from then on. `shutdown()` (or the client's garbage collection,
or the interpreter's exit) asks the core to stop, kills it if it does not within
`SHUTDOWN_TIMEOUT_S`, and removes the sockets' private directory.

vLLM: `vllm/v1/engine/core_client.py` (`SyncMPClient`, `AsyncMPClient`; one thread receives
outputs), `vllm/v1/engine/utils.py` (starting the core and waiting for its handshake).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import zmq

import phases
from phases.p01_naive_attention import EngineSetup
from phases.p01_naive_attention.engine import checked_args
from tinyvllm.config import EngineConfig
from tinyvllm.download import resolve_model
from tinyvllm.errors import EngineDeadError, StepError
from tinyvllm.inputs import PromptType, parse_prompt
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.secret_env import child_env, secrets_for

from . import serial
from .core import socket_paths
from .output_processor import FrontSequence
from .serial import (Abort, AddRequest, BadMessage, Failed, Outputs, Ready, Refused, RequestDelta, Shutdown,
                     Utility, UtilityResult)

logger = logging.getLogger("tinyvllm.engine_core_client")
POLL_MS = 50                 # a wait for the core looks at its process this often
SHUTDOWN_TIMEOUT_S = 5.0     # a core that does not stop within this is killed
REPO = Path(phases.__file__).resolve().parents[1]   # the registry's, also where a learner's copy of this runs


@dataclass(slots=True)
class FrontRequest:
    """A request checked by `make_request`, not yet sent (what `add_group` sends)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(slots=True)
class _Open:
    """What the front keeps of an open request to build its `RequestOutput`s from the deltas."""

    request: FrontRequest
    seqs: list[FrontSequence]
    prompt_logprobs: list | None = field(default=None)


def remote_error(text: str) -> Exception:
    """An error the core reported as "Type: message": bad input (ValueError, TypeError) as itself,
    anything else as a RuntimeError that names the engine core."""
    kind, _, message = text.partition(": ")
    if kind in ("ValueError", "TypeError"):
        return {"ValueError": ValueError, "TypeError": TypeError}[kind](message)
    return RuntimeError(f"the engine core: {text}")


class _CoreProcess:
    """The child process and the sockets to it; `stop` is idempotent (the client's finalizer)."""

    def __init__(self, phase: int, model_path: str, engine_args: dict, nnodes: int):
        try:
            args = json.dumps(engine_args)
        except TypeError as e:
            raise TypeError(f"engine arguments cross to the engine core as JSON: {e}") from None
        self.ipc_dir = tempfile.mkdtemp(prefix="tinyvllm-core-")   # mode 0700: this user's alone
        self.ctx = zmq.Context()
        self.inputs, self.outputs = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for sock in (self.inputs, self.outputs):
            sock.setsockopt(zmq.LINGER, 0)
        in_path, out_path = socket_paths(self.ipc_dir)
        self.inputs.bind(in_path)
        self.outputs.bind(out_path)
        # the one child that needs a secret is given it: ranks on several hosts sign with it, and
        # so do a KV producer and its consumers on a socket
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))   # this code, not another copy
        env = child_env(PYTHONPATH=path, **secrets_for(engine_args, nnodes))
        cmd = [sys.executable, "-m", "phases.p09_engine_core", self.ipc_dir, str(os.getpid()), str(phase),
               model_path, args]
        try:   # a session of its own: a Ctrl-C at the terminal reaches the front, which stops the core
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            self.close()
            raise

    def how_it_ended(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self, ask: bool = True) -> None:
        """End the core (asked to, or, with `ask` False, killed at once) and let go of the sockets."""
        if self.proc.poll() is None and not ask:
            self.proc.kill()
        if self.proc.poll() is None:
            try:
                self.inputs.send(serial.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def close(self) -> None:
        if not self.ctx.closed:
            self.inputs.close(), self.outputs.close()
            self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class EngineCoreClient:
    """Phase 9's engine as the front process sees it: the in-process engine's public interface
    (what `LLM`, the CLI and the server call), over an engine core in a child process.

    Args:
        model: a model folder (None: the default model), as `LLM` takes it.
        engine_args: the engine arguments (checked by the registry first).
        phase: whose parts the core builds.

    The core is started first, and the front reads the model's config and tokenizer
    (`EngineSetup.create`) while the core's interpreter imports PyTorch: most of what the front
    needs costs no time the core would not take anyway.
    """

    def __init__(self, model, engine_args: dict, phase: int):
        self.phase = phase
        model_path = resolve_model(model, engine_args.get("tokenizer"))   # first: a default model converted once, not by both
        config = EngineConfig.from_kwargs(**engine_args)
        self._core = _CoreProcess(phase, str(model_path), engine_args, config.nnodes)
        self._finalizer = weakref.finalize(self, self._core.stop)
        try:
            self.setup = setup = EngineSetup.create(model_path, engine_args)
        except BaseException:   # the core would load the model for nothing: stopped at once
            self._core.stop(ask=False)
            raise
        self.config, self.tokenizer = setup.config, setup.tokenizer
        self.device, self.dtype, self.model_path = setup.device, setup.dtype, setup.model_path
        self.model_config, self.max_model_len = setup.model_config, setup.max_model_len
        self.eos_token_ids = setup.eos_token_ids
        self._open: dict[str, _Open] = {}
        self._outputs: list[RequestOutput] = []     # received, not yet returned by step
        self._errors: list[StepError] = []          # failed requests, raised by the next step
        self._results: dict[int, UtilityResult] = {}
        self._awaited: set[int] = set()             # call ids whose answers are waited for
        self._call_ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._fatal: str | None = None              # the core's last words, if it said any
        self._build_error: str | None = None        # why the core could not build the engine
        self._ready: Ready | None = None
        self._snapshot: dict = {}
        # The state above changes under `_lock`; one thread at a time receives (`_receiving`), and
        # wakes the others (`_received`) when what it took may be what they wait for: a server's
        # request check is answered while its engine thread waits for the next outputs.
        self._lock = threading.RLock()
        self._received = threading.Condition(self._lock)
        self._receiving = threading.Lock()
        self._send_lock = threading.Lock()          # a zmq socket is used by one thread at a time
        self._pending: list[bytes] = []             # messages of add_group, sent with the next one
        self._wait(lambda: self._ready is not None)
        if self._dead is not None:
            self.shutdown()
            if self._build_error is not None:   # a bad argument only the parts could see: as in one process
                raise remote_error(self._build_error) from self._dead
            raise self._dead
        self.core_pid = self._ready.pid

    # -- requests in -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> FrontRequest:
        """Check a request (here, and in the core what needs its parts); raises on bad input."""
        self.check_health()
        params = checked_args(request_id, params, self._open)
        text, ids = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        params.check_vocab(self.model_config.vocab_size)   # here too: top_k=2**70 must not reach msgpack
        self._call("check_request", len(ids), serial.params_to_wire(params))
        return FrontRequest(request_id, text, ids, params, arrival_time or time.perf_counter())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        self.add_group(self.make_request(request_id, prompt, params, arrival_time))

    def add_group(self, request: FrontRequest) -> None:
        """Send a request `make_request` checked to the core."""
        self.check_health()
        with self._lock:
            if request.request_id in self._open:
                raise ValueError(f"request_id {request.request_id!r} is already running")
            seqs = [FrontSequence(i, self.tokenizer, request.prompt_token_ids, request.params)
                    for i in range(request.params.n)]
            self._open[request.request_id] = _Open(request, seqs)
        message = AddRequest(request.request_id, request.prompt_token_ids, serial.params_to_wire(request.params),
                             request.arrival_time)
        with self._send_lock:   # sent with the next message, or by step
            self._pending.append(serial.encode(message))

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now (the core frees their blocks at its next turn); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            known = [rid for rid in ids if self._open.pop(rid, None) is not None]
        if known and self._dead is None:
            self._send(Abort(known))

    def has_unfinished_requests(self) -> bool:
        """Requests still open, or outputs and errors received (by any thread) that `step` has not
        returned yet: the last of a request must reach its caller."""
        return bool(self._open or self._outputs or self._errors)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._open)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The outputs the core sent since the last call (waiting for some while requests are
        open). Raises `StepError` for requests whose step failed in the core (the others go on),
        and `EngineDeadError` once the core is gone."""
        self._send()   # the requests added since the last call
        self._wait(lambda: self._outputs or self._errors or not self._open)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if self._errors:
                raise self._errors.pop(0)
            outputs, self._outputs = self._outputs, []
        return outputs

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the core has died (without waiting for it)."""
        if self._dead is None and self._core.proc.poll() is not None:
            self._wait(lambda: False, POLL_MS)   # its last words, then its death, noticed
        if self._dead is not None:
            raise self._dead

    # -- numbers -----------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        return self._call("get_stats")

    def reset_stats(self) -> None:
        self._call("reset_stats")

    def model_facts(self) -> dict:
        return self._call("model_facts")

    def wait_until_compiled(self, max_batch: int | None = None) -> float:
        """Wait for the core's decode step compiling in the background, where a batch of
        `max_batch` would use it (a benchmark asks before it times); the seconds waited."""
        return self._call("wait_until_compiled", max_batch)

    def snapshot(self) -> dict:
        """The engine's state as plain data. While requests run, the last one the core sent (at
        most `core.SNAPSHOT_EVERY_S` old: a server's step loop never waits for the core to
        answer); when none run, asked of the core now."""
        if self._open or self._dead is not None:
            return self._snapshot
        self._snapshot = self._call("snapshot")
        return self._snapshot

    def shutdown(self) -> None:
        """Stop the engine core (asked, then killed after SHUTDOWN_TIMEOUT_S) and remove its sockets."""
        self._finalizer()

    # -- the sockets -------------------------------------------------------------------------------
    def _send(self, message=None, after_adds: bool = True) -> None:
        """Send `message`; with `after_adds`, after every request `add_group` queued, in order, as
        one ZeroMQ message of several parts. The core takes such a batch whole, so the requests of
        a `generate` call start in one step, as in one process (and their tokens are the same to
        the last bit). A utility call goes alone: checking the next request must not start the
        ones before it, one step each."""
        with self._send_lock:
            parts = [serial.encode(message)] if message is not None else []
            if after_adds:
                parts, self._pending = self._pending + parts, []
            if parts:
                self._core.inputs.send_multipart(parts, copy=False)

    def _call(self, method: str, *args):
        """Run one of the core's utilities and wait for its answer (its ValueError/TypeError raised here)."""
        self.check_health()
        call_id = next(self._call_ids)
        with self._lock:
            self._awaited.add(call_id)
        try:
            self._send(Utility(call_id, method, list(args)), after_adds=False)
            self._wait(lambda: call_id in self._results)
            if self._dead is not None:
                raise self._dead
        finally:
            with self._lock:
                self._awaited.discard(call_id)
                answer = self._results.pop(call_id, None)
        if answer.error is not None:
            raise remote_error(answer.error)
        return answer.result

    def _wait(self, done, timeout_ms: float | None = None) -> None:
        """Until `done()` or the core is dead (or `timeout_ms` passed): receive, where no other
        thread does, else wait to be woken by the one that does. The core's process is looked at
        every POLL_MS."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while deadline is None or time.monotonic() < deadline:
            with self._lock:
                if done() or self._dead is not None:
                    return
            if self._receiving.acquire(blocking=False):
                try:
                    self._receive(POLL_MS)
                finally:
                    self._receiving.release()
                continue
            with self._received:
                if not (done() or self._dead is not None):
                    self._received.wait(POLL_MS / 1000)

    def _receive(self, timeout_ms: int) -> None:
        """Handle every message waiting (waiting up to `timeout_ms` for the first), and wake the
        threads that wait; notice a dead core."""
        outputs = self._core.outputs
        if not outputs.poll(timeout_ms):
            if self._core.proc.poll() is not None:
                with self._received:
                    self._died()
                    self._received.notify_all()
            return
        with self._received:
            while True:
                try:
                    data = outputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._handle(serial.decode(data.bytes))
                except (BadMessage, ValueError, TypeError, KeyError) as e:
                    logger.warning("refused a message from the engine core: %s", e)
            self._received.notify_all()

    def _handle(self, message) -> None:
        if isinstance(message, Outputs):
            for delta in message.outputs:
                self._apply(delta)
            if message.snapshot is not None:
                self._snapshot = message.snapshot
        elif isinstance(message, UtilityResult):
            if message.call_id not in self._awaited:
                raise BadMessage(f"an answer to no call waiting (call {message.call_id}: {message.error})")
            self._results[message.call_id] = message
        elif isinstance(message, Failed):
            if message.kind in ("fatal", "build"):
                self._fatal = message.message
                self._build_error = message.message if message.kind == "build" else None
                return
            failed = [rid for rid in message.request_ids if self._open.pop(rid, None) is not None]
            if failed:
                self._errors.append(StepError(failed, RuntimeError(f"in the engine core: {message.message}")))
        elif isinstance(message, Refused):
            logger.warning("the engine core refused a message: %s", message.reason)
        elif isinstance(message, Ready):
            self._ready, self._snapshot = message, message.snapshot
        else:
            raise BadMessage(f"a {type(message).__name__} message, which only the front sends")

    def _apply(self, delta: RequestDelta) -> None:
        """Add a request's delta to what the front holds of it; queue its RequestOutput."""
        # >>> exercise front_outputs (2 stars): The front's output processing: a request's delta (each sequence's new token ids, logprobs, how the core ended it) taken by its sequences, and its RequestOutput queued as the engine in one process would return it; a request a stop string ended here is aborted in the core.
        # hint: a delta of a request no longer open is dropped; FrontSequence.take and to_output; the request is finished when all its sequences are; the core does not know of a stop string: self._send(Abort([...])).
        # checked by: test_phase9_gives_phase8_s_outputs, test_preemption_and_prefix_caching_give_phase8_s_tokens, test_ngram_drafts_and_structured_outputs_through_the_split, test_a_stop_string_ends_the_request_in_the_front_and_the_core
        state = self._open.get(delta.request_id)
        if state is None:   # aborted here (or ended by a stop string) after the core had run it
            return
        for s in delta.seqs:
            state.seqs[s.index].take(s)
        if delta.new_prompt_logprobs is not None:
            state.prompt_logprobs = (state.prompt_logprobs or []) + serial.prompt_logprobs_from_wire(
                delta.new_prompt_logprobs)
        finished = all(seq.finish_reason is not None for seq in state.seqs)
        metrics = serial.metrics_from_wire(delta.metrics)
        if finished and metrics.finished_time is None:   # ended here, at the last token's time
            metrics.finished_time = metrics.last_token_time
        r = state.request
        self._outputs.append(RequestOutput(
            r.request_id, r.prompt, r.prompt_token_ids, [seq.to_output() for seq in state.seqs], finished,
            metrics, delta.num_cached_tokens, None if state.prompt_logprobs is None else list(state.prompt_logprobs)))
        if finished:
            del self._open[delta.request_id]
            if not delta.finished:   # a stop string, which the core does not look for
                self._send(Abort([delta.request_id]))
        # <<< exercise front_outputs

    def _died(self) -> None:
        """The core is gone: every open request fails, and every later call raises."""
        core = self._core
        open_ids = list(self._open)
        reason = f": {self._fatal}" if self._fatal else ""
        self._dead = EngineDeadError(
            f"the engine core process (pid {core.proc.pid}) has died ({core.how_it_ended()}){reason}; "
            f"its {len(open_ids)} open request(s) failed")
        self._open.clear()
        self._outputs.clear()
        self._errors.clear()
