"""Safe parsing and evaluation of the small arithmetic expressions a spec may hold (`scale`, `map.expr`).

The text is untrusted. A tokenizer accepts only the grammar's own tokens — numbers, the variables, the whitelisted
functions and constants, ``+ - * / // % **``, parentheses, commas and spaces — and refuses everything else (``#``,
quotes, newlines, ``;``, ``_``, other names) before a recursive-descent parser builds a tree under the limits of
`relgen.spec.limits`. Nothing reaches `eval`, Python's `ast` (which skips ``#`` comments) or sympy's parser. Every
constant part is evaluated while parsing, so a division by zero, an overflow or a complex value is refused at
once. The tree evaluates in float64 with numpy (vectorised over offsets), never exactly, so evaluation is bounded;
`Expression.bounds` bounds it over an interval (the analyzer's saturation proofs) and `Expression.to_sympy` gives
its symbolic form.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import sympy

from relgen.spec.limits import (
    MAX_DEGREE,
    MAX_EXPONENT,
    MAX_EXPRESSION_DEPTH,
    MAX_EXPRESSION_LENGTH,
    MAX_EXPRESSION_NODES,
    quoted,
)


class ExpressionError(ValueError):
    """An expression that is not well formed, uses something outside the whitelist or exceeds a limit."""


@dataclass(frozen=True)
class _Function:
    numpy: Callable[..., np.ndarray]
    sympy: Callable[..., sympy.Expr]
    arity: tuple[int, int | None]  # fewest and most arguments (None: any number)


def _log(x: np.ndarray, base: np.ndarray | None = None) -> np.ndarray:
    return np.log(x) if base is None else np.log(x) / np.log(base)


def _minimum(*args: np.ndarray) -> np.ndarray:
    return functools.reduce(np.minimum, args)


def _maximum(*args: np.ndarray) -> np.ndarray:
    return functools.reduce(np.maximum, args)


_UNARY = (1, 1)
_FUNCTIONS: dict[str, _Function] = {
    "sqrt": _Function(np.sqrt, sympy.sqrt, _UNARY),
    "log": _Function(_log, sympy.log, (1, 2)),
    "exp": _Function(np.exp, sympy.exp, _UNARY),
    "abs": _Function(np.abs, sympy.Abs, _UNARY),
    "Abs": _Function(np.abs, sympy.Abs, _UNARY),
    "floor": _Function(np.floor, sympy.floor, _UNARY),
    "ceil": _Function(np.ceil, sympy.ceiling, _UNARY),
    "ceiling": _Function(np.ceil, sympy.ceiling, _UNARY),
    "min": _Function(_minimum, sympy.Min, (1, None)),
    "Min": _Function(_minimum, sympy.Min, (1, None)),
    "max": _Function(_maximum, sympy.Max, (1, None)),
    "Max": _Function(_maximum, sympy.Max, (1, None)),
    "sign": _Function(np.sign, sympy.sign, _UNARY),
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "+": np.add,
    "-": np.subtract,
    "*": np.multiply,
    "/": np.divide,
    "//": lambda a, b: np.floor(np.divide(a, b)),  # Python's and sympy's floor division
    "%": np.mod,  # the sign of the divisor, as Python's % and sympy's Mod
    "**": np.power,
}
_SYMPY_BINARY: dict[str, Callable[[sympy.Expr, sympy.Expr], sympy.Expr]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: sympy.floor(a / b),
    "%": sympy.Mod,
    "**": lambda a, b: a**b,
}
_DIVISIONS = ("/", "//", "%")

_TOKEN = re.compile(
    r"(?P<space>[ \t]+)"
    r"|(?P<number>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"|(?P<name>[A-Za-z][A-Za-z0-9]*)"
    r"|(?P<op>\*\*|//|[-+*/%(),])"
)


@dataclass(frozen=True)
class _Token:
    kind: str  # "number", "name", "op" or "end"
    text: str
    start: int


@dataclass(frozen=True)
class _Node:
    """One node of the tree: `kind` is "number", "variable", "constant", "neg", a binary operator or "call"."""

    kind: str
    start: int
    end: int  # the node's text is source[start:end], for error messages
    children: tuple[_Node, ...] = ()
    name: str = ""  # of a variable, constant or function
    value: float | None = None  # float64 value of a node without variables (a literal's own value)
    degree: float = 0.0  # a bound on the node's degree in the variables


@dataclass(frozen=True)
class Expression:
    """A parsed, validated expression over `variables`."""

    text: str
    variables: tuple[str, ...]
    root: _Node
    size: int  # nodes of the tree

    @property
    def degree(self) -> float:
        """A bound on the degree in the variables (a polynomial's degree; 1 for Min(Abs(delta), 16))."""
        return self.root.degree

    @property
    def value(self) -> float | None:
        """The float64 value when the expression has no variable in it."""
        return self.root.value

    def evaluate(self, values: Mapping[str, np.ndarray | float]) -> np.ndarray:
        """Float64 values at `values` (one array or number per variable, broadcast); NaN or ±inf where undefined."""
        env = {name: np.asarray(values[name], dtype=np.float64) for name in self.variables}
        with np.errstate(all="ignore"):
            return np.asarray(_evaluate(self.root, env), dtype=np.float64)

    def bounds(self, low: float, high: float) -> tuple[float, float]:
        """Bounds (lo, hi) on the values of a one-variable expression while its variable ranges over the reals in
        [low, high], by interval arithmetic: linear in the tree, and sound for the float64 values `evaluate` gives
        — every one lies in [lo, hi] (an end is infinite where a value may overflow). (nan, nan) when some value
        may be NaN: a division by an interval holding 0, a square root of one holding negatives, inf − inf, ..."""
        with np.errstate(all="ignore"):
            return _bounds(self.root, (float(low), float(high)))

    def to_sympy(self) -> sympy.Expr:
        """The sympy form, each variable an integer symbol. Constant parts are their float64 values (integers when
        integral), so that sympy never evaluates a transcendental constant exactly; evaluating the result exactly
        at a point is bounded by the degree limit but may still be slow for transcendental functions of a
        variable — use `evaluate` for values."""
        symbols = {name: sympy.Symbol(name, integer=True) for name in self.variables}
        expr = _to_sympy(self.root, symbols)
        if expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo, sympy.I):
            raise ExpressionError(f"{quoted(self.text)} is undefined (a division by zero or a complex value)")
        return expr


