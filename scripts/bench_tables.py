"""Tables of measured numbers in the lessons and pages, written from the committed bench reports.

A page never carries a hand-typed speed: it carries a marker naming a report in
`docs/assets/bench/`, and this script writes the table under it (`python scripts/bench_tables.py`
rewrites every page; `--check` only says which are stale, as `tests/test_bench_tables.py` does).

    <!-- bench-table: throughput-ladder.json | engines: phase2, phase3, hf | baseline: phase2 -->
    ...written here...
    <!-- /bench-table -->

The marker's fields, separated by `|`:

- the first: one report, or several joined by `+` (all from one machine: a table names its
  machine once, so two machines in one table are refused);
- `engines:` the rows, in order: `name`, `name@report.json` where two reports hold the same name,
  and `= label` to rename a row (`phase5@latency-int8.json = phase 5, int8 weights`); all of them
  when left out;
- `columns:` for an engine report, names from `ENGINE_COLUMNS` (default: engine, out tok/s,
  speedup when there is a baseline, TTFT ms, TPOT ms); for a report of `rows` or `results`
  (step breakdowns, kernels, accuracy), `key = header` pairs;
- `baseline:` the row the speedup column divides by (the displayed tok/s over the baseline's
  displayed tok/s, so every speedup agrees with the numbers beside it);
- `where:` for a rows report, `key = value` filters (`batch = 1`; `key != value` leaves rows out);
  a column `key*1000 = header` shows the value times 1000 (seconds as ms);
- `rungs:` instead of a report, the ladder: `phase2/phase1@latency.json, ...`, each phase over the
  one below on the workload of its own report, with the machine on each row (`= text` names a
  rung in the plot); `plot: NAME.png`
  also draws it, as bars, into docs/assets/bench/ (when the script writes, not under `--check`).

Above each table: the machine (CPU, its kind, cores, measured memory bandwidth), the workload and
the command that wrote the report, in one line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tinyvllm.hardware import report_kind

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "docs" / "assets" / "bench"
PAGES = ("README.md", "docs/*.md", "docs/lab/*.md", "phases/p[0-9][0-9]_*/README.md")

BLOCK = re.compile(r"(<!-- bench-table:(?P<spec>.*?)-->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)


def _num(value, scale=1.0, digits=1, suffix=""):
    return "-" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def _shown_tok_s(e) -> float:
    """An engine's output tok/s as its table shows it (a speedup divides these, so it agrees)."""
    return float(_num(e["output_tok_per_s"]).replace(",", ""))


def _median_ms(e, key):
    d = e.get(key)
    return None if not d else d["median"] * 1e3


# name -> (header, value of an engine row: str)
ENGINE_COLUMNS = {
    "engine": ("engine", lambda e: e["_label"]),
    "out tok/s": ("output tok/s", lambda e: _num(e["output_tok_per_s"])),
    "total tok/s": ("total tok/s", lambda e: _num(e["total_tok_per_s"])),
    "TTFT ms": ("TTFT ms (median)", lambda e: _num(_median_ms(e, "ttft_s"))),
    "TPOT ms": ("TPOT ms (median)", lambda e: _num(_median_ms(e, "tpot_s"))),
    "TTFT p99 ms": ("TTFT ms (p99)", lambda e: _num(None if not e.get("ttft_s") else e["ttft_s"]["p99"] * 1e3)),
    "load s": ("`LLM()` s", lambda e: _num((e.get("startup") or {}).get("load_s"), digits=2)),
    "start-up s": ("start-up s (first token)", lambda e: _num((e.get("startup") or {}).get("first_token_s"), digits=2)),
    "compile wait s": ("rounds waited for the compile, s",
                       lambda e: _num((e.get("startup") or {}).get("compile_wait_s"), digits=1)),
    "wall s": ("wall s", lambda e: _num(e["wall_s"], digits=2)),
    "TTFT cold ms": ("TTFT cold ms", lambda e: _num(e.get("ttft_cold_s"), 1e3)),
    "TTFT cached ms": ("TTFT cached ms", lambda e: _num(e.get("ttft_cached_s"), 1e3)),
    "prefix hits": ("prefix-cache hits", lambda e: _num(e.get("prefix_cache_hit_rate"), 100, 0, "%")),
    "KV blocks": ("peak KV blocks", lambda e: _num(e.get("peak_kv_blocks_used"), digits=0)),
    "KV used": ("KV tokens used", lambda e: _num(e.get("kv_token_utilization"), 100, 0, "%")),
    "KV tokens": ("KV tokens reserved", lambda e: _num(e.get("peak_kv_tokens_reserved"), digits=0)),
    "preemptions": ("preemptions", lambda e: _num(e.get("num_preemptions"), digits=0)),
    "accepted": ("drafts accepted", lambda e: _num(e.get("spec_acceptance_rate"), 100, 0, "%")),
    "tok/run": ("tokens per model run", lambda e: _num(e.get("spec_mean_accepted_length"), digits=2)),
    "peak mem GiB": ("peak memory GiB", lambda e: _num(e.get("peak_memory_bytes"), 2**-30, 2)),
    "roofline": ("of the roofline", lambda e: _num(e.get("fraction_of_roofline"), 100, 0, "%")),
    "speedup": ("speedup", None),   # filled from the baseline
}
DEFAULT_COLUMNS = ("engine", "out tok/s", "speedup", "TTFT ms", "TPOT ms")


