"""The site as a reader meets it in a browser, checked on the built HTML (CI has no browser).

- No table swallowed by a paragraph (a Markdown table needs a blank line before it: without one it
  renders as one paragraph of pipes, and neither MkDocs' strict build nor anything else notices).
- No table wider than the content column at 1280 px (Material scrolls such a table sideways, and its
  right-hand columns are off screen), estimated from its words without a browser.
- No code line clipped: the site's stylesheet wraps code blocks inside the column.
- Copy buttons copy what a reader pastes into a shell: a ``console`` block its commands without the
  ``$`` prompt and without output; a ``text`` block (output) has none.
- Material's reading aids where they help: warnings for the safety points, tabs for the installs,
  collapsible reports, footer navigation.

Each guard is also run on a page that has the flaw, and must find it. The column widths were measured
with headless Chromium at 1280 px (``toc.integrate``: the table of contents sits in the left sidebar).
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import yaml
from site_build import BuiltSite, built_site  # noqa: F401  (a fixture)

from kvpolicy.app import rule
from kvpolicy.language.diagnostics import CHECKS

REPO = Path(__file__).resolve().parents[2]
CSS = REPO / "docs" / "stylesheets" / "extra.css"

COLUMN_PX = 970
"""A table's room at 1280 px: the content column (938 px) and the .8rem Material lets a table reach into
each margin, measured in headless Chromium."""

CODE_COLUMN_CHARS = 124
"""Characters of a code line that fit the content column at 1280 px (12.2 px monospace, the stylesheet's
``pre`` at .9em); a longer line is clipped unless code wraps."""


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = load_hooks()


# --- reading built HTML ---------------------------------------------------------------------------------


class Content(HTMLParser):
    """The parts of a page's article the guards look at: paragraphs' text, tables' cells (each a list
    of (text, in a code span) runs, marked header or not), code blocks' classes, attributes and text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.tables: list[list[list[dict]]] = []
        self.blocks: list[dict] = []
        self._paragraph: list[str] | None = None
        self._cell: dict | None = None
        self._code = 0
        self._block: dict | None = None
        self._in_pre = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "p":
            self._paragraph = []
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self._cell = {"header": tag == "th", "runs": []}
            self.tables[-1][-1].append(self._cell)
        elif tag == "code":
            self._code += 1
        elif tag == "div" and "highlight" in classes:
            language = next((name[9:] for name in classes if name.startswith("language-")), "")
            self._block = {"language": language, "classes": classes, "copy": attributes.get("data-copy"), "text": []}
            self.blocks.append(self._block)
        elif tag == "pre":
            self._in_pre = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self._paragraph is not None:
            self.paragraphs.append("".join(self._paragraph))
            self._paragraph = None
        elif tag in ("td", "th"):
            self._cell = None
        elif tag == "code" and self._code:
            self._code -= 1
        elif tag == "pre":
            self._in_pre = False
            self._block = None

    def handle_data(self, data: str) -> None:
        if self._paragraph is not None:
            self._paragraph.append(data)
        if self._cell is not None:
            self._cell["runs"].append((data, self._code > 0))
        if self._block is not None and self._in_pre:
            self._block["text"].append(data)


def content(page_html: str) -> Content:
    article = page_html.split('<article class="md-content__inner md-typeset">', 1)[-1].split("</article>", 1)[0]
    parsed = Content()
    parsed.feed(article)
    for block in parsed.blocks:
        block["text"] = "".join(block["text"])
    return parsed


# --- the guards -------------------------------------------------------------------------------------------


def tables_in_paragraphs(page_html: str) -> list[str]:
    """Paragraphs holding a table row: a line of two or more pipes (a table Markdown did not see)."""
    return [
        paragraph[:120]
        for paragraph in content(page_html).paragraphs
        if any(line.strip().startswith("|") and line.count("|") >= 3 for line in paragraph.splitlines())
    ]


