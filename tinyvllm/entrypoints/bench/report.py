"""From runs to a report: medians over repeats, rounds that agree, speedups, the table, the JSON
file and the plot.

The report is one dict (written as JSON by `--json`); the table and the plot are both drawn from
it, so the three always agree.

A speedup is the ratio of the numbers shown: an engine's median output tok/s over the baseline's,
each as a table prints it (one decimal). The table, the plot, the JSON's `ratios` and the pages'
tables (`scripts/bench_tables.py`) all divide the same two numbers.

Rounds agree when the fastest of an engine's rounds is at most `ROUNDS_SPREAD_LIMIT` times its
slowest (output tok/s). The harness re-runs rounds that do not; `report_to_show` is what a notebook
prints beside a claim: the live report when its rounds agree, the committed one otherwise.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from tinyvllm.hardware import report_kind

from .machine import load_warning
from .runners import STATS_KEYS, RunResult

if TYPE_CHECKING:  # matplotlib is optional: imported when a plot is drawn
    from matplotlib.figure import Figure

# The widest an engine's rounds may spread (fastest over slowest output tok/s) and still agree.
# In the committed CPU reports of several rounds (docs/assets/bench/), 68 of 70 engines' rounds
# spread at most 1.25x, 66 at most 1.2x; rounds on a loaded 2-core machine spread 5x to 10x. And
# the smallest gain a lesson claims from a phase over the one below is about 1.3x (continuous
# batching at 4 seats): rounds that spread wider than the gain cannot show it.
ROUNDS_SPREAD_LIMIT = 1.25

# The committed reports the lessons' tables come from (present in a clone of the repository).
COMMITTED_REPORTS = Path(__file__).resolve().parents[3] / "docs" / "assets" / "bench"


def distribution(values: list[float]) -> dict:
    """mean, median and 99th percentile (linear interpolation), or nulls when there are none."""
    if not values:
        return dict(mean=None, median=None, p99=None)
    a = np.asarray(values, dtype=float)
    return dict(mean=float(a.mean()), median=float(np.median(a)), p99=float(np.percentile(a, 99)))


def _median(values: list):
    """The median of numbers; of ints, the lower middle one (a value that was observed); None
    if any is None."""
    if not values or any(v is None for v in values):
        return None
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return float(statistics.median(values))


def rounds_spread(tok_per_s: list[float]) -> float | None:
    """How far rounds spread: the fastest output tok/s over the slowest (None for one round)."""
    return max(tok_per_s) / min(tok_per_s) if len(tok_per_s) > 1 else None


def closest_rounds(tok_per_s: list[float], n: int) -> list[int]:
    """The indices (in round order) of the n rounds whose output tok/s lie closest together: of
    the rounds sorted by speed, the n in a row with the smallest spread (the faster on a tie,
    since a busy machine only slows a run). All of them when there are n or fewer."""
    if len(tok_per_s) <= n:
        return list(range(len(tok_per_s)))
    order = sorted(range(len(tok_per_s)), key=lambda i: tok_per_s[i])
    start = min(range(len(order) - n + 1),
                key=lambda s: (tok_per_s[order[s + n - 1]] / tok_per_s[order[s]], -s))
    return sorted(order[start:start + n])


def summarize(name: str, info: dict, runs: list[RunResult], roofline: dict, sequential: bool,
              used: list[int] | None = None, spread_limit: float = ROUNDS_SPREAD_LIMIT,
              num_cold: int = 1) -> dict:
    """One engine's entry of the report: the median of every number over the rounds `used`
    (indices into `runs`; default all of them), TTFT cold (the first `num_cold` requests of a
    sequential workload) against cached (the rest), whether those rounds agree (`rounds_agree`:
    their spread, `rounds_spread`, is at most `spread_limit`; None for one round), and every
    round run, each marked `used` or not."""
    used = list(range(len(runs))) if used is None else sorted(used)
    all_runs, runs = runs, [runs[i] for i in used]
    first = runs[0]
    med = lambda f: _median([f(r) for r in runs])
    per_run = [dict(wall_s=r.wall_s, output_tok_per_s=r.output_tok_per_s,
                    ttft_median_s=distribution(r.ttft_s)["median"],
                    tpot_median_s=distribution(r.tpot_s)["median"], used=i in used)
               for i, r in enumerate(all_runs)]
    spread = rounds_spread([r.output_tok_per_s for r in runs])
    entry = dict(name=name, **info,
                 requests=first.num_requests, prompt_tokens=first.prompt_tokens,
                 output_tokens=first.output_tokens,
                 wall_s=med(lambda r: r.wall_s),
                 output_tok_per_s=med(lambda r: r.output_tok_per_s),
                 total_tok_per_s=med(lambda r: (r.prompt_tokens + r.output_tokens) / r.wall_s),
                 requests_per_s=med(lambda r: r.num_requests / r.wall_s))
    for key in ("ttft_s", "tpot_s"):
        dists = [distribution(getattr(r, key)) for r in runs]
        entry[key] = {stat: _median([d[stat] for d in dists]) for stat in ("mean", "median", "p99")}
    # One after another, the first request finds nothing cached; the others may hit the prefix.
    entry["ttft_cold_s"] = med(lambda r: float(np.median(r.ttft_s[:num_cold]))) if sequential else None
    entry["ttft_cached_s"] = (med(lambda r: float(np.median(r.ttft_s[num_cold:])))
                              if sequential and first.num_requests > 1 else None)
    for key in STATS_KEYS:
        entry[key] = _median([r.stats.get(key) for r in runs])
    q, h = entry["prefix_cache_queries"], entry["prefix_cache_hits"]
    entry["prefix_cache_hit_rate"] = h / q if q else None
    # speculative decoding (phase 6): accepted / proposed drafts, and tokens per verified run
    drafts, proposed, accepted = (entry["spec_num_drafts"], entry["spec_num_draft_tokens"],
                                  entry["spec_num_accepted_tokens"])
    entry["spec_acceptance_rate"] = accepted / proposed if proposed else None
    entry["spec_mean_accepted_length"] = 1 + accepted / drafts if drafts else None
    used, reserved = entry["peak_kv_tokens_used"], entry["peak_kv_tokens_reserved"]
    entry["kv_token_utilization"] = used / reserved if used is not None and reserved else None
    entry["peak_memory_bytes"] = med(lambda r: r.peak_memory_bytes)
    entry["memory_increase_bytes"] = med(lambda r: r.memory_increase_bytes)
    entry["roofline"] = roofline
    entry["fraction_of_roofline"] = entry["output_tok_per_s"] / roofline["tok_per_s"]
    entry["rounds_spread"] = spread
    entry["rounds_agree"] = None if spread is None else spread <= spread_limit
    entry["runs"] = per_run
    return entry


def shown_tok_per_s(value: float) -> float:
    """Output tok/s as every table shows it, with one decimal."""
    return float(f"{value:.1f}")


def speedup(tok_per_s: float, baseline_tok_per_s: float) -> float:
    """The speedup of a median output tok/s over the baseline's: the ratio of the two numbers as
    a table shows them, so that it agrees with the numbers beside it (the exact ratio where the
    baseline shows as 0.0)."""
    shown, base = shown_tok_per_s(tok_per_s), shown_tok_per_s(baseline_tok_per_s)
    return shown / base if base else tok_per_s / baseline_tok_per_s


def speedups(engines: list[dict], baseline: str) -> dict:
    """Each engine's speedup over the baseline engine (`speedup`): its median output tok/s over
    the baseline's median, as the table shows them."""
    base = next(e for e in engines if e["name"] == baseline)["output_tok_per_s"]
    return {e["name"]: speedup(e["output_tok_per_s"], base) for e in engines}