def compile_expression(text: str | float | int, variables: Iterable[str]) -> Expression:
    """Parse and check `text` (or a plain number) as an expression over `variables`."""
    names = tuple(variables)
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ExpressionError(f"expected a number or an expression, got {quoted(text)}")
    if not isinstance(text, str):
        if isinstance(text, float) and not math.isfinite(text):
            raise ExpressionError(f"expected a finite number, got {text!r}")
        spelled = quoted(text)
        return Expression(spelled, names, _number_node(text, 0, len(spelled), spelled), 1)
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise ExpressionError(f"expression too long: {len(text)} characters (at most {MAX_EXPRESSION_LENGTH})")
    parser = _Parser(text, names)
    root = parser.parse()
    return Expression(text, names, root, parser.nodes)


@functools.lru_cache(maxsize=256)
def cached_expression(text: str, variables: tuple[str, ...]) -> Expression:
    """`compile_expression` for text that is evaluated again and again (a map's expression, a spec's scale)."""
    return compile_expression(text, variables)


def parse_expression(text: str | float | int, variables: Iterable[str]) -> sympy.Expr:
    """Parse `text` into a sympy expression over `variables` (each an integer symbol); see `Expression.to_sympy`."""
    return compile_expression(text, variables).to_sympy()


# -- tokens and parsing --------------------------------------------------------------------------------------------


def _tokens(text: str) -> list[_Token]:
    tokens, at = [], 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise ExpressionError(
                f"character {text[at]!r} at position {at} is not allowed in {quoted(text)} (expressions hold "
                "numbers, names, + - * / // % **, parentheses, commas and spaces)"
            )
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append(_Token(kind, match.group(), at))
        at = match.end()
    tokens.append(_Token("end", "", len(text)))
    return tokens


