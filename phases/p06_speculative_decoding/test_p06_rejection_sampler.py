"""Phase 6 checkpoint, the rejection sampler alone: every token it emits is distributed as the
target's processed distribution p, whatever the draft proposed and from whatever q.

Synthetic p and q over a small vocabulary; many draws with one fixed seed; a chi-square test of
the emitted tokens against p at a level (0.1%) that a correct sampler passes with the seed fixed,
while a one-line mistake (residual p instead of max(0, p - q), accepting with q/p, the bonus from
the wrong row) moves the distribution by far more than the test allows (see `test_the_test`).
"""

import math

import pytest
import torch

from phases.p06_speculative_decoding.rejection_sampler import rejection_sample
from tinyvllm.sampler import Sampler, filter_probs

V = 6
N = 6000


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_matches(counts: torch.Tensor, p: torch.Tensor) -> tuple[bool, float]:
    """Goodness of fit of `counts` to p; categories where p is 0 must have no count at all."""
    n = counts.sum()
    if (counts[p == 0] > 0).any():
        return False, float("inf")
    support = p > 0
    expected = n * p[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat < chi2_critical(int(support.sum()) - 1), stat


def dist(*vals: float) -> torch.Tensor:
    t = torch.tensor(vals, dtype=torch.float64)
    return t / t.sum()


def truncated(logits: list[float], top_k=0, top_p=1.0) -> torch.Tensor:
    """A target as the Sampler makes it: softmax, then top-k / top-p cut, renormalized."""
    probs = filter_probs(torch.softmax(torch.tensor([logits], dtype=torch.float64), -1), torch.tensor([top_k]),
                         torch.tensor([top_p]), torch.tensor([0.0]))[0]
    return probs / probs.sum()


# Each case: target rows p_0..p_k (k + 1, V), draft rows q_0..q_{k-1} (k, V) or None (one-hot
# proposals, fixed tokens as an n-gram lookup would give).
CASES = {
    "one-hot proposals": (
        torch.stack([dist(5, 1, 3, 1, 0.5, 2), dist(1, 4, 1, 2, 1, 1), dist(2, 1, 1, 1, 3, 1)]),
        None, [2, 1]),
    "top-k/top-p target, dense draft": (
        torch.stack([truncated([2.0, 1.5, 0.2, -1, 0.9, 0.0], top_k=3),
                     truncated([0.1, 2.0, 1.9, 0.3, -0.5, 1.0], top_p=0.8),
                     truncated([1.0, 1.0, 0.5, 2.0, 0.0, 0.2], top_k=4)]),
        torch.stack([dist(1, 1, 1, 1, 1, 1), dist(3, 1, 2, 1, 1, 2)]), None),
    "draft mass where the target has none": (
        torch.stack([dist(4, 3, 0, 0, 2, 1), dist(0, 1, 5, 2, 0, 0), dist(1, 0, 0, 3, 3, 1)]),
        torch.stack([dist(2, 1, 4, 3, 0, 0), dist(1, 2, 1, 1, 3, 0)]), None),
    "draft close to the target (the bonus token is drawn often)": (
        torch.stack([dist(4, 3, 1, 1, 2, 1), dist(1, 5, 2, 2, 1, 1), dist(1, 1, 1, 6, 3, 1)]),
        torch.stack([dist(4, 3, 1.2, 1, 2, 1), dist(1, 5, 2, 2.4, 1, 1)]), None),
}


def sample_positions(p, q, fixed, sampler=rejection_sample, n=N, seed=0):
    """Counts of the token emitted at each position j, over the draws that reached j."""
    g = torch.Generator().manual_seed(seed)
    k = p.shape[0] - 1
    counts = torch.zeros(k + 1, V, dtype=torch.float64)
    for _ in range(n):
        if q is None:
            drafts = fixed
        else:  # the draft samples its proposals from q (p_j's row does not depend on them here)
            drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
        out = sampler(p, drafts, q, g)
        assert 1 <= len(out) <= k + 1
        assert out[:-1] == drafts[: len(out) - 1]  # the emitted run starts with accepted drafts
        for j, t in enumerate(out):
            counts[j, t] += 1
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_every_emitted_position_is_distributed_as_the_target(case):
    p, q, fixed = CASES[case]
    counts = sample_positions(p, q, fixed)
    k = p.shape[0] - 1
    for j in range(p.shape[0]):
        if counts[j].sum() < 200:  # too few draws reached this position to test it
            continue
        ok, stat = chi2_matches(counts[j], p[j])
        where = "the bonus token, all drafts accepted" if j == k else f"after {j} accepted drafts"
        assert ok, (f"{case}: position {j} ({where}): {_same_as_a_mistake(p, q, fixed, counts)}token frequencies "
                    f"{[round(x, 3) for x in (counts[j] / counts[j].sum()).tolist()]}, the target's "
                    f"{[round(x, 3) for x in p[j].tolist()]} (chi2 {stat:.1f} over {int(counts[j].sum())} draws)")
    if case.startswith("draft close"):
        assert counts[2].sum() > 1000, "the bonus token (after all drafts accepted) must be tested"



def _mutant(p, drafts, q, g, residual_from_p=False, bonus_row=-1, accept_q_over_p=False):
    """rejection_sample with one line changed."""
    out = []
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand(1, generator=g))
        ok = (u * float(p[j, d]) < q_d) if accept_q_over_p else (u * q_d < float(p[j, d]))
        if ok:
            out.append(d)
            continue
        if residual_from_p:
            residual = p[j].clone()
        elif q is None:
            residual = p[j].clone()
            residual[d] = 0
        else:
            residual = (p[j] - q[j]).clamp(min=0)
        out.append(Sampler.draw(residual[None], [g])[0])
        return out
    out.append(Sampler.draw(p[bonus_row][None], [g])[0])
    return out


MISTAKES = {"residual_from_p": ("a rejected draft's replacement drawn from p, not from max(0, p - q)",
                                {"residual_from_p": True}),
            "bonus_row": ("the bonus token drawn from another row than the last target row", {"bonus_row": -2}),
            "accept_q_over_p": ("a draft accepted with probability min(1, q/p), not min(1, p/q)",
                                {"accept_q_over_p": True})}


def _same_as_a_mistake(p, q, fixed, counts) -> str:
    """'it draws exactly what <a mistake> draws; ' when the same seed gives the same counts."""
    for why, kwargs in MISTAKES.values():
        def mutant(p, drafts, q, g, kwargs=kwargs):
            return _mutant(p, drafts, q, g, **kwargs)
        if torch.equal(sample_positions(p, q, fixed, sampler=mutant), counts):
            return f"it draws exactly what {why} draws; "
    return ""


@pytest.mark.parametrize("mutation", ["residual_from_p", "bonus_row", "accept_q_over_p"])
def test_the_test(mutation):
    """The same test fails each one-line mistake on at least one case."""
    kwargs = MISTAKES[mutation][1]

    def mutant(p, drafts, q, g):
        return _mutant(p, drafts, q, g, **kwargs)

    caught = False
    for case, (p, q, fixed) in CASES.items():
        counts = sample_positions(p, q, fixed, sampler=mutant, n=2000)
        for j in range(p.shape[0]):
            if counts[j].sum() >= 200 and not chi2_matches(counts[j], p[j])[0]:
                caught = True
    assert caught, f"the chi-square test does not see the mistake {mutation}"


def test_seeded_runs_repeat():
    p, q, _ = CASES["draft mass where the target has none"]
    a = sample_positions(p, q, None, n=300, seed=7)
    b = sample_positions(p, q, None, n=300, seed=7)
    assert torch.equal(a, b)
