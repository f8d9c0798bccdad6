"""Errors an engine raises about its own running, as opposed to bad input (ValueError/TypeError,
raised before a request is queued)."""

from __future__ import annotations


class StepError(RuntimeError):
    """A step failed while running some requests. Those requests were aborted (their blocks are
    free again); `request_ids` lists them, for the caller to tell each one's client. The message
    names none of them: a server shows it to every client of the step, and one client must not
    learn another's request ids. The engine is consistent and takes new requests, and the other
    requests it holds go on. `__cause__` is the original exception."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = list(request_ids)
        super().__init__(f"a step failed ({type(cause).__name__}: {cause}); its "
                         f"{len(self.request_ids)} request(s) were aborted, and the engine goes on")


class EngineDeadError(RuntimeError):
    """The engine cannot run any request any more: its thread stopped, or the process of its
    engine core died (phase 9). Every open request fails with it; a server answers 503 and exits
    non-zero, for a supervisor to restart it."""
