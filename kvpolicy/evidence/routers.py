"""What the routers that read vLLM store keys need from kvpolicy, checked against their own code.

Two programs outside vLLM read the keys of vLLM's Mooncake store connector today (design brief,
section 9), and each gets its own part here:

* **Mooncake Conductor** parses every object key it is told about. :func:`parse_vllm_object_key` is
  a port of its ``ParseVllmObjectKey`` (``kvcache-ai/Mooncake``,
  ``mooncake-conductor/src/kvevent/object_key_parser.cpp`` at commit
  ``46983c540ed5897651e0761c99e01e1a5eaaec9e``; its rules are the same at ``b8e95816``), branch for
  branch: the compact vLLM-Ascend keys of 3 or 4 parts, then vLLM's labelled layout, then
  vLLM-Ascend's. :func:`template_router_problems` renders a key template's keys and says why
  Conductor would not read them as the key contract states (the loader's ``KVP205`` warning).
* **Dynamo** (``ai-dynamo/dynamo`` pull request #14965, open) reads a descriptor of each group's
  exact key prefixes that a worker publishes. :class:`DynamoDescriptor` has the field names of its
  schema version 1 (``lib/llm/src/kv_router/shared_cache/mooncake_store_contract.rs`` at
  ``980590bfc3c6b983dccafd99afb90d5f58d92e8a``, written by
  ``components/src/dynamo/vllm/mooncake_store_runtime.py``); :func:`dynamo_descriptor` builds one
  from a key contract and its layout, :func:`check_dynamo_descriptor` applies that validator's rules.

Pure: imports neither vLLM nor Mooncake.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from kvpolicy.language.expressions import ExpressionError
from kvpolicy.language.keys import (
    DEMOTED_SUFFIX,
    INTEGER_FIELDS,
    KEY_VERSION,
    SEPARATOR,
    UPSTREAM_KEY_TEMPLATE,
    KeyContext,
    chunk_key,
    render_prefix,
    store_namespace,
    template_fields,
)
from kvpolicy.language.models import Group, Layout, StrictModel, topology_variables
from kvpolicy.planning.contract import KeyContract
from kvpolicy.planning.store_layout import SHARDED_FORMATS

# --- Mooncake Conductor: ParseVllmObjectKey ----------------------------------------------------------

CONDUCTOR_SOURCE = (
    "kvcache-ai/Mooncake mooncake-conductor/src/kvevent/object_key_parser.cpp ParseVllmObjectKey "
    "@ 46983c540ed5897651e0761c99e01e1a5eaaec9e"
)
"""The code :func:`parse_vllm_object_key` ports."""

MIN_HASH_HEX_DIGITS = 16
"""Conductor's shortest hash: 16 hex digits (8 bytes), and an even number of them."""

_UINT64_LIMIT = 1 << 64

ConductorLayout = Literal["vllm", "vllm-ascend", "vllm-ascend-compact"]
"""Which of Conductor's key layouts a key was read as: vLLM's labelled keys (``@tp_rank:N@pcpN@dcpN@pp_rank:N``),
vLLM-Ascend's labelled keys (``@pcpN@dcpN@head_or_tp_rank:N``) or its compact layerwise keys."""


@dataclass(frozen=True)
class ConductorKey:
    """A key Conductor reads: what its parser returns, and the fields it read to get there."""

    key: str
    """The key as given (Conductor's ``logical_key``)."""
    layout: ConductorLayout
    """The layout the key was read as."""
    namespace_prefix: str
    """Conductor's ``namespace_prefix``, exactly as it computes it. For vLLM's layout: the ``@``-parts
    before the one just ahead of ``tp_rank:`` (which it takes for the model name), joined by ``@``
    with leading empty parts dropped, as its ``JoinParts`` does."""
    full_hash: str
    """The hash part, without ``0x``, in lowercase."""
    low64: int
    """The hash's low 64 bits (its last 16 hex digits): the value Conductor indexes."""
    namespace: str | None = None
    """Everything before ``@tp_rank:`` (vLLM's layout only): kvpolicy's namespace of the key."""
    model: str | None = None
    """The part just before ``tp_rank:`` (vLLM's layout only), which readers take for the model name."""
    tp_rank: int | None = None
    """``tp_rank:N``: for a kvpolicy key, the key's ``{shard}``."""
    pcp_rank: int | None = None
    """``pcpN``."""
    dcp_rank: int | None = None
    """``dcpN``."""
    pp_rank: int | None = None
    """``pp_rank:N``; None where a vLLM-Ascend key has none."""
    group: int | None = None
    """``group:N``; None when the key has no group part (Conductor then reads it as group 0's)."""
    cache_role: str | None = None
    """What follows ``cache_role:``, when the key has that part."""
    cache_family: str | None = None
    """What follows ``cache_family:``, when the key has that part."""
    head_or_tp_rank: int | None = None
    """vLLM-Ascend's ``head_or_tp_rank:N`` (or a compact key's last part)."""
    layer_id: int | None = None
    """vLLM-Ascend's layer: ``layer_id:N``, or a number after the hash."""


@dataclass(frozen=True)
class ConductorRefusal:
    """A key Conductor does not read."""

    key: str
    reason: str
    """Conductor's own error string."""
    detail: str
    """Which part of the key breaks vLLM's labelled layout, in kvpolicy's words."""

    def __str__(self) -> str:
        return f"{self.detail} (Conductor: {self.reason})"


def _is_hex(character: str) -> bool:
    return character in "0123456789abcdefABCDEF"


