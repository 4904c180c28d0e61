"""The two versioned documents kvpolicy reads: a replication *policy* and a model *layout*.

Both are frozen Pydantic models that reject unknown fields, immutable all the way down (their
free-form mappings are :class:`FrozenMapping`, their lists tuples), so a loaded document is
hashable and no caller can change it under another. Every field carries an attribute docstring:
``use_attribute_docstrings`` turns it into the JSON Schema description that editors show, so one
sentence documents the code, the schema and the YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
import re
import typing
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from enum import Enum
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, core_schema

from kvpolicy.language.catalog import SPEC_FIELDS, is_subclass
from kvpolicy.language.expressions import MAX_INT, Expression, ExpressionError, shared_expression
from kvpolicy.language.keys import UPSTREAM_KEY_TEMPLATE, check_template

TOPOLOGY_VARIABLES = ("tp_size", "pp_size", "pcp_size", "dcp_size", "total_num_kv_heads", "model_total_num_kv_heads")
"""Variables every expression may read, besides the fields of the spec being matched.
``total_num_kv_heads`` is the KV heads of the layer being decided (its entry in the layout's
``layer_kv_heads``, else the model-wide value); ``model_total_num_kv_heads`` is always the model-wide
value (vLLM's ``get_total_num_kv_heads()``, which its store uses for every layer)."""
RESERVED_FIELD_NAMES = frozenset((*TOPOLOGY_VARIABLES, "block_size", "page_size_bytes"))
"""Names a spec field may not have: expressions read them from the topology or the spec itself."""

SPEC_VARIABLES = ("block_size", "page_size_bytes")
"""Spec attributes every layout states and expressions may read."""


def _parse_expression(value: Any) -> Expression:
    if isinstance(value, Expression):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer or an expression string, got {type(value).__name__}")
    try:
        return shared_expression(str(value))
    except ExpressionError as error:
        raise ValueError(error.message) from error


ExpressionText = Annotated[
    Expression,
    BeforeValidator(_parse_expression),
    PlainSerializer(lambda expression: expression.source, return_type=str),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "description": "An integer or an expression over the topology and the spec's fields.",
        }
    ),
]
"""An integer or an expression such as ``max(1, tp_size // total_num_kv_heads)``."""

ScalarValue = StrictInt | StrictBool | StrictStr | None
"""Strict: a number written ``1.0`` is not the integer 1, nor the string ``"1"``."""
MatchValue = ScalarValue | list[Any]
"""A value a rule's ``match.fields`` compares with; once loaded, its lists are tuples (:func:`deep_frozen`)."""

_Key = TypeVar("_Key")
_Value_co = TypeVar("_Value_co", covariant=True)


