import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []
for l in lines:
    m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2)))
loops = []
for a, t in ins:
    m = re.search(r'BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)', t)
    if m:
        tgt = int(m.group(1), 16)
        if tgt < a:
            loops.append((tgt, a))
for tgt, a in loops:
    body = [t for x, t in ins if tgt <= x <= a]
    c = collections.Counter()
    for t in body:
        op = t.split()[0] if not t.startswith('@') else t.split()[1]
        op = op.split('.')[0]
        c[op] += 1
    keys = ['HGMMA', 'MUFU', 'LDL', 'STL', 'LDG', 'LDGSTS', 'UTMALDG', 'SYNCS', 'BAR', 'FFMA', 'FMUL', 'FADD', 'FMNMX', 'SHFL', 'F2FP', 'ISETP', 'FSEL', 'SEL']
    print(f"loop {tgt:#x}-{a:#x}: {len(body)} instr; " + " ".join(f"{k}={c[k]}" for k in keys if c[k]))
