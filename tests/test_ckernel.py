"""`tinyvllm.ckernel.CKernel`: a C file built once, named after its source and flags; the folders
it searches (`search`) reach the compiler but not the name, so two environments that keep the
same headers in different places share one build."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from tinyvllm.ckernel import CKernel


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_search_folders_reach_the_compiler_but_not_the_name(tmp_path):
    source = tmp_path / "probe.c"
    source.write_text('#include "probe.h"\nint probe(void) { return PROBE; }\n')
    built = {}
    for value in (7, 7):
        headers = tmp_path / f"headers{len(built)}"
        headers.mkdir()
        (headers / "probe.h").write_text(f"#define PROBE {value}\n")
        kernel = CKernel(source, ["-O1", "-shared", "-fPIC"], frozenset(), {}, search={"CPATH": str(headers)})
        built[str(headers)] = kernel.build(tmp_path / "kernels")
    first, second = built.values()
    assert first == second                                   # the folder is not in the name
    assert ctypes.CDLL(str(first)).probe() == 7              # the header was found through it
    without = CKernel(source, ["-O1", "-shared", "-fPIC"], frozenset(), {})
    with pytest.raises(subprocess.CalledProcessError):       # no folder: probe.h is not found
        without.build(tmp_path / "other")
