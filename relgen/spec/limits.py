"""Hard limits on what a spec may ask for: specs are shared like model configs, so they are untrusted input.

Every limit is checked before the work it bounds (reading, parsing, evaluating, analysing), and each sits far above
every real model (DeBERTa 256 buckets over ±512, T5 32–128 buckets, clipping to ±4096 at most) and far below harm.
"""

from __future__ import annotations

from typing import Any

#: Bytes of a spec file or text: the largest legal spec (4096 boundaries one per line and the longest description)
#: is about 50 KB; reading stops at this many bytes plus one, so /dev/zero is refused at once.
MAX_SPEC_BYTES = 64 * 1024
#: YAML nodes after alias expansion: a legal spec has at most a few thousand; an alias bomb ("billion laughs") is
#: refused by counting, never by expanding.
MAX_YAML_NODES = 10_000
#: Nesting depth of YAML collections: a spec nests three deep (spec, map, boundaries); libyaml's composer recurses
#: once per level (and crashes the interpreter at about 30,000), so deeper text is refused while it is scanned.
MAX_YAML_DEPTH = 16
#: Characters of a number in YAML: converting a long digit string (or a base-60 one, 1:30:00) is quadratic.
MAX_NUMBER_LENGTH = 100

#: Characters of `name`: it becomes a module and file name (path components are limited to 255 bytes).
MAX_NAME_LENGTH = 64
#: Characters of `description`: free text shown in generated headers, a few sentences.
MAX_DESCRIPTION_LENGTH = 4096

#: Characters of an expression (`scale`, `map.expr`): real ones are under 60.
MAX_EXPRESSION_LENGTH = 1024
#: Nodes (numbers, names, operators, calls) of an expression tree.
MAX_EXPRESSION_NODES = 256
#: Nesting depth of an expression (brackets, unary signs, powers, calls): the parser recurses once per level.
MAX_EXPRESSION_DEPTH = 32
#: Largest constant exponent magnitude: `d**-0.5` and `2**-3` are what specs use.
MAX_EXPONENT = 64
#: Largest degree in the variable an expression may build ((d**64)**64 has degree 4096): bounds the size of exact
#: values and of the polynomials a symbolic proof may expand.
MAX_DEGREE = 64

#: Largest offset magnitude a map may name (clipped min/max, boundaries, T5 max_distance, DeBERTa max_position):
#: 8× the widest clipping of a real model.
MAX_OFFSET = 1 << 15
#: Largest number of table rows (expression rows, T5 buckets, 2 × DeBERTa position_buckets, boundaries + 1):
#: the rows of the widest clipped map, ±MAX_OFFSET.
MAX_ROWS = 2 * MAX_OFFSET + 1
#: Largest number of boundaries of a boundaries map: they are spelled out in the spec file.
MAX_BOUNDARIES = 4096

#: Longest sequence the analyzer plans for (relgen explain, and the runtime's plans for windows longer than an
#: unproven map's): a plan lists every row's offsets, so analysis is linear in the length — about 0.3 s on one core
#: at this length for an identity map, whose 2N − 1 rows grow with it.
MAX_SEQ_LEN = 1 << 17

#: Characters of a value quoted in an error message.
MAX_QUOTED_CHARS = 60


def shortened(text: str) -> str:
    """`text` cut to MAX_QUOTED_CHARS, so that an error about hostile input stays one short line."""
    return text if len(text) <= MAX_QUOTED_CHARS else text[: MAX_QUOTED_CHARS - 3] + "..."


def quoted(value: Any) -> str:
    """`repr(value)`, shortened (a repr has no newline: it escapes them)."""
    return shortened(repr(value))