def disagreeing(report: dict) -> list[dict]:
    """The engines of a report whose rounds spread wider than the report's limit."""
    return [e for e in report["engines"] if e.get("rounds_agree") is False]


def rounds_warning(e: dict, limit: float) -> str:
    """One engine's rounds that disagree, in words."""
    tok = [r["output_tok_per_s"] for r in e["runs"] if r.get("used", True)]
    return (f"{e['name']}'s rounds ran at {min(tok):,.1f} to {max(tok):,.1f} output tok/s, "
            f"{e['rounds_spread']:.2f}x apart (more than {limit:.2f}x)")


def report_to_show(live: dict, committed: str, log: TextIO | None = None) -> dict:
    """The report a notebook prints beside a claim: `live` when every engine's rounds agree,
    otherwise the committed report `docs/assets/bench/<committed>` (the one the lesson's table
    comes from), saying why and naming the machine it was measured on.

    One round per engine cannot show that the machine was quiet, so it is not enough either.

    Args:
        live: A report from `run_bench`, just measured.
        committed: The file name of a report in docs/assets/bench/, e.g. "latency.json".
        log: Where to say which report is shown (default: standard output).

    Returns:
        The report to show: `live` or the committed one.

    Raises:
        ValueError: If the committed report is not there (a clone of the repository has it).
    """
    log = sys.stdout if log is None else log
    agree = [e.get("rounds_agree") for e in live["engines"]]
    if all(a is True for a in agree):
        return live
    limit = live.get("rounds", {}).get("spread_limit", ROUNDS_SPREAD_LIMIT)
    if any(a is False for a in agree):
        why = "; ".join(rounds_warning(e, limit) for e in disagreeing(live))
        log.write(f"This machine is busy: {why}. Numbers measured now cannot back the text.\n")
    else:
        log.write("One round per engine cannot show that the machine was quiet.\n")
    return committed_report(committed, log)