def _char_px(character: str, code: bool) -> float:
    """Width of a character at Material's table font (.64rem, 12.8 px Roboto; code .85em monospace)."""
    if code:
        return 6.55
    if character.isdigit():
        return 7.1
    if character.isupper():
        return 8.3
    if character in "ilj.,:;|!' ":
        return 3.2
    if character in "mw":
        return 10.0
    return 6.3


def _unbreakable(text: str, code: bool, first_column: bool) -> list[str]:
    """The pieces a browser will not break ``text`` into: words (after hyphens too), whole code spans in
    a row's first cell (the stylesheet keeps names whole there), three characters of code elsewhere
    (Material breaks code anywhere)."""
    if code and not first_column:
        return [text[:3]] if text.strip() else []
    words = [word for word in re.split(r"\s+", text) if word]
    return words if code else [piece for word in words for piece in re.split(r"(?<=-)", word) if piece]


def table_width(rows: list[list[dict]]) -> float:
    """A table's least width in px: per column its widest unbreakable piece, plus the cells' padding
    (within 5% above, 21% below what Chromium lays out, on every table of the site)."""
    widths: dict[int, float] = {}
    for row in rows:
        for column, cell in enumerate(row):
            pieces = [
                sum(_char_px(character, code) for character in piece) * (1.08 if cell["header"] else 1.0)
                for text, code in cell["runs"]
                for piece in _unbreakable(text, code, column == 0)
            ]
            widths[column] = max(widths.get(column, 0.0), max(pieces, default=0.0) + 21.5)
    return sum(widths.values())


def wide_tables(page_html: str) -> list[tuple[str, int]]:
    """Tables that cannot fit the column: (their header, least width in px)."""
    found = []
    for rows in content(page_html).tables:
        width = table_width(rows)
        if width > COLUMN_PX:
            header = " | ".join("".join(text for text, _ in cell["runs"]).strip() for cell in rows[0]) if rows else ""
            found.append((header[:100], round(width)))
    return found


def code_wraps(css: str) -> bool:
    """The stylesheet wraps code blocks: ``pre > code`` with ``white-space: pre-wrap`` and a way to break a
    token with no space in it."""
    rules = re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL))
    return any(
        ".md-typeset pre > code" in [selector.strip() for selector in selectors.split(",")]
        and re.search(r"white-space:\s*pre-wrap", body)
        and re.search(r"overflow-wrap:\s*anywhere|word-break:\s*break-all", body)
        for selectors, body in rules
    )


def clipped_code_lines(page_html: str, stylesheets: dict[str, str]) -> list[str]:
    """Code lines longer than the column, unless a stylesheet the page links wraps code."""
    linked = [css for name, css in stylesheets.items() if f'href="{name}"' in page_html or f"/{name}\"" in page_html]
    if any(code_wraps(css) for css in linked):
        return []
    return [
        line[:80] + "..."
        for block in content(page_html).blocks
        for line in block["text"].splitlines()
        if len(line) > CODE_COLUMN_CHARS
    ]


def wrong_copy_buttons(page_html: str) -> list[str]:
    """Code blocks whose copy button would copy a prompt or output: a ``console`` block must copy exactly
    its commands (``data-copy``), a ``text`` block must have no button (``no-copy``)."""
    wrong = []
    for block in content(page_html).blocks:
        if block["language"] == "console":
            expected = "\n".join(line[2:] for line in block["text"].splitlines() if line.startswith("$ "))
            if block["copy"] is None or html.unescape(block["copy"]) != expected:
                wrong.append(f"console block copies {block['copy'] or 'its whole text'!r}, not {expected!r}")
        elif block["language"] == "text" and "no-copy" not in block["classes"]:
            wrong.append(f"text block (output) has a copy button: {block['text'][:60]!r}")
    return wrong


# --- the guards find the flaws they are for ---------------------------------------------------------------

ARTICLE = '<article class="md-content__inner md-typeset">{}</article>'


