"""The policy expression language: what it computes, what it refuses, and where it says the problem is."""

from __future__ import annotations

import functools
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.language.expressions import MAX_DEPTH, MAX_INT, MAX_SOURCE_LENGTH, Expression, ExpressionError

TOPOLOGY = {"tp_size": 8, "pp_size": 2, "pcp_size": 1, "dcp_size": 1, "total_num_kv_heads": 2}


def evaluate(source: str, **variables: object) -> object:
    return Expression(source).evaluate({**TOPOLOGY, **variables})


def error_of(source: str, **variables: object) -> ExpressionError:
    with pytest.raises(ExpressionError) as caught:
        evaluate(source, **variables)
    return caught.value


# --- what it computes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("tp_size - 10", -2),
        ("7 // 2", 3),
        ("-7 // 2", -4),  # floor division, as in Python
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("-tp_size", -8),
        ("+tp_size", 8),
        ("tp_size // total_num_kv_heads", 4),
    ],
)
def test_integer_arithmetic(source, expected):
    assert evaluate(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("tp_size > 4", True),
        ("tp_size < 4", False),
        ("tp_size >= 8", True),
        ("tp_size <= 7", False),
        ("tp_size == 8", True),
        ("tp_size != 8", False),
        ("1 < tp_size <= 8", True),  # chained, as in Python
        ("1 < tp_size < 8", False),
    ],
)
def test_comparison(source, expected):
    assert evaluate(source) is expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("tp_size == 8 and dcp_size == 1", True),
        ("tp_size == 8 and dcp_size > 1", False),
        ("dcp_size > 1 or pp_size == 2", True),
        ("dcp_size > 1 or pp_size == 1", False),
        ("not dcp_size > 1", True),
        ("not tp_size", False),
    ],
)
def test_boolean_operators(source, expected):
    assert evaluate(source) is expected


def test_boolean_operators_short_circuit():
    # the right operand would divide by zero; it must not be evaluated
    assert evaluate("dcp_size == 1 or tp_size // 0") is True
    assert evaluate("dcp_size > 1 and tp_size // 0") is False


def test_conditional_picks_the_branch_its_test_selects():
    assert evaluate("1 if dcp_size > 1 else tp_size") == 8
    assert evaluate("1 if dcp_size > 1 else tp_size", dcp_size=2) == 1


def test_conditional_evaluates_only_the_chosen_branch():
    assert evaluate("tp_size // 0 if dcp_size > 1 else 3") == 3


@pytest.mark.parametrize(
    ("heads", "expected"),
    [(1, 8), (2, 4), (8, 1), (16, 1)],
)
def test_max_min_compute_the_upstream_head_factor(heads, expected):
    assert evaluate("max(1, tp_size // total_num_kv_heads)", total_num_kv_heads=heads) == expected


def test_min_and_max_take_several_arguments():
    assert evaluate("min(tp_size, 3, 5)") == 3
    assert evaluate("max(tp_size, 3, 50)") == 50


@pytest.mark.parametrize(
    ("source", "max_tp_shards", "expected"),
    [
        ("max_tp_shards is None", None, True),
        ("max_tp_shards is None", 2, False),
        ("max_tp_shards is not None", None, False),
        ("max_tp_shards is not None", 2, True),
        ("max_tp_shards == None", None, True),
    ],
)
def test_none_checks(source, max_tp_shards, expected):
    assert evaluate(source, max_tp_shards=max_tp_shards) is expected


def test_none_guard_lets_the_right_side_use_the_value():
    source = "max_tp_shards is not None and max_tp_shards < tp_size"
    assert evaluate(source, max_tp_shards=None) is False
    assert evaluate(source, max_tp_shards=2) is True


def test_order_comparison_with_none_is_an_error_that_says_what_to_do():
    error = error_of("max_tp_shards < tp_size", max_tp_shards=None)
    assert "is None" in error.message


@pytest.mark.parametrize(
    ("source", "mamba_type", "expected"),
    [
        ("mamba_type == 'mamba2'", "mamba2", True),
        ('mamba_type == "mamba2"', "linear_attention", False),
        ("mamba_type != 'mamba2'", "linear_attention", True),
    ],
)
def test_string_equality(source, mamba_type, expected):
    assert evaluate(source, mamba_type=mamba_type) is expected


def test_comparing_a_string_with_an_integer_by_order_is_an_error():
    error_of("mamba_type < 3", mamba_type="mamba2")


