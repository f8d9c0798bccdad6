"""Speeds on the pages come from the committed reports: every table under a `bench-table` marker is
what `scripts/bench_tables.py` writes from its report, every lesson has one, and no speed table on
the front pages or in a lesson is typed by hand."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_tables  # noqa: E402

# The pages where a speed may only appear as a rendered table.
FRONT_PAGES = ["README.md", "docs/index.md", "docs/benchmarks.md",
               *sorted(str(p.relative_to(REPO)) for p in REPO.glob("phases/p[0-9][0-9]_*/README.md"))]
SPEED_HEADER = re.compile(r"^\|.*(tok/s|tokens/s|ms/token|speedup|TPOT|TTFT).*\|\s*$", re.I)


def test_every_table_matches_its_report():
    stale = bench_tables.stale()
    assert not stale, f"tables out of date with their reports (run python scripts/bench_tables.py): {stale}"


@pytest.mark.parametrize("readme", sorted(REPO.glob("phases/p[0-9][0-9]_*/README.md")), ids=lambda p: p.parent.name)
def test_every_lesson_has_a_measured_table(readme):
    assert "<!-- bench-table:" in readme.read_text(), f"{readme.parent.name}'s lesson has no table rendered from a report"


@pytest.mark.parametrize("page", FRONT_PAGES)
def test_no_speed_table_is_typed_by_hand(page):
    text = (REPO / page).read_text()
    outside = bench_tables.BLOCK.sub("", text)
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # code blocks show program output, not tables
    typed = [line for line in outside.splitlines() if SPEED_HEADER.match(line)]
    assert not typed, f"{page}: a speed table outside a bench-table marker: {typed[0]}"


def test_a_changed_number_is_caught(tmp_path):
    block = "<!-- bench-table: latency-peers.json | engines: phase7, llamacpp | baseline: llamacpp -->\n"
    fresh = bench_tables.rewrite(block + "<!-- /bench-table -->")
    assert "| 1.00x |" in fresh and "llama.cpp" in fresh and "(amx)" in fresh
    edited = re.sub(r"\| (\d+)\.(\d) \|", lambda m: f"| {int(m.group(1)) + 1}.{m.group(2)} |", fresh, count=1)
    assert edited != fresh and bench_tables.rewrite(edited) == fresh


def test_the_speedup_agrees_with_the_numbers_beside_it():
    table = bench_tables.render("throughput-ladder.json | engines: phase2, phase3 | baseline: phase2")
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| phase")]
    (base, _), (new, speedup) = ((float(r[1].replace(",", "")), r[2].strip()) for r in rows)
    assert speedup == f"{new / base:.2f}x"


def test_rows_can_be_left_out_and_scaled():
    """`where: key != value` leaves rows out; a column `key*1000` shows seconds as ms."""
    report = bench_tables.load("kernels-prefill-zen4.json")
    table = bench_tables.render("kernels-prefill-zen4.json | where: case = chunk, kernel != triton | "
                                "columns: kernel = kernel, seconds*1000 = ms")
    rows = [line.split("|")[1:-1] for line in table.splitlines() if re.match(r"\| (cpu|sdpa|phase3|triton) ", line)]
    expected = [r for r in report["rows"] if r["case"] == "chunk" and r["kernel"] != "triton"]
    assert [r[0].strip() for r in rows] == [r["kernel"] for r in expected] and expected
    assert [r[1].strip() for r in rows] == [f"{r['seconds'] * 1000:,.2f}" for r in expected]


def test_one_table_one_machine():
    with pytest.raises(bench_tables.TableError, match="another machine"):
        bench_tables.render("throughput-ladder.json + throughput-peers.json | engines: phase2@throughput-ladder.json, vllm")
    with pytest.raises(bench_tables.TableError, match="no report"):
        bench_tables.render("nothing.json")
    with pytest.raises(bench_tables.TableError, match="unknown column"):
        bench_tables.render("throughput-ladder.json | columns: engine, speed")


def test_two_generations_under_one_name_are_two_machines():
    from tinyvllm.hardware import microarchitecture
    assert microarchitecture("AMD", (25, 17)) == "Zen 4" and microarchitecture("AMD", (23, 1)) == "Zen"
    assert microarchitecture("AMD", (25, 1)) == "Zen 3" and microarchitecture("Intel", (6, 143)) == ""
    zen1 = {"cpu": "AMD EPYC", "cpu_kind": "avx2", "cores": 2}  # a report from before the field
    zen4 = dict(zen1, cpu_family_model=[25, 17], cpu_microarchitecture="Zen 4")
    assert not bench_tables.same_machine(zen1, zen4) and bench_tables.same_machine(zen4, dict(zen4))
    assert bench_tables.same_machine(zen1, dict(zen1, cpu_microarchitecture=""))  # a generation not named
    assert bench_tables.machine_line(zen4, None) == "2-core AMD EPYC Zen 4 (avx2)"
    assert bench_tables.machine_line(zen1, None) == "2-core AMD EPYC (avx2)"


def test_an_amx_cpu_is_a_kind_of_its_own_in_every_report():
    """AVX512-VNNI with AMX is "amx", without it "avx512_vnni": a choice measured on one is not
    made on the other. A report from before "amx" was a kind records "avx512_vnni" and its flags;
    its table names the kind the flags tell."""
    from tinyvllm.hardware import kind_of
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
    assert kind_of(avx512) == "avx512_vnni" and kind_of(avx512 | {"amx_int8", "amx_bf16"}) == "amx"
    assert kind_of({"avx2", "fma"}) == "avx2" and kind_of({"avx2"}) == "other" and kind_of(set()) == "other"
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_kind": "avx512_vnni", "cores": 2,
            "cpu_flags": sorted(avx512 | {"amx_int8", "amx_bf16"})}
    assert bench_tables.machine_line(xeon, None) == "2-core Intel(R) Xeon(R) Processor (amx)"
    zen4 = {"cpu": "AMD EPYC", "cpu_kind": "avx512_vnni", "cores": 2, "cpu_flags": sorted(avx512),
            "cpu_microarchitecture": "Zen 4"}
    assert bench_tables.machine_line(zen4, None) == "2-core AMD EPYC Zen 4 (avx512_vnni)"


def _tables():
    """(page, spec, body) of every bench-table on every page."""
    for page in bench_tables.pages():
        for m in bench_tables.BLOCK.finditer(page.read_text()):
            yield page.relative_to(REPO), m["spec"], m["body"]


def _is_accuracy(spec_text: str) -> bool:
    """A table of perplexities (`tinyvllm bench accuracy`): numbers of the model, not of a machine's
    speed, whose reports record no machine."""
    spec = bench_tables.parse_spec(spec_text)
    return bool(spec["reports"]) and all("results" in (r := bench_tables.load(n)) and "machine" not in r
                                         for n in spec["reports"])


def test_every_table_names_its_machine():
    """Each table of measured speeds says where it was measured: one machine in a line above it,
    or a column naming each row's (a ladder of several machines)."""
    unnamed = [f"{page}: {spec.strip()[:80]}" for page, spec, body in _tables()
               if "*Measured on " not in body and "| measured on |" not in body and not _is_accuracy(spec)]
    assert not unnamed, "tables that do not name their machine:\n" + "\n".join(unnamed)


