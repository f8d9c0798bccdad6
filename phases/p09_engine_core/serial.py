"""The messages between the front process and the engine core: small typed records in msgpack.

    front -> core   AddRequest   a checked request: its id, prompt token ids, sampling params
                    Abort        request ids to stop now (unknown ids are ignored)
                    Utility      a call that answers: check_request, get_stats, reset_stats, snapshot
                    Shutdown     finish and exit
    core -> front   Ready        the engine is built (or Failed: why it could not be)
                    Outputs      per request that got tokens this step, its new token ids (RequestDelta;
                                 the front makes the text)
                    Failed       requests the core could not run (a step failed), or the core itself
                    Refused      a message the core could not decode, by its reason (no request id:
                                 it did not decode)
                    UtilityResult  the answer to one Utility call

A record is a slotted dataclass; on the wire it is `[tag, field, field, ...]` (nested records as
lists, in field order). `decode` reads only plain msgpack data (no extension types) and then
checks the tag is a record's and every field has its declared type, so a message that does not
fit is refused by name (`BadMessage`) before anything acts on it. Nothing is ever unpickled: a
pickle from the other side would run whatever code it names.

This is vLLM's `vllm/v1/serial_utils.py` (msgspec structs over msgpack) and
`vllm/v1/engine/__init__.py` (EngineCoreRequest, EngineCoreOutputs), cut down: tinyvllm checks the
types itself instead of using msgspec, one dependency fewer.

`SamplingParams` crosses as its public fields (`params_to_wire`): the core builds it again, so its
checks run in the core too. Logprobs cross as `[token_id, logprob, rank, decoded_token]` rows.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

from tinyvllm.outputs import Logprob, RequestMetrics
from tinyvllm.sampling_params import SamplingParams

# Far above any real message (a prompt of max_model_len ids is a few hundred KB), far below what
# would hurt: a bigger one is refused before it is unpacked.
MAX_MESSAGE_BYTES = 64 * 2**20
RECORDS: dict[str, type] = {}   # tag -> record class: the only types a message may be


class BadMessage(ValueError):
    """A message that is not one of `RECORDS` with its fields' types; it is refused, never run."""


def record(cls):
    """Make `cls` a slotted dataclass and register it under its name (its tag on the wire)."""
    cls = dataclass(slots=True)(cls)
    RECORDS[cls.__name__] = cls
    return cls


# -- front -> core ----------------------------------------------------------------------------------
@record
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict             # `params_to_wire(SamplingParams)`
    arrival_time: float      # time.perf_counter() in the front: CLOCK_MONOTONIC, one clock for
                             # every process of the machine, so the core's times compare with it


@record
class Abort:
    request_ids: list[str]


@record
class Utility:
    call_id: int
    method: str              # one of the core's UTILITIES, never any attribute by name
    args: list


@record
class Shutdown:
    pass


# -- core -> front ----------------------------------------------------------------------------------
@record
class Ready:
    pid: int
    snapshot: dict


@record
class SeqDelta:
    index: int
    new_token_ids: list[int]
    new_logprobs: list | None          # a row list per new token; None without logprobs
    finish_reason: str | None          # "stop" (EOS, a stop token id), "length", "abort" (the grammar)
    stop_reason: int | str | None


@record
class RequestDelta:
    request_id: str
    finished: bool
    num_cached_tokens: int
    metrics: dict                      # RequestMetrics' fields
    new_prompt_logprobs: list | None   # prompt positions recorded since the last delta
    seqs: list[SeqDelta]


@record
class Outputs:
    outputs: list[RequestDelta]
    snapshot: dict | None              # the engine's state (Engine.snapshot), now and then


@record
class Failed:
    request_ids: list[str]
    kind: str                          # "step": a step failed, the core goes on; "fatal": the core
                                       # stops; "build": the engine could not be built
    message: str


@record
class Refused:
    reason: str


@record
class UtilityResult:
    call_id: int
    result: Any
    error: str | None                  # "ValueError: ..." when the call raised


# -- encoding ---------------------------------------------------------------------------------------
def _to_plain(value):
    """A record as the list of its fields, and a list of records as lists; other values as they
    are (msgpack writes them; a list's items are all of one type, so its first says which)."""
    if type(value).__name__ in RECORDS:
        return [_to_plain(getattr(value, name)) for name in value.__slots__]
    if isinstance(value, list) and value and type(value[0]).__name__ in RECORDS:
        return [_to_plain(v) for v in value]
    return value


def encode(message) -> bytes:
    """A record -> bytes: `[tag, *fields]` in msgpack."""
    if type(message).__name__ not in RECORDS:
        raise TypeError(f"not a message record: {type(message).__name__}")
    return msgpack.packb([type(message).__name__, *_to_plain(message)], use_bin_type=True)