def _is_decimal(text: str) -> bool:
    """``IsNonNegativeDecimal``: ASCII digits only (no sign, no space; leading zeros allowed), and
    the value fits 64 bits."""
    if not text or not all("0" <= character <= "9" for character in text):
        return False
    digits = text.lstrip("0")
    return len(digits) <= 20 and int(digits or "0") < _UINT64_LIMIT


def _decimal(text: str) -> int:
    """The value of a part :func:`_is_decimal` accepted (however many leading zeros it has)."""
    return int(text.lstrip("0") or "0")


def _has_label(part: str, label: str) -> bool:
    """``HasLabel``: ``label`` and at least one character after it."""
    return part.startswith(label) and len(part) > len(label)


def _has_decimal_label(part: str, label: str) -> bool:
    return part.startswith(label) and _is_decimal(part[len(label) :])


def _strip_hex_prefix(text: str) -> str:
    return text[2:] if text.startswith(("0x", "0X")) else text


def _is_hash_text(text: str) -> bool:
    return len(text) >= MIN_HASH_HEX_DIGITS and len(text) % 2 == 0 and all(_is_hex(character) for character in text)


def _is_vllm_hash(text: str) -> bool:
    return _is_hash_text(_strip_hex_prefix(text))


def _join_parts(parts: list[str], begin: int, end: int) -> str:
    """``JoinParts``: ``@`` only once something was appended, so leading empty parts vanish."""
    result = ""
    for part in parts[begin:end]:
        if result:
            result += SEPARATOR
        result += part
    return result


def _hash_of(text: str) -> tuple[str, int]:
    """(lowercase hash, low 64 bits) of a hash part ``FillProjectedHash`` accepts."""
    full = _strip_hex_prefix(text).lower()
    return full, int(full[-MIN_HASH_HEX_DIGITS:], 16)


def parse_vllm_object_key(key: str) -> ConductorKey | ConductorRefusal:
    """``key`` as Mooncake Conductor's ``ParseVllmObjectKey`` reads it (see :data:`CONDUCTOR_SOURCE`),
    or why it does not: the same branches in the same order, so a key is read as the layout
    Conductor reads it as, with the fields that layout holds."""
    parts = key.split(SEPARATOR)  # SplitAt(object_key, '@'): every part, empty ones included
    # The compact vLLM-Ascend layout: model@hash@rank, or model@group@hash@rank.
    if len(parts) in (3, 4):
        hash_index = 1 if len(parts) == 3 else 2
        if parts[0] and (len(parts) == 3 or _is_decimal(parts[1])) and _is_vllm_hash(parts[hash_index]) and _is_decimal(parts[-1]):
            full, low64 = _hash_of(parts[hash_index])
            return ConductorKey(
                key, "vllm-ascend-compact", parts[0] if len(parts) == 3 else _join_parts(parts, 0, hash_index),
                full, low64, group=_decimal(parts[1]) if len(parts) == 4 else None, head_or_tp_rank=_decimal(parts[-1]),
            )
    if len(parts) < 6:
        return ConductorRefusal(key, "vLLM object_key has too few fields", _diagnose(parts))
    hash_index = len(parts) - 1
    for index in range(1, len(parts)):
        if not _has_decimal_label(parts[index], "tp_rank:"):
            continue
        if (
            index + 3 >= hash_index
            or not _has_decimal_label(parts[index + 1], "pcp")
            or not _has_decimal_label(parts[index + 2], "dcp")
            or not _has_decimal_label(parts[index + 3], "pp_rank:")
        ):
            continue
        cursor = index + 4
        group = cache_role = cache_family = None
        if cursor < hash_index and _has_decimal_label(parts[cursor], "group:"):
            group = _decimal(parts[cursor].removeprefix("group:"))
            cursor += 1
        if cursor < hash_index and _has_label(parts[cursor], "cache_role:"):
            cache_role = parts[cursor].removeprefix("cache_role:")
            cursor += 1
        if cursor < hash_index and _has_label(parts[cursor], "cache_family:"):
            cache_family = parts[cursor].removeprefix("cache_family:")
            cursor += 1
        if cursor != hash_index or not _is_vllm_hash(parts[hash_index]):
            continue
        full, low64 = _hash_of(parts[hash_index])
        return ConductorKey(
            key,
            "vllm",
            _join_parts(parts, 0, index - 1) if index > 1 else "",
            full,
            low64,
            namespace=SEPARATOR.join(parts[:index]),
            model=parts[index - 1],
            tp_rank=_decimal(parts[index].removeprefix("tp_rank:")),
            pcp_rank=_decimal(parts[index + 1].removeprefix("pcp")),
            dcp_rank=_decimal(parts[index + 2].removeprefix("dcp")),
            pp_rank=_decimal(parts[index + 3].removeprefix("pp_rank:")),
            group=group,
            cache_role=cache_role,
            cache_family=cache_family,
        )
    ascend = _parse_ascend(key, parts)
    if ascend is not None:
        return ascend
    return ConductorRefusal(key, "unrecognized vLLM/vLLM-Ascend object_key", _diagnose(parts))