class _Parser:
    """Python's precedence: + - < * / // % < unary - + < ** (right-associative, binding a unary minus on its
    right: 2**-1, and weaker than one on its left: -2**2 = -4)."""

    def __init__(self, text: str, variables: tuple[str, ...]):
        self.text = text
        self.variables = variables
        self.tokens = _tokens(text)
        self.at = 0
        self.depth = 0
        self.nodes = 0

    def parse(self) -> _Node:
        if self.tokens[0].kind == "end":
            raise ExpressionError(f"cannot parse {quoted(self.text)}: the expression is empty")
        node = self._sum()
        if self._peek().kind != "end":
            self._unexpected()
        return node

    # -- grammar ---------------------------------------------------------------------------------------------
    def _sum(self) -> _Node:
        node = self._product()
        while self._peek().text in ("+", "-"):
            op = self._next().text
            node = self._binary(op, node, self._product())
        return node

    def _product(self) -> _Node:
        node = self._unary()
        while self._peek().text in ("*", "/", "//", "%"):
            op = self._next().text
            node = self._binary(op, node, self._unary())
        return node

    def _unary(self) -> _Node:
        token = self._peek()
        if token.text not in ("-", "+"):
            return self._power()
        self._next()
        with self._nested():
            operand = self._unary()
        if token.text == "+":
            return operand
        return self._make("neg", token.start, operand.end, (operand,), degree=operand.degree)

    def _power(self) -> _Node:
        base = self._atom()
        if self._peek().text != "**":
            return base
        self._next()
        with self._nested():
            exponent = self._unary()
        return self._binary("**", base, exponent)

    def _atom(self) -> _Node:
        token = self._next()
        if token.kind == "number":
            return self._counted(
                _number_node(_literal(token.text), token.start, token.start + len(token.text), self.text)
            )
        if token.text == "(":
            with self._nested():
                node = self._sum()
            self._expect(")")
            return node
        if token.kind != "name":
            self._unexpected(token)
        if self._peek().text == "(":
            return self._call(token)
        end = token.start + len(token.text)
        if token.text in self.variables:
            return self._make("variable", token.start, end, name=token.text, degree=1.0)
        if token.text in _CONSTANTS:
            return self._make("constant", token.start, end, name=token.text, value=_CONSTANTS[token.text])
        if token.text in _FUNCTIONS:
            raise ExpressionError(f"cannot parse {quoted(self.text)}: function {token.text!r} needs its arguments")
        allowed = ", ".join([*self.variables, *_CONSTANTS]) or "none"
        raise ExpressionError(f"unknown symbol {token.text!r} in {quoted(self.text)} (allowed: {allowed})")

    def _call(self, name: _Token) -> _Node:
        function = _FUNCTIONS.get(name.text)
        if function is None:
            known = ", ".join(sorted(_FUNCTIONS))
            raise ExpressionError(f"unknown function {name.text!r} in {quoted(self.text)} (known: {known})")
        self._expect("(")
        args: list[_Node] = []
        with self._nested():
            if self._peek().text != ")":
                args.append(self._sum())
                while self._peek().text == ",":
                    self._next()
                    args.append(self._sum())
        end = self._expect(")").start + 1
        fewest, most = function.arity
        if len(args) < fewest or (most is not None and len(args) > most):
            wanted = f"{fewest}" if fewest == most else f"{fewest} or more" if most is None else f"{fewest} to {most}"
            raise ExpressionError(
                f"cannot evaluate {quoted(self.text)}: {name.text} takes {wanted} argument(s), got {len(args)}"
            )
        if name.text in ("min", "Min", "max", "Max"):
            degree = max(a.degree for a in args)
        else:
            degree = sum(a.degree for a in args)
        return self._make("call", name.start, end, tuple(args), name=name.text, degree=degree)

    # -- node construction and checks ------------------------------------------------------------------------
    def _binary(self, op: str, left: _Node, right: _Node) -> _Node:
        if op in _DIVISIONS and right.value == 0:
            self._refuse(left.start, right.end, "division by zero")
        if op == "**":
            if right.value is None:
                raise ExpressionError(
                    f"power with a variable exponent in {quoted(self.text)}: exponents must be constant numbers"
                )
            if abs(right.value) > MAX_EXPONENT:
                raise ExpressionError(
                    f"power too large in {quoted(self.text)} (constant exponents are limited to ±{MAX_EXPONENT})"
                )
            if left.value == 0 and right.value < 0:
                self._refuse(left.start, right.end, "division by zero")
            degree = left.degree * abs(right.value)
        elif op in ("+", "-"):
            degree = max(left.degree, right.degree)
        else:
            degree = left.degree + right.degree
        return self._make(op, left.start, right.end, (left, right), degree=degree)

    def _make(self, kind: str, start: int, end: int, children: tuple[_Node, ...] = (), **fields) -> _Node:
        node = _Node(kind, start, end, children, **fields)
        if node.degree > MAX_DEGREE:
            raise ExpressionError(
                f"degree too high in {quoted(self.text)}: {node.degree:g} in the variable (at most {MAX_DEGREE})"
            )
        if node.value is None and children and all(c.value is not None for c in children):
            node = _fold(node, self.text)
        return self._counted(node)

    def _counted(self, node: _Node) -> _Node:
        self.nodes += 1
        if self.nodes > MAX_EXPRESSION_NODES:
            raise ExpressionError(
                f"expression too large: more than {MAX_EXPRESSION_NODES} nodes in {quoted(self.text)}"
            )
        return node

    def _refuse(self, start: int, end: int, why: str) -> None:
        raise ExpressionError(f"cannot evaluate {_part(self.text, start, end)}: {why}")

    # -- tokens ----------------------------------------------------------------------------------------------
    def _peek(self) -> _Token:
        return self.tokens[self.at]

    def _next(self) -> _Token:
        token = self.tokens[self.at]
        if token.kind != "end":
            self.at += 1
        return token

    def _expect(self, text: str) -> _Token:
        token = self._next()
        if token.text != text:
            self._unexpected(token, expected=text)
        return token

    def _unexpected(self, token: _Token | None = None, expected: str | None = None) -> None:
        token = token or self._peek()
        found = "the end" if token.kind == "end" else f"{token.text!r} at position {token.start}"
        wanted = f"expected {expected!r}, found" if expected else "unexpected"
        raise ExpressionError(f"cannot parse {quoted(self.text)}: {wanted} {found}")

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        """One more level of nesting (the parser recurses once per level)."""
        self.depth += 1
        if self.depth > MAX_EXPRESSION_DEPTH:
            raise ExpressionError(
                f"expression nested too deeply: more than {MAX_EXPRESSION_DEPTH} levels in {quoted(self.text)}"
            )
        try:
            yield
        finally:
            self.depth -= 1


