"""Validation's shortcuts against what they replace: freezing a free-form value in one walk, layer
names without ranges, one shared instance per expression text, a mapping's own views, and the exact
key a plan caches a spec by. Each gives what the plain way gives, refusal messages included."""

from __future__ import annotations

import datetime
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from core_support import MODEL, mamba
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pydantic_core import PydanticCustomError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fuzz_strategies as fs

from kvpolicy.language.expressions import MAX_INT, Expression, ExpressionError, shared_expression
from kvpolicy.language.models import MAX_VALUE_DEPTH, FrozenMapping, Layout, Spec, expand_layer_pattern

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- freezing a free-form value: one walk, the checks of two -------------------------------------


def reference_readable(value: Any, depth: int = 0) -> None:
    """The check before the one-walk freeze, as it was."""
    if depth > MAX_VALUE_DEPTH:
        raise ValueError(f"values are nested deeper than {MAX_VALUE_DEPTH} levels")
    if type(value) is int and abs(value) > MAX_INT:
        raise ValueError(f"an integer of {value.bit_length()} bits is too large; integers are at most 2**63 - 1")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                message = f"mapping keys must be strings, got {type(key).__name__} {str(key)[:40]!r}"
                raise ValueError(message)  # not TypeError: as the models raise it
            reference_readable(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            reference_readable(item, depth + 1)


def reference_frozen(items: dict[str, Any]) -> str:
    """``repr`` of the frozen value, or the refusal, as the two steps gave them."""
    try:
        reference_readable(items)
        frozen = FrozenMapping(items)
        try:
            hash(frozen)
        except TypeError as error:
            raise ValueError(f"values must be scalars, lists or mappings ({error})") from None
    except ValueError as error:
        return f"refused: {error}"
    return repr(frozen)


def frozen_by_validation(items: dict[str, Any]) -> str:
    document = {
        "version": 1, "kind": "ModelLayout", "model": MODEL, "source": items, "total_num_kv_heads": 1,
        "groups": [{"spec": mamba(), "layers": ["l.0.mixer"]}],
    }
    try:
        return repr(Layout.model_validate(document).source)
    except ValidationError as error:
        (item,) = [item for item in error.errors(include_url=False) if item["loc"][:1] == ("source",)]
        return "refused: " + item["msg"].removeprefix("Value error, ")


def nested(depth: int, leaf: Any, *, as_dict: bool) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf} if as_dict else [leaf]
    return leaf


unusual = st.sampled_from([
    {1, 2}, frozenset({3}), b"bytes", bytearray(b"x"), datetime.date(2001, 12, 14), (1, [2, {"a": 3}]),
    FrozenMapping({"a": [1]}), {1: "int key"}, {None: 1}, 2**63, -(2**63), 2**63 - 1, True, 1.5, math.nan,
])
values = st.recursive(
    st.one_of(fs.scalars(), unusual),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)), children, max_size=4),
    ),
    max_leaves=16,
)


@PROPERTY
@given(st.dictionaries(st.text(max_size=6), values, max_size=5))
def test_a_free_form_value_is_frozen_or_refused_as_by_the_two_steps(items: dict[str, Any]) -> None:
    assert frozen_by_validation(items) == reference_frozen(items)


@pytest.mark.parametrize("depth", [MAX_VALUE_DEPTH - 2, MAX_VALUE_DEPTH - 1, MAX_VALUE_DEPTH, MAX_VALUE_DEPTH + 1])
@pytest.mark.parametrize("leaf", [1, "s", None, 2**64, [], {}, {"x": [1, 2]}, {3: 1}, {1, 2}])
@pytest.mark.parametrize("as_dict", [True, False])
def test_values_at_the_depth_limit_are_judged_as_by_the_two_steps(depth: int, leaf: Any, as_dict: bool) -> None:
    items = {"k": nested(depth, leaf, as_dict=as_dict)}
    assert frozen_by_validation(items) == reference_frozen(items)


def test_the_first_refusal_in_document_order_is_the_one_reported() -> None:
    items = {"a": [1, {"b": 2**70}], "c": {5: 1}, "d": nested(80, 1, as_dict=False)}
    assert frozen_by_validation(items) == reference_frozen(items) == (
        "refused: an integer of 71 bits is too large; integers are at most 2**63 - 1"
    )


# --- layer names ---------------------------------------------------------------------------------

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def reference_expanded(pattern: str) -> tuple[str, ...] | str:
    """``expand_layer_pattern`` as it was, without the shortcut for names without ranges."""
    found = _RANGE.search(pattern)
    if not found:
        return (pattern,)
    low, high = int(found.group(1)), int(found.group(2))
    if high < low or high - low > 100_000:
        return "too large"
    total = math.prod(int(b) - int(a) + 1 for a, b in _RANGE.findall(pattern))
    if total > 100_001:
        return "too large"
    head, tail = pattern[: found.start()], pattern[found.end() :]
    names: list[str] = []
    for index in range(low, high + 1):
        inner = reference_expanded(f"{head}{index}{tail}")
        if isinstance(inner, str):
            return inner
        names.extend(inner)
    return tuple(names)


@PROPERTY
@given(st.one_of(fs.layer_patterns(), st.text(alphabet="{}.0123abc", max_size=12)))
def test_layer_patterns_expand_as_before(pattern: str) -> None:
    expected = reference_expanded(pattern)
    try:
        found: tuple[str, ...] | str = expand_layer_pattern(pattern)
    except PydanticCustomError:
        found = "too large"
    assert found == expected


