"""The Hugging Face transformers peer: `model.generate` as a user would run it.

That is: the requests in batches of `batch_size`, in the order they came; each batch's prompts
left-padded to its longest (so every row's next token lands in the last column), and
`max_new_tokens` set to the largest request of the batch, since `generate` takes one value for
the whole batch. Rows that asked for fewer tokens go on computing until the batch ends; only the
tokens each request asked for are counted. That waste is real, and it is exactly what continuous
batching removes.

`generate` returns only at the end of a batch, so to time each token a `StoppingCriteria` that
never stops is passed in: transformers calls it once per generated token.

Its KV cache is reported like the engines' (`peak_kv_tokens_reserved` / `_used`): a batch's
cache holds width + max_new_tokens - 1 positions for every row, padding included, while the
requests need only their own prompt and tokens.

transformers is optional for tinyvllm (it is in the `dev` extras); this module is imported only
for `tinyvllm bench --vs hf`.
"""

from __future__ import annotations

import time

import torch
import transformers
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging

from tinyvllm.weights import weight_bytes_per_step

from .machine import PeakMemory
from .roofline import element_size
from .runners import OnTokens, RunResult, check_token_counts, tpot
from .workloads import Workload


class _TokenClock(StoppingCriteria):
    """Records when each token of a batch was made; never stops generation."""

    def __init__(self, asked: list[int], on_tokens: OnTokens):
        self.asked = asked
        self.on_tokens = on_tokens
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        step = len(self.times)
        self.on_tokens(sum(1 for a in self.asked if a >= step))  # only tokens a request asked for
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFRunner:
    """transformers' `AutoModelForCausalLM.generate` on left-padded static batches."""

    kind = "hf"
    name = "hf"

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype | None, batch_size: int,
                 eos_token_ids: list[int]):
        hf_logging.set_verbosity_error()  # no warnings about unused sampling settings
        hf_logging.disable_progress_bar()
        # Loaded as from_pretrained loads it when not told, then cast to `dtype` (None: left as
        # loaded, transformers' own default): works the same on every transformers version.
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_path).to(device=device, dtype=dtype).eval()
        self.load_s = time.perf_counter() - start
        self.device, self.dtype, self.batch_size = device, self.model.dtype, batch_size
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.label = f"HF transformers {transformers.__version__}"

    @property
    def max_concurrency(self) -> int:
        return self.batch_size

    @property
    def weight_bytes(self) -> int:
        return weight_bytes_per_step(self.model)

    @property
    def kv_bytes_per_element(self) -> int:
        return element_size(self.dtype)

    def describe(self) -> dict:
        return dict(kind=self.kind, label=self.label, transformers=transformers.__version__,
                    batch_size=self.batch_size, dtype=str(self.dtype).removeprefix("torch."),
                    device=str(self.device),
                    attn_implementation=getattr(self.model.config, "_attn_implementation", None))

    @torch.inference_mode()
    def run(self, workload: Workload, on_tokens: OnTokens = lambda n: None) -> RunResult:
        reqs = workload.requests
        size = 1 if workload.sequential else self.batch_size
        batches = [list(range(s, min(s + size, len(reqs)))) for s in range(0, len(reqs), size)]
        ttfts: list[float] = [0.0] * len(reqs)
        tpots: list[float] = []
        counts = [0] * len(reqs)
        # The KV cache generate grows holds every row to the batch's width + max_new_tokens, padding
        # included; the requests themselves need only their prompt + their own tokens.
        kv_reserved = kv_used = 0
        memory = PeakMemory(self.device)
        memory.start()
        t0 = time.perf_counter()
        for batch in batches:
            arrival = time.perf_counter() if workload.sequential else t0
            prompts = [reqs[i].prompt_token_ids for i in batch]
            asked = [reqs[i].max_tokens for i in batch]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(prompts):  # left padding: real tokens end at the last column
                input_ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            clock = _TokenClock(asked, on_tokens)
            new = max(asked)
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=new, min_new_tokens=new,  # min: EOS cannot end it early (ignore_eos)
                do_sample=False, pad_token_id=self.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]))
            made = out.shape[1] - width
            reserved = len(batch) * (width + made - 1)  # the last token is never fed back
            if reserved > kv_reserved:
                kv_reserved, kv_used = reserved, sum(len(p) + a - 1 for p, a in zip(prompts, asked))
            for row, i in enumerate(batch):
                counts[i] = min(made, asked[row])  # the tokens past what it asked are not counted
                ttfts[i] = clock.times[0] - arrival
                t = tpot(clock.times[0], clock.times[counts[i] - 1], counts[i])
                if t is not None:
                    tpots.append(t)
        wall = time.perf_counter() - t0
        memory.stop()
        check_token_counts(self.name, workload, counts)
        return RunResult(wall_s=wall, num_requests=len(reqs), prompt_tokens=workload.num_prompt_tokens,
                         output_tokens=sum(counts), ttft_s=ttfts, tpot_s=tpots,
                         stats=dict(peak_kv_tokens_reserved=kv_reserved, peak_kv_tokens_used=kv_used),
                         peak_memory_bytes=memory.peak, memory_increase_bytes=memory.increase)