def committed_report(committed: str, log: TextIO | None = None) -> dict:
    """The committed report `docs/assets/bench/<committed>` (the one a lesson's table comes from),
    saying on `log` (default: standard output) that it is shown, and the machine it was measured on.

    Raises:
        ValueError: If the report is not there (a clone of the repository has it).
    """
    log = sys.stdout if log is None else log
    path = COMMITTED_REPORTS / committed
    if not path.is_file():
        raise ValueError(f"committed: no report {committed!r} in {COMMITTED_REPORTS} "
                         "(the notebooks run from a clone of the repository)")
    shown = json.loads(path.read_text())
    m = shown["machine"]
    log.write(f"Shown instead: the committed report docs/assets/bench/{committed}, measured on "
              f"{cpu_name(m)} ({m['cores']} cores){', ' + m['gpu'] if m.get('gpu') else ''}.\n")
    return shown


# -- the table -----------------------------------------------------------------------------------
def _fmt(value, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value * scale:,.{digits}f}{suffix}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _percent(fraction: float | None) -> str:
    """A percentage with two significant digits when it is small (0.046%), one decimal otherwise."""
    if fraction is None:
        return "-"
    pct = 100 * fraction
    return f"{pct:.2g}%" if pct < 1 else f"{pct:.1f}%"