def _part(text: str, start: int, end: int) -> str:
    """The text, quoted, and the part of it an error is about when that is not all of it."""
    if start == 0 and end == len(text.rstrip()):
        return quoted(text)
    return f"{quoted(text[start:end])} in {quoted(text)}"


def _literal(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)


def _number_node(number: int | float, start: int, end: int, text: str) -> _Node:
    try:
        value = float(number)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ExpressionError(f"number too large: {_part(text, start, end)}")
    return _Node("number", start, end, value=value)


def _fold(node: _Node, text: str) -> _Node:
    """A node whose children are all constant gets its own float64 value, which must be a finite real number."""
    with np.errstate(all="ignore"):
        value = float(_evaluate(node, {}))
    if math.isnan(value):
        raise ExpressionError(f"cannot evaluate {_part(text, node.start, node.end)}: not a real number")
    if math.isinf(value):
        raise ExpressionError(f"cannot evaluate {_part(text, node.start, node.end)}: too large (beyond float64)")
    return dataclasses.replace(node, value=value)


# -- evaluation ----------------------------------------------------------------------------------------------------


def _evaluate(node: _Node, env: Mapping[str, np.ndarray]) -> np.ndarray | float:
    if node.value is not None:
        return node.value
    if node.kind == "variable":
        return env[node.name]
    args = [_evaluate(child, env) for child in node.children]
    if node.kind == "neg":
        return np.negative(args[0])
    if node.kind == "call":
        return _FUNCTIONS[node.name].numpy(*args)
    return _BINARY[node.kind](*args)