def test_a_table_swallowed_by_a_paragraph_is_found() -> None:
    swallowed = ARTICLE.format("<p>engine: tiny models\n| model | on |\n|---|---|\n| llama | 1 |</p>")
    assert tables_in_paragraphs(swallowed) and not tables_in_paragraphs(ARTICLE.format("<p>a | b</p>"))


def test_a_table_wider_than_the_column_is_found() -> None:
    numbers = "".join(f"<th>column {index}</th>" for index in range(12))
    cells = "".join("<td>1234567890</td>" for _ in range(12))
    wide = ARTICLE.format(f"<table><tr>{numbers}</tr><tr>{cells}</tr></table>")
    narrow = ARTICLE.format("<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>two words</td></tr></table>")
    assert wide_tables(wide) and not wide_tables(narrow)


def test_a_long_code_line_is_clipped_without_the_wrapping_stylesheet() -> None:
    page = ARTICLE.format(f'<div class="language-text highlight"><pre><code>{"x" * 200}</code></pre></div>')
    assert clipped_code_lines(page, {}) and clipped_code_lines(page, {"extra.css": ".md-typeset pre { }"})
    linked = '<link rel="stylesheet" href="extra.css">' + page
    assert clipped_code_lines(linked, {"extra.css": CSS.read_text(encoding="utf-8")}) == []


def test_a_console_copy_button_copying_prompts_or_output_is_found() -> None:
    block = '<div class="language-console highlight"{}><pre><code>$ kvpolicy list\ndefault  ...\n</code></pre></div>'
    assert wrong_copy_buttons(ARTICLE.format(block.format("")))
    assert wrong_copy_buttons(ARTICLE.format(block.format(' data-copy="$ kvpolicy list"')))
    assert wrong_copy_buttons(ARTICLE.format(block.format(' data-copy="kvpolicy list"'))) == []
    text = '<div class="language-text highlight"><pre><code>output</code></pre></div>'
    assert wrong_copy_buttons(ARTICLE.format(text))


def test_the_hook_makes_console_blocks_copy_their_commands_only() -> None:
    block = (
        '<div class="language-console highlight"><pre><span></span><code><span class="gp">$ </span>kvpolicy plan '
        "--policy default --layout x --tp <span class=\"m\">4</span>\n<span class=\"go\">plan: ...</span>\n"
        '<span class="gp">$ </span>kvpolicy list\n</code></pre></div>'
    )
    marked = HOOKS.copy_commands_only(block)
    assert 'data-copy="kvpolicy plan --policy default --layout x --tp 4&#10;kvpolicy list"' in marked
    assert "no-copy" in HOOKS.copy_commands_only('<div class="language-text highlight"><pre><code>x</code></pre></div>')


# --- the built site -------------------------------------------------------------------------------------


def test_the_site_builds_strictly(built_site: BuiltSite) -> None:  # noqa: F811
    assert built_site.returncode == 0 and "WARNING" not in built_site.stderr, built_site.stderr[-3000:]


def test_no_built_page_has_a_table_inside_a_paragraph(built_site: BuiltSite) -> None:  # noqa: F811
    found = {page: swallowed for page, text in built_site.pages().items() if (swallowed := tables_in_paragraphs(text))}
    assert found == {}


def test_no_built_table_is_wider_than_the_column_at_1280_px(built_site: BuiltSite) -> None:  # noqa: F811
    found = {page: wide for page, text in built_site.pages().items() if (wide := wide_tables(text))}
    assert found == {}


def test_no_built_code_line_is_clipped(built_site: BuiltSite) -> None:  # noqa: F811
    stylesheets = {"stylesheets/extra.css": CSS.read_text(encoding="utf-8")}
    found = {page: lines for page, text in built_site.pages().items() if (lines := clipped_code_lines(text, stylesheets))}
    assert found == {}
    assert code_wraps(stylesheets["stylesheets/extra.css"])


