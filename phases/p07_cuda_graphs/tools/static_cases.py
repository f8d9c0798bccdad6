"""The decode step on the static buffers with phase 4's Triton kernels, in Triton's interpreter.

    TRITON_INTERPRET=1 python -m phases.p07_cuda_graphs.tools.static_cases MODEL_DIR

For a float and an int8 KV cache: a phase 7 engine with `attention_backend="triton"` prefills
three requests and runs a decode step; then the buffers of that step run through the decode
runner three ways: the Triton kernels on the metadata a captured graph reads (every block-table
column, `max_seq_len` the most a sequence may hold, no length copied to the host), the same
kernels on the columns the rows use, and phase 2's PyTorch attention (phase 5's for the int8
cache). Prints one JSON object: each way's largest logit difference from PyTorch's, and (with
the int8 cache, which runs both kernels' paths) whether the whole engine gives the tokens of the
same engine with `attention_backend="torch"`.
"""

from __future__ import annotations

import json
import sys
from functools import partial


def case(model: str, kv_cache_dtype: str, whole_engine: bool) -> dict:
    import torch

    from phases.p02_paged_kv import PagedAttention
    from phases.p05_quantization import QuantizedPagedAttention
    from phases.p07_cuda_graphs import DecodeRunner
    from tinyvllm import LLM, SamplingParams

    args = dict(max_num_seqs=4, max_model_len=96, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=24)
    llm = LLM(model, phase=7, attention_backend="triton", **args)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([5, 33, 17])]
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    engine.step()                       # the prefills
    engine.step()                       # one static decode step: the buffers hold its rows
    runner, parts = engine.runner, engine.parts
    assert runner.num_static_steps == 1, runner.num_static_steps
    bucket = 4
    buffers = runner.buffers
    ib = runner.input_batch
    n = ib.num_reqs
    ib.num_computed[:n] -= 1            # the step's inputs again: the token each row computed
    buffers.fill(ib.token_ids[:n], ib.num_computed[:n], ib.block_table[:n], ib.num_blocks[:n], bucket)
    ib.num_computed[:n] += 1
    reference = (partial(QuantizedPagedAttention, parts.kv_cache) if kv_cache_dtype != "auto"
                 else partial(PagedAttention, parts.kv_cache))
    with torch.inference_mode():
        want = DecodeRunner(parts.model, buffers, reference).run(bucket)[:n]
        fixed = DecodeRunner(parts.model, buffers, parts.attention, fixed_shapes=True).run(bucket)[:n]
        used = DecodeRunner(parts.model, buffers, parts.attention).run(bucket)[:n]
    engine.abort_request([f"s{i}" for i in range(len(prompts))])
    result = dict(attention=parts.attention.func.__name__, fixed_err=float((fixed - want).abs().max()),
                  used_err=float((used - want).abs().max()), scale=float(want.abs().max()),
                  static_steps=runner.num_static_steps)
    if whole_engine:  # the whole engine, prefills and decodes, against the torch backend's
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        ref = LLM(model, phase=7, attention_backend="torch", **args)
        result["tokens_equal"] = got == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    return result


def main(argv: list[str]) -> None:
    model = argv[0]
    print(json.dumps({"auto": case(model, "auto", False), "int8": case(model, "int8", True)}))


if __name__ == "__main__":
    main(sys.argv[1:])
