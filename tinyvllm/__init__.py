"""tinyvllm: a vLLM-style inference engine, built in seven phases to learn from.

    from tinyvllm import LLM, SamplingParams
"""

from tinyvllm.entrypoints.llm import LLM
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics"]
