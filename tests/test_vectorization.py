"""The kernels compiled for sm_90 here without a GPU (Triton's bundled ptxas): memory-access widths, and
compilation itself at edge lengths.

The projection's stores (the forward's, where it writes Z̃^Q itself) and the reductions' dZ̃ loads stream whole
rows: they must stay 16-byte vector accesses (the table reduction's where every window starts on a multiple of 16
columns). A 2-byte scalar access there cost 6× on the H200 (docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import SLOW

import relgen
from relgen.codegen import generator as codegen

ROOT = Path(__file__).resolve().parent.parent
pytestmark = SLOW  # every case compiles whole modules for sm_90 (10 s and more on 2 cores)


def compile_check(spec: str, seq_len: int, *options: str) -> str:
    """benchmarks/compile_check.py's report: one line per launched kernel, "ok …" or "FAIL …"."""
    import triton.backends.nvidia

    if not (Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas").exists():
        pytest.skip("no ptxas to compile for sm_90 here")
    script, spec_file = ROOT / "benchmarks" / "compile_check.py", ROOT / "specs" / spec
    done = subprocess.run(
        [sys.executable, str(script), str(spec_file), "--seq-len", str(seq_len), *options],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def memory_ops(spec: str, seq_len: int) -> dict[str, list[str]]:
    """Kernel name → compile_check's count of global accesses by width ("st.v4.b32:8 ..."), one per launch; and
    "tiles" → the KernelConfig the launches used."""
    ops, kernel = {}, None
    for line in compile_check(spec, seq_len, "--memory-ops").splitlines():
        tiles = re.match(r"tiles for N = \d+: (.*)", line)
        if tiles:
            ops["tiles"] = [tiles.group(1)]
        match = re.match(r"ok\s+(\w+)", line)
        if match:
            kernel = match.group(1)
            usage = re.search(r"regs=(\d+) spills=(\d+)B", line)  # ptxas -v: registers, spill-store bytes
            ops.setdefault(kernel + " usage", []).append(f"{usage.group(1)} {usage.group(2)}" if usage else line)
        elif kernel and line.startswith("     "):
            ops.setdefault(kernel, []).append(line.strip())
    return ops


def count(ops: str, op: str) -> int:
    return sum(int(n) for name, n in re.findall(r"([\w.]+):(\d+)", ops) if name == op)


@pytest.mark.parametrize(
    ("spec", "seq_len"),
    [
        ("deberta_v3.yaml", 1024),  # every window is the whole expansion (C = 1019 < N + G − 1); rows of 1024
        ("shaw.yaml", 600),  # rows of 520 = 513 rounded to ROW_ALIGN: 16-byte aligned, not a multiple of 16
    ],
)
def test_streaming_kernels_use_vector_accesses(spec, seq_len):
    ops = memory_ops(spec, seq_len)
    plan = relgen.compile_mechanism(ROOT / "specs" / spec).plan
    fused = codegen.GenerationFlags.from_plan(plan).fused_zq  # the forward writes Z̃^Q itself
    # _project_kernel's launches: two per side it projects (the second writes again where Z̃ exceeds fp16), and
    # for a Z̃^Q the forward wrote, the backward's second launch; all compile the same stores
    launches = 2 * ((not fused and plan.has_query) + plan.has_key) + fused
    streaming = ["_reduce_tokens_kernel", "_reduce_table_kernel", "_project_kernel"]
    assert set(streaming) <= set(ops) and len(ops["_project_kernel"]) == launches, ops
    # Z̃ rows go out as 16-byte stores, enough to write a thread's share of the fp16 tile; the few 2-byte ones are
    # the end-column buffer's (2 entries per token), where the scalar row stores of the bug were 64 per thread
    tiles = ops["tiles"][0]
    block_t, block_w, warps = _ints(r"project=ProjectTiles\(block_t=(\d+), block_w=(\d+), num_warps=(\d+)", tiles)
    share = block_t * block_w * 2 // (32 * warps)  # bytes of the Z̃ tile per thread
    for launch in ops.get("_project_kernel", []):  # each projected side
        assert count(launch, "st.v4.b32") * 16 >= share and count(launch, "st.b16") <= 4, (launch, tiles)
    if fused:  # the forward's stores: its block's Z̃^Q tiles and its O tile (d = 64), all 16 bytes wide; the
        # block's rewrite at its own scale (where its entries exceed fp16) compiles the end-column stores again
        block_m, fwd_warps = _ints(r"forward=AttnTiles\(block_m=(\d+), block_n=\d+, num_warps=(\d+)", tiles)
        shares = block_m * (block_w + 64) * 2 // (32 * fwd_warps)
        (launch,) = ops["_attn_fwd_kernel"]
        assert count(launch, "st.v4.b32") * 16 >= shares and count(launch, "st.b16") <= 8, (launch, tiles)
    for launch in ops["_reduce_tokens_kernel"] + ops["_reduce_table_kernel"]:  # windows start at 0 here: aligned
        assert count(launch, "ld.b16") == 0, launch
    # the streaming kernels hold one tile at a time: no spills (the attention passes are another matter:
    # docs/performance.md)
    for name in streaming:
        for usage in ops[f"{name} usage"]:
            regs, spilled = (int(x) for x in usage.split())
            assert regs <= 255 and spilled == 0, (name, usage)


def _ints(pattern: str, text: str) -> tuple[int, ...]:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return tuple(int(x) for x in match.groups())


@pytest.mark.parametrize("spec", ["txl.yaml", "deberta_v3.yaml"])
def test_one_query_and_one_key_compile(spec):
    """Triton compiles an integer argument equal to 1 as that constant: with Nq = Nk = 1 so compiled, ptxas crashed
    (SIGSEGV) on TXL's query pass with the H200 table's 64x64 8-warp tiles (the GPU suite on the H200).
    compile_check specialises as the launcher does, on the tiles the table gives that length."""
    report = compile_check(spec, 1, "--config-for", "1")
    kernels = re.findall(r"^ok\s+(\w+)", report, re.MULTILINE)
    assert {"_attn_fwd_kernel", "_attn_bwd_q_kernel", "_attn_bwd_kv_kernel"} <= set(kernels), report


@pytest.mark.parametrize("spec", ["txl.yaml", "deberta_v3.yaml"])
def test_int64_kernels_compile(spec):
    """The INT64 variants (a call past 2³¹ elements: TXL from about 46K tokens) compile for sm_90, the projection's
    second launch included, whose branch on its maximum is a run-time one: Triton refuses a name there that
    changes type (int32 strides widened to int64 inside it failed TXL's 64K test and the int64-strided calls' tests
    on the GPU). The interpreter does not check types, so only a compile for the GPU finds this."""
    report = compile_check(spec, 200, "--int64")
    assert "FAIL" not in report, report
    kernels = re.findall(r"^ok\s+(\w+)", report, re.MULTILINE)
    assert kernels.count("_project_kernel") >= 2 and "_attn_bwd_kv_kernel" in kernels, report
