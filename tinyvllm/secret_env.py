"""The secrets tinyvllm reads from its environment, kept out of every other process.

Three variables hold secrets (`SECRET_VARIABLES`): `TINYVLLM_TP_TOKEN`, the key every rank of an
engine over several hosts signs its messages with, `TINYVLLM_API_KEY`, the server's key, and
`TINYVLLM_KV_TOKEN`, the key a KV producer and its consumers sign their frames with. A
process's environment is copied into every process it starts: a C compiler (`tinyvllm.ckernel`),
inductor's compile workers, a tensor-parallel worker. So a secret does not stay there:

- `take_secret` reads one and takes it out of `os.environ` (`tinyvllm serve` takes both before it
  builds anything), so no process started after inherits it; this process's later readers (a
  second engine) get it from here.
- `child_env` is the environment tinyvllm gives every process it starts: this one's without any
  secret variable, even one set again after it was taken. The one child that needs a secret, a
  worker rank, is given it on purpose, in its environment (the command line is anyone's to read
  with `ps`).
"""

from __future__ import annotations

import os

SECRET_VARIABLES = ("TINYVLLM_TP_TOKEN", "TINYVLLM_API_KEY", "TINYVLLM_KV_TOKEN")

# The secrets taken out of os.environ, by variable: a registry of this process's, read by later
# engines of the same process
_TAKEN: dict[str, str] = {}


def take_secret(name: str) -> str | None:
    """The value of the secret variable `name`, taken out of `os.environ` (a value set there again
    replaces the one taken before); None where it was never set."""
    if name not in SECRET_VARIABLES:
        raise ValueError(f"name must be one of {', '.join(SECRET_VARIABLES)}, got {name!r}")
    value = os.environ.pop(name, None)
    if value is not None:
        _TAKEN[name] = value
    return _TAKEN.get(name)


def take_secrets() -> None:
    """Take every secret variable out of `os.environ` (a command does this first)."""
    for name in SECRET_VARIABLES:
        take_secret(name)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process tinyvllm starts: this process's without any secret variable,
    then `extra` (which may give one on purpose)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    env.update(extra)
    return env


def secrets_for(engine_args: dict, nnodes: int = 1) -> dict[str, str]:
    """The secret variables an engine with these arguments signs with, to be given on purpose to
    the process that runs it: TINYVLLM_TP_TOKEN over several hosts (`nnodes`), TINYVLLM_KV_TOKEN
    for a KV producer or consumer on a socket (`kv_transfer_config`'s kv_port). Those not set are
    left out (the engine names them when it starts)."""
    kv = engine_args.get("kv_transfer_config")
    wanted = (["TINYVLLM_TP_TOKEN"] if nnodes > 1 else []) + \
        (["TINYVLLM_KV_TOKEN"] if isinstance(kv, dict) and kv.get("kv_port") is not None else [])
    found = {name: take_secret(name) for name in wanted}
    return {name: value for name, value in found.items() if value}