class FrozenMapping(Mapping[_Key, _Value_co]):
    """An immutable, hashable mapping that keeps insertion order; its values are :func:`deep_frozen`.

    As a Pydantic field type, ``FrozenMapping[K, V]`` validates and appears in JSON Schema exactly
    like ``dict[K, V]`` (an ``object``), and serializes back to plain dicts and lists.
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[_Key, _Value_co] | Iterable[tuple[_Key, _Value_co]] = ()) -> None:
        self._items: dict[_Key, _Value_co] = {key: deep_frozen(value) for key, value in dict(items).items()}
        self._hash: int | None = None

    @classmethod
    def of_frozen(cls, items: dict[_Key, _Value_co]) -> FrozenMapping[_Key, _Value_co]:
        """A mapping of ``items``, whose values are :func:`deep_frozen` already; it keeps ``items``."""
        mapping = cls.__new__(cls)
        mapping._items, mapping._hash = items, None
        return mapping

    def __getitem__(self, key: _Key) -> _Value_co:
        return self._items[key]

    def __iter__(self) -> Iterator[_Key]:
        return iter(self._items)

    # Views of the dict itself (read-only): Mapping's own would call __getitem__ per key.
    def keys(self) -> KeysView[_Key]:
        return self._items.keys()

    def values(self) -> ValuesView[_Value_co]:
        return self._items.values()

    def items(self) -> ItemsView[_Key, _Value_co]:
        return self._items.items()

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            # Order-blind, like equality: two mappings with the same items are equal whatever their order.
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"

    def __reduce__(self) -> tuple[type[FrozenMapping[_Key, _Value_co]], tuple[dict[_Key, _Value_co]]]:
        return type(self), (self._items,)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        key_type, value_type = typing.get_args(source) or (Any, Any)
        return core_schema.no_info_after_validator_function(
            _validated_frozen,
            handler.generate_schema(dict[key_type, value_type]),  # type: ignore[valid-type]
            serialization=core_schema.plain_serializer_function_ser_schema(thawed),
        )


def deep_frozen(value: Any) -> Any:
    """``value`` with every mapping in it made a :class:`FrozenMapping` and every list a tuple."""
    if isinstance(value, FrozenMapping):
        return value
    if isinstance(value, Mapping):
        return FrozenMapping(value)
    if isinstance(value, (list, tuple)):
        return tuple(deep_frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """The inverse of :func:`deep_frozen`: mappings as dicts and tuples as lists, all the way down
    (a :class:`FieldExpression` as the ``{expr: ...}`` mapping a document writes)."""
    if isinstance(value, FieldExpression):
        return {"expr": value.expr.source}
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thawed(item) for item in value]
    return value


MAX_VALUE_DEPTH = 64
"""Deepest nesting of lists and mappings a free-form value may have (the dumper and the reader recurse)."""


def _readable_values(value: Any, depth: int = 0) -> None:
    """Refuse, anywhere in ``value``, what the YAML reader would not give back after a dump: an integer
    beyond 63 bits, a mapping key that is not a string, nesting deeper than :data:`MAX_VALUE_DEPTH`."""
    if depth > MAX_VALUE_DEPTH:
        raise _too_deep()
    if type(value) is int and abs(value) > MAX_INT:
        raise _too_large(value)
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _not_a_name(key)
            _readable_values(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _readable_values(item, depth + 1)


def _too_deep() -> ValueError:
    return ValueError(f"values are nested deeper than {MAX_VALUE_DEPTH} levels")


def _too_large(value: int) -> ValueError:
    return ValueError(f"an integer of {value.bit_length()} bits is too large; integers are at most 2**63 - 1")


def _not_a_name(key: Any) -> ValueError:
    return ValueError(f"mapping keys must be strings, got {type(key).__name__} {str(key)[:40]!r}")


class _Unusual(Exception):
    """A value other than the dicts, lists and scalars a YAML document holds."""


def _frozen_if_readable(value: Any, depth: int) -> Any:
    """``deep_frozen(value)`` after ``_readable_values(value, depth)`` in one walk, for the values a
    document holds (dicts, lists, strings, numbers, booleans, None), which are hashable once frozen;
    raises :class:`_Unusual` at anything else, for the two steps to judge. Both walk depth first in
    order, so the first refusal is the same."""
    if depth > MAX_VALUE_DEPTH:
        raise _too_deep()
    kind = type(value)
    if kind in _KEPT:
        return value
    if kind is int:
        if abs(value) > MAX_INT:
            raise _too_large(value)
        return value
    inline = depth < MAX_VALUE_DEPTH  # the items are not too deep: the scalars among them need no call
    if kind is list or kind is tuple:
        return tuple([item if inline and type(item) in _KEPT else _frozen_if_readable(item, depth + 1) for item in value])
    if kind is dict:
        items = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _not_a_name(key)
            items[key] = item if inline and type(item) in _KEPT else _frozen_if_readable(item, depth + 1)
        return FrozenMapping.of_frozen(items)
    raise _Unusual


_KEPT = frozenset((str, bool, float, type(None)))
"""Values :func:`deep_frozen` keeps as they are and :func:`_readable_values` never refuses (at a depth it allows)."""


def _validated_frozen(items: dict[Any, Any]) -> FrozenMapping[Any, Any]:
    try:
        return _frozen_if_readable(items, 0)  # type: ignore[no-any-return]
    except _Unusual:
        pass
    _readable_values(items)
    frozen: FrozenMapping[Any, Any] = FrozenMapping(items)
    try:
        hash(frozen)
    except TypeError as error:  # a value deep_frozen cannot freeze, such as a set built in Python
        raise ValueError(f"values must be scalars, lists or mappings ({error})") from None
    return frozen


NAME_PATTERN = r"^[a-z0-9][a-z0-9-]*$"
"""A policy's or rule's name: kebab-case."""
_NAME_PATTERN = NAME_PATTERN


def _as_tuple(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


NameOrNames = Annotated[
    tuple[str, ...],
    BeforeValidator(_as_tuple),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
]
"""A name, or a list of names (read as a tuple)."""

_LAYER_NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 1000}
LayerNames = Annotated[
    tuple[Annotated[str, Field(min_length=1, max_length=1000)], ...],
    WithJsonSchema({"anyOf": [_LAYER_NAME_SCHEMA, {"type": "array", "items": _LAYER_NAME_SCHEMA, "minItems": 1}]}),
]
"""Layer names or ``{a..b}`` patterns: one, or a list; none empty."""


def expression_variables(spec_fields: Iterable[str] = ()) -> frozenset[str]:
    """The names a policy's expressions may read: the topology, the spec's block and page size, every
    field of vLLM's spec classes, and the policy's own ``spec_fields``."""
    return frozenset(TOPOLOGY_VARIABLES) | frozenset(SPEC_VARIABLES) | SPEC_FIELDS | frozenset(spec_fields)


def _invalid(message: str) -> PydanticCustomError:
    """A value error of a validator that runs once per item (a group, a rule, a field): pydantic keeps
    an exception raised as ``ValueError``, with its traceback and the frames' locals, in each error,
    which a file of a hundred thousand bad items would multiply; this keeps the message."""
    return PydanticCustomError("invalid-value", "{message}", {"message": message})


def _located_error(check: str, location: tuple[str | int, ...], value: Any, error: ExpressionError) -> InitErrorDetails:
    """A validation error of ``check`` (a :data:`kvpolicy.language.diagnostics.CHECKS` name) at ``location``
    below the model raising it, ``column`` characters into the value."""
    context = {"message": error.message, "column": error.column}
    return InitErrorDetails(type=PydanticCustomError(check, "{message}", context), loc=location, input=value)


def _an_integer(value: Any) -> Any:
    # YAML's `true` is Python's True, which equals 1; the JSON Schema's `const: 1` rejects it, so must this.
    if isinstance(value, bool):
        raise ValueError(f"must be the integer 1, not {str(value).lower()}")
    # `1.0` (or `!!float 1`) equals 1 too, and a Literal takes it: a version is a whole number as written.
    if isinstance(value, float):
        raise ValueError(f"must be the integer 1, not the number {value!r}")
    return value


DocumentVersion = Annotated[Literal[1], BeforeValidator(_an_integer)]
"""The document format version: exactly the integer 1."""


KV_CACHE_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.32's ``KVCacheLayout`` names (dimension orders of a layer's KV cache)."""
KVCacheLayoutName = Literal["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


class StrictModel(BaseModel):
    """The base of every model in this module: frozen, rejects unknown fields, and turns attribute
    docstrings into JSON Schema descriptions."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        hide_input_in_errors=True,
    )


class Replication(str, Enum):
    """How the bytes of a cache spec are spread over the TP ranks."""

    SHARDED = "sharded"
    """Every TP rank holds distinct bytes: factor 1."""
    REPLICATED = "replicated"
    """Every TP rank holds the same heads: factor tp_size (under DCP, ranks of equal dcp rank share bytes)."""


class Schedule(str, Enum):
    """Which ranks of a replica set write a chunk to the store."""

    STRIPED = "striped"
    """Each chunk is written once per replica set; rank phase (stripe rank + group) % factor, the stripe
    rank being the TP rank (upstream's) or, under DCP, its position among the ranks of its dcp rank."""
    LEADER = "leader"
    """The lowest rank of each replica set writes every chunk."""
    ALL = "all"
    """Every rank writes every chunk; the store keeps the first copy."""


class LoadMode(str, Enum):
    """How the ranks of a replica set read a group's chunks from the store on a hit."""

    PER_RANK = "per-rank"
    """Every rank reads every chunk it needs (vLLM's way): a chunk of a group replicated over ``f``
    ranks leaves the store ``f`` times."""
    STRIPED = "striped"
    """Each member of a replica set reads a disjoint ``1/f`` of the chunks and the members exchange
    them over the TP group: each chunk leaves the store once per replica set. Needs one receive thread
    per rank and no disk-offload staging budget; otherwise the connector reads per rank."""


class AuditMode(str, Enum):
    WARN = "warn"
    """On a digest mismatch the group falls back to factor 1 and rank 0 logs one error."""
    ENFORCE = "enforce"
    """On a digest mismatch the connector stops with that error."""
    OFF = "off"
    """Trust the policy without checking."""


class Keyed(str, Enum):
    OPTIONAL = "optional"
    """Keys are keyed when the deployment names a secret (``kvpolicy_secret``), plain otherwise."""
    REQUIRED = "required"
    """Keys must be keyed: a deployment that names no secret refuses to start."""
    OFF = "off"
    """Keys stay plain (readable by routers) even with a secret, which then seals objects only."""


class Verified(str, Enum):
    OPTIONAL = "optional"
    """Objects are sealed when the deployment asks (``kvpolicy_verify_objects``)."""
    REQUIRED = "required"
    """Objects must be sealed: a deployment that does not verify them refuses to start."""


class Match(StrictModel):
    """Which layer specs a rule applies to. All given conditions must hold; none given matches all."""

    spec: NameOrNames | None = None
    """Spec class names (one, or a list); a spec matches when its class or any of its base classes is listed."""
    fields: FrozenMapping[str, MatchValue] = Field(default_factory=FrozenMapping)
    """Spec field values that must be equal; a list means any of its values."""
    layers: NameOrNames | None = None
    """Layer-name globs (fnmatch; one, or a list); a layer matches when any glob matches its name."""


class Rule(StrictModel):
    """One replication rule. Rules are tried in order per layer spec; the first that matches wins."""

    name: str = Field(pattern=_NAME_PATTERN, max_length=128)
    """Unique kebab-case name, shown in plans and errors."""
    reason: str = Field(min_length=1)
    """One line on why this rule is right."""
    match: Match = Match()
    """Which specs and layers the rule applies to."""
    when: ExpressionText | None = None
    """Boolean expression over the topology and the spec's fields; the rule applies only when true."""
    replication: Replication | None = None
    """``sharded`` (factor 1) or ``replicated`` (factor tp_size)."""
    factor: ExpressionText | None = None
    """Expression for the replication factor: consecutive TP ranks that repeat the same heads. Under
    decode-context parallelism the plan keeps only those of equal dcp rank together (same tokens)."""
    shards: ExpressionText | None = None
    """Expression for the number of distinct shards over TP; the factor is tp_size // shards."""

    @model_validator(mode="after")
    def _one_outcome(self) -> Rule:
        given = [name for name in ("replication", "factor", "shards") if getattr(self, name) is not None]
        if len(given) != 1:
            raise _invalid(
                "a rule needs exactly one of 'replication', 'factor' or 'shards'"
                + (f", got {' and '.join(given)}" if given else "")
            )
        return self


class KeyFormat(StrictModel):
    """How store keys are spelled."""

    template: str = Field(default=UPSTREAM_KEY_TEMPLATE, max_length=1000)
    """Key prefix template; fields: {cache_prefix} (rendered with a trailing '@' when set), {model},
    {store_namespace}, {fingerprint}, {shard}, {pcp_rank}, {dcp_rank}, {pp_rank}, {group}."""

    keyed: Keyed = Keyed.OPTIONAL
    """Keyed namespaces: a chunk key's last part is an HMAC of the key under the deployment's secret, so
    nobody without the secret can compute, probe or pre-write a key (routers cannot read them either).
    ``optional``: when the deployment names a secret; ``required``: refuse to start without one;
    ``off``: never."""
    verified: Verified = Verified.OPTIONAL
    """Verified objects: each object carries a MAC of its key and bytes under the deployment's secret,
    checked on every load (a mismatch is a load failure, recomputed). ``optional``: when the deployment
    sets ``kvpolicy_verify_objects``; ``required``: refuse to start without it."""

    @field_validator("template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        return check_template(template)


class Audit(StrictModel):
    """Online check that a replicated group really is byte-identical across its replica set."""

    mode: AuditMode = AuditMode.WARN
    """What a digest mismatch does: ``warn`` (fall back to factor 1), ``enforce`` (stop) or ``off``."""
    steps: int = Field(default=4, ge=0, le=10_000, strict=True)
    """Number of save steps audited after start-up."""


class Policy(StrictModel):
    """A replication policy: ordered rules that turn cache specs and a topology into factors."""

    version: DocumentVersion
    """Document format version."""
    kind: Literal["ReplicationPolicy"]
    """Document kind; tells policies and layouts apart."""
    name: str = Field(pattern=_NAME_PATTERN, max_length=128)
    """Policy name, shown in plans."""
    description: str = ""
    """What the policy is for."""
    rules: tuple[Rule, ...] = Field(max_length=1000)
    """Ordered rules; the first match per layer spec wins."""
    unmatched: Replication = Replication.SHARDED
    """Replication of specs no rule matches; ``sharded`` is always safe."""
    strict: bool = Field(default=False, strict=True)
    """Make a spec that no rule matches an error instead of applying ``unmatched``."""
    combine: Literal["gcd"] = "gcd"
    """How the factors of a uniform group's layers combine: ``gcd`` is the largest replica set over
    which every layer is identical."""
    schedule: Schedule = Schedule.STRIPED
    """Which ranks of a replica set write each chunk."""
    load: LoadMode = LoadMode.PER_RANK
    """Which ranks of a replica set read each chunk on a hit. Not part of the fingerprint: it changes
    who reads an object, not which objects exist."""
    key: KeyFormat = KeyFormat()
    """Store key format."""
    audit: Audit = Audit()
    """Online replication audit."""
    spec_fields: tuple[str, ...] = ()
    """Extra spec field names that expressions may read (for spec classes from plugins)."""

    _origins: tuple[str, ...] = PrivateAttr(default=())
    _expression_origins: tuple[Mapping[str, str], ...] = PrivateAttr(default=())
    _strict_origin: str | None = PrivateAttr(default=None)

    @property
    def strict_origin(self) -> str | None:
        """``file:line:col`` of ``strict:``'s value when it was loaded from a file that sets it; else None."""
        return self._strict_origin

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        seen: set[str] = set()
        for rule in rules:
            if rule.name in seen:
                raise ValueError(f"rule name '{rule.name}' is used twice; rule names must be unique")
            seen.add(rule.name)
        return rules

    @model_validator(mode="after")
    def _expressions_read_known_variables(self) -> Policy:
        known = expression_variables(self.spec_fields)
        errors: list[InitErrorDetails] = []
        for index, rule in enumerate(self.rules):
            for field in ("when", "factor", "shards"):
                expression: Expression | None = getattr(rule, field)
                if expression is None:
                    continue
                try:
                    expression.check_names(known)
                except ExpressionError as error:
                    errors.append(_located_error("invalid-expression", ("rules", index, field), expression.source, error))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def rule_origin(self, index: int) -> str:
        """``file:line`` of rule ``index`` when loaded from a file, else ``policy <name> rule <n>``."""
        if index < len(self._origins):
            return self._origins[index]
        return f"policy {self.name} rule {index + 1}"

    def expression_origin(self, index: int, field: str, offset: int = 0) -> str | None:
        """``file:line:col`` of rule ``index``'s ``field`` expression (``when``, ``factor``, ``shards``),
        ``offset`` characters into it (an :class:`ExpressionError`'s ``column``), when loaded from a
        file; else None."""
        if index >= len(self._expression_origins) or field not in self._expression_origins[index]:
            return None
        path_line, _, start = self._expression_origins[index][field].rpartition(":")
        return f"{path_line}:{int(start) + offset}"

    def with_origins(
        self,
        origins: tuple[str, ...],
        expression_origins: tuple[Mapping[str, str], ...] = (),
        strict_origin: str | None = None,
    ) -> Policy:
        """This policy, knowing where its rules (``file:line``), their expressions (``file:line:col``
        per field) and its ``strict`` setting stand in the file it was loaded from."""
        copy = self.model_copy()
        copy._origins = origins
        copy._expression_origins = expression_origins
        copy._strict_origin = strict_origin
        return copy


_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
MAX_LAYOUT_LAYERS = 200_000
"""Layer names one layout may expand to; real models have a few hundred at most."""


MAX_LAYOUT_NAME_CHARS = 32 * 1024 * 1024
"""Characters all of a layout's layer names may expand to (200,000 names of 160 characters): a few
ranges behind a long name must not make gigabytes of names."""
MAX_LAYER_NAME_CHARS = 1000
"""Characters of one layer name."""


def _expanded_length(pattern: str) -> int:
    """Characters of the longest name ``pattern`` expands to (each range at its upper bound)."""
    if "{" not in pattern:
        return len(pattern)
    return len(_RANGE.sub(lambda found: found.group(2), pattern))


def _expanded_count(pattern: str) -> int:
    if "{" not in pattern:  # no range (most names), without the regular expression
        return 1
    return math.prod(max(0, int(high) - int(low) + 1) for low, high in _RANGE.findall(pattern))


def _layer_patterns(raw_layout: Any) -> Iterator[str]:
    """The layer-name patterns of a raw (not yet validated) layout document, wherever they stand."""
    groups = raw_layout.get("groups") if isinstance(raw_layout, dict) else None
    for group in groups if isinstance(groups, list) else ():
        if not isinstance(group, dict):
            continue
        uniform = group.get("uniform")
        members = [group, *(uniform if isinstance(uniform, list) else ())]
        yield from _entry_patterns(members)
    heads = raw_layout.get("layer_kv_heads") if isinstance(raw_layout, dict) else None
    yield from _entry_patterns(heads if isinstance(heads, list) else ())


def _entry_patterns(entries: Iterable[Any]) -> Iterator[str]:
    """The layer-name patterns of raw entries that state ``layers``."""
    for entry in entries:
        layers = entry.get("layers") if isinstance(entry, dict) else None
        if isinstance(layers, str):
            yield layers
        elif isinstance(layers, list):
            yield from (pattern for pattern in layers if isinstance(pattern, str))


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` as an error quotes it: its first ``limit`` characters (a message quoting a megabyte, once
    per alias repeating it, would be a megabyte each)."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def expand_layer_pattern(pattern: str) -> tuple[str, ...]:
    """Expand ``{a..b}`` ranges (inclusive): ``l.{0..2}.attn`` → ``l.0.attn``, ``l.1.attn``, ``l.2.attn``."""
    if "{" not in pattern:  # no range (most names), without the regular expression
        return (pattern,)
    found = _RANGE.search(pattern)
    if not found:
        return (pattern,)
    low, high = int(found.group(1)), int(found.group(2))
    if high < low or high - low > 100_000:
        raise PydanticCustomError("too-large", "layer range {range} is empty or too large", {"range": found.group(0)[:80]})
    length = _expanded_length(pattern)
    if length > MAX_LAYER_NAME_CHARS:  # refused before any is made: each would be refused anyway
        raise PydanticCustomError(
            "too-large", "layer pattern '{pattern}' expands to names of {length} characters; at most {limit} are allowed",
            {"pattern": _excerpt(pattern), "length": length, "limit": MAX_LAYER_NAME_CHARS},
        )
    total = math.prod(int(b) - int(a) + 1 for a, b in _RANGE.findall(pattern))
    if total > 100_001:
        raise PydanticCustomError(
            "too-large", "layer pattern '{pattern}' expands to {total} names; at most 100001 are allowed",
            {"pattern": _excerpt(pattern), "total": total},
        )
    head, tail = pattern[: found.start()], pattern[found.end() :]
    return tuple(name for index in range(low, high + 1) for name in expand_layer_pattern(f"{head}{index}{tail}"))


class FieldExpression(StrictModel):
    """A spec field whose value depends on the topology, written ``{expr: "32 // tp_size"}``."""

    expr: ExpressionText
    """Expression for the field's value on one TP rank; reads the topology variables, ``block_size``
    and ``page_size_bytes``."""


def _field_value(value: Any) -> Any:
    """A spec field's value: a scalar, ``{expr: ...}``, or a list (whose ``{expr: ...}`` mappings
    become expressions; other mappings in a list stay mappings, as a plugin's fields may hold them);
    one clear error for anything else."""
    if value is None or isinstance(value, (bool, int, str, FieldExpression)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_list_item(item) for item in value)
    if isinstance(value, Mapping):
        if set(value) != {"expr"}:
            keys = ", ".join(_excerpt(repr(key), 40) for key in itertools.islice(value, 5))
            raise ValueError(
                f"a mapping as a field value must be {{expr: EXPRESSION}} (a value that depends on the topology), "
                f"not one with keys {keys}"
            )
        expression = value["expr"]
        if isinstance(expression, bool) or not isinstance(expression, (int, str)):
            raise ValueError(f"'expr' must be an expression string, got {type(expression).__name__}")
        return FieldExpression(expr=_parse_expression(expression))
    raise _invalid(f"expected an integer, boolean, string, null, list or {{expr: ...}}, got {type(value).__name__}")


def _list_item(item: Any) -> Any:
    if isinstance(item, (list, tuple)):
        return tuple(_list_item(inner) for inner in item)
    if isinstance(item, Mapping) and set(item) == {"expr"}:
        return _field_value(item)
    return item


FieldValue = Annotated[
    Any,
    PlainValidator(_field_value),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": ["integer", "boolean", "string", "null"]},
                {"type": "array"},
                {
                    "type": "object",
                    "properties": {"expr": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
                    "required": ["expr"],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]
"""A spec field's value as a document writes it: a scalar, ``{expr: ...}``, or a list of these (and
of lists); once loaded, its lists are tuples (:func:`deep_frozen`)."""

_BLOCK_SIZE_READS = frozenset(TOPOLOGY_VARIABLES)
_PAGE_SIZE_READS = _BLOCK_SIZE_READS | {"block_size"}
_FIELD_READS = _BLOCK_SIZE_READS | frozenset(SPEC_VARIABLES)


def field_expressions(value: Any) -> Iterator[Expression]:
    """The expressions in a spec field's value (a :class:`FieldExpression`, or a list holding some)."""
    if isinstance(value, FieldExpression):
        yield value.expr
    elif isinstance(value, tuple):
        for item in value:
            yield from field_expressions(item)


def _evaluated_field(value: Any, variables: Mapping[str, Any]) -> Any:
    if isinstance(value, FieldExpression):
        return value.expr.evaluate(variables)
    if isinstance(value, tuple):
        return tuple(_evaluated_field(item, variables) for item in value)
    return value


@dataclasses.dataclass(frozen=True)
class SpecValues:
    """A :class:`Spec` at one topology: every expression evaluated to one rank's value."""

    type: str
    classes: tuple[str, ...]
    """The class and its bases, most specific first."""
    block_size: int
    page_size_bytes: int
    fields: FrozenMapping[str, Any]


class Spec(StrictModel):
    """One KV-cache spec as vLLM reports it for a layer on one TP rank."""

    type: str = Field(min_length=1)
    """Spec class name, e.g. ``MLAAttentionSpec``."""
    bases: tuple[str, ...] = ()
    """Base class names from the class's MRO, most specific first, without ``object``."""
    block_size: ExpressionText
    """Tokens per block: an integer, or an expression over the topology where the block size changes
    with it (a hybrid model's, which vLLM aligns to one rank's state size)."""
    page_size_bytes: ExpressionText
    """Bytes one block occupies on one TP rank: an integer or an expression over the topology and
    ``block_size``."""
    fields: FrozenMapping[str, FieldValue] = Field(default_factory=FrozenMapping)
    """Other dataclass fields of the spec, one rank's values; ``{expr: ...}`` for one that depends on
    the topology. None may be named like a topology variable, ``block_size`` or ``page_size_bytes``,
    which expressions read from elsewhere."""

    @field_validator("block_size")
    @classmethod
    def _block_size_reads_the_topology(cls, block_size: Expression) -> Expression:
        _check_reads(block_size, _BLOCK_SIZE_READS)
        if not block_size.names:
            value = block_size.evaluate({})
            if type(value) is not int or value < 1:
                raise ValueError(f"must be a positive number of tokens, got '{block_size.source}' = {value!r}")
        return block_size

    @field_validator("page_size_bytes")
    @classmethod
    def _page_size_reads_the_topology(cls, page_size: Expression) -> Expression:
        _check_reads(page_size, _PAGE_SIZE_READS)
        return page_size

    @model_validator(mode="after")
    def _constant_values_are_valid(self) -> Spec:
        """What reads no topology variable has its value at every topology: judged here, where it
        stands, not at the first plan (a ``page_size_bytes`` of ``-1``, a field ``{expr: 1 // 0}``)."""
        if self.block_size.names:
            return self
        constants: dict[str, Any] = {"block_size": self.block_size.evaluate({})}
        errors: list[InitErrorDetails] = []
        page_size = self.page_size_bytes
        if page_size.names <= constants.keys():
            try:
                value = page_size.evaluate(constants)
                if type(value) is not int or value < 0:
                    raise ExpressionError(f"'{page_size.source}' is {value!r}, not a byte count")
                constants["page_size_bytes"] = value
            except ExpressionError as error:
                errors.append(_located_error("invalid-value", ("page_size_bytes",), page_size.source, error))
        for name, value in self.fields.items():
            for expression in field_expressions(value):
                if len(errors) >= 100 or not expression.names <= constants.keys():
                    continue
                try:
                    expression.evaluate(constants)
                except ExpressionError as error:
                    if isinstance(value, FieldExpression):  # at the character, in the expression
                        where: tuple[str, ...] = ("fields", name, "expr")
                        error = ExpressionError(f"field '{name}': {error.message}", error.column)
                    else:  # in a list: at the field (an item's index is not its place in nested lists)
                        where, error = ("fields", name), ExpressionError(error.message)
                    errors.append(_located_error("invalid-value", where, expression.source, error))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    @field_validator("fields", mode="after")
    @classmethod
    def _field_expressions_read_the_topology(
        cls, fields: FrozenMapping[str, FieldValue]
    ) -> FrozenMapping[str, FieldValue]:
        for value in fields.values():
            if isinstance(value, (FieldExpression, tuple)):  # the others hold no expression
                for expression in field_expressions(value):
                    _check_reads(expression, _FIELD_READS)
        return fields

    def evaluate(self, topology_variables: Mapping[str, Any]) -> SpecValues:
        """This spec on one rank of the topology ``topology_variables`` describes. Raises
        :class:`ExpressionError`, naming the attribute, when an expression fails or gives no size."""
        block_size = _size("block_size", self.block_size, topology_variables, minimum=1)
        variables = {**topology_variables, "block_size": block_size}
        page_size = _size("page_size_bytes", self.page_size_bytes, variables, minimum=0)
        variables["page_size_bytes"] = page_size
        fields: dict[str, Any] = {}
        for name, value in self.fields.items():
            try:
                fields[name] = _evaluated_field(value, variables)
            except ExpressionError as error:
                if isinstance(value, FieldExpression):
                    raise SpecExpressionError(f"field '{name}': {error.message}", error.column, ("fields", name, "expr")) from None
                raise SpecExpressionError(f"field '{name}': {error.message}", 0, ("fields", name)) from None
        return SpecValues(self.type, self.classes, block_size, page_size, FrozenMapping(fields))

    @field_validator("fields")
    @classmethod
    def _no_shadowing(cls, fields: FrozenMapping[str, FieldValue]) -> FrozenMapping[str, FieldValue]:
        reserved = [name for name in fields if name in RESERVED_FIELD_NAMES]
        if reserved:
            raise ValueError(
                f"spec field '{reserved[0]}' would shadow the variable expressions read as '{reserved[0]}'; "
                "remove it (block_size and page_size_bytes belong beside 'fields', topology variables come from the topology)"
            )
        return fields

    @property
    def classes(self) -> tuple[str, ...]:
        """The class and its bases, most specific first."""
        return (self.type, *self.bases)

    def exact_key(self) -> tuple[str, tuple[str, ...], str, str, str]:
        """A key two specs share only when they state exactly the same, for caching what a spec
        gives: ``==`` takes a field's ``true`` for ``1`` or ``1.0``, ``-0.0`` for ``0.0`` and fields in
        any order for the same, which a plan does not (its fingerprint, a rule's reasons). The fields
        by their ``repr``, which spells every value a document holds (scalars, tuples, mappings,
        expressions) unambiguously."""
        fields = self.fields
        spelled = repr(fields._items if type(fields) is FrozenMapping else fields)
        return (self.type, self.bases, self.block_size.source, self.page_size_bytes.source, spelled)


def _check_reads(expression: Expression, known: frozenset[str]) -> None:
    _reads_only(expression.source, known)


@functools.lru_cache(maxsize=4096)
def _reads_only(source: str, known: frozenset[str]) -> None:
    """Refuse an expression reading a variable outside ``known``; remembered per text when it reads
    none (a layout states the same few expressions in every group)."""
    try:
        shared_expression(source).check_names(known)
    except ExpressionError as error:
        raise ValueError(error.message) from error


class SpecExpressionError(ExpressionError):
    """An expression of a spec that fails at one topology (:meth:`Spec.evaluate`), knowing which:
    ``attribute`` is its place in the spec (``("page_size_bytes",)``, ``("fields", "x", "expr")``),
    so that the plan's refusal can point at it in the layout's file."""

    def __init__(self, message: str, column: int, attribute: tuple[str, ...]) -> None:
        super().__init__(message, column)
        self.attribute = attribute


def _size(name: str, expression: Expression, variables: Mapping[str, Any], *, minimum: int) -> int:
    try:
        value = expression.evaluate(variables)
    except ExpressionError as error:
        raise SpecExpressionError(f"{name}: {error.message}", error.column, (name,)) from None
    if type(value) is not int or value < minimum:
        raise SpecExpressionError(
            f"{name} '{expression.source}' is {value!r}, not "
            + ("a positive number of tokens" if minimum else "a byte count"),
            0,
            (name,),
        )
    return value


class LayerSpecs(StrictModel):
    """Layers that share one spec."""

    spec: Spec
    """The spec of these layers."""
    layers: LayerNames = Field(min_length=1)
    """Layer names (one, or a list); ``{a..b}`` expands to the integers a through b."""

    @field_validator("layers", mode="before")
    @classmethod
    def _expand(cls, layers: Any) -> Any:
        layers = _as_tuple(layers)
        if not isinstance(layers, (list, tuple)):
            return layers
        ranges = False
        for name in layers:
            if not isinstance(name, str):
                return layers
            ranges = ranges or "{" in name
        if not ranges:  # each name is its own expansion
            return tuple(layers)
        return tuple(name for pattern in layers for name in expand_layer_pattern(pattern))


class Member(NamedTuple):
    """Layers of a group that share one spec (:attr:`Group.members`): a named tuple, not a model,
    since both parts were validated with the group, and a plan reads a member of every group."""

    spec: Spec
    layers: tuple[str, ...]


class Group(StrictModel):
    """One prefix-cacheable KV-cache group: either one spec for its layers, or ``uniform`` per-layer specs."""

    name: str | None = None
    """Short name shown in plans."""
    spec: Spec | None = None
    """The group's spec, when all its layers share one."""
    layers: LayerNames | None = None
    """Layer names (one, or a list) when ``spec`` is given; ``{a..b}`` expands to the integers a through b."""
    uniform: tuple[LayerSpecs, ...] | None = None
    """Per-layer specs of a ``UniformTypeKVCacheSpecs`` group."""

    _expand = field_validator("layers", mode="before")(LayerSpecs._expand.__func__)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _one_shape(self) -> Group:
        if self.uniform is not None:
            if self.spec is not None or self.layers is not None:
                raise _invalid("a group has either 'spec' and 'layers', or 'uniform', not both")
            if not self.uniform:
                raise _invalid("'uniform' needs at least one entry")
        elif self.spec is None or not self.layers:
            raise _invalid("a group needs 'spec' and 'layers', or 'uniform'")
        return self

    @cached_property
    def members(self) -> tuple[Member, ...]:
        """The group as (spec, layers) entries: one for a plain group, several for a uniform one."""
        if self.uniform is not None:
            return tuple(Member(member.spec, member.layers) for member in self.uniform)
        assert self.spec is not None and self.layers is not None
        return (Member(self.spec, self.layers),)

    @property
    def is_uniform(self) -> bool:
        return self.uniform is not None


class _CloseNames:
    """Did-you-mean hints for unknown layer names, bounded: a few hints, each against at most
    ``MAX_CANDIDATES`` names, so a layout naming thousands of unknown layers is judged in milliseconds."""

    MAX_HINTS = 5
    MAX_CANDIDATES = 2_000

    def __init__(self, names: Iterable[str]) -> None:
        self._candidates = list(itertools.islice(names, self.MAX_CANDIDATES))
        self._left = self.MAX_HINTS

    def closest(self, name: str) -> str | None:
        if self._left == 0:
            return None
        self._left -= 1
        close = difflib.get_close_matches(name, self._candidates, n=1)
        return close[0] if close else None


class LayerHeads(StrictModel):
    """Layers whose own KV heads differ from the model-wide ``total_num_kv_heads``."""

    total_num_kv_heads: int = Field(ge=1, le=MAX_INT, strict=True)
    """The KV heads of each of these layers, over all TP ranks (vLLM's
    ``model_config.model_arch_config[layer_index].total_num_kv_heads``)."""
    layers: LayerNames = Field(min_length=1)
    """Layer names (one, or a list); ``{a..b}`` expands to the integers a through b."""

    _expand = field_validator("layers", mode="before")(LayerSpecs._expand.__func__)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, eq=False)
class _SourceOrigins:
    """Where a document's parts stand in the file it was read from: not part of what the document
    is, so any two compare equal (a layout read from one file equals the same layout read from
    another, or dumped and read back)."""

    origins: Mapping[tuple[int, int, tuple[str, ...]], str]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SourceOrigins)

    def __hash__(self) -> int:
        return 0


class Layout(StrictModel):
    """A model's prefix-cacheable KV-cache groups, as vLLM builds them."""

    version: DocumentVersion
    """Document format version."""
    kind: Literal["ModelLayout"]
    """Document kind; tells layouts and policies apart."""
    model: str = Field(min_length=1, max_length=1000)
    """Model name or path; keys use its last path component."""
    description: str = ""
    """What is special about this model's cache."""
    source: FrozenMapping[str, Any] = Field(default_factory=FrozenMapping)
    """Config fields this layout was derived from, and their values."""
    total_num_kv_heads: int = Field(ge=0, le=MAX_INT, strict=True)
    """Model-wide number of KV heads (vLLM's ``model_config.get_total_num_kv_heads()``); 0 for an
    attention-free model (``mamba``, ``mamba2``, ``falcon_mamba``), which then has no attention group."""
    layer_kv_heads: tuple[LayerHeads, ...] = ()
    """Attention layers whose own KV heads differ from ``total_num_kv_heads``: vLLM keeps such values
    per layer (Gemma-4's full-attention layers, each Nemotron-NAS block) and reports the largest
    (or, for Nemotron-NAS, the first block's) as the model-wide value. Rules read a layer's own
    count as ``total_num_kv_heads`` and the model-wide one as ``model_total_num_kv_heads``."""
    kv_cache_layout: KVCacheLayoutName | None = None
    """The ``KVCacheLayout`` the engine resolved for its attention backend (vLLM's CPU backend:
    ``LBHNC``), set when the layout is captured from an engine. It orders the bytes of a stored block,
    so the plan fingerprint covers it; unknown (omitted) in a hand-written layout."""
    groups: tuple[Group, ...] = Field(min_length=1)
    """Groups in vLLM's order; a group's index is its position in this list."""

    _spec_origins: _SourceOrigins = PrivateAttr(default_factory=lambda: _SourceOrigins({}))

    def spec_origin(self, group: int, member: int, attribute: tuple[str, ...], offset: int = 0) -> str | None:
        """``file:line:col`` of an expression of member ``member`` of group ``group``'s spec
        (``attribute`` as :class:`SpecExpressionError` names it), ``offset`` characters into it, when
        the layout was loaded from a file and the expression reads the topology; else None."""
        found = self._spec_origins.origins.get((group, member, attribute))
        if found is None:
            return None
        path_line, _, start = found.rpartition(":")
        return f"{path_line}:{int(start) + offset}"

    def with_spec_origins(self, origins: Mapping[tuple[int, int, tuple[str, ...]], str]) -> Layout:
        """This layout, knowing where the expressions of its specs that read the topology stand
        (``file:line:col`` by group, member and attribute) in the file it was loaded from."""
        copy = self.model_copy()
        copy._spec_origins = _SourceOrigins(dict(origins))
        return copy

    @model_validator(mode="before")
    @classmethod
    def _bounded_expansion(cls, data: Any) -> Any:
        # Checked on the raw patterns, before any is expanded: each pattern is bounded on its own,
        # but a few hundred bytes of ranges could still ask for millions of names in total.
        total = characters = 0
        for pattern in _layer_patterns(data):
            count = _expanded_count(pattern)
            total += count
            characters += count * _expanded_length(pattern)
        if total > MAX_LAYOUT_LAYERS:
            raise PydanticCustomError(
                "too-large", "the layer names expand to {total} layers; a layout may have at most {limit}",
                {"total": total, "limit": MAX_LAYOUT_LAYERS},
            )
        if characters > MAX_LAYOUT_NAME_CHARS:
            raise PydanticCustomError(
                "too-large",
                "the layer names expand to {characters} characters; a layout's layer names may have at most {limit}",
                {"characters": characters, "limit": MAX_LAYOUT_NAME_CHARS},
            )
        return data

    @model_validator(mode="after")
    def _each_layer_in_one_group(self) -> Layout:
        first_seen: dict[str, int] = {}
        spec_of: dict[str, Spec] = {}
        errors: list[InitErrorDetails] = []
        for group_index, group in enumerate(self.groups):
            for member_index, member in enumerate(group.members):
                location = ("groups", group_index, "layers") if group.uniform is None else (
                    "groups", group_index, "uniform", member_index, "layers"
                )
                for layer in member.layers:
                    if layer in first_seen and len(errors) < 100:
                        message = f"layer '{layer}' is already in group {first_seen[layer]}; a layer belongs to one group"
                        errors.append(
                            InitErrorDetails(
                                type=PydanticCustomError("duplicate-layer", "{message}", {"message": message}),
                                loc=location,
                                input=layer,
                            )
                        )
                    first_seen.setdefault(layer, group_index)
                    spec_of.setdefault(layer, member.spec)
        hints = _CloseNames(first_seen)
        for entry_index, entry in enumerate(self.layer_kv_heads):
            for layer in entry.layers:
                if len(errors) >= 100:
                    break
                location = ("layer_kv_heads", entry_index, "layers")
                problem = self._layer_heads_problem(layer, spec_of, entry_index, hints)
                if problem is not None:
                    errors.append(
                        InitErrorDetails(
                            type=PydanticCustomError("layer-kv-heads", "{message}", {"message": problem}),
                            loc=location,
                            input=layer,
                        )
                    )
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _layer_heads_problem(
        self, layer: str, spec_of: Mapping[str, Spec], entry_index: int, hints: _CloseNames
    ) -> str | None:
        """Why ``layer`` cannot have its own KV heads, or None."""
        spec = spec_of.get(layer)
        if spec is None:
            close = hints.closest(layer)
            hint = f"; did you mean '{close}'?" if close else "; name a layer of one of the groups"
            return f"layer '{layer}' is in no group{hint}"
        first = self._layer_heads_entry.get(layer)
        if first != entry_index:
            return f"layer '{layer}' already has its KV heads in layer_kv_heads entry {first}; a layer has one count"
        if not ("AttentionSpec" in spec.classes or is_subclass(spec.type, "AttentionSpec")):
            return f"layer '{layer}' holds {spec.type}, which has no KV heads; remove it from layer_kv_heads"
        return None

    @cached_property
    def _layer_heads_entry(self) -> dict[str, int]:
        """The first ``layer_kv_heads`` entry naming each layer."""
        first: dict[str, int] = {}
        for index, entry in enumerate(self.layer_kv_heads):
            for layer in entry.layers:
                first.setdefault(layer, index)
        return first

    @cached_property
    def kv_heads_by_layer(self) -> Mapping[str, int]:
        """Each layer whose own KV heads differ from ``total_num_kv_heads``, with its count."""
        return MappingProxyType(
            {
                layer: entry.total_num_kv_heads
                for entry in self.layer_kv_heads
                for layer in entry.layers
                if entry.total_num_kv_heads != self.total_num_kv_heads
            }
        )

    def layer_total_num_kv_heads(self, layer: str) -> int:
        """The KV heads of ``layer``: its ``layer_kv_heads`` entry, else the model-wide value."""
        return self.kv_heads_by_layer.get(layer, self.total_num_kv_heads)

    @field_validator("groups")
    @classmethod
    def _heads_for_attention(cls, groups: tuple[Group, ...], info: ValidationInfo) -> tuple[Group, ...]:
        if info.data.get("total_num_kv_heads", 1):
            return groups
        for index, group in enumerate(groups):
            for member in group.members:
                if "AttentionSpec" in member.spec.classes or is_subclass(member.spec.type, "AttentionSpec"):
                    raise ValueError(
                        f"total_num_kv_heads is 0 (an attention-free model) but group {index} holds attention "
                        f"({member.spec.type}); set the model's KV-head count"
                    )
        return groups


class Topology(StrictModel):
    """The parallel layout of one vLLM instance."""

    tp_size: int = Field(default=1, ge=1, le=4096, strict=True)
    """Tensor-parallel size."""
    pp_size: int = Field(default=1, ge=1, le=4096, strict=True)
    """Pipeline-parallel size."""
    pcp_size: int = Field(default=1, ge=1, le=4096, strict=True)
    """Prefill context-parallel size."""
    dcp_size: int = Field(default=1, ge=1, le=4096, strict=True)
    """Decode context-parallel size: a subdivision of TP, or with PCP the PCP axis or all of TP x PCP."""

    @model_validator(mode="after")
    def _dcp_as_vllm_allows(self) -> Topology:
        tp, pcp, dcp = self.tp_size, self.pcp_size, self.dcp_size
        if pcp == 1 and tp % dcp:
            raise ValueError(f"dcp_size {dcp} must divide tp_size {tp} (vLLM's DCP reuses the TP ranks)")
        if pcp > 1 and dcp not in (1, pcp, tp * pcp):
            raise ValueError(
                f"with pcp_size {pcp}, vLLM allows dcp_size 1, {pcp} (the PCP axis) or {tp * pcp} (all of TP x PCP); "
                f"got {dcp}"
            )
        return self

    def dcp_rank(self, tp_rank: int, pcp_rank: int = 0) -> int:
        """vLLM's DCP rank of a worker (``get_dcp_group().rank_in_group``): its ranks are laid out
        [pp, pcp, tp] and DCP groups run over the PCP axis first, then TP. Without PCP that is
        ``tp_rank % dcp_size``; spanning PCP, ``pcp_rank``; spanning TP x PCP, ``tp_rank * pcp_size + pcp_rank``."""
        if self.dcp_size == 1:
            return 0
        if self.pcp_size == 1:
            return tp_rank % self.dcp_size
        if self.dcp_size == self.pcp_size:
            return pcp_rank
        return tp_rank * self.pcp_size + pcp_rank


def topology_variables(
    topology: Topology, total_num_kv_heads: int, model_total_num_kv_heads: int | None = None
) -> dict[str, int]:
    """The :data:`TOPOLOGY_VARIABLES` an expression reads at ``topology``, for a layer of
    ``total_num_kv_heads`` KV heads in a model of ``model_total_num_kv_heads`` (None: the same)."""
    return {
        "tp_size": topology.tp_size,
        "pp_size": topology.pp_size,
        "pcp_size": topology.pcp_size,
        "dcp_size": topology.dcp_size,
        "total_num_kv_heads": total_num_kv_heads,
        "model_total_num_kv_heads": total_num_kv_heads if model_total_num_kv_heads is None else model_total_num_kv_heads,
    }
