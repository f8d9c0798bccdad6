"""Errors an engine raises about its own running, as opposed to bad input (ValueError/TypeError,
raised before a request is queued)."""

from __future__ import annotations


class StepError(RuntimeError):
    """A step failed while running some requests. Those requests were aborted (their blocks are
    free again) and are named here; the engine is consistent and takes new requests, and the
    other requests it holds go on. `__cause__` is the original exception."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = list(request_ids)
        super().__init__(f"a step failed running request(s) {', '.join(self.request_ids[:8])}"
                         f"{' ...' if len(self.request_ids) > 8 else ''} ({type(cause).__name__}: {cause}); "
                         f"they were aborted, and the engine goes on")