def _refuse_ext(code, data):
    raise BadMessage(f"an extension type ({code}) where only plain data may be")


def decode(data: bytes):
    """Bytes -> the record they encode; `BadMessage` (naming what did not fit) for anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"a message of {len(data)} bytes, over the {MAX_MESSAGE_BYTES} allowed")
    try:
        plain = msgpack.unpackb(data, raw=False, ext_hook=_refuse_ext, strict_map_key=True)
    except BadMessage:
        raise
    except Exception as e:
        raise BadMessage(f"not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(plain, list) or not plain or not isinstance(plain[0], str):
        raise BadMessage("not a [tag, fields...] list")
    cls = RECORDS.get(plain[0])
    if cls is None:
        raise BadMessage(f"unknown message type {plain[0][:40]!r}")
    return _build(cls, plain[1:], plain[0])


def _build(cls, values, where: str):
    fields = _fields(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        raise BadMessage(f"{where}: {len(fields)} fields expected")
    return cls(*(check(v, f"{where}.{name}") for (name, check), v in zip(fields, values)))


@functools.cache
def _fields(cls) -> list[tuple[str, Any]]:
    """(name, checker) of each field of a record: its annotations read once."""
    hints = typing.get_type_hints(cls)
    return [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]


def _refuse(value, kind, where: str):
    raise BadMessage(f"{where}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")


@functools.cache
def _checker(kind):
    """A function (value, where) -> value as `kind` (int, float, str, bool, None, list[X], dict,
    list, X | Y, a record, Any), or BadMessage naming `where`. Made once per type."""
    if kind is Any:
        return lambda value, where: value
    if typing.get_origin(kind) in (typing.Union, types.UnionType):   # X | Y: None first, then each
        options = [_checker(k) for k in typing.get_args(kind) if k is not type(None)]
        nullable = type(None) in typing.get_args(kind)

        def union(value, where):
            if value is None and nullable:
                return value
            for option in options:
                try:
                    return option(value, where)
                except BadMessage:
                    pass
            _refuse(value, kind, where)
        return union
    if typing.get_origin(kind) is list:
        (item_kind,) = typing.get_args(kind)
        item = _checker(item_kind)

        def items(value, where):
            if not isinstance(value, list):
                _refuse(value, kind, where)
            if item_kind is int and all(type(v) is int for v in value):   # token ids: one pass
                return value
            return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items
    if kind is float:   # an int where a float may be (msgpack writes 2.0 as 2 from some senders)
        return lambda value, where: (float(value) if type(value) in (int, float) else _refuse(value, kind, where))
    if kind in (int, str, bool, list, dict, type(None)):
        return lambda value, where: value if type(value) is kind else _refuse(value, kind, where)
    if getattr(kind, "__name__", None) in RECORDS:
        return lambda value, where: _build(kind, value, where)
    raise TypeError(f"a record field of a type serial.py does not check: {kind}")


# -- what crosses inside the records ----------------------------------------------------------------
PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))


INT64 = (-(2**63), 2**63 - 1)   # what msgpack writes of a signed int; SamplingParams bounds most fields


def params_to_wire(params: SamplingParams) -> dict:
    """SamplingParams as its public fields; ValueError, naming the field, for an int that does not
    fit in 64 bits (max_tokens=2**70: no engine could run it, and msgpack cannot write it)."""
    wire = {name: getattr(params, name) for name in PARAM_FIELDS}
    for name, value in wire.items():
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{name} must fit in a 64-bit integer, got an int of {value.bit_length()} bits")
    if params.structured_outputs is not None:
        wire["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return wire


def params_from_wire(wire: dict) -> SamplingParams:
    """SamplingParams from its public fields (its own checks run again); ValueError/TypeError."""
    unknown = set(wire) - set(PARAM_FIELDS)
    if unknown:
        raise ValueError(f"sampling params: unknown field(s) {sorted(unknown)[:5]}")
    return SamplingParams(**wire)


def logprobs_to_wire(rows: list[dict[int, Logprob]]) -> list:
    return [[[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in row.items()] for row in rows]


def logprobs_from_wire(rows: list) -> list[dict[int, Logprob]]:
    return [{int(t): Logprob(float(lp), rank, text) for t, lp, rank, text in row} for row in rows]


def prompt_logprobs_to_wire(rows: list) -> list:
    return [None if row is None else logprobs_to_wire([row])[0] for row in rows]


def prompt_logprobs_from_wire(rows: list) -> list:
    return [None if row is None else logprobs_from_wire([row])[0] for row in rows]


def metrics_to_wire(m: RequestMetrics) -> dict:
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}


def metrics_from_wire(wire: dict) -> RequestMetrics:
    return RequestMetrics(**wire)
