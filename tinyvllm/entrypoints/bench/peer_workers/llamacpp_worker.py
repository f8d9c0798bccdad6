"""The llama.cpp side of `tinyvllm bench --vs llamacpp`, run by the peer's own Python.

Loads the GGUF once, then answers the protocol of `tinyvllm/entrypoints/bench/peers.py`. The
requests run one after another: llama-cpp-python's `Llama` holds one sequence. Each is greedy
and runs to its max_tokens (`Llama.generate` never stops on its own), from exactly the given
token ids (no BOS added); the KV entries of the longest prefix it shares with the previous
prompt are kept, as llama.cpp does.

    python llamacpp_worker.py GGUF THREADS N_CTX
"""

import sys
import time

from protocol import open_channel, send, serve


def main() -> int:
    open_channel()
    import llama_cpp

    gguf, n_threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                          n_batch=512, verbose=False)
    load_s = time.perf_counter() - start

    def run_job(reqs, sequential, t0, starts, times):
        for i, (prompt, max_tokens) in enumerate(reqs):
            starts[i] = time.perf_counter() - t0
            for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                times[i].append(time.perf_counter() - t0)
                if len(times[i]) == max_tokens:
                    break
            send(tokens=len(times[i]))

    return serve(load_s, {"version": llama_cpp.__version__}, run_job)


if __name__ == "__main__":
    sys.exit(main())
