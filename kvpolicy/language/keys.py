"""The store key grammar: template fields, their validation, rendering and parsing, chunk keys, the
``@demoted:`` suffix, audit markers, and the plan fingerprint.

Routers and cache-aware schedulers rebuild and read store keys (design brief, section 9), so every
spelling of a key lives here and nowhere else: the rest of kvpolicy renders with :func:`render_prefix`,
:func:`chunk_key` and :func:`marker_key`, and reads with :func:`parse_prefix`, :func:`parse_key` and
:func:`split_chunk_key`.

A key is ``PREFIX@CHUNK_HASH`` (a chunk) or ``PREFIX@MARKER@FINGERPRINT[@xN]`` (an audit marker). A
prefix (a *namespace*) is the policy's template rendered for one (group, shard, pcp, dcp, pp) of one
plan, followed by ``@demoted:FINGERPRINT`` when the audit demoted the group and the template carries
no ``{fingerprint}``. :data:`KEY_VERSION` names the recipe; a change that would rename a stored object
must bump it (``tests/golden/`` holds each version's keys fixed).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import string
from dataclasses import dataclass
from typing import Any, Final

KEY_VERSION = 1
"""Version of the key recipe (prefix template fields, fingerprint inputs, chunk-hash spelling).
1: vLLM 0.32/0.33's Mooncake store keys, kvpolicy's fingerprint as of kvpolicy 0.1."""

SEPARATOR = "@"
"""What separates the parts of a key: vLLM's fields, the chunk hash, the demoted suffix, a marker."""

FINGERPRINT_LENGTH = 12
"""Hex digits of a plan fingerprint."""

UPSTREAM_KEY_TEMPLATE = (
    "{cache_prefix}{model}{store_namespace}"
    "@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"
)
"""vLLM's Mooncake store key prefix (0.32/0.33); chunk keys append ``@<chunk hash hex>``."""

KEY_TEMPLATE_FIELDS = (
    "cache_prefix",
    "model",
    "store_namespace",
    "fingerprint",
    "shard",
    "pcp_rank",
    "dcp_rank",
    "pp_rank",
    "group",
)
"""Every field a key template may use."""
REQUIRED_KEY_TEMPLATE_FIELDS = ("model", "shard", "pcp_rank", "dcp_rank", "pp_rank", "group")
"""Without any of these, two different namespaces would render the same key."""
INTEGER_FIELDS = ("shard", "pcp_rank", "dcp_rank", "pp_rank", "group")
"""Fields rendered as a decimal number."""
_DELIMITED_AFTER = ("cache_prefix",)
"""Fields that end in their own separator: {cache_prefix} renders with a trailing '@' (or not at all)."""
_DELIMITED_BEFORE = ("store_namespace",)
"""Fields that start with their own separator: {store_namespace} is empty or starts with '@'."""

DEMOTED_SUFFIX = "@demoted:"
"""Follows a demoted group's prefix, then the fingerprint, when the template has no ``{fingerprint}``."""

CHUNK_KEY_FORMAT: Final = "{prefix}@{chunk_hash}"
"""The key of one chunk: its namespace's prefix, ``@``, then the chunk hash."""

AGREEMENT_MARKER = "kvpolicy-audit-agreed"
DEMOTION_MARKER = "kvpolicy-audit-demoted"
MARKERS = (AGREEMENT_MARKER, DEMOTION_MARKER)


# --- the deployment's part of a key ----------------------------------------------------------------


@dataclass(frozen=True)
class KeyContext:
    """What the deployment, not the policy, puts into keys (vLLM's ``KeyMetadata`` fields)."""

    model: str
    """Model basename, as vLLM uses it (``model.rstrip('/').split('/')[-1]``)."""
    cache_prefix: str = ""
    """``kv_connector_extra_config.cache_prefix``; rendered with a trailing ``@`` when set."""
    store_namespace: str = ""
    """vLLM's opt-in store-format namespace; empty for the historical layout."""

    @classmethod
    def for_model(cls, model: str, cache_prefix: str = "", store_namespace: str = "") -> KeyContext:
        return cls(model_basename(model), cache_prefix, store_namespace)


