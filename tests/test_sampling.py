"""SamplingParams validation and the sampler: seeds, top-k/top-p/min-p, penalties, logprobs, n."""

import math

import pytest
import torch

from conftest import phase_params
from tinyvllm import SamplingParams
from tinyvllm.sampler import Sampler

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 250]}


@pytest.mark.parametrize("phase", phase_params())
def test_seed_reproducible_in_any_batch_and_run(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [9, 8, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    other_params = SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True)
    batched = llm.generate(others + [PROMPT], [other_params, other_params, p], use_tqdm=False)
    assert alone == again == batched[2].outputs[0].token_ids
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_n_returns_n_completions(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 1)
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 8 for c in out.outputs)


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 1)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p in (SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=12, ignore_eos=True)):
        assert llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logprobs(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 1)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert 3 <= len(lp) <= 4 and all(v.logprob <= 0 for v in lp.values())
        total += lp[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


class _FakeSeq:
    def __init__(self, params, out=(), prompt=(1,)):
        self.params = params
        self.token_ids = list(prompt) + list(out)
        self.output_token_ids = list(out)
        self.eos_token_ids = frozenset({0})
        self.generator = torch.Generator().manual_seed(params.seed or 0)
        self.min_tokens_pending = len(out) < params.min_tokens


@pytest.mark.phase01  # the sampler phase 1 sets up (tinyvllm learn check 1)
def test_sampler_top_k_draws_only_from_top_k():
    logits = torch.randn(1, 50)
    top5 = set(logits[0].topk(5).indices.tolist())
    for seed in range(30):
        toks, _ = Sampler()(logits, [_FakeSeq(SamplingParams(temperature=2.0, top_k=5, seed=seed))])
        assert toks[0] in top5


@pytest.mark.phase01  # the sampler phase 1 sets up (tinyvllm learn check 1)
def test_sampler_top_p_and_min_p_filter():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for seed in range(40):
        t, _ = Sampler()(logits, [_FakeSeq(SamplingParams(temperature=1.0, top_p=0.7, seed=seed))])
        assert t[0] in (0, 1)
        t, _ = Sampler()(logits, [_FakeSeq(SamplingParams(temperature=1.0, min_p=0.35, seed=seed))])
        assert t[0] in (0, 1)


@pytest.mark.phase01  # the sampler phase 1 sets up (tinyvllm learn check 1)
def test_sampler_matches_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    seq = _FakeSeq(SamplingParams(temperature=1.0, seed=0))
    seq.generator = g
    for _ in range(3000):
        t, _ = Sampler()(probs.log()[None], [seq])
        counts[t[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03), (
        f"3000 draws from probabilities {probs.tolist()} came out {(counts / 3000).tolist()}")


def test_penalties_and_min_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.5]])
    s = Sampler()
    seq = _FakeSeq(SamplingParams(temperature=0, repetition_penalty=10.0), out=[1], prompt=[0])
    assert s(logits, [seq])[0] == [2]  # tokens 0 (prompt) and 1 (output) are both penalized
    seq = _FakeSeq(SamplingParams(temperature=0, frequency_penalty=0.75), out=[0, 0])
    assert s(logits, [seq])[0] == [1]  # once per occurrence: 5 - 2 * 0.75 = 3.5 < 4
    seq = _FakeSeq(SamplingParams(temperature=0, presence_penalty=0.75), out=[0, 0])
    assert s(logits, [seq])[0] == [0]  # once: 5 - 0.75 = 4.25 > 4
    seq = _FakeSeq(SamplingParams(temperature=0, min_tokens=2), out=[3])
    assert s(logits, [seq])[0] == [1]  # EOS (id 0 here) is banned until min_tokens are out

@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop=3), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"), (dict(max_tokens="8"), "max_tokens"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert p.stop is None and p.seed is None and p.ignore_eos is False and p.logprobs is None


@pytest.mark.phase01
def test_filter_probs_keeps_what_each_rule_allows():
    """Each row's own rules, in one call: top-k keeps the k most likely tokens, top-p the most
    likely ones until their mass reaches top_p of the row's (the one that crosses it included),
    min-p those at least min_p times the row's largest; kept values are not renormalized."""
    from tinyvllm.sampler import filter_probs

    p = torch.tensor([0.05, 0.5, 0.15, 0.3])   # most likely first: tokens 1, 3, 2, 0
    rows = [((0, 1.0, 0.0), 1, [0, 1, 2, 3], "no rule"),
            ((2, 1.0, 0.0), 1, [1, 3], "top_k=2: the two most likely"),
            ((5, 1.0, 0.0), 1, [0, 1, 2, 3], "top_k=5, more than the vocabulary: all"),
            ((0, 0.7, 0.0), 1, [1, 3], "top_p=0.7: 0.5 is short of it, 0.5 + 0.3 reaches it"),
            ((0, 0.4, 0.0), 1, [1], "top_p=0.4: the most likely token alone reaches it"),
            ((0, 1.0, 0.35), 1, [1, 3], "min_p=0.35: at least 0.35 * 0.5"),
            ((0, 0.7, 0.0), 4, [1, 3], "top_p=0.7 on a row that sums to 4: of the row's own mass"),
            ((0, 1.0, 0.5), 4, [1, 3], "min_p=0.5 on a row that sums to 4: of the row's own largest"),
            ((1, 0.95, 0.1), 1, [1], "top_k=1 with top_p and min_p: the most likely token")]
    probs = torch.stack([p * scale for _, scale, _, _ in rows])
    top_k, top_p, min_p = (torch.tensor([r[0][i] for r in rows]) for i in range(3))
    out = filter_probs(probs, top_k, top_p.float(), min_p.float())
    assert out.shape == probs.shape
    for i, ((k, tp, mp), scale, want, why) in enumerate(rows):
        kept = out[i].nonzero()[:, 0].tolist()
        assert kept == want, f"row {i}, top_k={k}, top_p={tp}, min_p={mp} ({why}): kept tokens {kept}, not {want}"
        assert torch.equal(out[i, want], probs[i, want]), f"row {i} ({why}): a kept token's value changed"


