"""MkDocs hook: replace each ``<!-- kvpolicy-reference: NAME -->`` marker with the reference
kvpolicy computes from its own code (:mod:`kvpolicy.app.reference`), at build time, so nothing
generated is committed and the references cannot drift from the code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's kvpolicy, installed or not

from kvpolicy.app.reference import expand  # noqa: E402


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)