@pytest.mark.parametrize("source", ["True + 1", "-True", "max(1, True)", "'a' * 3", "shapes + 1"])
def test_arithmetic_only_accepts_integers(source):
    error = error_of(source, shapes=(1, 2))
    assert "expected an integer" in error.message


def test_division_by_zero_is_an_expression_error():
    error = error_of("tp_size // (dcp_size - 1)")
    assert "division by zero" in error.message
    error_of("tp_size % (dcp_size - 1)")


def test_integer_literal_factor_is_accepted():
    assert Expression("2").evaluate({}) == 2


# --- what it refuses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("tp_size.bit_length", "attribute access"),
        ("().__class__", "attribute access"),
        ("''.__class__.__mro__", "attribute access"),
        ("shapes[0]", "subscript"),
        ("(lambda: 1)", "Lambda"),
        ("lambda: 1", "Lambda"),
        ("[x for x in shapes]", "ListComp"),
        ("{x for x in shapes}", "SetComp"),
        ("(x for x in shapes)", "GeneratorExp"),
        ("{x: 1 for x in shapes}", "DictComp"),
        ("__import__('os')", "call to '__import__'"),
        ("open('x')", "call to 'open'"),
        ("eval('1')", "call to 'eval'"),
        ("getattr(tp_size, 'real')", "call to 'getattr'"),
        ("tp_size.__add__(1)", "call to"),
        ("max(*shapes)", "positional"),
        ("max(a=1)", "positional"),
        ("max()", "positional"),
        ("9**9", "'**'"),
        ("tp_size / 2", "'/'"),
        ("tp_size << 2", "'<<'"),
        ("tp_size & 1", "'&'"),
        ("~tp_size", "unary"),
        ("1 in shapes", "'in'"),
        ("1 not in shapes", "'in'"),
        ("tp_size is 1", "None"),
        ("(y := 1)", "NamedExpr"),
        ("f'{tp_size}'", "JoinedStr"),
        ("[1, 2]", "List"),
        ("(1, 2)", "Tuple"),
        ("{1: 2}", "Dict"),
        ("1.5", "float"),
        ("1j", "complex"),
        ("b'x'", "bytes"),
        ("...", "Ellipsis"),
        ("max", "function"),
        ("min + 1", "function"),
    ],
)
def test_disallowed_constructs_are_rejected_when_parsed(source, words):
    with pytest.raises(ExpressionError) as caught:
        Expression(source)
    assert words in caught.value.message


@pytest.mark.parametrize("source", ["1 +", "max(1, 2", "tp_size tp_size", "if", "1 if 2"])
def test_syntax_errors_are_expression_errors(source):
    with pytest.raises(ExpressionError) as caught:
        Expression(source)
    assert caught.value.message.startswith("invalid syntax")


def test_multi_line_source_is_rejected():
    with pytest.raises(ExpressionError, match="one line"):
        Expression("1 +\n2")


def test_largest_integer_literal_is_accepted_and_one_more_is_rejected():
    assert Expression(str(2**63 - 1)).evaluate({}) == 2**63 - 1
    with pytest.raises(ExpressionError, match="literal"):
        Expression(str(2**63))


def test_power_is_rejected_even_when_small():
    with pytest.raises(ExpressionError, match=r"\*\*"):
        Expression("2 ** 2")


def test_multiplication_chain_is_bounded():
    eighteen = " * ".join(["10"] * 18)
    assert Expression(eighteen).evaluate({}) == 10**18
    with pytest.raises(ExpressionError, match="exceeds"):
        Expression(" * ".join(["10"] * 19)).evaluate({})


def test_results_beyond_the_bound_are_rejected_for_every_operator():
    big = 2**62
    assert Expression("big + (big - 1)").evaluate({"big": big}) == 2**63 - 1
    for source in ["big + big", "-big - big - 1", "big * 2", "big * -3", "-(0 - big - big)"]:
        with pytest.raises(ExpressionError, match="exceeds"):
            Expression(source).evaluate({"big": big})


def test_oversized_variable_is_rejected():
    with pytest.raises(ExpressionError, match="exceeds"):
        Expression("x").evaluate({"x": 2**64})


def test_nesting_up_to_max_depth_is_accepted():
    # k unary minus signs over a literal make an AST k + 1 levels deep
    source = "-" * (MAX_DEPTH - 1) + "1"
    assert Expression(source).evaluate({}) == (-1) ** (MAX_DEPTH - 1)


