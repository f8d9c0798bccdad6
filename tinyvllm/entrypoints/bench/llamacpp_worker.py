"""The llama.cpp side of `tinyvllm bench --vs llamacpp`, run by the peer's own Python.

This file imports nothing of tinyvllm (the peer's virtual environment has only llama-cpp-python):
it loads the GGUF once, then answers one line of JSON per run on stdin with lines of JSON on
stdout:

    in:  {"requests": [[token ids, max_tokens], ...], "sequential": bool}
    out: {"tokens": k}                    after each request: k tokens made (a progress bar)
         {"result": {"start": [...], "times": [[...], ...], "max_rss_bytes": int}}

`start[i]` is when request i began and `times[i]` when each of its tokens came, in seconds since
the run began. The requests run one after another: llama-cpp-python's `Llama` holds one sequence.
Each is greedy and runs to its max_tokens (`Llama.generate` never stops on its own), from exactly
the given token ids (no BOS added); the KV entries of the longest prefix it shares with the
previous prompt are kept, as llama.cpp does.
"""

import json
import resource
import sys
import time


def main() -> int:
    import llama_cpp

    gguf, n_threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                          n_batch=512, verbose=False)
    print(json.dumps({"ready": {"load_s": time.perf_counter() - start, "version": llama_cpp.__version__,
                                "n_ctx": llm.n_ctx()}}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        starts, times = [], []
        for prompt, max_tokens in job["requests"]:
            starts.append(time.perf_counter() - t0)
            stamps = []
            for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                stamps.append(time.perf_counter() - t0)
                if len(stamps) == max_tokens:
                    break
            times.append(stamps)
            print(json.dumps({"tokens": len(stamps)}), flush=True)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"result": {"start": starts, "times": times, "max_rss_bytes": rss}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
