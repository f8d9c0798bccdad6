"""Which project files one decode step enters, in the order a reader would meet them.

    python scripts/trace_step.py                 # the newest phase, a tiny random model
    python scripts/trace_step.py --phase 3 --json trace.json

Builds `LLM(phase=N)` on a tiny random Llama (tinyvllm.testing), runs one greedy request until
its decode steps are steady, then records every Python call made inside the repository during
one `step()` (`sys.setprofile`). It prints the files in their order of first entry, how many
there are and the phase package of each; then the sequence of phase packages, in the order of
first entry of a file and in the order of first call of a function, with how often each
changes package: the context switches a reader pays when following one step through the code.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def project_file(filename: str) -> str | None:
    """The repository-relative path of a project source file (None: a library, or not a file)."""
    try:
        rel = Path(filename).resolve().relative_to(REPO)
    except ValueError:
        return None
    if rel.parts[0] not in ("phases", "tinyvllm") or rel.suffix != ".py":
        return None
    return str(rel)


def package_of(path: str) -> str:
    """'01'..'08' for a phase's file, 'foundation' for tinyvllm/, 'registry' for phases/*.py."""
    parts = Path(path).parts
    if parts[0] == "phases" and len(parts) > 2 and parts[1][:1] == "p" and parts[1][1:3].isdigit():
        return parts[1][1:3]
    return "foundation" if parts[0] == "tinyvllm" else "registry"


def trace_one_step(engine) -> tuple[list[str], list[str]]:
    """The project files `engine.step()` enters, in order of first entry, and the file of every
    project function it calls, in order of the function's first call."""
    files: dict[str, None] = {}
    functions: dict[object, str] = {}

    def profile(frame, event, arg):
        if event == "call":
            f = project_file(frame.f_code.co_filename)
            if f is not None:
                files.setdefault(f, None)
                functions.setdefault(frame.f_code, f)

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return list(files), list(functions.values())


def changes(packages: list[str]) -> tuple[list[str], int]:
    """The phase packages of a sequence of files, repeats in a row merged, and how often it changes."""
    seq = []
    for p in packages:
        if p.isdigit() and (not seq or seq[-1] != p):
            seq.append(p)
    return seq, max(0, len(seq) - 1)


def measure(phase: int, engine_args: dict) -> dict:
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.testing import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_llama(Path(tmp) / "tiny")
        llm = LLM(str(folder), phase=phase, **engine_args)
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": list(range(3, 19))},
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for _ in range(8):  # the prefill, then decode steps until nothing is made for the first time
            engine.step()
        files, functions = trace_one_step(engine)
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    by_file, file_changes = changes([package_of(f) for f in files])
    by_function, function_changes = changes([package_of(f) for f in functions])
    return dict(phase=phase, engine_args=engine_args, files=files, num_files=len(files),
                phase_order_of_files=by_file, phase_changes_of_files=file_changes,
                phase_order_of_functions=by_function, phase_changes_of_functions=function_changes,
                num_functions=len(functions))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", type=int, default=None, help="the phase (default: the newest)")
    p.add_argument("--engine-args", default="{}", help="engine arguments as JSON")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    import phases

    result = measure(a.phase or phases.latest_phase(), json.loads(a.engine_args))
    for f, pkg in zip(result["files"], (package_of(f) for f in result["files"])):
        print(f"  {pkg:>10}  {f}")
    print(f"phase {result['phase']}: {result['num_files']} project files, {result['num_functions']} functions")
    print(f"phase packages by first entry of a file: {' '.join(result['phase_order_of_files'])} "
          f"({result['phase_changes_of_files']} changes)")
    print(f"phase packages by first call of a function: {' '.join(result['phase_order_of_functions'])} "
          f"({result['phase_changes_of_functions']} changes)")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
