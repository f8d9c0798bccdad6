"""The engine core: phase 8's engine in a process of its own, driven by messages.

    front process (core_client.py)                 engine core process (this file)
    tokenize, check, text, HTTP                    Engine(setup, parts): the one loop
        AddRequest / Abort / Utility  --PUSH-->  PULL   take every message waiting
                                                        engine.step()
        Outputs / Failed / Refused    <--PULL--  PUSH   send the new token ids

`EngineCoreProc.run` is the busy loop (vLLM's `EngineCoreProc.run_busy_loop`,
vllm/v1/engine/core.py): take every input message (waiting for one only when no request runs),
add and abort requests, step, send each request's new tokens. A message that does not decode is
refused and logged by its reason (`serial.BadMessage`), and the front is told (`Refused`); it is
never run. A step that fails (`StepError`) fails its requests only (`Failed`), and the loop goes
on. With `async_scheduling` the step is a `BatchQueue`'s (batch_queue.py, vLLM's
`step_with_batch_queue`): the next step is scheduled while this one's model runs, two batches in
flight; without, it is `Engine.step`. Nothing around it changes.

Where the text is made: in the front, as in vLLM (its core sends token ids; `OutputProcessor`
detokenizes and applies stop strings, vllm/v1/engine/output_processor.py). The core's engine is
built with `detokenize=False` (`EngineSetup`): its sequences keep token ids only, and look for no
stop string; they end by what sampling decides (EOS, stop token ids, max_tokens, the context
length, the grammar). The front's `FrontSequence` (output_processor.py) makes the text with the
same `SequenceText` a sequence keeps in one process, and aborts a request a stop string ended.
(The text of each logprob's token, `Logprob.decoded_token`, is still the sampler's, in the core.)

Structured outputs are compiled here, in the core (as vLLM's `StructuredOutputManager` does,
vllm/v1/structured_output/): the grammar's matcher advances with every token the core samples,
so it lives where the sampling does; the front asks the core to check a constraint
(`check_request`) before the request is queued, and the compiled grammar waits in the core's
cache for the request that follows.

The core ends with its front: it asks the kernel for a signal when its parent dies
(`prctl(PR_SET_PDEATHSIG)`; Linux) and also compares its parent's pid whenever it waits, so a
front that was killed leaves no core holding the model's memory. SIGTERM and SIGINT end it too; a
`Shutdown` message ends it cleanly.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import time
import traceback

import zmq

from tinyvllm.errors import StepError
from tinyvllm.outputs import RequestOutput

from . import serial
from .async_scheduler import AsyncScheduler
from .batch_queue import BatchQueue
from .serial import (Abort, AddRequest, BadMessage, Failed, Outputs, Ready, Refused, RequestDelta, SeqDelta,
                     Shutdown, Utility, UtilityResult)

logger = logging.getLogger("tinyvllm.engine_core")
PARENT_POLL_MS = 500          # how often an idle core looks whether its front is still there
SNAPSHOT_EVERY_S = 0.1        # while nothing comes or goes, the engine's state rides on Outputs this often
PR_SET_PDEATHSIG = 1          # linux/prctl.h
PARENT_DEATH_SIGNAL = signal.SIGUSR1


def socket_paths(ipc_dir: str) -> tuple[str, str]:
    """The two sockets of one engine core: (front -> core, core -> front), in the front's private
    directory (mode 0700: no other user can connect)."""
    return f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"


class EngineCoreProc:
    """The core's side of the sockets around one in-process `Engine`.

    Args:
        engine: phase 8's engine (`Engine(setup, parts)`), built in this process.
        inputs: a PULL socket, connected to the front's; outputs: a PUSH socket.
        parent_pid: the front's pid; the core ends when it is gone (and removes `ipc_dir`, the
            sockets' directory, which the front removes otherwise).
    """

    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int, ipc_dir: str):
        self.engine, self.inputs, self.outputs = engine, inputs, outputs
        self.parent_pid, self.ipc_dir = parent_pid, ipc_dir
        self.stopping = False
        self.sent: dict[str, tuple[list[int], int]] = {}   # request id -> (tokens sent per seq, prompt logprobs sent)
        self.snapshot_sent_at = 0.0
        self.state_changed = True
        # the step: two batches in flight where the scheduler can plan ahead, else Engine.step
        self.batch_queue = BatchQueue(engine) if isinstance(engine.scheduler, AsyncScheduler) else None
        self.step = self.batch_queue.step if self.batch_queue is not None else engine.step
        self.utilities = {   # the calls a Utility message may make: these, never any name it brings
            "check_request": self.check_request,
            "get_stats": engine.get_stats,
            "reset_stats": engine.reset_stats,
            "snapshot": engine.snapshot,
            "model_facts": engine.model_facts,
            "wait_until_compiled": self.wait_until_compiled,
        }

    def send(self, message) -> None:
        self.outputs.send(serial.encode(message), copy=False)

    # -- the busy loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Take messages, step while requests run, send outputs; until Shutdown or the front is gone."""
        engine = self.engine
        while not self.stopping:
            self.take_inputs(wait=not engine.has_unfinished_requests())
            if self.stopping:
                break
            if engine.has_unfinished_requests():
                self.step_once()
            self.send_snapshot_if_due()

    def take_inputs(self, wait: bool) -> None:
        """Handle every message waiting; with `wait`, first wait for one (looking for the front)."""
        while wait and not self.inputs.poll(PARENT_POLL_MS):
            self.check_parent()
        while not self.stopping:
            try:
                parts = self.inputs.recv_multipart(zmq.NOBLOCK)   # a batch of records arrives whole
            except zmq.Again:
                return
            for data in parts:
                self.handle(data)

    def check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            logger.warning("the front process (pid %d) is gone: the engine core exits", self.parent_pid)
            shutil.rmtree(self.ipc_dir, ignore_errors=True)   # the front is not there to remove it
            raise SystemExit(1)

    def handle(self, data: bytes) -> None:
        try:
            message = serial.decode(data)
        except BadMessage as e:
            self.refuse(f"{e}")
            return
        self.state_changed = True
        # >>> exercise core_message (2 stars): The core's side of one decoded message: a request added, requests aborted (forgetting what was sent of them), a utility called, the loop told to stop; a record only the core sends is refused by its name.
        # hint: self.add(message), self.engine.abort_request(ids) and self.sent, self.call(message), self.stopping, self.refuse(reason).
        # checked by: test_phase9_gives_phase8_s_outputs, test_a_reused_id_and_an_unknown_abort, test_a_message_that_does_not_decode_is_refused_and_the_requests_go_on, test_a_stop_string_ends_the_request_in_the_front_and_the_core
        if isinstance(message, AddRequest):
            self.add(message)
        elif isinstance(message, Abort):
            self.engine.abort_request(message.request_ids)
            for rid in message.request_ids:
                self.sent.pop(rid, None)
        elif isinstance(message, Utility):
            self.call(message)
        elif isinstance(message, Shutdown):
            self.stopping = True
        else:   # a record, but one the core sends, not takes
            self.refuse(f"a {type(message).__name__} message, which only the engine core sends")
        # <<< exercise core_message

    def refuse(self, reason: str) -> None:
        logger.warning("engine core: refused a message: %s", reason)
        self.send(Refused(reason))

    def add(self, m: AddRequest) -> None:
        engine = self.engine
        if m.request_id in engine.groups:   # never fail the running one for its namesake
            self.refuse(f"AddRequest: request_id {m.request_id!r} is already running")
            return
        try:
            params = serial.params_from_wire(m.params)
            group = engine.make_request(m.request_id, {"prompt_token_ids": m.prompt_token_ids}, params,
                                        arrival_time=m.arrival_time)
        except (ValueError, TypeError) as e:   # the front checked it; a front that did not is told
            self.send(Failed([m.request_id], "step", f"the engine core refused the request: {e}"))
            return
        engine.add_group(group)
        self.sent[m.request_id] = ([0] * len(group.seqs), 0)

    def check_request(self, num_prompt_tokens: int, params: dict) -> None:
        """The checks of a request that need the core's parts (the pool's size, the grammar)."""
        if not isinstance(num_prompt_tokens, int):
            raise TypeError("num_prompt_tokens must be an int")
        self.engine.check_request(num_prompt_tokens, serial.params_from_wire(params))

    def wait_until_compiled(self, max_batch: int | None) -> float:
        """Wait for a decode step compiling in the background (phase 7 on a CPU), unless phase 7's
        C step serves every batch up to `max_batch`; the seconds waited. A benchmark asks this
        before its timed rounds (tinyvllm.entrypoints.bench's EngineRunner decides the same way
        for an engine in its own process)."""
        runner = getattr(self.engine.runner, "decode_runner", None)
        wait, c_step = getattr(runner, "wait_until_compiled", None), getattr(runner, "c_step", None)
        start = time.perf_counter()
        if wait is not None and not (max_batch and c_step and c_step.serves(max_batch)):
            wait()
        return time.perf_counter() - start

    def call(self, m: Utility) -> None:
        method = self.utilities.get(m.method)
        if method is None:
            self.send(UtilityResult(m.call_id, None, f"ValueError: no such call {m.method[:40]!r}"))
            return
        try:
            result, error = method(*m.args), None
        except Exception as e:
            result, error = None, f"{type(e).__name__}: {e}"
        self.send(UtilityResult(m.call_id, result, error))

    # -- one step ------------------------------------------------------------------------------------
    def step_once(self) -> None:
        engine = self.engine
        try:
            outputs = self.step()
        except StepError as e:             # its requests are aborted; the others go on
            self.fail(e.request_ids, str(e))
            return
        except Exception as e:             # no request named: every request fails, the core goes on
            ids = engine.unfinished_request_ids()
            engine.abort_request(ids)
            self.fail(ids, str(StepError(ids, e)))
            return
        snapshot = None   # the state, when requests came or went, and now and then besides
        if (self.state_changed or any(out.finished for out in outputs) or not engine.has_unfinished_requests()
                or time.monotonic() - self.snapshot_sent_at >= SNAPSHOT_EVERY_S):
            snapshot = self.take_snapshot()
        if outputs or snapshot is not None:   # a batch queue's first step returns none
            self.send(Outputs([self.delta(out) for out in outputs], snapshot))

    def fail(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self.sent.pop(rid, None)
        self.send(Failed(list(request_ids), "step", message))

    def delta(self, out: RequestOutput) -> RequestDelta:
        """What is new in `out` since the last delta of its request: its token ids and logprobs,
        each sent once, and how it ended (the front makes the text)."""
        seqs_sent, prompt_sent = self.sent.get(out.request_id) or ([0] * len(out.outputs), 0)
        seqs = []
        for c in out.outputs:
            start = seqs_sent[c.index]
            seqs.append(SeqDelta(c.index, c.token_ids[start:],
                                 None if c.logprobs is None else serial.logprobs_to_wire(c.logprobs[start:]),
                                 c.finish_reason, c.stop_reason))
            seqs_sent[c.index] = len(c.token_ids)
        new_prompt = None
        if out.prompt_logprobs is not None:
            new_prompt = serial.prompt_logprobs_to_wire(out.prompt_logprobs[prompt_sent:])
            prompt_sent = len(out.prompt_logprobs)
        if out.finished:
            self.sent.pop(out.request_id, None)
        else:
            self.sent[out.request_id] = (seqs_sent, prompt_sent)
        return RequestDelta(out.request_id, out.finished, out.num_cached_tokens,
                            serial.metrics_to_wire(out.metrics), new_prompt, seqs)

    def take_snapshot(self) -> dict:
        self.snapshot_sent_at, self.state_changed = time.monotonic(), False
        return self.engine.snapshot()

    def send_snapshot_if_due(self) -> None:
        """An idle engine whose state changed (an abort, say) sends it once."""
        if self.state_changed and not self.engine.has_unfinished_requests():
            self.send(Outputs([], self.take_snapshot()))


# -- the process -------------------------------------------------------------------------------------
def exit_with_parent(parent_pid: int, ipc_dir: str) -> None:
    """Have the kernel signal this process when the thread that started it ends, and exit then if
    the front itself is gone (a thread of a living front may have started it). The idle loop
    also compares parent pids (`check_parent`), where prctl is not there."""
    def on_parent_death(signum, frame):
        if os.getppid() != parent_pid:
            shutil.rmtree(ipc_dir, ignore_errors=True)   # the front is not there to remove it
            os._exit(1)

    signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (AttributeError, OSError):   # not Linux: the pid comparison alone
        pass
    on_parent_death(None, None)         # it may have died before prctl was asked


def core_main(ipc_dir: str, parent_pid: int, make_engine) -> int:
    """The body of the engine core process: connect, build the engine (`make_engine()`), say
    Ready (or Failed, with the reason), run the busy loop; its exit code."""
    exit_with_parent(parent_pid, ipc_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    if not logger.handlers:
        logging.basicConfig(level=logging.INFO, format="%(name)s (pid %(process)d): %(message)s")
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inputs, outputs):
        sock.setsockopt(zmq.LINGER, 1000)
    in_path, out_path = socket_paths(ipc_dir)
    inputs.connect(in_path)
    outputs.connect(out_path)
    engine, core, code = None, None, 0
    try:
        try:
            engine = make_engine()
        except BaseException as e:
            if not isinstance(e, (ValueError, TypeError)):   # a bad argument is the front's to raise
                traceback.print_exc()
            outputs.send(serial.encode(Failed([], "build", f"{type(e).__name__}: {e}")))
            return 1
        core = EngineCoreProc(engine, inputs, outputs, parent_pid, ipc_dir)
        core.send(Ready(os.getpid(), core.take_snapshot()))
        try:
            core.run()
        except Exception as e:   # a bug in the loop: the front hears why before the core is gone
            traceback.print_exc()
            ids = engine.unfinished_request_ids()
            outputs.send(serial.encode(Failed(ids, "fatal", f"{type(e).__name__}: {e}")))
            code = 1
    finally:
        if core is not None and core.batch_queue is not None:
            core.batch_queue.close()
        if engine is not None:
            engine.shutdown()
        inputs.close(), outputs.close()
        ctx.term()
    return code