def model_basename(model: str) -> str:
    return model.rstrip("/").split("/")[-1]


def store_namespace(*, store_pp: int, store_format: str, store_tp: int | None = None) -> str:
    """vLLM's store namespace (``TPShardedStoreLayout.shared_namespace`` and its fallbacks):
    ``[@store_tp:N]@store_pp:N@store_format:FORMAT``; ``store_tp`` only for TP-sharded objects."""
    shards = "" if store_tp is None else f"@store_tp:{store_tp}"
    return f"{shards}@store_pp:{store_pp}@store_format:{store_format}"


_STORE_NAMESPACE = r"(?:@store_tp:(?:0|[1-9][0-9]*))?@store_pp:(?:0|[1-9][0-9]*)@store_format:[A-Za-z0-9_]+"
"""What :func:`store_namespace` renders, as a regular expression."""


# --- templates -------------------------------------------------------------------------------------


def check_template(template: str) -> str:
    """``template`` when it is a valid key template, else a :class:`ValueError` saying what is wrong:
    not a format string, an unknown field (or a format spec / conversion), two fields without a
    separator, or a required field missing."""
    # Parsed as str.format() will render it: "{{" and "}}" are literal braces, not fields.
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"key template is not a format string: {error}") from None
    used = [
        name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
        for _, name, spec, conversion in parts
        if name is not None
    ]
    unknown = [name for name in used if name not in KEY_TEMPLATE_FIELDS]
    if unknown:
        raise ValueError(
            f"unknown key template field {{{unknown[0]}}}; known: " + ", ".join(f"{{{name}}}" for name in KEY_TEMPLATE_FIELDS)
        )
    for (_, before, _, _), (between, after, _, _) in itertools.pairwise(parts):
        if before is None or after is None or before in _DELIMITED_AFTER or after in _DELIMITED_BEFORE:
            continue
        if not any(not character.isdigit() for character in between):
            raise ValueError(
                f"key template fields {{{before}}} and {{{after}}} need a separator (e.g. '@') between them; "
                "otherwise different values render the same key"
            )
    missing = [name for name in REQUIRED_KEY_TEMPLATE_FIELDS if name not in used]
    if missing:
        raise ValueError(f"key template lacks {{{missing[0]}}}, so distinct namespaces would share keys")
    return template