def test_nesting_beyond_max_depth_is_rejected():
    with pytest.raises(ExpressionError, match="nested deeper"):
        Expression("-" * MAX_DEPTH + "1")


def test_deep_nested_calls_are_rejected():
    depth = MAX_DEPTH + 1
    source = "max(1, " * depth + "1" + ")" * depth
    with pytest.raises(ExpressionError, match="nested deeper"):
        Expression(source)


@pytest.mark.parametrize(
    "source",
    [
        "(" * 300 + "1" + ")" * 300,
        "[" * 400,
        "not " * 240 + "1",
        "-" * 999 + "1",
    ],
)
def test_pathological_nesting_is_an_expression_error_not_a_crash(source):
    with pytest.raises(ExpressionError):
        Expression(source)


def test_source_of_max_length_is_accepted():
    name = "x" * MAX_SOURCE_LENGTH
    assert Expression(name).evaluate({name: 3}) == 3


def test_source_longer_than_max_length_is_rejected():
    with pytest.raises(ExpressionError, match="longer than"):
        Expression("x" * (MAX_SOURCE_LENGTH + 1))


# --- names -------------------------------------------------------------------------------------


def test_unknown_variable_at_evaluation_suggests_the_close_name():
    error = error_of("1 + tp_sise")
    assert "unknown variable 'tp_sise'" in error.message
    assert "did you mean 'tp_size'" in error.message
    assert error.column == 4


def test_unknown_variable_without_a_close_name_has_no_suggestion():
    error = error_of("zzzzqqq")
    assert "unknown variable 'zzzzqqq'" in error.message
    assert "did you mean" not in error.message


def test_check_names_reports_the_unknown_variable_with_column_and_suggestion():
    with pytest.raises(ExpressionError) as caught:
        Expression("max(1, tp_size // total_num_kv_head)").check_names(TOPOLOGY)
    assert "unknown variable 'total_num_kv_head'" in caught.value.message
    assert "did you mean 'total_num_kv_heads'" in caught.value.message
    assert caught.value.column == len("max(1, tp_size // ")


def test_check_names_accepts_known_variables_and_function_names():
    Expression("max(1, tp_size // total_num_kv_heads)").check_names(TOPOLOGY)


def test_names_lists_the_variables_read():
    assert Expression("max(1, tp_size // x) if y is None else z").names == {"tp_size", "x", "y", "z"}


# --- columns -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "offending"),
    [
        ("tp_size + foo.bar", "foo.bar"),
        ("max(1, shapes[0])", "shapes[0]"),
        ("1 + 2 ** 3", "2 ** 3"),
        ("min(1, open('x'))", "open('x')"),
        ("tp_size == 1 or 1.5", "1.5"),
        ("mamba_type == 'ä' and foo.bar", "foo.bar"),  # columns count characters, not UTF-8 bytes
        ("   tp_size + foo.bar", "foo.bar"),  # leading blanks count
    ],
)
def test_parse_errors_carry_the_column_of_the_offending_node(source, offending):
    with pytest.raises(ExpressionError) as caught:
        Expression(source)
    assert caught.value.column == source.index(offending)


def test_evaluation_errors_carry_the_column_of_the_offending_node():
    source = "tp_size + (1 if dcp_size == 1 else 2) // (dcp_size - 1)"
    error = error_of(source)
    assert error.column == source.index("(1 if")  # the division node starts at its left operand


def test_syntax_error_column_points_at_the_problem():
    source = "tp_size + * 2"
    with pytest.raises(ExpressionError) as caught:
        Expression(source)
    assert caught.value.column == source.index("*")


# --- properties --------------------------------------------------------------------------------
#
# Random well-typed expressions built from every allowed node. Leaves are bounded by 12 and the tree by depth 4,
# so no intermediate can exceed 12 ** 16 < MAX_INT: Python's own eval is then an exact oracle.

VARIABLES = {"tp_size": 8, "pp_size": 2, "pcp_size": 1, "dcp_size": 1, "heads": 3, "neg": -5}
LEAF_BOUND = 12
assert LEAF_BOUND ** 16 < MAX_INT


