"""Safe parsing of the small arithmetic expressions a spec may hold (`scale`, `map.expr`).

Python's `ast` parses the text; only a whitelist of node types, names and functions is turned into a
sympy expression by hand. Nothing is ever passed to `eval` (which sympy's own `parse_expr` uses), so a spec
file cannot run code.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable

import sympy

_FUNCTIONS: dict[str, Callable[..., sympy.Expr]] = {
    "sqrt": sympy.sqrt,
    "log": sympy.log,
    "exp": sympy.exp,
    "abs": sympy.Abs,
    "Abs": sympy.Abs,
    "floor": sympy.floor,
    "ceil": sympy.ceiling,
    "ceiling": sympy.ceiling,
    "min": sympy.Min,
    "Min": sympy.Min,
    "max": sympy.Max,
    "Max": sympy.Max,
    "sign": sympy.sign,
}
_CONSTANTS: dict[str, sympy.Expr] = {"pi": sympy.pi, "e": sympy.E}
_BINARY: dict[type[ast.operator], Callable[[sympy.Expr, sympy.Expr], sympy.Expr]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: sympy.floor(a / b),
    ast.Mod: lambda a, b: sympy.Mod(a, b),
    ast.Pow: lambda a, b: a**b,
}


class ExpressionError(ValueError):
    """An expression that is not well formed or uses something outside the whitelist."""


def parse_expression(text: str | float | int, variables: Iterable[str]) -> sympy.Expr:
    """Parse `text` into a sympy expression over `variables` (each an integer symbol)."""
    if isinstance(text, bool):
        raise ExpressionError(f"expected a number or an expression, got {text!r}")
    if isinstance(text, int | float):
        return sympy.nsimplify(text) if isinstance(text, float) else sympy.Integer(text)
    symbols = {name: sympy.Symbol(name, integer=True) for name in variables}
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"cannot parse {text!r}: {err.msg}") from None
    try:
        return _convert(tree.body, symbols, text)
    except (TypeError, ArithmeticError) as err:  # e.g. sqrt() without its argument, Mod(d, 0)
        raise ExpressionError(f"cannot evaluate {text!r}: {err}") from None


#: Bounds on constant powers, so that a spec such as `9**9**9` is refused instead of computed exactly.
_MAX_EXPONENT = 64
_MAX_BASE = sympy.Integer(10) ** 100


def _power(base: sympy.Expr, exponent: sympy.Expr, text: str) -> sympy.Expr:
    if exponent.is_Number and (
        abs(exponent) > _MAX_EXPONENT or (base.is_Number and abs(base) > _MAX_BASE and abs(exponent) > 1)
    ):
        raise ExpressionError(f"power too large in {text!r} (constant exponents are limited to ±{_MAX_EXPONENT})")
    return base**exponent


def _convert(node: ast.AST, symbols: dict[str, sympy.Symbol], text: str) -> sympy.Expr:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        value = node.value
        return sympy.Integer(value) if isinstance(value, int) else sympy.Float(value)
    if isinstance(node, ast.Name):
        if node.id in symbols:
            return symbols[node.id]
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        allowed = ", ".join(sorted(symbols)) or "none"
        raise ExpressionError(f"unknown symbol {node.id!r} in {text!r} (allowed variables: {allowed})")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _convert(node.left, symbols, text), _convert(node.right, symbols, text)
        if isinstance(node.op, ast.Pow):
            return _power(left, right, text)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _convert(node.operand, symbols, text)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id not in _FUNCTIONS:
            known = ", ".join(sorted(_FUNCTIONS))
            raise ExpressionError(f"unknown function {node.func.id!r} in {text!r} (known: {known})")
        return _FUNCTIONS[node.func.id](*(_convert(arg, symbols, text) for arg in node.args))
    if isinstance(node, ast.Attribute):
        raise ExpressionError(f"attribute access ({ast.unparse(node)[:40]!r}) is not allowed in {text!r}")
    if isinstance(node, ast.Constant):
        raise ExpressionError(f"only numbers are allowed as constants, got {node.value!r} in {text!r}")
    raise ExpressionError(f"unsupported syntax ({type(node).__name__}: {ast.unparse(node)[:40]!r}) in {text!r}")
