"""relgen's own host time per call, without a GPU: every launch of relgen's kernels (the generated module's) keeps
its Python side, `Launcher`'s lookup and constexpr tail as on a launch of a compiled kernel on the GPU, and
launches nothing, so what remains is argument checking, geometry, tile selection, TMA descriptors, buffer
allocation, the torch ops of the glue and autograd's.

At N ≤ 1K a call is host-bound on the H200 (docs/performance.md), and this part of it can be
measured and trimmed on any machine. Triton's own C launcher (~10 µs per launch) is not included: time it on
the GPU with `benchmarks/profile_kernels.py`'s host_ms_per_fwd_call. The torch ops of the glue run on the CPU here
(a GPU would queue them): at long lengths a figure that grows with N beyond allocation is that work.

    python benchmarks/host_time.py [--specs shaw,txl] [--seq-lens 128,32768] [--window 256,0] [--heads 1]
                                   [--calls 400] [--forward-only] [--ring] [--dropout 0.1] [--profile]
                                   [--strided-tables] [--decode]
    python benchmarks/host_time.py --generate

--dropout P: the calls of a training step (attention dropout at rate P, a seed drawn per call).
--strided-tables: per-head tables as views [H, R, d] of [R, H, d] storage ([H, R] of [R, H]), as the Hugging Face
integrations pass their layers' projections of the relative embeddings and T5's bias (needs --heads 2 or more).
--decode: the forward calls of greedy decoding with a cache: one query at position N − 1 + t against N + t keys
(t = 0, 1, …, 255, then again), each call a new key length and query offset, as a decoder layer's self-attention
makes them (B = 1, H = --heads, no mask), against one such call repeated; maps whose tables keep their rows only.
--generate: Hugging Face T5's greedy generate() per decode step, eager against patched (generate_step_ms).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

import relgen
from relgen.check.verify import make_inputs
from relgen.runtime.launch import Launcher

ROOT = Path(__file__).resolve().parent.parent


#: what stubbed_launches keeps in place of a compiled kernel
_STANDIN = object()


@contextmanager
def stubbed_launches() -> Iterator[None]:
    """Every Launcher launch does the host work of a launch on the GPU once its kernel is compiled (a new key
    length or batch finds it by its class of integers, Launcher.lookup), and launches nothing."""

    def launch(self: Launcher, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        key = self.key(args, kwargs)
        if key is not None and self.lookup(key, args, kwargs) is None:
            self.keep(key, args, kwargs, _STANDIN)
        tuple(self._constexprs(len(args), kwargs))

    saved = Launcher.launch
    Launcher.launch = launch
    try:
        yield
    finally:
        Launcher.launch = saved


def best_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    for _ in range(min(calls, 30)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def load(name: str, window: tuple[int, int] | None) -> relgen.MechanismSpec:
    path = Path(name) if name.endswith((".yaml", ".yml")) else ROOT / "specs" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    if window is not None:
        data = {**data, "name": f"{data['name']}_local", "window": {"left": window[0], "right": window[1]}}
    return relgen.load_spec(data)


def calls_of(
    spec: relgen.MechanismSpec,
    n: int,
    heads: int,
    ring: bool = False,
    dropout_p: float = 0.0,
    strided_tables: bool = False,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward + backward) of one call at B = 1, `heads` heads, N = n, d = 64, fp16, on the CPU; `ring`:
    through relgen.distributed's ring of one (no process group), contiguous; with attention dropout at
    `dropout_p`; `strided_tables`: per-head tables as [H, R, d] views of [R, H, d] storage."""
    fn = relgen.compile_mechanism(spec)
    if ring:
        import relgen.distributed as rd

        fn = rd.context_parallel(fn)
    inputs = make_inputs(spec, b=1, h=heads, nq=n, d=64, dtype=torch.float16, device="cpu")
    tables = dict(inputs.tables)
    if strided_tables:
        tables = {
            name: t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for name, t in tables.items()
        }
    leaves = [inputs.q, inputs.k, inputs.v, *tables.values()]

    def forward():
        return fn(inputs.q, inputs.k, inputs.v, **tables, dropout_p=dropout_p)

    do = torch.ones_like(forward())  # made once: a CPU fill of dO would be timed as host work

    def both():
        torch.autograd.grad(forward(), leaves, do)

    return forward, both


