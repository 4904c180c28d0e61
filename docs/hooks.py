"""MkDocs hooks.

- Markdown: each ``<!-- kvpolicy-reference: NAME -->`` reference is replaced by the text kvpolicy computes
  from its own code (:mod:`kvpolicy.app.reference`), so the references cannot drift from the code; each
  ``{{ name }}`` by its figure from ``benchmarks/results/figures.yaml`` (:mod:`kvpolicy.app.figures`), so
  every measured number comes from one place.
- HTML: the copy button of a ``console`` block copies its commands only (no ``$`` prompt, no output), and
  a ``text`` block (output of a machine, an engine or a master) has no copy button.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's kvpolicy, installed or not

from kvpolicy.app.figures import expand_figures
from kvpolicy.app.reference import expand

BLOCK = re.compile(r'<div class="language-(?P<language>[\w-]+) highlight">(?P<body>.*?)</div>', re.DOTALL)
"""A highlighted code block as pymdownx.highlight writes it (``pygments_lang_class``)."""

TAG = re.compile(r"<[^>]+>")


def code_text(body: str) -> str:
    """The text of a highlighted block's code, as the reader sees it."""
    code = re.search(r"<code>(.*)</code>", body, re.DOTALL)
    return html.unescape(TAG.sub("", code.group(1) if code else ""))


def commands(console: str) -> str:
    """What a ``console`` block's copy button copies: its ``$ `` lines without the prompt."""
    return "\n".join(line[2:] for line in console.splitlines() if line.startswith("$ "))


def copy_commands_only(page_html: str) -> str:
    """``console`` blocks copy their commands only (Material copies a ``data-copy`` ancestor's value
    instead of the block's text); ``text`` blocks get no copy button (``no-copy``)."""

    def mark(found: re.Match[str]) -> str:
        language, body = found.group("language"), found.group("body")
        if language == "console":
            copied = html.escape(commands(code_text(body)), quote=True).replace("\n", "&#10;")
            return f'<div class="language-console highlight" data-copy="{copied}">{body}</div>'
        if language == "text":
            return f'<div class="language-text highlight no-copy">{body}</div>'
        return found.group(0)

    return BLOCK.sub(mark, page_html)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand_figures(expand(markdown))


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    return copy_commands_only(html_text)
