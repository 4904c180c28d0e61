"""Every measured figure the documentation quotes, from one place: ``benchmarks/results/figures.yaml``.

A page writes ``{{ name }}`` where it quotes a figure; :func:`expand_figures` (called by ``docs/hooks.py``
while the site builds) replaces it with the entry's value. An entry is a figure (``value``, the text shown:
``"1.204"``, ``"0.81–0.91"``, ``"3,991"``), a Markdown block (``value`` holding a table or a sentence), or
a ``table`` of a benchmark's latest output, read from the "Latest numbers" section of
``benchmarks/README.md`` (where ``benchmarks/run_all.py``'s output is recorded verbatim) by the script's name
and the table's position. A figure's ``excerpt``, where it has one, is the line of that recorded output it
comes from, so that the file cannot quietly disagree with what was measured.

``tests/docs/test_figures.py`` fails on a figure the file holds that a page types by hand instead. Pure:
reads YAML and Markdown only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "benchmarks" / "results" / "figures.yaml"
RESULTS = REPO / "benchmarks" / "README.md"
"""Where ``run_all.py``'s latest output is recorded, one ``### bench_NAME.py`` section per benchmark."""

REFERENCE = re.compile(r"\{\{ ([a-z0-9_.-]+) \}\}")
"""A figure on a page: ``{{ striped_reads.ttft }}``."""

TOKEN = re.compile(
    r"(?<![\w.,/-])(?:\d+(?:\.\d+)?(?:\s?[–-]\s?\d+(?:\.\d+)?)?\s?(?:ms|s|min|minutes)(?!\w)"
    r"|\d+\.\d+(?:\s?[–-]\s?\d+\.\d+)?|\d{1,3}(?:,\d{3})+)(?![\w.]\d)"
)
"""A number as a page or the file writes it: a decimal (``0.81``), a decimal range (``0.81–0.91``), a number
with thousands separators (``3,991``), or a duration (``55-65 s``, ``29 ms``, ``3.5 minutes``)."""


def distinctive(token: str) -> bool:
    """A number specific enough to be a measurement when it turns up on a page: a range, thousands, three
    significant digits (``1.204``, ``1.00``), a duration with a decimal, a range or three digits, or in
    minutes. Not ``0.33`` (vLLM 0.33, or 0.33%?) nor ``5 s`` (a threshold): too common to tell apart."""
    number = re.match(r"[\d.,]+", token).group(0)
    unit = token[len(number):].lstrip(" –-")
    if re.search(r"\d[–-]\d", token) or "," in number:
        return True
    if unit:
        return "." in number or len(number) >= 3 or unit.startswith("min")
    return len(number.replace(".", "").lstrip("0")) >= 3


def normalize_dashes(text: str) -> str:
    return text.replace("–", "-")


@cache
def _data(path: Path = FIGURES) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not isinstance(document.get("figures"), dict):
        raise TypeError(f"{path}: expected a mapping with 'figures'")
    return document


def entries(path: Path = FIGURES) -> Mapping[str, Mapping[str, Any]]:
    """Every entry of the figures file, by name."""
    return _data(path)["figures"]


def result_sections(path: Path = RESULTS) -> dict[str, str]:
    """The latest recorded output of each benchmark: ``bench_NAME.py`` -> its section's text."""
    text = path.read_text(encoding="utf-8")
    latest = text.split("\n## Latest numbers\n", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### (\S+\.py)\b.*$", latest, flags=re.MULTILINE)
    return {sections[i]: sections[i + 1] for i in range(1, len(sections) - 1, 2)}


def result_tables(section: str) -> list[str]:
    """The Markdown tables of a benchmark's output, in order."""
    tables, current = [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


def value(name: str, path: Path = FIGURES) -> str:
    """The text an entry stands for (a table read from the recorded output), its own references expanded."""
    found = entries(path)
    if name not in found:
        raise ValueError(f"unknown figure '{name}' (benchmarks/results/figures.yaml has no such entry)")
    entry = found[name]
    if "table" in entry:
        benchmark, index = entry["table"]["benchmark"], int(entry["table"]["index"])
        tables = result_tables(result_sections().get(benchmark, ""))
        if not 1 <= index <= len(tables):
            raise ValueError(f"figure '{name}': {benchmark}'s latest output has {len(tables)} tables, not {index}")
        return tables[index - 1]
    return expand_figures(str(entry["value"]).rstrip("\n"), path)


def expand_figures(markdown: str, path: Path = FIGURES) -> str:
    """``markdown`` with every ``{{ name }}`` replaced by its entry's text; an unknown name is a
    ``ValueError`` (the build fails rather than publish a page with a hole)."""

    def replace(found: re.Match[str]) -> str:
        text = value(found.group(1), path)
        line_start = markdown.rfind("\n", 0, found.start()) + 1
        indent = markdown[line_start:found.start()]
        if indent.strip() == "" and "\n" in text:  # a block: every line at the reference's indentation
            text = text.replace("\n", "\n" + indent)
        return text

    return REFERENCE.sub(replace, markdown)


def tokens(text: str) -> Iterator[str]:
    """The figures in ``text``, dashes normalized (``0.81–0.91`` and ``0.81-0.91`` are one figure)."""
    for found in TOKEN.finditer(text):
        yield normalize_dashes(found.group(0)).replace(" ", "")


def held_tokens(path: Path = FIGURES) -> dict[str, str]:
    """Every distinctive figure the file holds (token -> the entry holding it), tables included."""
    held: dict[str, str] = {}
    for name in entries(path):
        for token in tokens(value(name, path)):
            if distinctive(token):
                held.setdefault(token, name)
    return held