@functools.lru_cache(maxsize=256)
def _fields(template: str) -> tuple[tuple[str, str, str | None], ...] | None:
    """(field name, format spec, conversion) of each field of ``template``, in order; None when it
    is not a format string."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return None
    return tuple((name, spec or "", conversion) for _, name, spec, conversion in parts if name is not None)


def template_fields(template: str) -> frozenset[str]:
    """The names of the fields ``template`` uses (none for a template that is no format string)."""
    return frozenset(name for name, _, _ in _fields(template) or ())


def _plain_group_fields(template: str) -> int | None:
    """How many ``{group}`` fields ``template`` has, or None when any of its fields is more than a
    known name (a format spec, a conversion, an index)."""
    fields = _fields(template)
    if fields is None or any(name not in KEY_TEMPLATE_FIELDS or spec or conversion for name, spec, conversion in fields):
        return None
    return sum(1 for name, _, _ in fields if name == "group")


# --- rendering -------------------------------------------------------------------------------------


def render_prefix(
    template: str,
    context: KeyContext,
    *,
    fingerprint: str,
    group: int,
    shard: int,
    pcp_rank: int,
    dcp_rank: int,
    pp_rank: int,
    demoted: bool = False,
) -> str:
    """The key prefix of one namespace; chunk keys are :func:`chunk_key` of it.

    A ``demoted`` group's shard ids mean something else than under the declared factor; without the
    fingerprint in the template its keys would collide with instances that trust the rule, so the
    prefix then ends in :data:`DEMOTED_SUFFIX` and the fingerprint."""
    prefix = template.format(
        cache_prefix=f"{context.cache_prefix}{SEPARATOR}" if context.cache_prefix else "",
        model=context.model,
        store_namespace=context.store_namespace,
        fingerprint=fingerprint,
        group=group,
        shard=shard,
        pcp_rank=pcp_rank,
        dcp_rank=dcp_rank,
        pp_rank=pp_rank,
    )
    if demoted and "fingerprint" not in template_fields(template):
        prefix += f"{DEMOTED_SUFFIX}{fingerprint}"
    return prefix


_GROUP_MARK = "\x00group\x00"
"""Stands for the group index in :func:`prefix_pieces`; a key value holding it too is noticed."""


def prefix_pieces(
    template: str,
    context: KeyContext,
    *,
    fingerprint: str,
    shard: int,
    pcp_rank: int,
    dcp_rank: int,
    pp_rank: int,
    demoted: bool = False,
) -> list[str] | None:
    """:func:`render_prefix` of one namespace cut where the group index goes, so that
    ``str(group).join(pieces)`` is its prefix for every group (a plan renders each namespace once,
    not once per group); None for a template whose fields are not all plain (a format spec or
    conversion would render the index otherwise) or a value holding the cut mark."""
    expected = _plain_group_fields(template)
    if expected is None:
        return None
    rendered = render_prefix(
        template, context, fingerprint=fingerprint, group=_GROUP_MARK,  # type: ignore[arg-type]
        shard=shard, pcp_rank=pcp_rank, dcp_rank=dcp_rank, pp_rank=pp_rank, demoted=demoted,
    )
    pieces = rendered.split(_GROUP_MARK)
    return pieces if len(pieces) == expected + 1 else None


def chunk_key(namespace: str, chunk_hash_hex: str) -> str:
    """The store key of one chunk: its namespace's prefix and the chunk hash, as vLLM spells it."""
    return CHUNK_KEY_FORMAT.format(prefix=namespace, chunk_hash=chunk_hash_hex)


def split_chunk_key(key: str) -> tuple[str, str]:
    """(namespace, chunk hash) of a :func:`chunk_key`; the namespace may itself contain ``@``."""
    namespace, separator, chunk_hash_hex = key.rpartition(SEPARATOR)
    if not separator:
        raise ValueError(f"{key!r} is not a chunk key (no '@')")
    return namespace, chunk_hash_hex


def marker_key(namespace: str, marker: str, fingerprint: str, *, replicas: int | None = None) -> str:
    """An audit marker in ``namespace``: ``marker`` (:data:`AGREEMENT_MARKER` or
    :data:`DEMOTION_MARKER`) about the plan with ``fingerprint``, and for an agreement the size of the
    replica sets it verified. It sits beside the namespace's chunk keys but never collides with one:
    a chunk hash is hex, a marker name is not."""
    return f"{namespace}@{marker}@{fingerprint}" + (f"@x{replicas}" if replicas is not None else "")


# --- parsing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPrefix:
    """The fields of one namespace, read back from its prefix by :func:`parse_prefix`."""

    model: str
    shard: int
    pcp_rank: int
    dcp_rank: int
    pp_rank: int
    group: int
    cache_prefix: str = ""
    """Without its trailing ``@``; empty when the prefix has none (or the template no field for it)."""
    store_namespace: str = ""
    """Empty when the prefix has none (or the template no field for it)."""
    fingerprint: str | None = None
    """The template's ``{fingerprint}``; None when the template has none."""
    demoted: str | None = None
    """The fingerprint after :data:`DEMOTED_SUFFIX`; None for a group not demoted (or a template with
    ``{fingerprint}``, which spells a demotion by the fingerprint alone)."""

    @property
    def context(self) -> KeyContext:
        return KeyContext(self.model, self.cache_prefix, self.store_namespace)

    def render(self, template: str) -> str:
        """The prefix these fields render under ``template`` (the inverse of :func:`parse_prefix`)."""
        return render_prefix(
            template,
            self.context,
            fingerprint=self.fingerprint or self.demoted or "",
            group=self.group,
            shard=self.shard,
            pcp_rank=self.pcp_rank,
            dcp_rank=self.dcp_rank,
            pp_rank=self.pp_rank,
            demoted=self.demoted is not None,
        )


