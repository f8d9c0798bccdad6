"""Shared pytest fixtures for tests/ (the shared suite) and phases/ (the checkpoints).

- Every registered phase gets a marker: `pytest -m phase02` runs phase 2's checkpoint and its
  cases of the shared suite.
- `gpu` tests are skipped, with the reason, where no CUDA GPU is present.
- `--workspace DIR` grades a learner's copies of phases (tinyvllm learn) instead of the reference.
- Engines are cached per session: loading the default model takes seconds, not every test.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The notebooks run in a background kernel beside the tests (below). OpenMP threads that spin
# while they wait for work keep a core busy that the other process needs: beside a busy kernel a
# test of many small steps ran twice as long. Waiting passively gives the core back. Set before
# torch loads OpenMP; the notebooks' kernels and every subprocess inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Phase 7 on a CPU compiles its decode step in a background thread by default. The suite builds
# hundreds of engines and compares eager steps with the reference: an engine that does not ask
# runs eagerly here (compilation_mode=0). The tests of the compiled step ask for it, and
# test_p07_compiled.py's background tests remove this to run the default as users get it.
os.environ.setdefault("TINYVLLM_COMPILATION_MODE", "0")
# dtype="auto" multiplies many rows in bfloat16 on a CPU that computes it (`bf16_product_rows`):
# the suite compares tokens with transformers' float32 ones, so its engines stay float32 here;
# the tests of that path remove this.
os.environ.setdefault("TINYVLLM_BF16_PRODUCTS", "0")
# Checked mode (phase 2's check_kernels) on every device, a GPU's too, where it is off by
# default: a bookkeeping slip is a failing test, never a crash. The test of the default removes it.
os.environ.setdefault("TINYVLLM_CHECK_KERNELS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import phases  # noqa: E402

PHASE_NUMBERS = sorted(phases.PHASES)


def phase_params(min_phase: int = 1, kinds_from: int | None = None):
    """pytest.param for each registered phase >= min_phase, marked phaseNN, and `kinds` from phase
    `kinds_from` on (the phases whose paths the platform chooses by CPU kind, for a test that
    runs every phase)."""
    return [pytest.param(p, id=f"phase{p}", marks=[getattr(pytest.mark, f"phase{p:02d}"),
                                                   *([pytest.mark.kinds] if kinds_from and p >= kinds_from else [])])
            for p in PHASE_NUMBERS if p >= min_phase]


WORKSPACE_COPIES = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--workspace", default=None, metavar="DIR",
                     help="grade a learner's copies of phases in DIR (tinyvllm learn start N writes "
                          "them) instead of the reference ones")
    parser.addoption("--check-timeout", type=int, default=0, metavar="S",
                     help="fail a test that runs longer than S seconds (tinyvllm learn check sets it: "
                          "a learner's engine that waits for blocks nobody frees would loop forever)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--check-timeout")
    if not limit:
        yield
        return

    def stop(signum, frame):
        pytest.fail(f"this check did not finish in {limit} s: does the engine wait forever, for "
                    f"KV blocks that are never given back, or a request that never finishes?",
                    pytrace=False)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_configure(config):
    if config.getoption("--workspace"):
        from phases.workspace import use_workspace
        config.stash[WORKSPACE_COPIES] = use_workspace(config.getoption("--workspace"))


def pytest_report_header(config):
    copies = config.stash.get(WORKSPACE_COPIES, None)
    if copies is not None:
        return f"workspace: {config.getoption('--workspace')} stands in for {', '.join(copies) or 'no phase'}"


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    for item in items:
        parts = Path(str(item.fspath)).parts
        for part in parts:
            if part.startswith("p") and part[1:3].isdigit() and "_" in part:
                item.add_marker(getattr(pytest.mark, f"phase{part[1:3]}"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
    # the order of a run: every other test, then those of the background runs, then the timed ones
    items.sort(key=lambda item: 2 if _is_timed(item)
               else 1 if _is_notebook(item) or _needs_the_site(item) or _is_mutant(item) else 0)


# -- the notebooks, the docs build and the grader's wrong versions run in the background ------------
# tests/test_notebooks.py runs each notebook in a Jupyter kernel of its own: minutes of one-thread
# work that needs nothing from the other tests. They start as soon as the session is collected,
# one at a time, beside the other tests (which leave a core of the 2-core machine idle much of the
# time), then the docs site's build (tests/test_docs.py), then tests/test_learn_mutants.py's
# grading process (a minute and a half): one at a time, so the other tests share the machine with
# one of them (beside both at once, a full run took longer). Their tests come after the others
# and collect the results. The tests that time something (markers `throughput` and
# `timing`) run last, once the background work is done.
BACKGROUND_RUNS = pytest.StashKey[dict]()   # notebook path, "site" or "mutants" -> a Future of its result


def _is_notebook(item) -> bool:
    return getattr(item, "originalname", None) == "test_notebook_executes"


def _needs_the_site(item) -> bool:
    return "site" in getattr(item, "fixturenames", ())


def _is_mutant(item) -> bool:
    return getattr(item, "originalname", None) == "test_a_wrong_version_fails_its_checks"


def _is_timed(item) -> bool:
    return "throughput" in item.keywords or "timing" in item.keywords


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    runs = {}
    chosen = [item for item in session.items if _is_notebook(item)]
    if chosen:
        runs.update(chosen[0].module.start_in_background([item.callspec.params["path"] for item in chosen]))
    docs = [item for item in session.items if _needs_the_site(item)]
    if docs and (site := docs[0].module.build_in_background(list(runs.values()))) is not None:
        runs["site"] = site
    mutants = [item for item in session.items if _is_mutant(item)]
    if mutants:
        runs["mutants"] = mutants[0].module.start_in_background(mutants[0].module.chosen_ids(mutants),
                                                                after=list(runs.values()))
    session.config.stash[BACKGROUND_RUNS] = runs


def pytest_runtest_setup(item):
    if _is_timed(item):
        for run in item.config.stash.get(BACKGROUND_RUNS, {}).values():
            if not run.cancelled():   # cancelled: a test took it over
                run.exception()       # waits for it; its error, if any, is its own test's to report


def pytest_sessionfinish(session):
    runs = session.config.stash.get(BACKGROUND_RUNS, {})
    for run in runs.values():
        run.cancel()          # an interrupted session does not start the rest


@pytest.fixture(autouse=True)
def _no_secrets_taken_before(monkeypatch):
    """Each test starts with no secret taken out of the environment: `tinyvllm.secret_env` keeps,
    for the rest of a process, what an engine or a command took (a test sets and unsets them)."""
    from tinyvllm import secret_env

    monkeypatch.setattr(secret_env, "_TAKEN", {})


@pytest.fixture
def platform_rules():
    """`platform_rules(name=value, ...)`: for the rest of the test the platform answers these rules
    (`tinyvllm.platform`) so; a part reads its rules when it is built, so build it after."""
    from contextlib import ExitStack

    from tinyvllm import platform

    with ExitStack() as stack:
        yield lambda **values: stack.enter_context(platform.using(platform.current().with_rules(**values)))


# Checked mode's faults (phase 2's check_metadata): one decode step of two sequences over a pool
# of 8 blocks of 4 slots (row 0: 6 tokens in blocks 2, 5; row 1: 3 tokens in block 7), with one
# bookkeeping slip each, and what the error says about it
BAD_STEPS = {
    "block id past the pool": (lambda m: m.block_tables[0].__setitem__(1, 8), r"row 0, block 1: block id 8 is outside"),
    "slot of another sequence": (lambda m: m.slot_mapping.__setitem__(1, 21), r"token 1 .*writes slot 21, but its own slot is 30"),
    "table shorter than the length": (lambda m: m.seq_lens_tensor.__setitem__(0, 9), r"row 0 of 9 tokens needs 3 blocks"),
    "more rows of lengths than of tables": (lambda m: setattr(m, "seq_lens_tensor", torch.tensor([6, 3, 5])),
                                            r"2 rows of block tables, but seq_lens \(3,\)"),
}


@pytest.fixture
def bad_step():
    """`bad_step(fault)`: (KV pool, metadata, q, k, v, the error's pattern) for one of `BAD_STEPS`,
    float32 on the CPU: a checked attention part must refuse it before a kernel reads it."""
    import types

    from phases.p02_paged_kv import AttentionMetadata, KVCache

    def make(fault: str, cache_type=KVCache, **cache_args):
        config = types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=16)
        cache = cache_type(config, 8, 4, torch.float32, torch.device("cpu"), **cache_args)
        meta = AttentionMetadata.build([21, 30], [1, 1], [6, 3], [[2, 5], [7]], torch.device("cpu"))
        slip, pattern = BAD_STEPS[fault]
        slip(meta)
        q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
        return cache, meta, q, k, v, pattern
    return make


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tinyvllm.download import ensure_default_model
    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    from tinyvllm.testing import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"))


@pytest.fixture(scope="session")
def tiny_model_dir_llama3(tmp_path_factory) -> Path:
    """Another shape: tied embeddings, 3 layers, 8 query heads over 1 KV head, llama3 RoPE."""
    from tinyvllm.testing import make_tiny_llama
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama3"), hidden_size=64, num_layers=3, num_heads=8,
        num_kv_heads=1, tie_word_embeddings=True, seed=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def tiny_codes_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """tiny_model_dir with every projection on 4-bit codes and its LM head on 8-bit ones, as a
    Q4_1 checkpoint (the default model's) converted to float32."""
    from tinyvllm.testing import make_on_codes
    return make_on_codes(tiny_model_dir, tmp_path_factory.mktemp("tiny-codes"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3, written by transformers: q/k norms, biases on all four projections
    (attention_bias), head_dim 32 apart from hidden / heads (16), tied embeddings."""
    from tinyvllm.testing import make_tiny_family
    return make_tiny_family(tmp_path_factory.mktemp("tiny-qwen3"), "Qwen3ForCausalLM", head_dim=32,
                            attention_bias=True, tie_word_embeddings=True, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2, written by transformers: biases on q, k and v (none on o_proj),
    4 query heads over 1 KV head, untied embeddings."""
    from tinyvllm.testing import make_tiny_family
    return make_tiny_family(tmp_path_factory.mktemp("tiny-qwen2"), "Qwen2ForCausalLM", num_kv_heads=1,
                            seed=3)


@pytest.fixture(scope="session")
def tiny_windowed_dir(tmp_path_factory) -> Path:
    """A tiny random Mistral, written by transformers, whose every layer attends in a sliding
    window of 8 tokens: prompts and outputs of a few windows test the windowed paths."""
    from tinyvllm.testing import make_tiny_family
    return make_tiny_family(tmp_path_factory.mktemp("tiny-windowed"), "MistralForCausalLM", sliding_window=8,
                            seed=5)


_LLMS: dict = {}
# Engines of a large model held at once: one engine of the default model holds its weights
# (plus oneDNN's packed copy) and a KV pool, about 1.5 GB; seven phases' worth would not fit.
MAX_LARGE_ENGINES = 2
LARGE_MODEL_BYTES = 100 * 2**20
# A KV pool big enough for any test (the CPU default is 2 GiB, zero-filled, per engine).
TEST_KV_CACHE_MEMORY = 256 * 2**20


def _model_bytes(model) -> int:
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


# Ranks of a phase with tensor parallelism in the shared suite's engines (make_llm)
SHARED_SUITE_TP = 2


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(model_dir, phase, **engine_args) -> a cached LLM. Engines of large models are
    kept only while they are among the most recently used MAX_LARGE_ENGINES."""
    import gc

    from tinyvllm import LLM, platform

    def make(model, phase, **kwargs):
        # repr: values may be dicts; engine_core_process: an engine in this process, or in its own
        key = (str(model), phase, repr(sorted(kwargs.items())), platform.engine_core_process())
        large = _model_bytes(model) > LARGE_MODEL_BYTES
        if key not in _LLMS:
            if large:
                older = [k for k in _LLMS if _model_bytes(k[0]) > LARGE_MODEL_BYTES]
                for k in older[: max(0, len(older) - MAX_LARGE_ENGINES + 1)]:
                    del _LLMS[k]
                gc.collect()
            args = dict(kwargs)
            if phases.first_phase_with("tensor_parallel_size") == phase:
                # the shared suite runs tensor parallelism with two ranks, as a user asking for it,
                # on the phase that brings it (a later one runs one, as its users do by default)
                args.setdefault("tensor_parallel_size", min(SHARED_SUITE_TP, os.cpu_count() or 1))
            if ("kv_cache_memory" in phases.get_recipe(phase).engine_args
                    and "kv_cache_memory" not in args and "num_kv_blocks" not in args):
                args["kv_cache_memory"] = TEST_KV_CACHE_MEMORY
            _LLMS[key] = LLM(str(model), phase=phase, **args)
        _LLMS[key] = _LLMS.pop(key)  # most recently used last
        return _LLMS[key]

    yield make
    _LLMS.clear()


@pytest.fixture
def engine_in_this_process(monkeypatch):
    """For a test that reaches into an engine (replaces its runner's execute, sets its EOS ids):
    phase 9's engine core runs in a process of its own, where nothing here reaches; with this
    fixture every engine the test makes (make_llm's too) runs in the test's process
    (TINYVLLM_ENABLE_MULTIPROCESSING=0): the same parts and loop, without the process between.
    Phase 9's checkpoint covers what the process adds (phases/p09_engine_core/test_p09_checkpoint.py)."""
    monkeypatch.setenv("TINYVLLM_ENABLE_MULTIPROCESSING", "0")


@contextmanager
def gguf_parsed_once():
    """Within the block, the `gguf` package parses a file once and builds a tensor-name map once.
    transformers parses the GGUF file three times (config, weights, tokenizer: its 49k-word
    vocabulary field by field) and rebuilds gguf's name map for each of its 397 tensors. Loading
    the reference took 44 s of the 2-core CPU's suite, 21 s with this (pytest --durations,
    2026-11-24). A reader only reads (a memory map), so the model and tokenizer built from the
    shared one are the same; tests/test_convert.py checks them against tinyvllm's conversion."""
    import gguf
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)  # transformers imports them
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)  # per call
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


@pytest.fixture(scope="session")
def hf_gguf():
    """transformers' own loading of the default model's GGUF file: the reference.
    Returns (model, tokenizer)."""
    pytest.importorskip("transformers", reason="transformers is the test reference: pip install -e '.[dev]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tinyvllm.download import ensure_default_model, ensure_gguf

    ensure_default_model(quiet=True)
    gguf = ensure_gguf(quiet=True)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tok


@pytest.fixture(scope="session")
def hf_reference(request):
    """`reference(compute, *args)`: transformers' answer `compute(model, tokenizer, *args)` on the
    default model's GGUF file (`hf_gguf`), computed once per machine and kept in the cache
    (`$TINYVLLM_CACHE/references/`) under a hash of the versions of transformers and torch, the
    GGUF file's content, the source of `compute` and `args` (the inputs: token ids,
    texts). Loading the reference and generating its tokens took 45 s of every run of the 2-core
    CPU's suite; a new version, file, input or computation computes it again."""
    import hashlib
    import inspect

    import transformers

    from tinyvllm.download import cache_dir, ensure_gguf

    with open(ensure_gguf(quiet=True), "rb") as f:   # its content: each fresh venv installs it anew
        base = (transformers.__version__, torch.__version__, hashlib.file_digest(f, "sha256").hexdigest())

    def reference(compute, *args):
        digest = hashlib.sha256(repr((base, inspect.getsource(compute), args)).encode()).hexdigest()
        path = cache_dir() / "references" / f"{compute.__name__}-{digest[:16]}.pt"
        if path.is_file():
            return torch.load(path, weights_only=True)
        with torch.no_grad():
            value = compute(*request.getfixturevalue("hf_gguf"), *args)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(value, tmp)
        tmp.replace(path)  # atomic: a run beside this one reads the whole file or none
        return value

    return reference


@pytest.fixture
def namespaces():
    """Three network namespaces, each a host of its own: A (node 0) joined to B (node 1) by one veth
    pair, and to C (an outsider) by another (`tinyvllm.testing`'s NETNS_ addresses); removed
    afterwards, with anything still running in them. Needs root and iproute2 (else skipped)."""
    from tinyvllm.testing import NETNS_NODE0, NETNS_NODE1, NETNS_OUTSIDER, NETNS_OUTSIDER_LINK, ip_command

    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` (scripts/setup.sh installs it where it runs as root)")
    tag = f"tv{os.getpid() % 100000}"
    names = [f"{tag}a", f"{tag}b", f"{tag}c"]
    made = []
    try:
        for name in names:
            r = ip_command("netns", "add", name)
            if r.returncode:
                pytest.skip(f"cannot make a network namespace here: {r.stderr.strip()}")
            made.append(name)
        a, b, c = names
        steps = [("link", "add", f"{a}b", "type", "veth", "peer", "name", f"{b}a"),
                 ("link", "add", f"{a}c", "type", "veth", "peer", "name", f"{c}a"),
                 ("link", "set", f"{a}b", "netns", a), ("link", "set", f"{b}a", "netns", b),
                 ("link", "set", f"{a}c", "netns", a), ("link", "set", f"{c}a", "netns", c),
                 ("-n", a, "addr", "add", f"{NETNS_NODE0}/24", "dev", f"{a}b"),
                 ("-n", b, "addr", "add", f"{NETNS_NODE1}/24", "dev", f"{b}a"),
                 ("-n", a, "addr", "add", f"{NETNS_OUTSIDER_LINK}/24", "dev", f"{a}c"),
                 ("-n", c, "addr", "add", f"{NETNS_OUTSIDER}/24", "dev", f"{c}a")]
        steps += [("-n", ns, "link", "set", dev, "up") for ns, dev in
                  [(a, "lo"), (b, "lo"), (c, "lo"), (a, f"{a}b"), (b, f"{b}a"), (a, f"{a}c"), (c, f"{c}a")]]
        steps.append(("-n", c, "route", "add", f"{NETNS_NODE0}/32", "via", NETNS_OUTSIDER_LINK))   # C reaches node 0 only
        for step in steps:
            r = ip_command(*step)
            if r.returncode:
                pytest.skip(f"cannot join network namespaces here (ip {' '.join(step)}): {r.stderr.strip()}")
        yield names
    finally:
        for name in made:
            for pid in ip_command("netns", "pids", name).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            ip_command("netns", "del", name)
