"""T5-base's greedy generate() on a GPU, HF eager and sdpa against the patched model (relgen.integrations.patch),
each in a fresh model with the same random weights: the time per decode step (a 32-token call less a 4-token one,
divided by the 28 steps between them, so that the encoder and the prefill cancel; the median of REPEATS such
pairs, whose spread is printed too, since a step is host time and host time varies within a process), one
32-token call under torch.profiler (its operators by host time, its kernels by GPU time, and the GPU time of all
its kernels) and one under cProfile (Python's functions by own and cumulative time). Eager runs first and last,
to show how far the machine drifted between. The last sequence's final eighth is padding. A development aid
beside benchmarks/models.py, whose generate() figure is one whole call.

    python benchmarks/t5_generate.py BATCH SEQ_LEN [REPEATS]
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import transformers
from models import FAMILIES, build, t5_config
from torch.profiler import ProfilerActivity, profile

TOKENS = 32


def generate_calls(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, system: str, repeats: int):
    def run(t: int = TOKENS):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=t, min_new_tokens=t
            )

    def timed(t: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(t)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run()
    run(4)
    steps = sorted((timed(TOKENS) - timed(4)) / (TOKENS - 4) * 1e3 for _ in range(repeats))
    batch, n = ids.shape
    print(
        f"{system}: B={batch} N={n} {statistics.median(steps):.2f} ms a decode step (median of {repeats}; "
        f"{steps[0]:.2f} to {steps[-1]:.2f})",
        flush=True,
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{system}: profiled {TOKENS}-token call: {kernels / 1e3:.1f} ms of GPU kernels in {launches} launches")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    host = cProfile.Profile()
    host.enable()
    run()
    torch.cuda.synchronize()
    host.disable()
    for order, limit in (("tottime", 25), ("cumtime", 40)):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(limit)
        print(f"{system}: cProfile of a {TOKENS}-token call by {order}\n{text.getvalue()}")


def main() -> None:
    cfg = t5_config(False)
    batch, n = int(sys.argv[1]), int(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (batch, n), generator=g).cuda()
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, n - n // 8 :] = 0
    mask = mask.cuda()
    torch.manual_seed(0)
    weights = transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager").state_dict()
    for system in ["eager", "sdpa", "relgen", "eager"]:
        model = build(FAMILIES["t5"], cfg, weights, system).eval()
        generate_calls(model, ids, mask, system, repeats)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