def _parse_ascend(key: str, parts: list[str]) -> ConductorKey | None:
    """vLLM-Ascend's labelled layout: ``pcpN@dcpN@head_or_tp_rank:N``, then optional ``pp_rank``,
    ``group``, ``cache_role``, ``cache_family``, ``layer_id`` before the hash, or a layer number after it."""
    final = len(parts) - 1
    for index in range(1, len(parts)):
        if (
            not _has_decimal_label(parts[index], "pcp")
            or index + 2 >= len(parts)
            or not _has_decimal_label(parts[index + 1], "dcp")
            or not _has_decimal_label(parts[index + 2], "head_or_tp_rank:")
        ):
            continue
        hash_index, found = final, _ascend_labels(parts, index, final)
        layer_after = None
        if found is None and final > index + 3 and _is_decimal(parts[final]):
            found = _ascend_labels(parts, index, final - 1)
            hash_index, layer_after = final - 1, _decimal(parts[final])
        if found is None:
            continue
        full, low64 = _hash_of(parts[hash_index])
        number = {label: _decimal(value) for label, value in found.items() if label not in ("cache_role:", "cache_family:")}
        return ConductorKey(
            key, "vllm-ascend", parts[0], full, low64,
            pcp_rank=_decimal(parts[index].removeprefix("pcp")),
            dcp_rank=_decimal(parts[index + 1].removeprefix("dcp")),
            head_or_tp_rank=_decimal(parts[index + 2].removeprefix("head_or_tp_rank:")),
            pp_rank=number.get("pp_rank:"),
            group=number.get("group:"),
            cache_role=found.get("cache_role:"),
            cache_family=found.get("cache_family:"),
            layer_id=number.get("layer_id:", layer_after),
        )
    return None


def _ascend_labels(parts: list[str], index: int, hash_index: int) -> dict[str, str] | None:
    """The optional labelled parts of a vLLM-Ascend key whose ``pcp`` part is at ``index``, when its
    hash sits at ``hash_index`` (``matches_layout``); None when the key does not fit that way."""
    if hash_index <= index + 2 or not _is_vllm_hash(parts[hash_index]):
        return None
    cursor, found = index + 3, {}
    for label, decimal in (("pp_rank:", True), ("group:", True), ("cache_role:", False), ("cache_family:", False),
                           ("layer_id:", True)):
        if cursor < hash_index and (_has_decimal_label if decimal else _has_label)(parts[cursor], label):
            found[label] = parts[cursor][len(label) :]
            cursor += 1
    return found if cursor == hash_index else None


_OPTIONAL = f"'{SEPARATOR}group:N', '{SEPARATOR}cache_role:...' and '{SEPARATOR}cache_family:...'"
"""The parts Conductor reads, in this order, between ``pp_rank:N`` and the hash."""
_VLLM_LAYOUT = (
    f"'{SEPARATOR}tp_rank:N{SEPARATOR}pcpN{SEPARATOR}dcpN{SEPARATOR}pp_rank:N', then optionally {_OPTIONAL}, "
    f"then '{SEPARATOR}' and the hash"
)
"""vLLM's labelled layout as Conductor reads it, for messages."""
_NAMESPACE_END = f"'{SEPARATOR}tp_rank:'"
"""Where kvpolicy's namespace of a key ends, for messages."""


def _diagnose(parts: list[str]) -> str:
    """Which part of a key breaks vLLM's labelled layout, read as Conductor reads it."""
    if len(parts) < 6:
        return f"the key has {len(parts)} '@'-separated parts; Conductor reads vLLM keys of at least 6: {_VLLM_LAYOUT}"
    hash_part = parts[-1]
    if not _is_vllm_hash(hash_part):
        return (
            f"the last part {hash_part[:40]!r} is not a hash: Conductor needs at least {MIN_HASH_HEX_DIGITS} hex digits, "
            "an even number of them (optionally after '0x')"
        )
    starts = [index for index in range(1, len(parts)) if _has_decimal_label(parts[index], "tp_rank:")]
    if not starts:
        where = " (it is the first part, which Conductor never reads as one)" if _has_decimal_label(parts[0], "tp_rank:") else ""
        return f"no part after the first is 'tp_rank:N'{where}; Conductor reads {_VLLM_LAYOUT}"
    index = starts[0]
    for position, label in zip(range(index + 1, index + 4), ("pcp", "dcp", "pp_rank:"), strict=True):
        if position >= len(parts) - 1:
            return f"'{parts[index]}' must be followed by '@{label}N' before the hash; Conductor reads {_VLLM_LAYOUT}"
        if not _has_decimal_label(parts[position], label):
            return f"'{parts[index]}' must be followed by '@{label}N', found {parts[position][:40]!r}; Conductor reads {_VLLM_LAYOUT}"
    extra = [
        part for part in parts[index + 4 : -1]
        if not (_has_decimal_label(part, "group:") or _has_label(part, "cache_role:") or _has_label(part, "cache_family:"))
    ]
    if extra:
        return (
            f"after '{SEPARATOR}{parts[index + 3]}' Conductor reads only {_OPTIONAL}, in that order, before the hash; "
            f"found {(SEPARATOR + extra[0])[:60]!r}"
        )
    return (
        f"after '{SEPARATOR}{parts[index + 3]}' Conductor reads {_OPTIONAL} only in that order, before the hash; "
        "this key has them in another"
    )


# --- a key template's keys as Conductor reads them ----------------------------------------------------