# -- interval arithmetic -------------------------------------------------------------------------------------------
#
# Sound for the float64 evaluation itself, not only for the reals: IEEE operations (+ − × ÷ √) round
# monotonically, so an operation monotone in each argument is bounded by its values at the ends; libm's exp, log and
# pow need not be, so their bounds are widened by an ulp. An infinite end is an overflow that may really occur, so
# ∞ − ∞, 0·∞, ∞/∞ and ∞ % m (NaN in evaluation) make an interval undefined, and NaN propagates.

Interval = tuple[float, float]
#: Some value may be NaN: it propagates through every operation (Min(NaN, 5) is NaN too).
_UNDEFINED: Interval = (math.nan, math.nan)


def _interval(low: float, high: float) -> Interval:
    low, high = float(low), float(high)
    return _UNDEFINED if math.isnan(low) or math.isnan(high) else (low, high)


def _infinite(a: Interval) -> bool:
    return math.isinf(a[0]) or math.isinf(a[1])


def _holds_zero(a: Interval) -> bool:
    return a[0] <= 0 <= a[1]


def _bounds(node: _Node, x: Interval) -> Interval:
    if node.value is not None:
        return node.value, node.value
    if node.kind == "variable":
        return x
    args = [_bounds(child, x) for child in node.children]
    if any(math.isnan(a[0]) for a in args):
        return _UNDEFINED
    if all(a[0] == a[1] for a in args):  # constant over the interval: its value, as `evaluate` computes it
        value = float(_evaluate(dataclasses.replace(node, children=tuple(_point(a[0]) for a in args)), {}))
        return _interval(value, value)
    if node.kind == "call":
        return _CALL_BOUNDS[node.name](*args)
    if node.kind == "neg":
        return -args[0][1], -args[0][0]
    if node.kind == "**":
        return _power_bounds(args[0], node.children[1].value or 0.0)
    return _BINARY_BOUNDS[node.kind](*args)


def _point(value: float) -> _Node:
    return _Node("number", 0, 0, value=value)


def _sum_bounds(a: Interval, b: Interval) -> Interval:
    if (a[1] == math.inf and b[0] == -math.inf) or (a[0] == -math.inf and b[1] == math.inf):
        return _UNDEFINED
    return _interval(a[0] + b[0], a[1] + b[1])


def _difference_bounds(a: Interval, b: Interval) -> Interval:
    return _sum_bounds(a, (-b[1], -b[0]))


def _ends(f: Callable[[float, float], float], a: Interval, b: Interval) -> Interval:
    values = [float(f(p, q)) for p in a for q in b]
    return _interval(min(values), max(values))


def _product_bounds(a: Interval, b: Interval) -> Interval:
    if (_infinite(a) and _holds_zero(b)) or (_infinite(b) and _holds_zero(a)):
        return _UNDEFINED
    return _ends(np.multiply, a, b)


def _quotient_bounds(a: Interval, b: Interval) -> Interval:
    if _holds_zero(b) or (_infinite(a) and _infinite(b)):
        return _UNDEFINED
    return _ends(np.divide, a, b)  # monotone in each argument while b keeps its sign


def _mod_bounds(a: Interval, m: Interval) -> Interval:
    """a % m with the divisor's sign (Python's %): a − k·m when a/m stays within one k, else [0, m] or [m, 0]."""
    if _infinite(a) or _holds_zero(m):
        return _UNDEFINED
    if m[0] == m[1]:
        k0, k1 = np.floor(np.divide(a[0], m[0])), np.floor(np.divide(a[1], m[0]))
        if k0 == k1:
            return _interval(np.mod(a[0], m[0]), np.mod(a[1], m[0]))  # increasing in a within one k
    return (0.0, m[1]) if m[0] > 0 else (m[0], 0.0)