def decode_calls(spec: relgen.MechanismSpec, n: int, heads: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(decode, repeat): one forward call of a decode step a call, a query at position n − 1 + t against n + t keys
    (a cache of k and v), t cycling over 256 steps; and the first step's call again and again (its signature
    kept: what a step would cost without its checks)."""
    fn = relgen.compile_mechanism(spec)
    steps = 256
    inputs = make_inputs(spec, b=1, h=heads, nq=1, nk=n + steps, d=64, dtype=torch.float16, device="cpu")
    step = iter(range(1 << 62))

    def forward(keys: int | None = None):
        keys = n + next(step) % steps if keys is None else keys
        k, v = inputs.k[:, :, :keys], inputs.v[:, :, :keys]
        return fn(inputs.q, k, v, **inputs.tables, q_offset=keys - 1)

    return forward, lambda: forward(n)


def generate_step_ms(rounds: int = 5) -> tuple[float, float]:
    """(HF eager, patched) milliseconds per decode step of greedy generate() on a 12-layer T5 too narrow for the
    CPU's arithmetic to matter (d_model 64, 2 heads of 64; B = 2, 64 input tokens; dynamic cache): a 36-token call
    less a 4-token one, over the 32 steps between them, the best of `rounds` rounds in which both take turns. The
    patched model's relgen launches are stubbed (its tokens are meaningless; each call still makes every step)."""
    import transformers

    import relgen.integrations

    config = transformers.T5Config(
        d_model=64, d_kv=64, num_heads=2, num_layers=12, d_ff=64, vocab_size=128, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    patched = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    patched.load_state_dict(eager.state_dict())
    relgen.integrations.patch(patched)
    ids = torch.randint(2, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def seconds(model: torch.nn.Module, tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                max_new_tokens=tokens, min_new_tokens=tokens,
            )  # fmt: skip
        return time.perf_counter() - start

    models = (eager, patched)
    for model in models:
        seconds(model, 8)
    best = [float("inf")] * len(models)
    for _ in range(rounds):
        for n, model in enumerate(models):
            best[n] = min(best[n], (seconds(model, 36) - seconds(model, 4)) / 32 * 1e3)
    return best[0], best[1]


def profile(fn: Callable[[], object], calls: int, rows: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="shaw,txl,deberta_v3,t5")
    parser.add_argument("--seq-lens", default="128")
    parser.add_argument("--window", default=None, help="LEFT,RIGHT: the specs with a local window")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--ring", action="store_true", help="each call through relgen.distributed's ring of one")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout rate of the calls")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of the forward (by own time)")
    parser.add_argument("--strided-tables", action="store_true", help="tables as [H, R, d] views of [R, H, d]")
    parser.add_argument("--decode", action="store_true", help="decode steps: one query, a new key length a call")
    parser.add_argument("--generate", action="store_true", help="T5 generate(): eager against patched, per step")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the glue's torch ops run on the CPU here: threads add only noise on a shared machine
    window = tuple(int(x) for x in args.window.split(",")) if args.window else None
    if args.generate:
        with stubbed_launches():
            eager_ms, patched_ms = generate_step_ms()
        print(f"T5 generate() per decode step: eager {eager_ms:.2f} ms, patched {patched_ms:.2f} ms (launches stubbed)")
        return
    with stubbed_launches():
        for n in (int(x) for x in args.seq_lens.split(",")):
            for name in args.specs.split(","):
                spec = load(name, window)
                if args.decode:
                    if spec.map.num_rows(n) != spec.map.num_rows(n + 1):
                        print(f"{spec.name:16s} decode: its tables grow with the length (identity map): skipped")
                        continue
                    with torch.no_grad():
                        decode, repeat = decode_calls(spec, n, args.heads)
                        step_us, repeat_us = best_us(decode, args.calls), best_us(repeat, args.calls)
                    line = f"{spec.name:16s} N={n:<6d} H={args.heads:<3d} decode step {step_us:8.1f} µs"
                    print(line + f"   one call repeated {repeat_us:8.1f} µs  (launches stubbed, best of 5)", flush=True)
                    continue
                forward, both = calls_of(spec, n, args.heads, args.ring, args.dropout, args.strided_tables)
                label = spec.name + (" ring" if args.ring else "") + (f" p={args.dropout:g}" if args.dropout else "")
                label += " strided" if args.strided_tables else ""
                line = f"{label:16s} N={n:<6d} H={args.heads:<3d} forward {best_us(forward, args.calls):8.1f} µs"
                if not args.forward_only:
                    line += f"   forward + backward {best_us(both, args.calls):8.1f} µs"
                print(line + "  (launches stubbed, best of 5)", flush=True)
                if args.profile:
                    print(profile(forward, args.calls), flush=True)


if __name__ == "__main__":
    main()