_SAMPLE_HASH = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
"""A chunk hash as vLLM's default sha256 prefix caching spells it: 64 hex digits."""
_SAMPLE_FINGERPRINT = "0123456789ab"
_SAMPLE_NUMBERS = {"shard": 3, "pcp_rank": 1, "dcp_rank": 2, "pp_rank": 5, "group": 4}
"""Distinct values, so that a field read in another's place is noticed."""
_SAMPLE_CONTEXTS = (
    KeyContext("MODEL"),
    KeyContext(
        "MODEL",
        cache_prefix="PREFIX",
        store_namespace=store_namespace(store_tp=8, store_pp=0, store_format=next(iter(SHARDED_FORMATS.values()))),
    ),
)
"""A bare deployment, and one with a cache prefix and vLLM's TP-sharded store namespace."""
_READ_AS = {"shard": "tp_rank", "pcp_rank": "pcp_rank", "dcp_rank": "dcp_rank", "pp_rank": "pp_rank", "group": "group"}
"""Template field → the :class:`ConductorKey` field it must be read as."""
_CONDUCTOR_LABEL = {"shard": "tp_rank:", "pcp_rank": "pcp", "dcp_rank": "dcp", "pp_rank": "pp_rank:", "group": "group:"}

VLLM_FIELDS = UPSTREAM_KEY_TEMPLATE.partition("{store_namespace}")[2]
"""The end of vLLM's own template: the fields Conductor reads, in its order."""
ROUTER_TEMPLATE_FIX = (
    f"end the template with vLLM's '{VLLM_FIELDS}' and put kvpolicy's own fields before it, as the shipped "
    "default puts '@plan:{fingerprint}' after '{store_namespace}'"
)
"""What a template the routers cannot read should look like."""


@dataclass(frozen=True)
class RouterProblem:
    """Why routers would not read a template's keys as the key contract states them."""

    message: str
    """What is wrong and the fix."""
    field: str | None = None
    """The template field at fault, when one is (the warning points at it)."""


def _render(template: str, context: KeyContext, numbers: Mapping[str, int], *, demoted: bool = False) -> str:
    prefix = render_prefix(template, context, fingerprint=_SAMPLE_FINGERPRINT, demoted=demoted, **numbers)
    return chunk_key(prefix, _SAMPLE_HASH)


@functools.lru_cache(maxsize=256)
def template_router_problems(template: str, *, audited: bool = False) -> tuple[RouterProblem, ...]:
    """Why Mooncake Conductor would not read the keys ``template`` renders as the key contract states
    them: a key it refuses, a field it reads as another (or not at all), or kvpolicy's namespace
    (everything before ``@tp_rank:``) taking in a field that tells ranks or groups apart, or missing
    the model. ``audited``: the policy's audit may demote a group, whose keys then end in
    ``@demoted:FINGERPRINT`` unless the template holds ``{fingerprint}``. ``template`` must be a valid
    key template (:func:`kvpolicy.language.keys.check_template`). Empty when Conductor reads every key right."""
    problems: list[RouterProblem] = []
    fields = template_fields(template)
    base: dict[str, ConductorKey] = {}
    for context in _SAMPLE_CONTEXTS:
        key = _render(template, context, _SAMPLE_NUMBERS)
        parsed = parse_vllm_object_key(key)
        if isinstance(parsed, ConductorRefusal):
            problems.append(RouterProblem(f"Mooncake Conductor does not read its keys: {parsed.detail}; {ROUTER_TEMPLATE_FIX}"))
            return tuple(problems)
        if parsed.layout != "vllm":
            problems.append(RouterProblem(
                f"Mooncake Conductor reads its keys as {parsed.layout} keys, without vLLM's rank fields; {ROUTER_TEMPLATE_FIX}"
            ))
            return tuple(problems)
        base[context.cache_prefix] = parsed
    parsed = base[""]
    in_namespace = []
    for name in INTEGER_FIELDS:
        moved = parse_vllm_object_key(_render(template, _SAMPLE_CONTEXTS[0], {**_SAMPLE_NUMBERS, name: _SAMPLE_NUMBERS[name] + 10}))
        if isinstance(moved, ConductorKey) and moved.namespace != parsed.namespace:
            in_namespace.append(name)
            problems.append(RouterProblem(
                f"{{{name}}} lands in the namespace (everything before {_NAMESPACE_END}, e.g. {parsed.namespace!r}), so "
                f"routers see one namespace per {'group' if name == 'group' else 'rank'} of one deployment; move it "
                f"after {_NAMESPACE_END} as '{SEPARATOR}{_CONDUCTOR_LABEL[name]}{{{name}}}'",
                name,
            ))
    for name, read_as in _READ_AS.items():
        found = getattr(parsed, read_as)
        if name in in_namespace or found == _SAMPLE_NUMBERS[name]:
            continue
        read = f"reads {read_as} {found}" if found is not None else f"finds no '@{_CONDUCTOR_LABEL[name]}N' part"
        problems.append(RouterProblem(
            f"Mooncake Conductor {read} where the key holds {{{name}}} = {_SAMPLE_NUMBERS[name]}, in {parsed.key[:120]!r}; "
            f"{ROUTER_TEMPLATE_FIX}",
            name,
        ))
    other = parse_vllm_object_key(_render(template, KeyContext("OTHER-MODEL"), _SAMPLE_NUMBERS))
    if isinstance(other, ConductorKey) and other.namespace == parsed.namespace:
        problems.append(RouterProblem(
            f"{{model}} is not in the namespace (everything before {_NAMESPACE_END}), so routers cannot tell two "
            f"models' keys apart; put it before {_NAMESPACE_END}",
            "model",
        ))
    if audited and "fingerprint" not in fields:
        key = _render(template, _SAMPLE_CONTEXTS[0], _SAMPLE_NUMBERS, demoted=True)
        refused = parse_vllm_object_key(key)
        if not (isinstance(refused, ConductorKey) and refused.layout == "vllm"):
            problems.append(RouterProblem(
                f"when the audit demotes a group, its keys end in '{DEMOTED_SUFFIX}FINGERPRINT' after the template, which "
                f"Mooncake Conductor does not read ({refused.detail if isinstance(refused, ConductorRefusal) else 'not as vLLM keys'}); "
                f"put {{fingerprint}} in the namespace, e.g. '@plan:{{fingerprint}}' before {_NAMESPACE_END}, so that a "
                "demotion changes the namespace instead (or set audit mode 'off')"
            ))
    return tuple(problems)