def test_copy_buttons_copy_commands_only(built_site: BuiltSite) -> None:  # noqa: F811
    pages = built_site.pages()
    found = {page: wrong for page, text in pages.items() if (wrong := wrong_copy_buttons(text))}
    consoles = sum(block["language"] == "console" for text in pages.values() for block in content(text).blocks)
    assert found == {} and consoles >= 20
    config = json.loads(re.search(r'<script id="__config" type="application/json">(.*?)</script>',
                                  pages["index.html"]).group(1))
    assert "content.code.copy" in config["features"]


def test_format_references_list_fields_as_definitions_not_wide_tables(built_site: BuiltSite) -> None:  # noqa: F811
    for page in ("reference/policy/index.html", "reference/layout/index.html", "reference/discovery/index.html"):
        parsed = content(built_site.page(page))
        assert max((len(row) for rows in parsed.tables for row in rows), default=0) < 5, page
        assert built_site.page(page).count("<dt>") >= 5, page
    css = CSS.read_text(encoding="utf-8")
    assert re.search(r"\.md-typeset dt code\s*\{[^}]*white-space:\s*nowrap", css)


# --- reading aids (item 5) -------------------------------------------------------------------------------


def test_the_safety_points_are_warnings(built_site: BuiltSite) -> None:  # noqa: F811
    warnings = {
        page: re.findall(r'<div class="admonition (?:warning|danger)">\s*<p class="admonition-title">([^<]*)</p>', text)
        for page, text in built_site.pages().items()
    }
    titles = [title for found in warnings.values() for title in found]
    assert any("another rank" in title for title in titles), titles
    assert any("GPU" in title for title in titles), titles
    assert warnings["index.html"] and warnings["getting-started/index.html"]


def test_the_installs_are_tabs_and_long_reports_collapse(built_site: BuiltSite) -> None:  # noqa: F811
    start = built_site.page("getting-started/index.html")
    labels = re.findall(r'<label for="__tabbed_\d+_\d+">([^<]*)</label>', start)
    assert len(labels) >= 3 and any("GPU" in label for label in labels) and any("CPU" in label for label in labels)
    guide = built_site.page("guides/new-state-type/index.html")
    assert guide.count("<details") >= 3


def test_footer_navigation_is_on(built_site: BuiltSite) -> None:  # noqa: F811
    page = built_site.page("getting-started/index.html")
    assert 'class="md-footer__link md-footer__link--prev"' in page and 'md-footer__link--next' in page


# --- diagnostics pages and `kvpolicy rule`'s URL -------------------------------------------------------------


def test_every_diagnostic_page_kvpolicy_rule_names_is_in_the_checkout_and_built(built_site: BuiltSite) -> None:  # noqa: F811
    for check in CHECKS:
        where = rule.diagnostic_location(check, environ={})
        source = where.split(" ", 1)[0]
        assert source == f"docs/{rule.diagnostic_page(check)}" and (REPO / source).is_file(), where
        page = built_site.path / rule.diagnostic_page(check).removesuffix(".md") / "index.html"
        assert page.is_file(), page
        text = page.read_text(encoding="utf-8")
        assert "<h1 id=" in text and check.code in text and "Use instead" in text, check.code


def test_with_a_published_site_kvpolicy_rule_names_its_page_there_as_mkdocs_writes_it(built_site: BuiltSite) -> None:  # noqa: F811
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8").replace("!ENV", ""))
    assert config["site_url"] == rule.DOCS_URL_VARIABLE  # the site's address is the deployment's
    for check in CHECKS:
        url = rule.diagnostic_location(check, environ={rule.DOCS_URL_VARIABLE: "https://docs.example.org/kv/"})
        assert url.startswith("https://docs.example.org/kv/reference/diagnostics/")
        assert (built_site.path / url.removeprefix("https://docs.example.org/kv/") / "index.html").is_file(), url
