"""A small, safe expression language for replication rules.

Policies compute factors and conditions from the topology and a spec's fields, e.g.
``max(1, tp_size // total_num_kv_heads)`` or ``max_tp_shards is not None and dcp_size == 1``.
The source is parsed with :mod:`ast` and only a whitelist of node types is accepted; evaluation
walks the tree itself, so nothing reaches ``eval``/``exec``, attributes, subscripts or imports.
Sizes are bounded (source length, nesting depth, integer magnitude) so a policy cannot hang or
exhaust the planner.
"""

from __future__ import annotations

import ast
import difflib
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, cast

MAX_SOURCE_LENGTH = 1000
MAX_DEPTH = 32
MAX_INT = 2**63 - 1

Value = int | bool | str | None | tuple[Any, ...]

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
# Any, not Value: the validator lets only comparable operands reach an ordering (typeshed types operator.lt
# for operands that support it).
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_FUNCTIONS: dict[str, Callable[[list[int]], int]] = {
    "min": min,
    "max": max,
    "cdiv": lambda pair: -(-pair[0] // pair[1]),
}
"""Functions an expression may call; ``cdiv(a, b)`` is vLLM's ceiling division (``vllm.utils.math_utils``)."""
_ARITY = {"cdiv": 2}
"""Functions that take an exact number of arguments (the others take one or more)."""
_OPERATOR_SPELLING = {
    ast.Div: "'/' (use '//' for integer division)",
    ast.Pow: "'**'",
    ast.BitAnd: "'&' (use 'and')",
    ast.BitOr: "'|' (use 'or')",
    ast.BitXor: "'^'",
    ast.LShift: "'<<'",
    ast.RShift: "'>>'",
    ast.MatMult: "'@'",
}


class ExpressionError(ValueError):
    """An expression that cannot be parsed, is not allowed, or fails to evaluate.

    ``column`` is the 0-based offset of the offending node inside the expression source, so a
    loader can point at the exact character in the YAML file.
    """

    def __init__(self, message: str, column: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.column = column


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


@dataclass(frozen=True)
class Expression:
    """A parsed, validated expression; evaluate it with :meth:`evaluate`."""

    source: str

    def __post_init__(self) -> None:
        _ = self._tree  # parse eagerly so an invalid expression never exists

    @cached_property
    def _tree(self) -> ast.expr:
        return _parse(self.source)

    @cached_property
    def _compiled(self) -> Compiled:
        return _compile_source(self.source)

    @cached_property
    def names(self) -> frozenset[str]:
        """Variables the expression reads."""
        return frozenset(name for name, _ in _variables(self.source))

    def check_names(self, known: Iterable[str]) -> None:
        """Raise for the first variable that is not in ``known``, with a did-you-mean."""
        known = frozenset(known)
        for name, column in _variables(self.source):
            if name not in known:
                raise ExpressionError(f"unknown variable '{name}'{_suggest(name, known)}", column)

    def evaluate(self, variables: Mapping[str, Value]) -> Value:
        return self._compiled(variables)

    def __reduce__(self) -> tuple[type[Expression], tuple[str]]:
        # The source is the whole value; the cached tree and closures are rebuilt where it is read.
        return type(self), (self.source,)


@lru_cache(maxsize=4096)
def shared_expression(source: str) -> Expression:
    """The :class:`Expression` of ``source``, one instance per source (raises like ``Expression``).

    An expression is immutable, and a layout states the same few in every group: sharing one
    instance parses, checks, compiles and reads the names of each once, not once per group."""
    return Expression(source)


@lru_cache(maxsize=4096)
def _parse(source: str) -> ast.expr:
    """Parse and check ``source``; cached because layouts repeat the same few expressions per group.

    The returned tree is shared and must not be modified.
    """
    if len(source) > MAX_SOURCE_LENGTH:
        raise ExpressionError(f"expression is longer than {MAX_SOURCE_LENGTH} characters")
    if "\n" in source.strip():
        raise ExpressionError("expression must fit on one line")
    text = source.strip()
    indent = len(source) - len(source.lstrip())
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as error:
        raise ExpressionError(f"invalid syntax: {error.msg}", indent + max(0, (error.offset or 1) - 1)) from None
    # ast columns are UTF-8 byte offsets into the stripped text; make them character offsets into ``source``.
    encoded = text.encode()
    for node in ast.walk(tree):
        if hasattr(node, "col_offset"):
            node.col_offset = indent + len(encoded[: node.col_offset].decode(errors="ignore"))
    _check_tree(tree, depth=1)
    return tree


def _check_tree(node: ast.AST, depth: int) -> None:
    column = getattr(node, "col_offset", 0)
    if depth > MAX_DEPTH:
        raise ExpressionError(f"expression is nested deeper than {MAX_DEPTH} levels", column)
    match node:
        case ast.Constant(value=value):
            if isinstance(value, (bool, str)) or value is None:
                pass
            elif isinstance(value, int):
                if abs(value) > MAX_INT:
                    raise ExpressionError(f"integer literal exceeds {MAX_INT}", column)
            else:
                raise ExpressionError(
                    f"only integers, strings, True/False and None are allowed, not {type(value).__name__} {value!r}",
                    column,
                )
        case ast.Name(id=name):
            if name in _FUNCTIONS:  # a call's own name is not visited: Call returns early below
                raise ExpressionError(f"'{name}' is a function; call it as {name}(...)", column)
        case ast.BinOp(op=op):
            if type(op) not in _BINARY:
                spelling = _OPERATOR_SPELLING.get(type(op), type(op).__name__)
                raise ExpressionError(f"operator {spelling} is not allowed", column)
        case ast.UnaryOp(op=op):
            if not isinstance(op, (ast.USub, ast.UAdd, ast.Not)):
                raise ExpressionError("only unary '-', '+' and 'not' are allowed", column)
        case ast.BoolOp() | ast.IfExp():
            pass
        case ast.Compare(ops=ops, comparators=comparators):
            for comparison, right in zip(ops, comparators, strict=True):
                if type(comparison) not in _COMPARE:
                    raise ExpressionError("'in' and 'not in' are not allowed", column)
                if isinstance(comparison, (ast.Is, ast.IsNot)) and not (
                    isinstance(right, ast.Constant) and right.value is None
                ):
                    raise ExpressionError("'is' and 'is not' may only compare with None", column)
        case ast.Call(func=func, args=args, keywords=keywords):
            if not isinstance(func, ast.Name) or func.id not in _FUNCTIONS:
                name = func.id if isinstance(func, ast.Name) else ast.unparse(func)
                raise ExpressionError(
                    f"call to '{name}' is not allowed; only {', '.join(sorted(_FUNCTIONS))} may be called",
                    column,
                )
            if keywords or not args or any(isinstance(arg, ast.Starred) for arg in args):
                raise ExpressionError(f"{func.id}() takes {_arguments(func.id)}", column)
            if func.id in _ARITY and len(args) != _ARITY[func.id]:
                raise ExpressionError(f"{func.id}() takes {_arguments(func.id)}, got {len(args)}", column)
            for arg in args:
                _check_tree(arg, depth + 1)
            return
        case ast.Attribute():
            raise ExpressionError("attribute access is not allowed", column)
        case ast.Subscript():
            raise ExpressionError("subscripts are not allowed", column)
        case _:
            raise ExpressionError(f"{type(node).__name__} is not allowed in an expression", column)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context)):
            continue
        _check_tree(child, depth + 1)


