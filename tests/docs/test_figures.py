"""Every measured number on the site comes from one place: ``benchmarks/results/figures.yaml``.

Pages write ``{{ name }}`` and the build puts the figure there (:mod:`kvpolicy.app.figures`); a figure the
file holds, typed by hand on a page or in the README, fails here, as does a reference to no figure, and a
figure whose ``excerpt`` is not in the recorded benchmark output it claims to come from.

Not scanned: ``console`` blocks (kvpolicy's own output, run by test_docs_site.py, whose plan ratios are
not benchmark figures), ``yaml`` blocks (documents), and the references written into docs/reference/
(generated from the code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpolicy.app import figures

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SOURCES = [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]
WRITTEN = re.compile(r"<!-- kvpolicy-reference: ([a-z0-9-]+) -->.*?<!-- /kvpolicy-reference: \1 -->", re.DOTALL)
SKIPPED_BLOCKS = re.compile(r"^([ \t]*)```(?:console|yaml)\b.*?^\1```[ \t]*$", re.MULTILINE | re.DOTALL)


def prose(text: str) -> str:
    """What a page types itself: figure references, written references and run or validated blocks removed."""
    return figures.REFERENCE.sub(" ", SKIPPED_BLOCKS.sub("", WRITTEN.sub("", text)))


def typed_figures(text: str, held: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, figure, entry) of each figure the file holds that ``text`` types by hand."""
    found = []
    for number, line in enumerate(prose(text).splitlines(), start=1):
        for token in figures.tokens(line):
            if token in held:
                found.append((number, token, held[token]))
    return found


@pytest.fixture(scope="module")
def held() -> dict[str, str]:
    return figures.held_tokens()


def test_no_page_types_a_figure_the_results_hold(held: dict[str, str]) -> None:
    typed = {
        str(path.relative_to(REPO)): found
        for path in SOURCES
        if (found := typed_figures(path.read_text(encoding="utf-8"), held))
    }
    assert typed == {}, "write {{ name }} instead (benchmarks/results/figures.yaml)"


def test_a_figure_typed_by_hand_is_found(held: dict[str, str]) -> None:
    assert typed_figures("striped loads were 1.204 times as fast", held) == [(1, "1.204", "striped_reads.ttft")]
    assert typed_figures("the dev loop: 3,991 tests", held)
    assert typed_figures("striped was 0.81-0.91 of per-rank", held)  # a hyphen for the file's en dash
    assert typed_figures("striped loads were {{ striped_reads.ttft }} times as fast", held) == []
    assert typed_figures("```console\n$ kvpolicy plan\n1.204\n```\n", held) == []


def test_every_figure_a_page_names_exists_and_every_figure_is_used() -> None:
    named = {name for path in SOURCES for name in figures.REFERENCE.findall(path.read_text(encoding="utf-8"))}
    entries = figures.entries()
    used_inside = {name for entry in entries.values() for name in figures.REFERENCE.findall(str(entry.get("value", "")))}
    assert sorted(named - set(entries)) == []
    assert sorted(set(entries) - named - used_inside) == []


def test_an_unknown_figure_fails_the_build_rather_than_leaving_a_hole() -> None:
    with pytest.raises(ValueError, match="unknown figure 'nope'"):
        figures.expand_figures("{{ nope }}")


def test_a_table_figure_is_read_from_the_recorded_output_and_keeps_its_indentation() -> None:
    table = figures.value("fleet_load.run1")
    assert table.startswith("| connector ") and table.count("\n") >= 4
    assert figures.expand_figures("=== \"tab\"\n\n    {{ fleet_load.run1 }}\n").count("\n    | ") >= 4


def test_every_excerpt_is_in_the_recorded_output_and_holds_its_figure() -> None:
    recorded = figures.normalize_dashes((REPO / "benchmarks" / "README.md").read_text(encoding="utf-8"))
    for name, entry in figures.entries().items():
        if "excerpt" in entry:
            excerpt = figures.normalize_dashes(entry["excerpt"])
            assert excerpt in recorded, name
            assert figures.normalize_dashes(str(entry["value"])) in excerpt, name


def test_every_table_a_figure_names_is_in_the_latest_output() -> None:
    sections = figures.result_sections()
    for name, entry in figures.entries().items():
        if "table" in entry:
            assert entry["table"]["benchmark"] in sections, name
            assert figures.value(name).startswith("|"), name