class TableError(ValueError):
    pass


def load(name: str) -> dict:
    path = REPORTS / name
    if not path.is_file():
        raise TableError(f"no report {name} in docs/assets/bench/")
    return json.loads(path.read_text())


def machine_line(machine: dict | None, limits: dict | None) -> str:
    if not machine:
        return ""
    cpu = short_machine(dict(machine, gpu=None))
    where = machine.get("gpu") or f"{machine['cores']}-core {cpu}"
    if machine.get("gpu"):
        where += f" with a {machine['cores']}-core {cpu} host"
    bw = f", {limits['memory_bandwidth'] / 1e9:.0f} GB/s of memory bandwidth" if limits and limits.get("memory_bandwidth") else ""
    return f"{where}{bw}"


def _kind(m: dict) -> str | None:
    kind = report_kind(m) or m.get("cpu_capability")
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(kind, kind)


def same_machine(a: dict | None, b: dict | None) -> bool:
    """One CPU (and GPU) name and generation ("Zen 4": reports before it lack it, and differ from
    those that name one; "" names none), and one kind where both reports record it (early reports
    do not)."""
    a, b = a or {}, b or {}
    kinds = {_kind(a), _kind(b)} - {None}
    return a.get("cpu") == b.get("cpu") and a.get("gpu") == b.get("gpu") and (
        (a.get("cpu_microarchitecture") or None) == (b.get("cpu_microarchitecture") or None)) and (
        len(kinds) <= 1 or kinds == {"avx512", "avx512_vnni"})


def short_machine(m: dict) -> str:
    if m.get("gpu"):
        return m["gpu"]
    cpu = " ".join(filter(None, [m["cpu"], m.get("cpu_microarchitecture")]))
    return f"{cpu} ({_kind(m)})" if _kind(m) else cpu


def parse_spec(spec: str) -> dict:
    parts = [p.strip() for p in spec.split("|")]
    out = {"reports": []}
    if ":" not in parts[0]:
        out["reports"] = [r.strip() for r in parts.pop(0).split("+")]
    for p in parts:
        key, _, value = p.partition(":")
        key = key.strip()
        if key not in ("engines", "columns", "baseline", "where", "rungs", "plot"):
            raise TableError(f"unknown field {key!r} in bench-table marker {spec!r}")
        out[key] = [v.strip() for v in value.split(",") if v.strip()]
    return out


def _workload_line(report: dict) -> str:
    w = report.get("workload")
    if not isinstance(w, dict):
        return ""
    p = w.get("params", {})
    if w["num_requests"] == 1:
        return f"one request, {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output tokens"
    if p.get("submission") == "one after another":
        return (f"{w['num_requests']} requests one after another, {w['prompt_tokens']} prompt tokens, "
                f"{w['output_tokens']} output tokens")
    return (f"{w['num_requests']} requests at once ({p.get('dataset', '?')} prompts), {w['prompt_tokens']} prompt tokens, "
            f"{w['output_tokens']} output tokens")


def _engine_rows(spec: dict, reports: dict[str, dict]) -> list[dict]:
    rows = []
    names = spec.get("engines")
    if not names:
        return [dict(e, _label=e["label"]) for r in reports.values() for e in r["engines"]]
    for item in names:
        ref, _, label = item.partition("=")
        name, _, src = ref.strip().partition("@")
        pool = [reports[src]] if src else list(reports.values())
        if src and src not in reports:
            raise TableError(f"engine {item!r}: {src} is not one of this table's reports")
        found = [e for r in pool for e in r["engines"] if e["name"] == name]
        if len(found) != 1:
            raise TableError(f"engine {item!r}: {len(found)} rows named {name!r} in {', '.join(reports) if not src else src}")
        rows.append(dict(found[0], _label=label.strip() or found[0]["label"]))
    return rows


NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?[x%]?$|^-$")


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    """Numbers right-aligned, words left."""
    align = ["--:" if rows and all(NUMBER.match(r[i]) for r in rows) else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _settings(engine: dict) -> str:
    """The engine arguments a row ran with, short: `quantization=int8`, `speculative ngram`."""
    out = []
    for k, v in (engine.get("engine_args") or {}).items():
        if k in ("device", "gpu_memory_utilization", "kv_cache_memory"):
            continue
        if isinstance(v, dict):
            out.append(f"{k.split('_')[0]} {v.get('method', '')}".strip())
        else:
            out.append(f"{k}={v}")
    return ", ".join(out)


def rungs(spec: dict) -> list[dict]:
    """The rows of a ladder: for `phase2/phase1@latency.json`, both engines and their report."""
    out = []
    for item in spec["rungs"]:
        item, _, label = item.partition("=")
        pair, _, src = item.partition("@")
        new, _, old = (x.strip() for x in pair.partition("/"))
        report = load(src.strip())
        by_name = {e["name"]: e for e in report["engines"]}
        if new not in by_name or old not in by_name:
            raise TableError(f"rung {item!r}: {src} has no {new!r} or no {old!r}")
        a, b = by_name[new], by_name[old]
        ta, tb = _shown_tok_s(a), _shown_tok_s(b)
        out.append({"new": a, "old": b, "tok_s": ta, "old_tok_s": tb, "speedup": round(ta / tb, 2),
                    "workload": _workload_line(report), "machine": short_machine(report["machine"]),
                    "model": report.get("model", {}).get("name"), "label": label.strip()})
    return out


def render_rungs(spec: dict) -> str:
    """Each phase on the workload it exists for, one row per rung: its speedup over the phase
    below in one report. Rungs of one machine: the machine named once, above the table; of
    several (each rung comes from its own report): on each row."""
    rows = rungs(spec)
    machines = [load(src)["machine"] for src in _rung_reports(spec)]
    one = all(same_machine(m, machines[0]) for m in machines)
    body = [[r["new"]["label"], _settings(r["new"]) or "default settings", r["workload"], r["old"]["label"],
             _num(r["old_tok_s"]), _num(r["tok_s"]), f"{r['speedup']:.2f}x"] + ([] if one else [r["machine"]])
            for r in rows]
    header = ["phase", "with", "workload", "over", "tok/s below", "tok/s", "speedup"] + ([] if one else ["measured on"])
    first = load(_rung_reports(spec)[0])
    caption = f"*Measured on a {machine_line(first['machine'], first.get('limits'))}.*\n\n" if one else ""
    return caption + _markdown(header, body) + "\n" + _repeated(rows)


def _repeated(rows: list[dict]) -> str:
    """A line under a ladder for each engine that two rungs measured (each rung is a run of its
    own): the same engine, settings and workload give two numbers, and the table says so."""
    seen: dict[tuple, list[str]] = {}
    for r in rows:
        for e, tok_s in ((r["new"], r["tok_s"]), (r["old"], r["old_tok_s"])):
            key = (e["label"], _settings(e) or "default settings", r["workload"], r["machine"])
            seen.setdefault(key, []).append(_num(tok_s))
    lines = [f"*{label[0].upper() + label[1:]} with {settings}, {workload}: in {len(runs)} rungs, each measured in a "
             f"run of its own, at {' and '.join(runs)} output tok/s.*\n"
             for (label, settings, workload, _), runs in seen.items() if len(set(runs)) > 1]
    return ("\n" + "".join(lines)) if lines else ""


def _rung_reports(spec: dict) -> list[str]:
    return [item.partition("=")[0].partition("@")[2].strip() for item in spec["rungs"]]


def plot_rungs(spec: dict, path: Path) -> None:
    """The ladder as horizontal bars: each rung's speedup over the phase below (log scale)."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    from matplotlib.figure import Figure

    rows = rungs(spec)
    fig = Figure(figsize=(9, 0.55 * len(rows) + 1.2), layout="tight")
    ax = fig.subplots()
    y = list(range(len(rows)))[::-1]
    gpu = ["tab:green" if "NVIDIA" in r["machine"] else "tab:purple" for r in rows]
    ax.barh(y, [r["speedup"] for r in rows], color=gpu)
    if "tab:green" in gpu:   # the legend says which bars ran on a GPU (the GPU runs used random weights)
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color="tab:purple", label="CPU, the default model"),
                           Patch(color="tab:green", label="GPU, random weights in its shapes")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    one = len({r["machine"] for r in rows}) == 1   # one machine: named in the title, not on each bar
    for yi, r in zip(y, rows):
        ax.annotate(f"{r['speedup']:.2f}x" + ("" if one else f"  {r['machine']}"), (r["speedup"], yi),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    names = [f"{r['new']['label'].split(' (')[0]} over {r['old']['label'].split(' (')[0]}: "
             + (r["label"] or textwrap.shorten(_settings(r["new"]) or r["workload"].split(",")[0], 34)) for r in rows]
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.5, 1, 2, 5, 10]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axvline(1, color="gray", lw=0.8)   # a bar left of it: the setting costs on that workload
    ax.set_xlim(min(0.8, min(r["speedup"] for r in rows) * 0.8), max(r["speedup"] for r in rows) * 6)
    ax.set_xlabel("output tokens/s over the phase below (log scale)")
    ax.set_title("Each phase on the workload it exists for" + (f", on {rows[0]['machine']}" if one else ""),
                 fontsize=10)
    fig.savefig(path, dpi=110)


def render(spec_text: str) -> str:
    """The caption line and the markdown table that a marker's spec asks for."""
    spec = parse_spec(spec_text)
    if spec.get("rungs"):
        return render_rungs(spec)
    if not spec["reports"]:
        raise TableError(f"bench-table marker {spec_text!r} names no report")
    reports = {name: load(name) for name in spec["reports"]}
    first = next(iter(reports.values()))
    for name, r in reports.items():
        if not same_machine(r.get("machine"), first.get("machine")):
            raise TableError(f"{name} was measured on another machine than {spec['reports'][0]}: "
                             "one table, one machine")
    workloads = {_workload_line(r) for r in reports.values()}
    caption = machine_line(first.get("machine"), first.get("limits"))
    if "engines" in first:
        rows = _engine_rows(spec, reports)
        columns = spec.get("columns") or [c for c in DEFAULT_COLUMNS if c != "speedup" or spec.get("baseline")]
        for c in columns:
            if c not in ENGINE_COLUMNS:
                raise TableError(f"unknown column {c!r}; known: {', '.join(ENGINE_COLUMNS)}")
        base = None
        if "speedup" in columns:
            if not spec.get("baseline"):
                raise TableError("a speedup column needs a baseline")
            bname = spec["baseline"][0]
            matches = [r for r in rows if r["name"] == bname or r["_label"] == bname]
            if len(matches) != 1:
                raise TableError(f"baseline {bname!r} is not exactly one row of the table")
            base = _shown_tok_s(matches[0])
        body = []
        for e in rows:
            cells = []
            for c in columns:
                if c == "speedup":
                    cells.append(f"{_shown_tok_s(e) / base:.2f}x")
                else:
                    cells.append(ENGINE_COLUMNS[c][1](e))
            body.append(cells)
        header = [ENGINE_COLUMNS[c][0] for c in columns]
        if len(workloads) == 1 and next(iter(workloads)):
            caption += f"; {next(iter(workloads))}"
    else:
        items = [r for rep in reports.values() for r in rep.get("rows", rep.get("results", []))]
        for cond in spec.get("where", []):
            key, _, value = (s.strip() for s in cond.partition("="))
            negate = key.endswith("!")
            key = key.rstrip("!").strip()
            items = [r for r in items if (str(r.get(key)) == value) != negate]
        pairs = [(k.strip(), h.strip() or k.strip()) for k, _, h in (c.partition("=") for c in spec.get("columns", []))]
        if not pairs:
            raise TableError("a table of rows needs `columns: key = header, ...`")
        body = []
        for r in items:
            cells = []
            for k, _ in pairs:
                k, _, scale = k.partition("*")
                v = r.get(k.strip())
                v = v * float(scale) if scale and isinstance(v, (int, float)) else v
                cells.append("-" if v is None else f"{v:,.2f}" if isinstance(v, float) else str(v))
            body.append(cells)
        header = [h for _, h in pairs]
    commands = [r.get("command") for r in reports.values() if r.get("command")]
    lines = []
    if caption:
        lines.append(f"*Measured on {'an' if caption[0] in 'AEIOUN' and not caption[0].isdigit() else 'a'} {caption}.*")
    if commands:
        lines.append("<small>" + "; ".join(f"`{c}`" for c in commands) + "</small>")
    if lines:
        lines.append("")
    return "\n".join(lines + [_markdown(header, body)]) + "\n"


def pages() -> list[Path]:
    found = []
    for pattern in PAGES:
        found += sorted(REPO.glob(pattern))
    return found


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("spec")) + m.group(4), text)


def stale() -> list[str]:
    return [str(p.relative_to(REPO)) for p in pages() if rewrite(p.read_text()) != p.read_text()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page's table is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"{p}: a bench table differs from its report (python scripts/bench_tables.py rewrites it)")
        return 1 if bad else 0
    drawn = set()
    for p in pages():
        text = p.read_text()
        for m in BLOCK.finditer(text):
            spec = parse_spec(m.group("spec"))
            if spec.get("rungs") and spec.get("plot") and spec["plot"][0] not in drawn:
                drawn.add(spec["plot"][0])
                plot_rungs(spec, REPORTS / spec["plot"][0])
                print(f"drew docs/assets/bench/{spec['plot'][0]}")
        new = rewrite(text)
        if new != text:
            p.write_text(new)
            print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