# --- expressions: one instance per text ----------------------------------------------------------


@PROPERTY
@given(fs.expressions())
def test_a_shared_expression_is_the_expression_of_its_text(source: str) -> None:
    try:
        own = Expression(source)
    except ExpressionError as error:
        with pytest.raises(ExpressionError) as shared_error:
            shared_expression(source)
        assert (shared_error.value.message, shared_error.value.column) == (error.message, error.column)
        return
    shared = shared_expression(source)
    assert shared == own and shared is shared_expression(source) and shared.names == own.names
    try:
        expected: Any = own.evaluate(fs.TOPOLOGY)
    except ExpressionError as error:
        expected = ("error", error.message)
    try:
        found: Any = shared.evaluate(fs.TOPOLOGY)
    except ExpressionError as error:
        found = ("error", error.message)
    assert found == expected


def test_validated_documents_share_their_expressions() -> None:
    first, second = (Spec.model_validate(mamba(page_size_bytes="4096 // tp_size")) for _ in range(2))
    assert first.page_size_bytes is second.page_size_bytes


# --- a frozen mapping's views ---------------------------------------------------------------------


def test_a_frozen_mappings_views_are_its_items_and_change_nothing() -> None:
    mapping = FrozenMapping({"b": [1, 2], "a": {"c": None}})
    assert list(mapping.keys()) == ["b", "a"] and list(mapping.values()) == [(1, 2), FrozenMapping({"c": None})]
    assert list(mapping.items()) == list(zip(mapping.keys(), mapping.values(), strict=True))
    assert mapping.items() == {("b", (1, 2)), ("a", FrozenMapping({"c": None}))}  # still set-like
    for view in (mapping.keys(), mapping.values(), mapping.items()):
        assert not any(hasattr(view, name) for name in ("add", "remove", "pop", "clear", "update", "__setitem__"))
    assert mapping == {"a": {"c": None}, "b": (1, 2)} and hash(mapping) == hash(FrozenMapping({"a": {"c": None}, "b": [1, 2]}))


# --- the exact key of a spec ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"tp_replicated": True}, {"tp_replicated": 1}),
        ({"shapes": [[1.0]]}, {"shapes": [[1]]}),
        ({"shapes": [[-0.0]]}, {"shapes": [[0.0]]}),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({"dtype": "1"}, {"dtype": 1}),
        ({"shapes": [datetime.datetime(2001, 1, 1, 5, tzinfo=datetime.UTC)]},
         {"shapes": [datetime.datetime(2001, 1, 1, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=-5)))]}),
        ({"max_tp_shards": {"expr": "tp_size"}}, {"max_tp_shards": {"expr": " tp_size"}}),
    ],
)
def test_specs_equal_by_eq_but_not_the_same_have_different_exact_keys(first: dict[str, Any], second: dict[str, Any]) -> None:
    a, b = Spec.model_validate(mamba(**first)), Spec.model_validate(mamba(**second))
    assert a.exact_key() != b.exact_key()


@PROPERTY
@given(st.dictionaries(st.sampled_from(("a", "b", "shapes")), fs.yaml_values(6), max_size=3))
def test_specs_share_an_exact_key_only_when_their_values_are_spelled_alike(fields: dict[str, Any]) -> None:
    try:
        spec = Spec.model_validate(mamba(**fields))
    except ValidationError:
        return
    again = Spec.model_validate(mamba(**fields))
    assert spec.exact_key() == again.exact_key()
    assert spec.exact_key()[-1] == repr(dict(spec.fields))


def group_layers(patterns: list[str]) -> tuple[str, ...] | str:
    document = {
        "version": 1, "kind": "ModelLayout", "model": MODEL, "total_num_kv_heads": 1,
        "groups": [{"spec": mamba(), "layers": patterns}],
    }
    try:
        return Layout.model_validate(document).groups[0].layers
    except ValidationError:
        return "refused"


@PROPERTY
@given(st.lists(st.one_of(fs.layer_patterns(), st.text(alphabet="{}.0123abl", max_size=10)), min_size=1, max_size=4))
def test_a_groups_layer_names_expand_as_each_name_does(patterns: list[str]) -> None:
    expanded = [reference_expanded(pattern) for pattern in patterns]
    found = group_layers(patterns)
    if any(isinstance(names, str) for names in expanded):
        assert found == "refused"
        return
    names = tuple(name for group in expanded for name in group)
    # Refused for another reason (an empty name, a name twice): so are the names written out.
    assert found == names or found == group_layers(list(names)) == "refused"


@pytest.mark.parametrize("field", ["block_size", "page_size_bytes"])
def test_an_expression_reading_an_unknown_variable_is_refused_every_time(field: str) -> None:
    # Expressions that read known variables are remembered per text; refusals are not.
    for _ in range(3):
        with pytest.raises(ValidationError, match="unknown variable 'tp_sise'; did you mean 'tp_size'"):
            Spec.model_validate({**mamba(), field: "max(1, 16 // tp_sise)"})
        assert Spec.model_validate({**mamba(), field: "max(1, 16 // tp_size)"})
    with pytest.raises(ValidationError, match="unknown variable 'head_size'"):
        Spec.model_validate({**mamba(), "fields": {"x": {"expr": "head_size"}}})  # fields read the topology only
