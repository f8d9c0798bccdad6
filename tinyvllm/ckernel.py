"""C kernels built on first use and called through ctypes: `CKernel`.

A few of tinyvllm's CPU kernels are short C files beside the phase that teaches them (phase 3's
batch-invariant kernels, phase 5's int8/int4 products). Each is compiled once per machine with
the system's C compiler (`CC`, default `cc`) into `$TINYVLLM_CACHE/kernels/` (default
~/.cache/tinyvllm), the library named after a hash of its source and flags, so an edit or
another compiler builds a new one. A library is loaded from there only while that folder is this
user's alone (`private_dir`): anyone who could write it would choose the code that runs. A C++ file (phase 7's operators) is compiled by `CXX` (default
`c++`), with the folders it searches given apart from its flags (`search`: PyTorch's headers and
libraries, wherever the environment keeps them) so that they are not in the name. It is loaded
only where the CPU kind tinyvllm acts as has the instructions it was compiled for
(`tinyvllm.platform`), with the macros its rules set (`defines`: `-DFETCH_AHEAD=1` on the kind
whose rule says so, `-DCODES_AHEAD=4096` where a rule is a number); where it cannot be built,
`load()` warns once and returns None, and the caller takes another path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tinyvllm import platform
from tinyvllm.secret_env import child_env


@dataclass
class CKernel:
    """One C file: how to build it, where it can run, and its functions' argument types."""

    source: Path
    flags: list[str]
    needs: frozenset[str]          # CPU flags (/proc/cpuinfo) it needs
    signatures: dict[str, list]
    fallback: str = "another kernel is used"   # what happens where it cannot be built (the warning)
    search: dict[str, str] = field(default_factory=dict)   # CPATH, LIBRARY_PATH, ...: not in the key
    defines: dict[str, str] = field(default_factory=dict)  # macro -> the platform rule it is (0/1, or a number)
    lib: ctypes.CDLL | None = None
    tried: bool = False

    def build(self, cache: Path | None = None) -> Path:
        """Compile the source (once: the file is reused while the source and flags are the same)."""
        from tinyvllm.download import cache_dir, private_dir

        src = self.source.read_bytes()
        cc = os.environ.get("CXX", "c++") if self.source.suffix == ".cpp" else os.environ.get("CC", "cc")
        rules = platform.current()
        flags = self.flags + [f"-D{macro}={int(rules.rule(rule) or 0)}" for macro, rule in self.defines.items()]
        key = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
        out = private_dir(cache or cache_dir() / "kernels") / f"{self.source.stem}-{key}.so"
        if not out.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # several processes may build
            os.close(fd)
            try:
                subprocess.run([cc, *flags, str(self.source), "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, env=self.environment())
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return out

    def load(self) -> ctypes.CDLL | None:
        """The compiled library, or None where it cannot run or be built here (warned once). Where
        the kind the platform acts as cannot run it, None, asked again each time (a test or a tool
        may act as another kind)."""
        if not self.supported():
            return None
        if not self.tried:
            self.tried = True
            try:
                lib = ctypes.CDLL(str(self.build()))
                for name, argtypes in self.signatures.items():
                    getattr(lib, name).argtypes = argtypes
                    getattr(lib, name).restype = None
                self.lib = lib
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or e
                warnings.warn(f"tinyvllm: could not build {self.source.name} ({detail}); {self.fallback}")
        return self.lib

    def environment(self) -> dict[str, str]:
        """The compiler's environment: this process's without its secrets (`child_env`: a compiler
        needs no token or key), with `search`'s folders first."""
        env = child_env()
        for name, folder in self.search.items():
            env[name] = os.pathsep.join(p for p in (folder, env.get(name)) if p)
        return env

    def supported(self) -> bool:
        """The CPU kind tinyvllm acts as has the instructions the file is compiled for."""
        return platform.current().has(self.needs)

    def available(self) -> bool:
        return self.load() is not None

    def address(self, name: str) -> int:
        """Where the loaded library's function `name` starts, for a caller in C or C++."""
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value


def torch_extension(source: Path, needs: frozenset[str], signatures: dict[str, list], fallback: str) -> CKernel:
    """A C++ file of PyTorch operator kernels (torch/library.h), built against the installed
    PyTorch: its headers and libraries (their folders kept out of the name, its version in it)."""
    import torch

    root = Path(torch.__file__).parent
    return CKernel(source, ["-O2", "-std=c++20", "-shared", "-fPIC", f"-DTORCH_VERSION={torch.__version__}",
                            "-Wl,--no-as-needed", "-ltorch_cpu", "-lc10"], needs, signatures, fallback,
                   search={"CPATH": str(root / "include"), "LIBRARY_PATH": str(root / "lib")})