@functools.cache
def int_expressions(depth: int) -> st.SearchStrategy[str]:
    leaves = st.one_of(st.integers(-LEAF_BOUND, LEAF_BOUND).map(str), st.sampled_from(sorted(VARIABLES)))
    if depth == 0:
        return leaves
    sub = int_expressions(depth - 1)
    return st.one_of(
        leaves,
        st.builds(lambda a, op, b: f"({a} {op} {b})", sub, st.sampled_from(["+", "-", "*", "//", "%"]), sub),
        st.builds(lambda op, a: f"({op}{a})", st.sampled_from(["-", "+"]), sub),
        st.builds(lambda f, args: f"{f}({', '.join(args)})", st.sampled_from(["min", "max"]),
                  st.lists(sub, min_size=2, max_size=3)),
        st.builds(lambda t, a, b: f"({a} if {t} else {b})", bool_expressions(depth - 1), sub, sub),
        st.builds(lambda a, op, b: f"({a} {op} {b})", sub, st.sampled_from(["and", "or"]), sub),
    )


@functools.cache
def bool_expressions(depth: int) -> st.SearchStrategy[str]:
    ints = int_expressions(max(depth - 1, 0))
    comparison = st.builds(
        lambda first, rest: "(" + first + "".join(f" {op} {operand}" for op, operand in rest) + ")",
        ints,
        st.lists(st.tuples(st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), ints), min_size=1, max_size=3),
    )
    none_check = st.builds(lambda name, op: f"({name} {op} None)", st.sampled_from(sorted(VARIABLES)),
                           st.sampled_from(["is", "is not"]))
    leaves = st.one_of(st.sampled_from(["True", "False"]), comparison, none_check)
    if depth == 0:
        return leaves
    sub = bool_expressions(depth - 1)
    return st.one_of(
        leaves,
        st.builds(lambda a: f"(not {a})", sub),
        st.builds(lambda a, op, b: f"({a} {op} {b})", sub, st.sampled_from(["and", "or"]), sub),
        st.builds(lambda t, a, b: f"({a} if {t} else {b})", sub, sub, sub),
    )


def python_eval(source: str) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eval(source, {"__builtins__": {"min": min, "max": max}}, dict(VARIABLES))  # the oracle


@settings(deadline=None)
@given(st.one_of(int_expressions(4), bool_expressions(3)))
def test_allowed_expressions_evaluate_like_python(source):
    expression = Expression(source)
    try:
        expected = python_eval(source)
    except ZeroDivisionError:
        with pytest.raises(ExpressionError, match="division by zero"):
            expression.evaluate(VARIABLES)
        return
    actual = expression.evaluate(VARIABLES)
    assert type(actual) is type(expected)
    assert actual == expected


TOKENS = [
    "tp_size", "dcp_size", "mamba_type", "shapes", "none_field", "min", "max", "__class__", "__import__", "open",
    "1", "0", "9", "'s'", '"t"', "None", "True", "(", ")", "[", "]", "{", "}", ",", ".", ":", "+", "-", "*", "**",
    "//", "/", "%", "<", ">", "==", "!=", "<=", ">=", " is ", " not ", " and ", " or ", " if ", " else ", " in ",
    " lambda ", " for ", "=", ":=", " ", "\n", "\x00", "é", "#",
]
FIELDS = {"mamba_type": "mamba2", "shapes": (1, 2), "none_field": None, "flag": True}


@settings(deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(st.sampled_from(TOKENS), max_size=30).map("".join)))
def test_junk_never_raises_anything_but_expression_error(source):
    try:
        Expression(source).evaluate({**TOPOLOGY, **FIELDS})
    except ExpressionError:
        pass


@pytest.mark.parametrize(("source", "expected"), [("cdiv(7, 2)", 4), ("cdiv(8, 2)", 4), ("cdiv(0, 3)", 0), ("cdiv(1, 3)", 1)])
def test_cdiv_is_ceiling_division(source: str, expected: int) -> None:
    assert Expression(source).evaluate({}) == expected


def test_cdiv_by_zero_is_an_expression_error() -> None:
    with pytest.raises(ExpressionError, match="division by zero in 'cdiv"):
        Expression("cdiv(tp_size, 0)").evaluate({"tp_size": 2})


@pytest.mark.parametrize("source", ["cdiv(1)", "cdiv(1, 2, 3)"])
def test_cdiv_takes_exactly_two_arguments(source: str) -> None:
    with pytest.raises(ExpressionError, match=r"cdiv\(\) takes 2 positional arguments"):
        Expression(source)