# --- Dynamo: the router descriptor ---------------------------------------------------------------

DYNAMO_SOURCE = (
    "ai-dynamo/dynamo pull request #14965: lib/llm/src/kv_router/shared_cache/mooncake_store_contract.rs "
    "@ 980590bfc3c6b983dccafd99afb90d5f58d92e8a"
)
"""The validator :func:`check_dynamo_descriptor` ports."""

DYNAMO_SCHEMA_VERSION = 1
"""The descriptor schema version Dynamo reads."""
DYNAMO_MAX_GROUPS = 64
"""Groups (and GPU groups) one descriptor may have."""
DYNAMO_MAX_PREFIXES = 1024
"""Key prefixes one descriptor may list, over all groups."""
DYNAMO_MAX_PREFIX_BYTES = 4096
"""UTF-8 bytes of one key prefix."""
DYNAMO_PINNED_ADAPTER = "vllm-1085b644"
"""The only ``adapter`` Dynamo accepts: its own exporter for stock vLLM at :data:`DYNAMO_PINNED_VLLM_REVISION`."""
DYNAMO_PINNED_VLLM_REVISION = "1085b64425a9e6f5ca52876ad32e55fda5665f4e"
"""The only ``vllm_revision`` Dynamo accepts."""
KVPOLICY_ADAPTER = f"kvpolicy-keys-v{KEY_VERSION}"
"""The ``adapter`` kvpolicy names: its key recipe, so that no reader takes these keys for stock vLLM's."""

DynamoKind = Literal["full_attention", "sliding_window", "mamba"]
"""The group kinds Dynamo knows."""
_U32 = (1 << 32) - 1

_STOCK = {
    "full_attention": ("FullAttentionSpec", "FullAttentionManager"),
    "sliding_window": ("SlidingWindowSpec", "SlidingWindowManager"),
    "mamba": ("MambaSpec", "MambaManager"),
}
"""Kind → the exact vLLM spec class and KV-cache manager Dynamo accepts for it."""


class DynamoHashContract(StrictModel):
    """How a key's hash part is made: what the router hashes a request's tokens with to find it."""

    algorithm: str = "sha256"
    """vLLM's ``--prefix-caching-hash-algo``; Dynamo accepts ``sha256``."""
    digest_encoding: str = "hex"
    """How the digest is spelled after the last ``@``: lowercase hex (the key contract's ``block-hash-hex``)."""
    gpu_event_hash: str = "low64"
    """What vLLM's GPU KV events carry of the hash: its low 64 bits (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    seed_policy: str = "pythonhashseed-0"
    """How the first block's parent hash is seeded: ``PYTHONHASHSEED=0`` makes it the same on every instance."""
    key_separator: str = "@"
    """What separates a key's prefix from its hash."""


class DynamoInputContract(StrictModel):
    """Which requests the router may credit with a store hit (the deployment's, stated as Dynamo needs it)."""

    text_only: bool = True
    """No multimodal inputs or prompt embeddings."""
    normalized_namespaces: bool = True
    """Namespaces spelled the same by every worker."""
    lora: bool = True
    """LoRA adapters hashed by name."""


class DynamoCoordinator(StrictModel):
    """vLLM's store coordinator geometry."""

    lcm_block_size: int = Field(ge=0, le=_U32)
    """The least common multiple of the groups' block sizes (vLLM's scheduler block size)."""
    speculative: bool = False
    """Speculative decoding on (Dynamo refuses it)."""
    drop_blocks: bool = False
    """EAGLE block dropping on (Dynamo refuses it)."""
    partial_hash_hits: bool
    """Hits at the hash block size rather than the scheduler block size (an aligned Mamba group's)."""


class DynamoGroup(StrictModel):
    """One store group: its kind, its geometry and every key prefix a hit needs."""

    group_id: int = Field(ge=0)
    """Position among the store groups: 0, 1, ... in order (the key's ``group`` field)."""
    kind: DynamoKind
    """``full_attention``, ``sliding_window`` or ``mamba``."""
    spec: str
    """The group's vLLM spec class."""
    manager: str
    """The vLLM KV-cache manager of that class."""
    block_size: int = Field(ge=0, le=_U32)
    """Tokens per stored chunk."""
    hash_block_size: int = Field(ge=0, le=_U32)
    """Tokens per hash block (the same for every group)."""
    key_prefixes: tuple[str, ...]
    """Every namespace that must hold a chunk for a hit (the key contract's ``lookup_prefixes``)."""
    sliding_window: int | None = Field(default=None, ge=0, le=_U32)
    """Tokens in the window of a ``sliding_window`` group; None otherwise."""
    mamba_cache_mode: str | None = None
    """``align`` for a ``mamba`` group; None otherwise."""