@dataclass(frozen=True)
class ParsedKey:
    """A store key read back by :func:`parse_key`: its namespace and either a chunk hash or a marker."""

    prefix: KeyPrefix
    chunk_hash: str | None = None
    """Lowercase hex; None for a marker."""
    marker: str | None = None
    """:data:`AGREEMENT_MARKER` or :data:`DEMOTION_MARKER`; None for a chunk."""
    marker_fingerprint: str | None = None
    replicas: int | None = None
    """An agreement's verified replica-set size (``@xN``)."""


class KeyParseError(ValueError):
    """A key or prefix the template does not spell: ``SOURCE:1:COLUMN: error: WHAT``."""

    def __init__(self, key: str, column: int, message: str, *, source: str = "key") -> None:
        self.key, self.column, self.message, self.source = key, column, message, source
        super().__init__(f"{source}:1:{column}: error: {message}")


_NUMBER = r"(?:0|[1-9][0-9]*)"
_HEX_FINGERPRINT = f"[0-9a-f]{{{FINGERPRINT_LENGTH}}}"
_FIELD_PATTERNS = {
    # A cache prefix may hold '@' itself; the model's basename may not (else the two are ambiguous).
    # Lazy: without a cache prefix when the rest reads so, or "Model@store_tp:8@store_pp:1..." would
    # read as cache prefix "Model" of a model "store_tp:8".
    "cache_prefix": (r"(?:(?P<cache_prefix>.+?)@)??", "the cache prefix"),
    "model": (r"(?P<model>[^@]+)", "the model name"),
    "store_namespace": (f"(?P<store_namespace>(?:{_STORE_NAMESPACE})?)", "vLLM's store namespace (or nothing)"),
    "fingerprint": (f"(?P<fingerprint>{_HEX_FINGERPRINT})", f"a fingerprint ({FINGERPRINT_LENGTH} lowercase hex digits)"),
    **{name: (f"(?P<{name}>{_NUMBER})", f"a number for {{{name}}}") for name in INTEGER_FIELDS},
}


@dataclass(frozen=True)
class _Grammar:
    """One template's prefixes as regular expressions: one piece per literal and field, in order."""

    pieces: tuple[tuple[str, str], ...]
    """(regular expression, what it expects, for a message) of each part of a prefix."""
    key_tail: str
    """What follows a prefix in a key: a chunk hash or a marker."""

    @functools.cached_property
    def prefix(self) -> re.Pattern[str]:
        return re.compile("".join(pattern for pattern, _ in self.pieces))

    @functools.cached_property
    def key(self) -> re.Pattern[str]:
        return re.compile("".join(pattern for pattern, _ in self.pieces) + self.key_tail)

    def locate(self, text: str, *, tail: tuple[str, str] | None = None) -> tuple[int, str]:
        """(1-based column, what was expected there) of the first part of ``text`` the grammar refuses."""
        pieces = [*self.pieces, *([tail] if tail else [])]
        for count in range(len(pieces), -1, -1):
            match = re.compile("".join(pattern for pattern, _ in pieces[:count])).match(text)
            if match is None:
                continue
            if count == len(pieces):
                return match.end() + 1, "the end of the " + ("key" if tail else "prefix")
            return match.end() + 1, pieces[count][1]
        raise AssertionError("the empty pattern matches every text")


