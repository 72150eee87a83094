"""Compile every kernel a call launches for a GPU target, on a machine without a GPU.

Runs the call in Triton's interpreter to record each launch (kernel, argument types, constexprs, warps, stages),
then compiles each recorded launch for the target in a fresh process (no interpreter) and prints registers,
spills (Triton's bundled ptxas -v) and shared memory. Compile errors the interpreter forgives (non-constexpr
globals, unsupported syntax) show up here without spending GPU time.

    python benchmarks/compile_check.py specs/shaw.yaml [--dtype fp16] [--arch 90] [--seq-len 300] [--config-for 8192]
        [--tiles backward.num_warps=8 backward_kv.block_m=32 ...] [--ablation no_projections] [--relations in_tile]
        [--dropout-seed int|tensor] [--k-offset 0] [--head-dim 64] [--heads 2] [--kv-heads 2] [--layout bhnd|bnhd]
        [--int64]

--relations in_tile: the plan's in-tile relation products (the variant ablation no_projections runs), for any spec
the variant serves (a bias term included, which the ablation refuses).

--int64: the kernels a call past 2³¹ elements launches (their strides in int64, INT64), recorded on a small call.

--k-offset K: the call's keys (and queries) start at position K; with dropout, a K that is not a multiple of four
compiles the kernels' one-Philox-call-per-score mode (relgen.runtime.dropout).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def record(
    spec_path: str,
    dtype: str,
    seq_len: int,
    arch: int,
    config_for: int,
    overrides: list[str],
    ablation: str | None,
    dropout_seed: str | None = None,
    head_dim: int = 64,
    kv_heads: int = 2,
    layout: str = "bhnd",
    k_offset: int = 0,
    relations: str | None = None,
    heads: int = 2,
    int64: bool = False,
) -> list[dict]:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import interpreter

    import relgen
    from relgen.tiles import configs, select, tuning

    launches: list[dict] = []
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = list(inspect.signature(fn).parameters.values())
        signature, constexprs, attrs, elements = {}, {}, {}, {}
        values = dict(zip([p.name for p in params], args, strict=False))
        values.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
        # the launched object's own list: a kernel's twin leaves other integers to run time
        unspecialised = set(self.kwargs.get("do_not_specialize") or [])
        for p in params:
            value = values[p.name]
            if "constexpr" in str(p.annotation):
                signature[p.name] = "constexpr"
                constexprs[p.name] = value
                continue
            # Triton's launcher's own rule (an integer equal to 1 becomes that constant; integers divisible by 16
            # and 16-byte aligned pointers get a divisibility hint), so this check cannot drift from it
            kind, key = native_specialize_impl(CUDABackend, value, False, p.name not in unspecialised, True)
            signature[p.name] = kind
            if isinstance(kind, tuple):  # a tuple argument (strides): specialised element by element
                elements[p.name] = key
            elif kind == "constexpr":
                constexprs[p.name] = key
            elif key:
                attrs[p.name] = key
        launches.append(
            {
                "module": inspect.getsourcefile(fn),
                "kernel": fn.__name__,
                "signature": signature,
                "constexprs": constexprs,
                "attrs": attrs,
                "elements": elements,
                "num_warps": kwargs.get("num_warps", 4),
                "num_stages": kwargs.get("num_stages", 2),
            }
        )
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    if int64:  # every offset counts as past int32, so that the call records the kernels' INT64 variants
        from relgen.runtime import geometry

        geometry.INT32_REACH = 0
    spec = relgen.load_spec(spec_path)
    torch_dtype = getattr(torch, DTYPES[dtype])
    mechanism = relgen.compile_mechanism(spec)
    # an ablation's variant is its own kernel family (tuning.plan_family), with its own tiles
    module = mechanism._ablated(mechanism.module, ablation, {})[0] if ablation else mechanism.module
    if relations is not None:
        module = mechanism._variant(module, relations=relations)
    plan = module.PLAN
    terms = tuple(plan.terms)
    # the configuration the GPU would run at `config_for` tokens: the committed table's entry for this
    # architecture, else the resource heuristic (asked for while not interpreting)
    cfg = tuning.table_config(str(arch), tuning.plan_family(plan), torch_dtype, head_dim, config_for)
    if cfg is None:
        os.environ["TRITON_INTERPRET"] = "0"
        cfg = configs.default_config(torch_dtype, head_dim, config_for, terms, tuning.in_tile(plan))
        os.environ["TRITON_INTERPRET"] = "1"
    cfg = cfg.with_changes(overrides)  # e.g. backward.num_warps=8: what-if compiles without a GPU
    print(f"tiles for N = {config_for}: {cfg}", flush=True)
    n = seq_len
    rows = spec.map.num_rows(n + k_offset)
    shape = (rows, head_dim) if spec.heads_share_tables else (heads, rows, head_dim)
    tables = {}
    if spec.has_query:
        tables["aq"] = torch.randn(shape, dtype=torch_dtype, requires_grad=True)
    if spec.has_key:
        tables["ak"] = torch.randn(shape, dtype=torch_dtype, requires_grad=True)
    if spec.has_bias:
        tables["bias"] = torch.randn(shape[:-1], requires_grad=True)
    # `heads` query heads; k and v with kv_heads of them (1: multi-query), in `layout`
    q, k, v = (torch.randn(1, count, n, head_dim, dtype=torch_dtype) for count in (heads, kv_heads, kv_heads))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = {"layout": layout, "q_offset": k_offset, "k_offset": k_offset}
    if dropout_seed is not None:  # the dropout kernels, with the seed as an int or read from a tensor
        options |= {"dropout_p": 0.1, "dropout_seed": 5 if dropout_seed == "int" else torch.tensor([5])}
    with select.override_config(cfg):
        if relations is not None:
            out = module.attention(q, k, v, tables.get("aq"), tables.get("ak"), tables.get("bias"), **options)
        else:
            out = relgen.compile_mechanism(spec)(q, k, v, **tables, ablation=ablation, **options)
        out.sum().backward()
    seen, unique = set(), []
    for launch in launches:
        key = json.dumps(
            [launch["kernel"], launch["signature"], launch["constexprs"], launch["attrs"], launch["elements"]],
            sort_keys=True,
            default=str,
        )
        if key not in seen:
            seen.add(key)
            unique.append(launch)
    return unique


def memory_ops(ptx: str) -> str:
    """Global loads / stores by vector width and element size: scalar 2-byte accesses are what to look for."""
    import collections
    import re

    counts = collections.Counter(m.group(1) for m in re.finditer(r"\b((?:ld|st)\.global(?:\.\w+)*)\s", ptx))
    return " ".join(f"{op.replace('.global', '')}:{n}" for op, n in sorted(counts.items()))


def ptxas_usage(ptx: str, arch: int) -> str:
    """Registers and spills by Triton's own ptxas (`-v`): what the driver would report, without a GPU."""
    import re
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    if not ptxas.exists():
        return "regs=? (no ptxas)"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    done = subprocess.run(
        [str(ptxas), f"-arch={target}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, check=False
    )
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if regs is None:
        return f"regs=? (ptxas: {done.stderr.strip().splitlines()[-1:]})"
    text = f"regs={regs.group(1)}"
    if spills is not None:
        text += f" spills={spills.group(1)}B stored/{spills.group(2)}B loaded"
    return text


def compile_all(launches: list[dict], arch: int, show_memory_ops: bool) -> int:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    failures = 0
    modules = {}
    for launch in launches:
        path = launch["module"]
        if path not in modules:
            spec = importlib.util.spec_from_file_location(f"m{len(modules)}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[path] = module
        fn = getattr(modules[path], launch["kernel"])
        # the JITFunction under a relgen.runtime.launch.Launcher (a bare JITFunction's `kernel` is None)
        fn = getattr(fn, "kernel", None) or fn
        names = [p.name for p in fn.params]
        signature, constexprs = dict(launch["signature"]), dict(launch["constexprs"])
        attrs = {(names.index(name),): CUDABackend.parse_attr(key) for name, key in launch["attrs"].items()}
        for name, keys in launch["elements"].items():  # a tuple's elements, as Triton's own launch keys them
            signature[name] = tuple(signature[name])  # (JSON gave a list)
            for i, (kind, key) in enumerate(zip(signature[name], keys, strict=True)):
                if kind == "constexpr":
                    constexprs[(names.index(name), i)] = key
                elif key:
                    attrs[(names.index(name), i)] = CUDABackend.parse_attr(key)
        src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
        opts = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
            md = compiled.metadata
            print(
                f"ok   {launch['kernel']:28s} warps={opts['num_warps']} stages={opts['num_stages']} "
                f"shared={md.shared:6d}B {ptxas_usage(compiled.asm['ptx'], arch)}"
            )
            if show_memory_ops:
                print(f"     {memory_ops(compiled.asm['ptx'])}")
            if os.environ.get("RELGEN_DUMP_IR"):  # where to write each kernel's TTGIR (layouts of loads/stores)
                for stage in ("ttgir", "ptx"):
                    with open(os.path.join(os.environ["RELGEN_DUMP_IR"], f"{launch['kernel']}.{stage}"), "w") as out:
                        out.write(compiled.asm[stage])
        except Exception as err:  # report every kernel, not just the first failure
            failures += 1
            cause, chain = err, []
            while cause is not None:
                chain.append(f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1][:400]}")
                cause = cause.__cause__ or cause.__context__
            print(f"FAIL {launch['kernel']}: " + " <- ".join(chain))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--seq-len", type=int, default=300, help="length of the recorded (interpreted) call")
    parser.add_argument(
        "--config-for",
        type=int,
        default=None,
        help="compile the tiles a GPU uses at this length (default: --seq-len)",
    )
    parser.add_argument(
        "--tiles", nargs="*", default=[], metavar="PART.FIELD=N", help="change the tiles, e.g. backward.num_warps=8"
    )
    parser.add_argument("--memory-ops", action="store_true", help="count global loads/stores by width in the PTX")
    parser.add_argument(
        "--ablation", default=None, help="compile a Table 7 variant (relgen.runtime.mechanism.ABLATIONS)"
    )
    parser.add_argument(
        "--dropout-seed", choices=["int", "tensor"], default=None, help="compile the dropout kernels, seed as given"
    )
    parser.add_argument("--k-offset", type=int, default=0, help="q_offset = k_offset of the recorded call")
    parser.add_argument("--head-dim", type=int, default=64, help="d of the recorded call (and of its tiles)")
    parser.add_argument("--heads", type=int, default=2, help="query heads of the recorded call")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (dividing --heads; 1: multi-query)")
    parser.add_argument("--layout", default="bhnd", choices=("bhnd", "bnhd"), help="layout of q, k, v")
    parser.add_argument(
        "--relations", default=None, choices=("in_tile",), help="compile the plan with these relation products"
    )
    parser.add_argument(
        "--int64", action="store_true", help="the kernels' INT64 variants (strides in int64), as past 2³¹ elements"
    )
    parser.add_argument("--compile-from", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_from:
        with open(args.compile_from) as f:
            return 1 if compile_all(json.load(f), args.arch, args.memory_ops) else 0
    launches = record(
        args.spec,
        args.dtype,
        args.seq_len,
        args.arch,
        args.config_for or args.seq_len,
        args.tiles,
        args.ablation,
        args.dropout_seed,
        args.head_dim,
        args.kv_heads,
        args.layout,
        args.k_offset,
        args.relations,
        args.heads,
        args.int64,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f, default=str)
    # explicitly off: without a CUDA device relgen would otherwise switch the interpreter on (configure_triton)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, __file__, args.spec, "--arch", str(args.arch), "--compile-from", f.name]
        + (["--memory-ops"] if args.memory_ops else []),
        env=env,
        check=False,
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
