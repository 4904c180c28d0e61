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
from functools import cached_property

MAX_SOURCE_LENGTH = 1000
MAX_DEPTH = 32
MAX_INT = 2**63 - 1

Value = int | bool | str | None | tuple

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Value, Value], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_FUNCTIONS: dict[str, Callable[..., int]] = {"min": min, "max": max}
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
        self._tree  # parse eagerly so an invalid expression never exists

    @cached_property
    def _tree(self) -> ast.expr:
        return _parse(self.source)

    @cached_property
    def names(self) -> frozenset[str]:
        """Variables the expression reads."""
        return frozenset(
            node.id
            for node in ast.walk(self._tree)
            if isinstance(node, ast.Name) and node.id not in _FUNCTIONS
        )

    def check_names(self, known: Iterable[str]) -> None:
        """Raise for the first variable that is not in ``known``, with a did-you-mean."""
        known = frozenset(known)
        for node in ast.walk(self._tree):
            if isinstance(node, ast.Name) and node.id not in _FUNCTIONS and node.id not in known:
                raise ExpressionError(
                    f"unknown variable '{node.id}'{_suggest(node.id, known)}", node.col_offset
                )

    def evaluate(self, variables: Mapping[str, Value]) -> Value:
        return _Evaluator(variables).visit(self._tree)


def _parse(source: str) -> ast.expr:
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
            for op, right in zip(ops, comparators, strict=True):
                if type(op) not in _COMPARE:
                    raise ExpressionError("'in' and 'not in' are not allowed", column)
                if isinstance(op, (ast.Is, ast.IsNot)) and not (
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
                raise ExpressionError(f"{func.id}() takes one or more positional arguments", column)
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


class _Evaluator:
    def __init__(self, variables: Mapping[str, Value]) -> None:
        self.variables = variables

    def visit(self, node: ast.AST) -> Value:
        value = self._visit(node)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ExpressionError(f"value exceeds {MAX_INT}", getattr(node, "col_offset", 0))
        return value

    def _integer(self, node: ast.expr) -> int:
        value = self.visit(node)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ExpressionError(
                f"'{ast.unparse(node)}' is {_describe(value)}, expected an integer", node.col_offset
            )
        return value

    def _visit(self, node: ast.AST) -> Value:
        match node:
            case ast.Constant(value=value):
                return value
            case ast.Name(id=name):
                if name not in self.variables:
                    raise ExpressionError(
                        f"unknown variable '{name}'{_suggest(name, self.variables)}", node.col_offset
                    )
                return self.variables[name]
            case ast.BinOp(left=left, op=op, right=right):
                lhs, rhs = self._integer(left), self._integer(right)
                if isinstance(op, (ast.FloorDiv, ast.Mod)) and rhs == 0:
                    raise ExpressionError(f"division by zero in '{ast.unparse(node)}'", node.col_offset)
                return _BINARY[type(op)](lhs, rhs)
            case ast.UnaryOp(op=ast.Not(), operand=operand):
                return not self.visit(operand)
            case ast.UnaryOp(op=op, operand=operand):
                value = self._integer(operand)
                return -value if isinstance(op, ast.USub) else value
            case ast.BoolOp(op=ast.And(), values=values):
                result: Value = True
                for value_node in values:
                    result = self.visit(value_node)
                    if not result:
                        return result
                return result
            case ast.BoolOp(values=values):
                result = False
                for value_node in values:
                    result = self.visit(value_node)
                    if result:
                        return result
                return result
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return self.visit(body) if self.visit(test) else self.visit(orelse)
            case ast.Compare(left=left, ops=ops, comparators=comparators):
                lhs = self.visit(left)
                for op, right in zip(ops, comparators, strict=True):
                    rhs = self.visit(right)
                    if type(op) not in (ast.Eq, ast.NotEq, ast.Is, ast.IsNot) and (lhs is None or rhs is None):
                        raise ExpressionError(
                            f"cannot order-compare None in '{ast.unparse(node)}'; test 'is None' first",
                            node.col_offset,
                        )
                    try:
                        holds = _COMPARE[type(op)](lhs, rhs)
                    except TypeError:
                        raise ExpressionError(
                            f"cannot compare {_describe(lhs)} with {_describe(rhs)} in '{ast.unparse(node)}'",
                            node.col_offset,
                        ) from None
                    if not holds:
                        return False
                    lhs = rhs
                return True
            case ast.Call(func=ast.Name(id=name), args=args):
                return _FUNCTIONS[name](self._integer(arg) for arg in args)
        raise ExpressionError(f"{type(node).__name__} is not allowed", getattr(node, "col_offset", 0))


def _describe(value: Value) -> str:
    if value is None:
        return "None"
    return "a boolean" if isinstance(value, bool) else type(value).__name__
