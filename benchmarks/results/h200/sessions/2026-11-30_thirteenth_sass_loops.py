"""Instruction counts per loop of a cubin's SASS (thirteenth session): `cuobjdump -sass K.cubin > K.sass`, then
`python 2026-11-30_thirteenth_sass_loops.py K.sass`. A loop is a backward branch's span."""

import collections
import re
import sys
from pathlib import Path

KEYS = ["HGMMA", "MUFU", "LDL", "STL", "LDG", "LDGSTS", "UTMALDG", "SYNCS", "BAR", "FFMA", "FMUL", "FADD", "FMNMX",
        "SHFL", "F2FP", "ISETP", "FSEL", "SEL"]


def main(path: str) -> None:
    instructions = []
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instructions.append((int(m.group(1), 16), m.group(2)))
    for address, text in instructions:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= address:
            continue
        target = int(m.group(1), 16)
        body = [t for a, t in instructions if target <= a <= address]
        ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in body)
        counts = " ".join(f"{k}={ops[k]}" for k in KEYS if ops[k])
        print(f"loop {target:#x}-{address:#x}: {len(body)} instr; {counts}")


if __name__ == "__main__":
    main(sys.argv[1])
