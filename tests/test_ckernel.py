"""`tinyvllm.ckernel.CKernel`: a C file built once, named after its source and flags; the folders
it searches (`search`) reach the compiler but not the name, so two environments that keep the
same headers in different places share one build."""

from __future__ import annotations

import ctypes
import os
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


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_compiler_inherits_no_secret(tmp_path, monkeypatch):
    """The tensor-parallel token and the server's key stay out of the compiler's environment (a
    compiler, and whatever it starts, needs neither), while the rest of it reaches the compiler."""
    record, cc = tmp_path / "env", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nenv > "{record}"\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TINYVLLM_TP_TOKEN", "ab" * 32)
    monkeypatch.setenv("TINYVLLM_API_KEY", "sk-do-not-leak")
    monkeypatch.setenv("TINYVLLM_PROBE", "reaches")
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 7; }\n")
    built = CKernel(source, ["-O1", "-shared", "-fPIC"], frozenset(), {}).build(tmp_path / "kernels")
    assert ctypes.CDLL(str(built)).probe() == 7
    seen = record.read_text()
    assert "TINYVLLM_PROBE=reaches" in seen
    assert "TINYVLLM_TP_TOKEN" not in seen and "TINYVLLM_API_KEY" not in seen and "sk-do-not-leak" not in seen


def _probe(tmp_path) -> CKernel:
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 7; }\n")
    return CKernel(source, ["-O1", "-shared", "-fPIC"], frozenset(), {"probe": []}, fallback="the probe is not used")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_kernel_folder_another_user_could_write_is_refused(tmp_path, monkeypatch):
    """Whoever can write the kernel folder, or the folder that holds it, chooses the code loaded
    from it: a folder writable by every user is refused by name before anything is built or loaded
    there, and `load` warns with that and falls back; made private again, it builds."""
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    for folder in (kernels, kernels.parent):
        folder.chmod(0o777)
        with pytest.raises(PermissionError, match=f"the cache folder {folder} is writable by every user .*"
                                                  f"chmod go-w {folder}.*TINYVLLM_CACHE"):
            _probe(tmp_path).build(kernels)
        assert not list(kernels.iterdir())
        folder.chmod(0o755)
    monkeypatch.setenv("TINYVLLM_CACHE", str(kernels.parent))
    kernels.chmod(0o777)
    with pytest.warns(UserWarning, match=f"could not build probe.c .*{kernels} is writable by every user.*"
                                         f"the probe is not used"):
        assert _probe(tmp_path).load() is None
    kernels.chmod(0o700)
    assert _probe(tmp_path).load() is not None           # built and loaded


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_kernel_folder_of_another_user_is_refused(tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir(mode=0o755)
    os.chown(kernels, 65534, 65534)
    with pytest.raises(PermissionError, match=f"the cache folder {kernels} is owned by another user \\(uid 65534\\)"):
        _probe(tmp_path).build(kernels)