@functools.lru_cache(maxsize=64)
def _grammar(template: str) -> _Grammar:
    check_template(template)
    pieces: list[tuple[str, str]] = []
    seen: set[str] = set()
    for literal, name, _, _ in string.Formatter().parse(template):
        if literal:
            pieces.append((re.escape(literal), repr(literal)))
        if name is None:
            continue
        pattern, expected = _FIELD_PATTERNS[name]
        # A field used twice renders the same text twice: a back-reference to all the first one matched.
        pieces.append((f"(?P<rendered_{name}>{pattern})" if name not in seen else f"(?P=rendered_{name})", expected))
        seen.add(name)
    if "fingerprint" not in seen:
        pieces.append((f"(?:{re.escape(DEMOTED_SUFFIX)}(?P<demoted>{_HEX_FINGERPRINT}))?", "the demoted suffix"))
    markers = "|".join(re.escape(marker) for marker in MARKERS)
    tail = (
        f"@(?:(?P<chunk_hash>[0-9a-f]+)"
        f"|(?P<marker>{markers})@(?P<marker_fingerprint>{_HEX_FINGERPRINT})(?:@x(?P<replicas>[1-9][0-9]*))?)"
    )
    return _Grammar(tuple(pieces), tail)


_KEY_TAIL_EXPECTED = "'@' then a chunk hash (lowercase hex) or an audit marker"


def _prefix_of(match: re.Match[str]) -> KeyPrefix:
    found = match.groupdict()
    return KeyPrefix(
        model=found["model"],
        shard=int(found["shard"]),
        pcp_rank=int(found["pcp_rank"]),
        dcp_rank=int(found["dcp_rank"]),
        pp_rank=int(found["pp_rank"]),
        group=int(found["group"]),
        cache_prefix=found.get("cache_prefix") or "",
        store_namespace=found.get("store_namespace") or "",
        fingerprint=found.get("fingerprint"),
        demoted=found.get("demoted"),
    )


def parse_prefix(prefix: str, template: str, *, source: str = "prefix") -> KeyPrefix:
    """The fields of ``prefix``, a namespace rendered from ``template`` (:func:`render_prefix`), so
    that ``parse_prefix(p, t).render(t) == p``. Raises :class:`ValueError` for an invalid template and
    :class:`KeyParseError`, naming the column and what the template expects there, for a prefix it
    does not spell."""
    grammar = _grammar(template)
    match = grammar.prefix.fullmatch(prefix)
    if match is None:
        column, expected = grammar.locate(prefix)
        raise KeyParseError(prefix, column, _refusal(prefix, column, expected, template), source=source)
    return _prefix_of(match)


def parse_key(key: str, template: str, *, source: str = "key") -> ParsedKey:
    """A store key of a namespace of ``template`` read back: a :func:`chunk_key` or a
    :func:`marker_key`. Raises as :func:`parse_prefix` does."""
    grammar = _grammar(template)
    match = grammar.key.fullmatch(key)
    if match is None:
        column, expected = grammar.locate(key, tail=(grammar.key_tail, _KEY_TAIL_EXPECTED))
        raise KeyParseError(key, column, _refusal(key, column, expected, template), source=source)
    found = match.groupdict()
    return ParsedKey(
        prefix=_prefix_of(match),
        chunk_hash=found["chunk_hash"],
        marker=found["marker"],
        marker_fingerprint=found["marker_fingerprint"],
        replicas=None if found["replicas"] is None else int(found["replicas"]),
    )


def _refusal(text: str, column: int, expected: str, template: str) -> str:
    rest = text[column - 1 :]
    found = f"found {rest[:24]!r}" + ("..." if len(rest) > 24 else "") if rest else "found the end"
    return f"expected {expected}, {found}, in {text!r} (key template {template!r})"


# --- the plan fingerprint --------------------------------------------------------------------------


def fingerprint(payload: Any) -> str:
    """A short, stable digest of a JSON-able description of the effective plan."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_LENGTH]