class DynamoDescriptor(StrictModel):
    """Dynamo's descriptor of vLLM's Mooncake store keys (schema version 1), field for field: what a
    worker publishes so the router can find a prompt's chunks in the store."""

    schema_version: int = Field(ge=0, le=_U32)
    """:data:`DYNAMO_SCHEMA_VERSION`."""
    adapter: str
    """Who wrote the descriptor: :data:`KVPOLICY_ADAPTER` for kvpolicy."""
    vllm_revision: str
    """The vLLM the keys come from."""
    hash: DynamoHashContract
    """How the hash part of a key is made."""
    input: DynamoInputContract
    """Which requests may be credited."""
    main_event_group: int = Field(ge=0)
    """The vLLM KV-cache group whose GPU events the router hashes: the first full-attention group."""
    main_event_block_size: int = Field(ge=0, le=_U32)
    """That group's block size."""
    gpu_to_store_group: tuple[int | None, ...]
    """Per vLLM KV-cache group, its store group (None for one the store does not keep)."""
    coordinator: DynamoCoordinator
    """The store coordinator's geometry."""
    groups: tuple[DynamoGroup, ...]
    """The store groups, in order."""


@dataclass(frozen=True)
class DynamoDeployment:
    """What the descriptor states that a plan does not hold: the deployment's hashing and vLLM."""

    vllm_revision: str = "unknown"
    """The vLLM version or revision the instance runs (the connector names the installed one)."""
    hash: DynamoHashContract = field(default_factory=DynamoHashContract)
    """How the instance hashes (the connector states its ``--prefix-caching-hash-algo`` and seed)."""