def _power_bounds(a: Interval, c: float) -> Interval:
    if c == 0:
        return 1.0, 1.0
    if c < 0:  # 1 / v^−c, widened: libm's v^c need not be that quotient's rounding
        low, high = _quotient_bounds((1.0, 1.0), _power_bounds(a, -c))
        if a[0] == a[1] or math.isnan(low):
            return low, high
        return _interval(np.nextafter(low, -math.inf), np.nextafter(high, math.inf))
    if not c.is_integer() and a[0] < 0:
        return _UNDEFINED  # NaN for negative bases
    if c % 2 == 0 and a[0] < 0 < a[1]:  # even powers fall, then rise
        return 0.0, _libm_ends(lambda v: np.power(v, c), (0.0, max(-a[0], a[1])))[1]
    if c % 2 == 0 and a[1] <= 0:
        low, high = _libm_ends(lambda v: np.power(v, c), (-a[1], -a[0]))  # (−v)^c = v^c
        return low, high
    return _libm_ends(lambda v: np.power(v, c), a)  # increasing: odd powers, and any power of v ≥ 0


def _monotone(
    f: Callable[[float], float], domain: float = -math.inf, strict: bool = False, libm: bool = False
) -> Callable[[Interval], Interval]:
    """The bounds of a function increasing on [domain, ∞) (or (domain, ∞)); undefined outside it. A `libm`
    function (exp, log) is widened by one ulp each way: its rounding need not be monotone."""

    def bounds(a: Interval) -> Interval:
        if a[0] < domain or (strict and a[0] == domain):
            return _UNDEFINED
        return _libm_ends(f, a) if libm else _interval(f(a[0]), f(a[1]))

    return bounds


def _libm_ends(f: Callable[[float], float], a: Interval) -> Interval:
    """Bounds of an increasing libm function over `a`, one ulp wider each way unless `a` is a single point."""
    low, high = float(f(a[0])), float(f(a[1]))
    if a[0] == a[1]:
        return _interval(low, high)
    return _interval(np.nextafter(min(low, high), -math.inf), np.nextafter(max(low, high), math.inf))


def _abs_bounds(a: Interval) -> Interval:
    if a[0] >= 0:
        return a
    if a[1] <= 0:
        return -a[1], -a[0]
    return 0.0, max(-a[0], a[1])


_log = _monotone(np.log, 0.0, strict=True, libm=True)


def _log_bounds(a: Interval, base: Interval | None = None) -> Interval:
    if base is None:
        return _log(a)
    logs = _log(a), _log(base)
    return _UNDEFINED if any(math.isnan(v[0]) for v in logs) else _quotient_bounds(*logs)


def _min_bounds(*args: Interval) -> Interval:
    return min(a[0] for a in args), min(a[1] for a in args)


def _max_bounds(*args: Interval) -> Interval:
    return max(a[0] for a in args), max(a[1] for a in args)


_CALL_BOUNDS: dict[str, Callable[..., Interval]] = {
    "sqrt": _monotone(np.sqrt, 0.0),
    "log": _log_bounds,
    "exp": _monotone(np.exp, libm=True),
    "abs": _abs_bounds,
    "Abs": _abs_bounds,
    "floor": _monotone(np.floor),
    "ceil": _monotone(np.ceil),
    "ceiling": _monotone(np.ceil),
    "min": _min_bounds,
    "Min": _min_bounds,
    "max": _max_bounds,
    "Max": _max_bounds,
    "sign": _monotone(np.sign),
}
_BINARY_BOUNDS: dict[str, Callable[[Interval, Interval], Interval]] = {
    "+": _sum_bounds,
    "-": _difference_bounds,
    "*": _product_bounds,
    "/": _quotient_bounds,
    "//": lambda a, b: _monotone(np.floor)(_quotient_bounds(a, b)),
    "%": _mod_bounds,
}


# -- sympy ---------------------------------------------------------------------------------------------------------


def _to_sympy(node: _Node, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    if node.value is not None:
        value = node.value
        return sympy.Integer(int(value)) if value.is_integer() and abs(value) < 2**53 else sympy.Float(value)
    if node.kind == "variable":
        return symbols[node.name]
    args = [_to_sympy(child, symbols) for child in node.children]
    if node.kind == "neg":
        return -args[0]
    if node.kind == "call":
        return _FUNCTIONS[node.name].sympy(*args)
    return _SYMPY_BINARY[node.kind](*args)