Compiled = Callable[[Mapping[str, Value]], Value]


def _compile(node: ast.AST) -> Compiled:
    """Turn a checked tree into nested closures once, so evaluation costs a few calls, not a tree walk.

    Same whitelist as :func:`_check_tree`; nothing is handed to ``eval`` or ``compile``.
    """
    inner = _compile_node(node)
    column = getattr(node, "col_offset", 0)

    def bounded(variables: Mapping[str, Value]) -> Value:
        value = inner(variables)
        if type(value) is int and abs(value) > MAX_INT:
            raise ExpressionError(f"value exceeds {MAX_INT}", column)
        return value

    return bounded


def _integer(node: ast.expr) -> Callable[[Mapping[str, Value]], int]:
    compiled = _compile(node)
    text = ast.unparse(node)

    def integer(variables: Mapping[str, Value]) -> int:
        value = compiled(variables)
        if type(value) is not int:
            raise ExpressionError(f"'{text}' is {_describe(value)}, expected an integer", node.col_offset)
        return value

    return integer


def _compile_node(node: ast.AST) -> Compiled:
    column = getattr(node, "col_offset", 0)
    match node:
        case ast.Constant(value=value):
            constant = cast(Value, value)  # the validator admits int, bool, str and None constants only
            return lambda variables: constant
        case ast.Name(id=name):

            def variable(variables: Mapping[str, Value]) -> Value:
                try:
                    return variables[name]
                except KeyError:
                    raise ExpressionError(f"unknown variable '{name}'{_suggest(name, variables)}", column) from None

            return variable
        case ast.BinOp(left=left, op=op, right=right):
            lhs, rhs, apply = _integer(left), _integer(right), _BINARY[type(op)]
            divides = isinstance(op, (ast.FloorDiv, ast.Mod))
            text = ast.unparse(node)

            def binary(variables: Mapping[str, Value]) -> Value:
                a, b = lhs(variables), rhs(variables)
                if divides and b == 0:
                    raise ExpressionError(f"division by zero in '{text}'", column)
                return apply(a, b)

            return binary
        case ast.UnaryOp(op=ast.Not(), operand=operand):
            compiled = _compile(operand)
            return lambda variables: not compiled(variables)
        case ast.UnaryOp(op=op, operand=operand):
            integer = _integer(operand)
            if isinstance(op, ast.USub):
                return lambda variables: -integer(variables)
            return integer
        case ast.BoolOp(op=op, values=values):
            parts = [_compile(value) for value in values]
            conjunction = isinstance(op, ast.And)

            def boolean(variables: Mapping[str, Value]) -> Value:
                result: Value = conjunction
                for part in parts:
                    result = part(variables)
                    if bool(result) is not conjunction:
                        return result
                return result

            return boolean
        case ast.IfExp(test=test, body=body, orelse=orelse):
            condition, then, otherwise = _compile(test), _compile(body), _compile(orelse)
            return lambda variables: then(variables) if condition(variables) else otherwise(variables)
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            first = _compile(left)
            steps = [(type(op), _COMPARE[type(op)], _compile(right)) for op, right in zip(ops, comparators, strict=True)]
            text = ast.unparse(node)

            def compare(variables: Mapping[str, Value]) -> Value:
                lhs = first(variables)
                for kind, apply, right in steps:
                    rhs = right(variables)
                    if kind not in _EQUALITY and (lhs is None or rhs is None):
                        raise ExpressionError(f"cannot order-compare None in '{text}'; test 'is None' first", column)
                    try:
                        holds = apply(lhs, rhs)
                    except TypeError:
                        raise ExpressionError(
                            f"cannot compare {_describe(lhs)} with {_describe(rhs)} in '{text}'", column
                        ) from None
                    if not holds:
                        return False
                    lhs = rhs
                return True

            return compare
        case ast.Call(func=ast.Name(id=name), args=args):
            function, arguments = _FUNCTIONS[name], [_integer(arg) for arg in args]
            text = ast.unparse(node)

            def call(variables: Mapping[str, Value]) -> Value:
                values = [argument(variables) for argument in arguments]
                if name == "cdiv" and values[1] == 0:
                    raise ExpressionError(f"division by zero in '{text}'", column)
                return function(values)

            return call
    raise ExpressionError(f"{type(node).__name__} is not allowed", column)


_EQUALITY = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)


@lru_cache(maxsize=4096)
def _variables(source: str) -> tuple[tuple[str, int], ...]:
    """(name, column) of every variable read, in source order."""
    nodes = [node for node in ast.walk(_parse(source)) if isinstance(node, ast.Name) and node.id not in _FUNCTIONS]
    return tuple((node.id, node.col_offset) for node in sorted(nodes, key=lambda node: node.col_offset))


@lru_cache(maxsize=4096)
def _compile_source(source: str) -> Compiled:
    return _compile(_parse(source))


def _arguments(function: str) -> str:
    count = _ARITY.get(function)
    return f"{count} positional arguments" if count else "one or more positional arguments"


def _describe(value: Value) -> str:
    if value is None:
        return "None"
    return "a boolean" if isinstance(value, bool) else type(value).__name__
