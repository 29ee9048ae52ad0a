"""Static checks of docs/ and README.md: the docs state what is true now.

- Every markdown link between docs resolves, in every doc (the run histories included).
- Every repository path a current doc names in backticks exists (`{a,b}` alternatives and
  `*` globs expanded; `<...>` placeholders and `::test` suffixes skipped). The run
  histories under docs/results/history-*.md record what was true when they were written,
  so only their links are checked.
- Every `--flag` a current doc passes to `benchmarks/<name>.py` is one that benchmark
  defines (the literal `"--flag"` in its source).
- The figure docs (performance, priority, simulation results) open with their current
  table and the command that reprints it, and stay short: the run history lives in
  docs/results/ and the commit log (issue 32).
"""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
HISTORY = sorted((DOCS / "results").glob("history-*.md"))
CURRENT = [
    *sorted(DOCS.glob("*.md")),
    REPO / "README.md",
    *(p for p in sorted((DOCS / "results").glob("*.md")) if p not in HISTORY),
]

FIGURE_DOCS = ("performance.md", "priority.md", "results.md")
MAX_LINES = 220  # "within about 200 lines"
TABLE_WITHIN = 40  # the current table starts within the first 40 lines

TOP_DIRS = (
    "docs/", "benchmarks/", "tests/", "ramjet/", "simulations/", "engine_stub/",
    "scripts/", "policies/", "deploy/", "kvpool/", "connectors/", "kernels/",
)  # fmt: skip
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
TOP = "|".join(map(re.escape, TOP_DIRS))
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})[\w./{{}},*-]*[\w}}*])")
BENCH_CMD = re.compile(r"benchmarks/(\w+)\.py((?:[ \t\n]+(?:--[\w-]+|[^\s#|`]+))*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _code_spans(text: str) -> list[str]:
    """Fenced blocks, inline code and indented lines: where a doc names paths and commands."""
    spans = [m.group(0) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    spans += [m.group(1) for m in INLINE.finditer(rest)]
    spans += [line for line in rest.splitlines() if line.startswith("    ")]
    return spans


def _expand(path: str) -> list[str]:
    """`a.{txt,json}` -> `a.txt`, `a.json` (every group, one level deep)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in product(*choices)]


def _exists(path: str) -> bool:
    return bool(list(REPO.glob(path))) if "*" in path else (REPO / path).exists()


def _missing_links(doc: Path) -> list[str]:
    out = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1).split("#")[0]
        if target and "://" not in target and not (doc.parent / target).exists():
            out.append(f"{_rel(doc)}: link {target}")
    return out


def _missing_paths(doc: Path) -> list[str]:
    out = []
    for span in _code_spans(doc.read_text()):
        for found in PATH.findall(span):
            path = found.split("::")[0].rstrip(".,")
            if "<" in path:
                continue
            out += [f"{_rel(doc)}: {p}" for p in _expand(path) if not _exists(p)]
    return out


def _unknown_flags(doc: Path) -> list[str]:
    out = []
    for span in _code_spans(doc.read_text()):
        for m in BENCH_CMD.finditer(re.sub(r"#[^\n]*", "", span)):
            src = REPO / "benchmarks" / f"{m.group(1)}.py"
            if not src.exists():
                out.append(f"{_rel(doc)}: benchmarks/{m.group(1)}.py does not exist")
                continue
            code = src.read_text()
            flags = re.findall(r"(?<![\w-])--[\w-]+", m.group(2))
            out += [f"{_rel(doc)}: {_rel(src)} has no {f}" for f in flags if f'"{f}"' not in code]
    return out


def test_every_link_between_docs_resolves() -> None:
    assert [x for doc in CURRENT + HISTORY for x in _missing_links(doc)] == []


def test_every_path_a_current_doc_names_exists() -> None:
    assert [x for doc in CURRENT for x in _missing_paths(doc)] == []


def test_every_benchmark_flag_a_current_doc_shows_is_defined() -> None:
    assert [x for doc in CURRENT for x in _unknown_flags(doc)] == []


@pytest.mark.parametrize("name", FIGURE_DOCS)
def test_a_figure_doc_opens_with_its_table_and_the_command_that_reprints_it(name: str) -> None:
    lines = (DOCS / name).read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"docs/{name}: {len(lines)} lines; history goes to docs/results/"
    )
    head = lines[:TABLE_WITHIN]
    rule = [i for i, line in enumerate(head) if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line)]
    assert rule, f"docs/{name}: no table in its first {TABLE_WITHIN} lines"
    before = "\n".join(lines[: rule[0]])
    assert re.search(r"benchmarks/\w+\.py|python -m simulations", before), (
        f"docs/{name}: no command before its first table"
    )


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The scanners find a broken link, a missing path (also one brace alternative) and an
    unknown flag, so the tests above cannot pass by finding nothing."""
    doc = tmp_path / "probe.md"
    doc.write_text(
        "[x](nowhere.md) `docs/results/e2e_vllm_two_rounds.{txt,nope}` `tests/none.py::t`\n"
        "    .venv/bin/python benchmarks/proxy_overhead.py --quick --no-such-flag\n"
    )
    assert _missing_links(doc) == ["probe.md: link nowhere.md"]
    assert _missing_paths(doc) == [
        "probe.md: docs/results/e2e_vllm_two_rounds.nope",
        "probe.md: tests/none.py",
    ]
    assert _unknown_flags(doc) == ["probe.md: benchmarks/proxy_overhead.py has no --no-such-flag"]