class RouterExportError(ValueError):
    """A plan the router's format cannot describe, with every reason."""

    def __init__(self, problems: tuple[str, ...]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _spec_fields(group: Group, member: int, variables: Mapping[str, Any]) -> Mapping[str, Any]:
    return group.members[member].spec.evaluate(variables).fields


def _group_kind(index: int, name: str, group: Group, variables: Mapping[str, Any]) -> tuple[DynamoKind, int | None] | str:
    """(kind, sliding window) of a layout group as Dynamo's exporter reads its spec, or why it has none.
    Dynamo takes the exact classes only (``type(spec) is ...``), with their stock semantics."""
    kinds: list[tuple[str, int | None]] = []
    for member_index, member in enumerate(group.members):
        spec_type = member.spec.type
        where = f"group {index} ({name})"
        try:
            fields = _spec_fields(group, member_index, variables)
        except ExpressionError as error:
            return f"{where}: its {spec_type} fields do not evaluate: {error.message}"
        if spec_type == "FullAttentionSpec":
            if fields.get("sliding_window") is not None or fields.get("attention_chunk_size") is not None or fields.get("non_causal"):
                return (
                    f"{where}: its FullAttentionSpec has a sliding window, chunked attention or non-causal attention, "
                    "which Dynamo refuses"
                )
            kinds.append(("full_attention", None))
        elif spec_type == "SlidingWindowSpec":
            window = fields.get("sliding_window")
            if (fields.get("extra_retained_tokens") or 0) != 0:
                return f"{where}: its SlidingWindowSpec retains extra tokens (speculative decoding), which Dynamo refuses"
            if type(window) is not int or not 1 < window <= _U32:
                return f"{where}: its SlidingWindowSpec states no sliding window above 1 token ({window!r}); Dynamo needs one"
            kinds.append(("sliding_window", window))
        elif spec_type == "MambaSpec":
            if fields.get("mamba_cache_mode") != "align" or (fields.get("num_speculative_blocks") or 0) != 0:
                return (
                    f"{where}: its MambaSpec has mamba_cache_mode {fields.get('mamba_cache_mode')!r}"
                    f" and {fields.get('num_speculative_blocks') or 0} speculative blocks; Dynamo needs 'align' and none"
                )
            kinds.append(("mamba", None))
        else:
            mla = " (an MLA latent)" if "MLAAttentionSpec" in member.spec.classes else ""
            return (
                f"{where} holds {spec_type}{mla}; Dynamo describes only FullAttentionSpec, SlidingWindowSpec and MambaSpec "
                "groups (the exact classes), so it cannot say where this group's chunks are"
            )
    if len(set(kinds)) != 1:
        return f"group {index} ({name}) mixes {', '.join(sorted({kind for kind, _ in kinds}))} layers; Dynamo needs one kind per group"
    return kinds[0]  # type: ignore[return-value]


KEYED_KEYS_UNREADABLE = (
    "each chunk key ends in an HMAC under the deployment's secret, not vLLM's block hash, so a "
    "router (Dynamo, Mooncake Conductor) cannot compute or read it"
)
"""Why routers cannot use keyed keys: said wherever a router's view of the keys is asked for."""


def keyed_keys_fix(*, policy_requires: bool) -> str:
    """How to keep keys router-readable: a policy that requires keyed namespaces must first allow them
    off (settings cannot override a requirement); verified objects still refuse tampered ones."""
    settings = "set kvpolicy_keyed_namespaces: false (kvpolicy_verify_objects still refuses tampered objects)"
    return f"to keep keys router-readable set the policy's key.keyed to 'optional' and {settings}" if policy_requires else (
        f"to keep keys router-readable {settings}"
    )


KEYED_FOR_ROUTERS = f"{KEYED_KEYS_UNREADABLE}; {keyed_keys_fix(policy_requires=False)}"
"""The why and the fix for a deployment whose policy lets keyed namespaces be turned off."""


def dynamo_descriptor(contract: KeyContract, layout: Layout, deployment: DynamoDeployment | None = None) -> DynamoDescriptor:
    """The descriptor Dynamo's router reads, of the plan ``contract`` states (``layout`` is the layout
    it was planned from): per group its kind, geometry and lookup prefixes; ``deployment`` (default:
    one that hashes as Dynamo needs, of an unknown vLLM) what it states besides. The groups are the
    layout's, which are vLLM's prefix-cacheable groups; a model with other KV-cache groups has a
    different GPU numbering than the identity :attr:`~DynamoDescriptor.gpu_to_store_group` stated here.
    The hash block size is vLLM's (the greatest common divisor of the groups' block sizes; no
    ``prefix_match_unit``). Raises :class:`RouterExportError` when a group has no Dynamo kind (MLA and
    every other spec class but the three) or no group is full attention: a descriptor leaving a group
    out would credit hits the store cannot serve."""
    if contract.chunk_key.chunk_hash == "keyed-hmac-hex":
        raise RouterExportError((f"keyed namespaces: {KEYED_FOR_ROUTERS}",))
    deployment = deployment or DynamoDeployment()
    topology = contract.topology
    variables = topology_variables(topology, layout.total_num_kv_heads)
    problems: list[str] = []
    kinds: list[tuple[DynamoKind, int | None]] = []
    for keys, group in zip(contract.groups, layout.groups, strict=True):
        kind = _group_kind(keys.index, keys.name, group, variables)
        if isinstance(kind, str):
            problems.append(kind)
        else:
            kinds.append(kind)
    if not problems and not any(kind == "full_attention" for kind, _ in kinds):
        problems.append("no group is full attention; Dynamo hashes a request by the first full-attention group's GPU events")
    if problems:
        raise RouterExportError(tuple(problems))
    sizes = [group.chunk_tokens for group in contract.groups]
    modes = [kind for kind, _ in kinds]
    hash_span = math.gcd(*sizes)
    scheduler = math.lcm(*sizes)
    main = modes.index("full_attention")
    aligned_mamba = any(
        kind == "mamba" and (size > hash_span if topology.dcp_size == 1 else size >= hash_span)
        for kind, size in zip(modes, sizes, strict=True)
    )
    groups = tuple(
        DynamoGroup(
            group_id=keys.index,
            kind=kind,
            spec=_STOCK[kind][0],
            manager=_STOCK[kind][1],
            block_size=keys.chunk_tokens,
            hash_block_size=hash_span,
            key_prefixes=tuple(sorted(keys.lookup_prefixes)),
            sliding_window=window,
            mamba_cache_mode="align" if kind == "mamba" else None,
        )
        for keys, (kind, window) in zip(contract.groups, kinds, strict=True)
    )
    return DynamoDescriptor(
        schema_version=DYNAMO_SCHEMA_VERSION,
        adapter=KVPOLICY_ADAPTER,
        vllm_revision=deployment.vllm_revision,
        hash=deployment.hash,
        input=DynamoInputContract(),
        main_event_group=main,
        main_event_block_size=sizes[main],
        gpu_to_store_group=tuple(range(len(groups))),
        coordinator=DynamoCoordinator(
            lcm_block_size=scheduler,
            # vLLM's store coordinator: hits at the hash block size when an aligned Mamba group's block is larger.
            partial_hash_hits=aligned_mamba and hash_span < scheduler,
        ),
        groups=groups,
    )


@dataclass(frozen=True)
class DynamoCheck:
    """A descriptor as Dynamo's validator sees it."""

    problems: tuple[str, ...]
    """What its validator refuses whoever wrote the descriptor: the schema version, the hash and
    input contracts, the limits on groups and prefixes, the group ids and the geometry."""
    pinned: tuple[str, ...]
    """What it refuses because it accepts only its own exporter: the adapter and the vLLM revision."""

    @property
    def valid(self) -> bool:
        """Within the format and its limits (:attr:`pinned` aside)."""
        return not self.problems


def check_dynamo_descriptor(descriptor: DynamoDescriptor) -> DynamoCheck:
    """Dynamo's validator (:data:`DYNAMO_SOURCE`) applied to ``descriptor``, every rule it has, each
    refusal said once (Dynamo stops at the first)."""
    pinned = []
    if descriptor.adapter != DYNAMO_PINNED_ADAPTER:
        pinned.append(f"adapter is {descriptor.adapter!r}; Dynamo accepts only its own, {DYNAMO_PINNED_ADAPTER!r}")
    if descriptor.vllm_revision != DYNAMO_PINNED_VLLM_REVISION:
        pinned.append(f"vllm_revision is {descriptor.vllm_revision!r}; Dynamo accepts only vLLM {DYNAMO_PINNED_VLLM_REVISION}")
    return DynamoCheck(tuple(_dynamo_problems(descriptor)), tuple(pinned))


def _dynamo_problems(descriptor: DynamoDescriptor) -> Iterator[str]:
    if descriptor.schema_version != DYNAMO_SCHEMA_VERSION:
        yield f"schema_version is {descriptor.schema_version}; Dynamo reads version {DYNAMO_SCHEMA_VERSION}"
    if descriptor.hash != DynamoHashContract():
        yield (f"hash contract {descriptor.hash.model_dump()} is not Dynamo's "
               f"{DynamoHashContract().model_dump()} (sha256 prefix caching, PYTHONHASHSEED=0, integer GPU event hashes)")
    if descriptor.input != DynamoInputContract():
        yield "input contract: Dynamo needs text_only, normalized_namespaces and lora all true"
    block, scheduler = descriptor.main_event_block_size, descriptor.coordinator.lcm_block_size
    if block == 0 or scheduler == 0:
        yield "main_event_block_size and coordinator.lcm_block_size must be positive"
    if descriptor.coordinator.speculative or descriptor.coordinator.drop_blocks:
        yield "Dynamo refuses speculative decoding and block dropping"
    groups = descriptor.groups
    if not 0 < len(groups) <= DYNAMO_MAX_GROUPS:
        yield f"{len(groups)} groups; Dynamo takes 1 to {DYNAMO_MAX_GROUPS}"
    projection = descriptor.gpu_to_store_group
    if not 0 < len(projection) <= DYNAMO_MAX_GROUPS:
        yield f"gpu_to_store_group has {len(projection)} entries; Dynamo takes 1 to {DYNAMO_MAX_GROUPS}"
    if [entry for entry in projection if entry is not None] != list(range(len(groups))):
        yield "gpu_to_store_group does not map the GPU groups onto store groups 0, 1, ... in order"
    main = projection[descriptor.main_event_group] if descriptor.main_event_group < len(projection) else None
    if main is None or main >= len(groups):
        yield f"main_event_group {descriptor.main_event_group} is no store group"
    else:
        if groups[main].kind != "full_attention" or groups[main].block_size != block:
            yield f"main event group (store group {main}) is not a full-attention group of block size {block}"
        if next((index for index, group in enumerate(groups) if group.kind == "full_attention"), None) != main:
            yield f"main event group (store group {main}) is not the first full-attention group"
    if not groups:
        return
    hash_span = groups[0].hash_block_size
    if hash_span == 0 or (block and block % hash_span):
        yield f"hash block size {hash_span} does not divide the main event block size {block}"
    alignment = math.lcm(block, scheduler) if block and scheduler else 0
    prefixes: set[str] = set()
    counted = 0
    for index, group in enumerate(groups):
        where = f"group {index}"
        if group.group_id != index:
            yield f"{where} has group_id {group.group_id}; Dynamo needs ids 0, 1, ... in order"
        size = group.block_size
        if not (size > 0 and group.hash_block_size == hash_span and hash_span and size % hash_span == 0
                and scheduler and scheduler % size == 0):
            yield (f"{where}: block size {size} and hash block size {group.hash_block_size} do not divide evenly "
                   f"(every group's hash block size {hash_span}, dividing its block size, which divides {scheduler})")
        alignment = math.lcm(alignment, size) if alignment and size else alignment
        if alignment > _U32:
            yield f"{where}: the groups' block sizes align only at {alignment} tokens, beyond Dynamo's 32 bits"
            alignment = 0
        spec, manager = _STOCK[group.kind]
        if (group.spec, group.manager) != (spec, manager):
            yield f"{where}: a {group.kind} group must be {spec} with {manager}, not {group.spec} with {group.manager}"
        if group.kind == "mamba":
            if group.mamba_cache_mode != "align" or group.sliding_window is not None:
                yield f"{where}: a mamba group needs mamba_cache_mode 'align' and no sliding window"
        elif group.mamba_cache_mode is not None:
            yield f"{where}: only a mamba group has a mamba_cache_mode"
        if group.kind == "full_attention":
            if group.sliding_window is not None:
                yield f"{where}: a full_attention group has no sliding window"
            if block and size % block:
                yield f"{where}: block size {size} is not a multiple of the main event block size {block}"
        if group.kind == "sliding_window":
            window = group.sliding_window
            if window is None or window <= 1:
                yield f"{where}: a sliding_window group needs a window above 1 token"
            elif block and size and size % block and -(-(window - 1) // size) != 1:
                yield (f"{where}: block size {size} is not a multiple of the main event block size {block}, "
                       f"and the window of {window} tokens spans more than one block")
        if not group.key_prefixes:
            yield f"{where} lists no key prefix"
        for prefix in group.key_prefixes:
            length = len(prefix.encode("utf-8"))
            if not 0 < length <= DYNAMO_MAX_PREFIX_BYTES or prefix.endswith("@"):
                yield (f"{where}: prefix {prefix[:60]!r} ({length} bytes) must be 1 to {DYNAMO_MAX_PREFIX_BYTES} bytes "
                       "and not end in '@'")
            if prefix in prefixes:
                yield f"{where}: prefix {prefix[:60]!r} is listed twice"
            prefixes.add(prefix)
            counted += 1
    if counted > DYNAMO_MAX_PREFIXES:
        yield f"{counted} key prefixes; Dynamo takes at most {DYNAMO_MAX_PREFIXES} in all"


def dynamo_refusals(contract: KeyContract, descriptor: DynamoDescriptor) -> tuple[str, ...]:
    """Why Dynamo (:data:`DYNAMO_SOURCE`) would not use ``descriptor`` today even where it is within
    the format: the pinned adapter and revision, and what its worker extension refuses of the
    deployment (context parallelism, a missing cache prefix)."""
    topology = contract.topology
    refused = list(check_dynamo_descriptor(descriptor).pinned)
    if topology.pcp_size > 1 or topology.dcp_size > 1:
        refused.append(f"pcp {topology.pcp_size}, dcp {topology.dcp_size}: Dynamo's exporter refuses context parallelism")
    if not contract.cache_prefix.strip():
        refused.append("no cache_prefix: Dynamo's exporter needs one, and every prefix to start with it and '@'")
    return tuple(refused)