def format_table(report: dict) -> str:
    """The end-of-run summary: the setup in a few lines, then one row per engine."""
    m, w, lim = report["machine"], report["workload"], report["limits"]
    gib = 2**-30
    lines = [
        (f"workload {w['name']}: {_count(w['num_requests'], 'request')}, {w['prompt_tokens']} prompt tokens, "
         f"{w['output_tokens']} output tokens ({w['params']['submission']}); model {report['model']['name']}"),
        (f"machine: {cpu_name(m)} ({m['cores']} cores), {m.get('gpu', m['device'])}, torch {m['torch']}; "
         f"measured {lim['memory_bandwidth'] / 1e9:.1f} GB/s memory, "
         f"{lim['matmul_flops'] / 1e9:.1f} GFLOP/s {lim['matmul_dtype']} matmul; "
         f"load average {_fmt(m.get('load_average_1min_before'), digits=2)} before, "
         f"{_fmt(m.get('load_average_1min_after'), digits=2)} after"),
        (f"median of {report['repeat']} run(s) each{', after a warm-up' if report['warmup'] else ''}; "
         f"speedup = out tok/s over {report['ratios']['baseline']}'s, the numbers shown"),
        "",
    ]
    prefix = w["name"] in ("prefix", "offload")
    ratios = speedups(report["engines"], report["ratios"]["baseline"])
    cols = [("engine", lambda e: e["label"]),
            ("out tok/s", lambda e: _fmt(e["output_tok_per_s"])),
            ("speedup", lambda e: _fmt(ratios[e["name"]], digits=2, suffix="x")),
            ("wall s", lambda e: _fmt(e["wall_s"], digits=2))]
    if prefix:
        cols += [("TTFT cold ms", lambda e: _fmt(e["ttft_cold_s"], 1e3)),
                 ("TTFT cached ms", lambda e: _fmt(e["ttft_cached_s"], 1e3)),
                 ("prefix hits", lambda e: _fmt(e["prefix_cache_hit_rate"], 100, 0, "%"))]
    else:
        cols += [("TTFT med ms", lambda e: _fmt(e["ttft_s"]["median"], 1e3)),
                 ("TTFT p99 ms", lambda e: _fmt(e["ttft_s"]["p99"], 1e3))]
    cols += [("TPOT med ms", lambda e: _fmt(e["tpot_s"]["median"], 1e3)),
             ("KV blocks", lambda e: _fmt(e["peak_kv_blocks_used"], digits=0)),
             ("KV used", lambda e: _fmt(e["kv_token_utilization"], 100, 0, "%")),
             ("peak mem GiB", lambda e: _fmt(e["peak_memory_bytes"], gib, 2)),
             ("roofline", lambda e: _percent(e["fraction_of_roofline"]))]
    if any(e.get("spec_num_drafts") for e in report["engines"]):
        cols += [("accepted", lambda e: _fmt(e.get("spec_acceptance_rate"), 100, 0, "%")),
                 ("tok/run", lambda e: _fmt(e.get("spec_mean_accepted_length"), digits=2))]
    rows = [[h for h, _ in cols]] + [[f(e) for _, f in cols] for e in report["engines"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    roof = ", ".join(f"{e['name']} {e['roofline']['tok_per_s']:,.0f} tok/s ({e['roofline']['bound']}-bound, "
                     f"batch {e['roofline']['batch']})" for e in report["engines"])
    lines += ["", f"decode roofline: {roof}"]
    starts = [e for e in report["engines"] if e.get("startup")]
    if starts:
        lines.append("start-up, engine built + its first request's first token: " + ", ".join(
            f"{e['name']} {e['startup']['load_s']:.2f} + {e['startup']['first_token_s'] - e['startup']['load_s']:.2f} s"
            for e in starts))
        waits = [e for e in starts if e["startup"].get("compile_wait_s", 0) >= 0.05]
        if waits:
            lines.append("the rounds waited for the decode step compiling in the background: " + ", ".join(
                f"{e['name']} {e['startup']['compile_wait_s']:.1f} s" for e in waits))
    loose = disagreeing(report)
    if loose:
        limit = report.get("rounds", {}).get("spread_limit", ROUNDS_SPREAD_LIMIT)
        lines += ["", "WARNING: the rounds disagree, the machine was loaded; measure again on an idle machine:"]
        lines += [f"  {rounds_warning(e, limit)}" for e in loose]
    if loaded := load_warning(m.get("load_average_1min_before"), m["cores"], was=True):
        lines += ["", loaded]
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def cpu_name(machine: dict) -> str:
    """The CPU's name, its generation where reports record it ("AMD EPYC Zen 4") and its kind
    (`tinyvllm.hardware.report_kind`: "avx2", "avx512_vnni", "amx"), or for
    older reports the vector instructions PyTorch uses on it ("AVX2", "AVX512"): two CPUs of one
    name can differ there, and CPU numbers follow it."""
    kind = report_kind(machine) or machine.get("cpu_capability")
    cpu = " ".join(filter(None, [machine["cpu"], machine.get("cpu_microarchitecture")]))
    return f"{cpu} ({kind})" if kind else cpu


# -- the plot ------------------------------------------------------------------------------------
def require_matplotlib():
    """matplotlib, or a clear error: it is optional for tinyvllm (in the `dev` extras)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[dev]')") from None
    return matplotlib


def _tick_label(label: str) -> str:
    """An engine's label in lines short enough to sit under its bar: "phase 3 (continuous_batching)"
    becomes "phase 3", "continuous", "batching"."""
    import textwrap
    return "\n".join(textwrap.wrap(label.replace("(", "").replace(")", "").replace("_", " "), 12))


def plot_report(report: dict) -> Figure:
    """Draw a report: the picture `--plot` saves, and the one the notebooks show.

    Two panels. Left, output tokens/s per engine (bars: the median; whiskers: the fastest and
    slowest of the rounds the median comes from; labels: speedup over the baseline's median and fraction of roofline). Right, the
    latencies: TTFT and TPOT medians, or for the prefix workload TTFT cold against cached.

    The figure is made without pyplot (no window, nothing left open in pyplot's list of
    figures); in a Jupyter notebook, a cell whose last expression is the figure shows it.

    Args:
        report: A report from `run_bench`, or one read back from the JSON file of `--json`.

    Returns:
        The `matplotlib.figure.Figure`, with two axes: throughput, then latency.

    Raises:
        ValueError: If matplotlib is not installed.
    """
    matplotlib = require_matplotlib()
    import matplotlib.ticker
    from matplotlib.figure import Figure

    engines, w, m = report["engines"], report["workload"], report["machine"]
    labels = [_tick_label(e["label"]) for e in engines]
    x = np.arange(len(engines))
    fig = Figure(figsize=(5 + 1.6 * len(engines), 4.8), layout="tight")
    ax1, ax2 = fig.subplots(1, 2)

    tps = [e["output_tok_per_s"] for e in engines]
    used = [[r["output_tok_per_s"] for r in e["runs"] if r.get("used", True)] for e in engines]
    lo, hi = [min(u) for u in used], [max(u) for u in used]
    colors = ["tab:gray" if e["kind"] == "hf" else "tab:purple" for e in engines]
    ax1.bar(x, tps, color=colors, yerr=[np.subtract(tps, lo), np.subtract(hi, tps)], capsize=4)
    # the ratio of the medians drawn, so a label agrees with the bars (and with the tables)
    ratios = speedups(engines, report["ratios"]["baseline"])
    for i, e in enumerate(engines):
        ratio = ratios[e["name"]]
        ax1.annotate(f"{ratio:.2f}x\n{_percent(e['fraction_of_roofline'])}\nof roofline",
                     (i, hi[i]), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                     textcoords="offset points")
    ax1.set_xticks(x, labels, fontsize=8)
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput (median; whiskers: min-max)", fontsize=10)
    ax1.margins(y=0.25)

    if w["name"] in ("prefix", "offload"):
        series = [("TTFT cold", [e["ttft_cold_s"] for e in engines]),
                  ("TTFT cached", [e["ttft_cached_s"] for e in engines])]
    else:
        series = [("TTFT median", [e["ttft_s"]["median"] for e in engines]),
                  ("TPOT median", [e["tpot_s"]["median"] for e in engines])]
    width = 0.38
    for k, (name, vals) in enumerate(series):
        ms = [np.nan if v is None else 1e3 * v for v in vals]
        ax2.bar(x + (k - 0.5) * width, ms, width, label=name)
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.set_ylabel("milliseconds (log scale)")
    ax2.set_yscale("log")
    # ticks at 1, 2 and 5 of every decade, written plainly (200, not 2 x 10^2)
    ax2.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    shown = [1e3 * v for _, vals in series for v in vals if v]
    if shown:  # room below the shortest bar (log scale) and above the tallest (the legend)
        ax2.set_ylim(min(shown) / 2, max(shown) * 4)
    ax2.set_title("latency", fontsize=10)
    ax2.legend(fontsize=8, ncols=2, loc="upper center")

    device = m.get("gpu") or f"{cpu_name(m)}, {m['cores']} cores"
    fig.suptitle(f"tinyvllm bench {w['name']}: {report['model']['name']}, {_count(w['num_requests'], 'request')}, "
                 f"{w['output_tokens']} output tokens\n{device}, torch {m['torch']}", fontsize=10)
    return fig


def write_plot(report: dict, path: str | Path) -> None:
    """Save `plot_report`'s picture of a report as an image file (`--plot PATH`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_report(report).savefig(path, dpi=110)