@pytest.mark.phase01
def test_draw_is_inverse_transform_sampling_from_each_rows_generator():
    """Row r takes one uniform number u from its own generator and the first token whose
    cumulative probability passes u * the row's total (rows need not sum to 1); a row with
    nothing to draw from gets a valid id (its most likely token)."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [2.0, 0.0, 6.0, 0.0], [0.0, 0.0, 0.0, 5.0],
                          [0.0, 0.0, 0.0, 0.0]])
    for trial in range(25):
        seeds = [100 + trial, 200 + trial, 300 + trial, 400 + trial]
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        got = Sampler.draw(probs, generators)
        assert len(got) == 4 and all(isinstance(t, int) and 0 <= t < 4 for t in got), got
        for r in range(3):
            u = torch.rand(1, generator=torch.Generator().manual_seed(seeds[r])).item()
            cdf = probs[r].cumsum(0)
            want = int((cdf <= u * cdf[-1]).sum())
            assert got[r] == want, (f"row {r}: u = {u:.3f} from its own generator, cumulative "
                                    f"probabilities {cdf.tolist()}: token {want}, not {got[r]}")
        assert got[3] == 0, (f"row 3 has nothing to draw from (all zero): it takes its most likely token, "
                             f"greedy_tokens' answer 0 (the first of equal values), not {got[3]}")
        for r, s in enumerate(seeds):  # one number per row and call: a seeded request's next draw depends on it
            fresh = torch.Generator().manual_seed(s)
            torch.rand(1, generator=fresh)
            assert torch.equal(torch.rand(1, generator=generators[r]), torch.rand(1, generator=fresh)), (
                f"row {r}: draw must take exactly one number from the row's generator")


@pytest.mark.phase01
@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2**-24])
def test_sampler_never_draws_a_zero_probability_token(u, monkeypatch):
    """Inverse transform sampling at the ends of [0, 1): the token found has probability > 0."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 1e-8, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.full((1,), u))
    toks = Sampler.draw(probs, [torch.Generator(), torch.Generator()])
    assert probs[0, toks[0]] > 0 and toks[1] == 2, (
        f"u = {u}: drew tokens {toks} from rows {probs.tolist()}, one of probability 0 (the search must find the "
        f"first token whose cumulative probability is above u * total, with u * total kept below the total)")
    if u == 0.5:
        assert toks[0] == 3, f"u = 0.5 is past the first quarter of row 0: token 3, not {toks[0]}"


def test_greedy_tokens_is_argmax_ties_nan_and_inf_included():
    """cpu_argmax.c (where it builds: float32 rows on a CPU) and PyTorch's max give argmax's
    answer: the first of equal values, the first NaN, a row of -inf's first; rows whose width is
    not a multiple of its 8 lanes, and a batch wide enough to be split between threads."""
    from tinyvllm.sampler import ARGMAX, greedy_tokens
    assert ARGMAX.load() is not None or not ARGMAX.available()
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 500)] * 50 + [(48, 49_152), (3, 7), (1, 1)]:
        logits = torch.randint(0, 3, shape, generator=g).float()     # many ties
        special = torch.rand(logits.shape, generator=g)
        logits[special < 0.01] = float("nan")
        logits[(special > 0.5) & (special < 0.51)] = float("inf")
        logits[special > 0.99] = float("-inf")
        logits[-1, :] = float("-inf") if shape[0] > 1 else logits[-1, :]
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
        assert torch.equal(greedy_tokens(logits.T.contiguous().T), logits.argmax(dim=-1))   # PyTorch's path


_MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5),
          SamplingParams(temperature=1.2, top_k=1), SamplingParams(temperature=0.7, top_p=0.9),
          SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.5),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
          SamplingParams(temperature=1.5, top_k=300)]


@pytest.mark.phase01
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", ["all", "greedy", "topk", "full"])
def test_vectorized_sampling_equals_row_by_row(seed, mix):
    """The sampler groups a batch's rows by their rules (greedy, top-k only, the rest) and samples
    each group at once; each row still gets the token it would get alone, from its own generator,
    and the parameters given as tensors (what a persistent batch hands over) give the same."""
    from types import SimpleNamespace

    from tinyvllm.sampler import SamplingTensors

    g = torch.Generator().manual_seed(seed)
    pick = {"all": _MIXED, "greedy": _MIXED[:1] * 3, "topk": _MIXED[1:3] + _MIXED[7:], "full": _MIXED[3:7]}[mix]
    params = [pick[int(i)] for i in torch.randint(0, len(pick), (9,), generator=g)]
    logits = torch.randn(9, 257, generator=g) * 3

    def rows():
        return [SimpleNamespace(params=p, min_tokens_pending=False, grammar=None,
                                generator=None if p.is_greedy else torch.Generator().manual_seed(100 * seed + i))
                for i, p in enumerate(params)]

    alone = [Sampler()(logits[i: i + 1], [r])[0][0] for i, r in enumerate(rows())]
    assert Sampler()(logits, rows())[0] == alone
    batch = rows()
    assert Sampler()(logits, batch, SamplingTensors.from_seqs(batch, logits.shape[-1]))[0] == alone
