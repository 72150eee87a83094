"""Twenty-second session, call 2: where torch.cuda.graph around eager dropout calls failed in call 1
("operation would make the legacy stream depend on a capturing blocking stream", during the captured backward),
in a test that had first run the same calls under torch.compile(mode="reduce-overhead"). One variant per process:

    python3 …_capture_probe.py VARIANT     (tensor, int, nodropout, after_compile, after_compile_reset,
                                             nodropout_after_compile, nodropout_after_compile_reset)

prints one JSON line: the variant, whether capture and two replays matched eager calls bit for bit, the error."""

import json
import sys
import traceback
from pathlib import Path

import torch

import relgen
from relgen.verify import make_inputs

ROOT = Path(__file__).resolve().parents[4]


def main(variant: str) -> dict:
    spec = relgen.load_spec(ROOT / "specs" / "t5.yaml")
    fn = relgen.compile_mechanism(spec)
    made = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    leaves = [made.q, made.k, made.v, *made.tables.values()]
    do = torch.randn_like(made.q)
    dropout = "nodropout" not in variant
    seed = torch.full((1,), 20, dtype=torch.int64, device="cuda")

    def options(value):
        return {"dropout_p": 0.1, "dropout_seed": value} if dropout else {}

    def step(call, value):
        out = call(made.q, made.k, made.v, **made.tables, **options(value))
        return [out, *torch.autograd.grad(out, leaves, do)]

    if "after_compile" in variant:
        compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), mode="reduce-overhead", fullgraph=True)
        for value in (11, 12, 13):
            seed.fill_(value)
            torch.compiler.cudagraph_mark_step_begin()
            step(compiled, seed)
        if variant.endswith("reset"):
            torch._dynamo.reset()
    captured_value = 7 if variant == "int" else seed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(fn, captured_value)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(fn, captured_value)
    exact = []
    for value in (21, 22):
        seed.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        want = step(fn, 7 if variant == "int" else value)
        exact.append(all(torch.equal(a, b) for a, b in zip(captured, want, strict=True)))
    return {"variant": variant, "ok": True, "replays_exact": exact}


if __name__ == "__main__":
    try:
        result = main(sys.argv[1])
    except Exception as err:  # the point is to see it
        result = {
            "variant": sys.argv[1],
            "ok": False,
            "error": repr(err)[:400],
            "where": traceback.format_exc()[-1500:],
        }
    print(json.dumps(result), flush=True)