# The pages a learner reads in order: the front page, the home page and the lessons. The
# benchmarks page and the lab notes keep many sessions side by side, each table with its machine.
LEARNER_PAGES = ("README.md", "docs/index.md", "phases/p")


def _numbers_on_the_learners_path() -> dict[tuple, set]:
    """(machine, model, workload, engine, its settings) -> {(output tok/s shown, where)} over the tables
    of the learner's pages; the rows of one ladder apart (each rung is a run of its own, and the
    ladder says so under it)."""
    seen: dict[tuple, set] = {}
    for page, spec_text, body in _tables():
        if not str(page).startswith(LEARNER_PAGES):
            continue
        spec = bench_tables.parse_spec(spec_text)
        if spec.get("rungs"):
            for r in bench_tables.rungs(spec):
                for e, tok_s in ((r["new"], r["tok_s"]), (r["old"], r["old_tok_s"])):
                    key = (r["machine"], r["model"], r["workload"], e["name"], bench_tables._settings(e))
                    seen.setdefault(key, set()).add((bench_tables._num(tok_s), f"{page}, a ladder"))
            continue
        reports = {name: bench_tables.load(name) for name in spec["reports"]}
        shown = [(name, e) for name, r in reports.items() for e in r.get("engines", [])]
        if spec.get("engines"):   # only the rows the table shows: `name` or `name@report`
            wanted = [item.partition("=")[0].strip().partition("@") for item in spec["engines"]]
            shown = [(n, e) for n, e in shown if any(e["name"] == w and src in ("", n) for w, _, src in wanted)]
        for name, e in shown:
            report = reports[name]
            key = (bench_tables.short_machine(report["machine"]), report.get("model", {}).get("name"),
                   bench_tables._workload_line(report), e["name"], bench_tables._settings(e))
            seen.setdefault(key, set()).add((bench_tables._num(e["output_tok_per_s"]), f"{page}, {name}"))
    return seen


def test_one_workload_on_one_machine_shows_one_number_on_the_learner_s_path():
    """The README, the home page and the lessons never give two numbers for one engine on one
    workload on one machine (a lesson shows the README's run, or one on a machine its table
    names); two rungs of one ladder that ran the same engine are said to be two runs under it."""
    clashes = []
    for (machine, model, workload, engine, settings), shown in _numbers_on_the_learners_path().items():
        numbers = {n for n, _ in shown}
        in_a_ladder = {n for n, w in shown if w.endswith("a ladder")}   # runs a ladder shows, and says so
        if len(numbers) > 1 and not numbers <= in_a_ladder:
            clashes.append(f"{engine} ({settings or 'default settings'}), {workload} of {model}, on {machine}: "
                           + "; ".join(f"{n} in {w}" for n, w in sorted(shown)))
    assert not clashes, "one workload, one machine, several numbers:\n" + "\n".join(clashes)
    ladder = (REPO / "README.md").read_text()
    assert "in 2 rungs, each measured in a run of its own, at 113.4 and 104.5 output tok/s" in ladder
