"""The front door: what users touch, on top of the phases (vLLM's `vllm/entrypoints/`).

- `llm.py`: `LLM`, vLLM's offline API (`from tinyvllm import LLM` re-exports it);
- `cli.py`: the `tinyvllm` command (generate, chat, download, bench, serve);
- `engine_flags.py`: every engine argument as a command-line flag, and back;
- `bench/`: `tinyvllm bench`, the one benchmark harness;
- `server/`: `tinyvllm serve`, the OpenAI-compatible server and its live page.

It imports the phases' registry (`phases`) and the foundation (`tinyvllm.*` outside this
package); neither imports it (tests/test_architecture.py).
"""
