"""The command line: generate and chat on a tiny model, --help, and a clear error for bad input."""

import subprocess
import sys

from tinyvllm.cli import main


def test_generate(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--phase", "1", "--prompt", "hello",
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "hello" in out.out and "tok/s" in out.err


def test_chat_one_turn(tiny_model_dir, capsys):
    assert main(["chat", "--model", str(tiny_model_dir), "--message", "hi", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "assistant>" in out.out and "first token after" in out.err


def test_bad_flag_value_is_a_clear_error(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "tinyvllm.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--temperature", "--top-p", "--max-tokens", "--phase", "--model", "--stop"):
        assert flag in out


def test_chat_answers_the_capital_of_france(default_model_dir, capsys):
    """The done-when of the foundation: the newest phase answers sensibly, streamed."""
    assert main(["chat", "--message", "What is the capital of France?", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_engine_never_imports_transformers(tiny_model_dir):
    code = ("import sys; from tinyvllm import LLM, SamplingParams; "
            f"LLM({str(tiny_model_dir)!r}).generate('hi', SamplingParams(max_tokens=3), use_tqdm=False); "
            "assert 'transformers' not in sys.modules, 'the engine imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)
