"""T5-base's greedy generate() on a GPU, HF eager and sdpa against the patched model (relgen.integrations.patch),
each a model of its own with the same random weights: the time per decode step (a 32-token call less a 4-token
one, divided by the 28 steps between them, so that the encoder and the prefill cancel), REPEATS rounds in which
every system takes its turn, so that the host's drift, which decides a host-bound step, reaches all systems alike
(the median and the spread of each are printed); then one 32-token call of each under torch.profiler (its
operators by host time, its kernels by GPU time, and the GPU time of all its kernels) and one under cProfile
(Python's functions by own and cumulative time). The last sequence's final eighth is padding. A development aid
beside benchmarks/models.py, whose generate() figure is one whole call.

    python benchmarks/t5_generate.py BATCH SEQ_LEN [REPEATS]
"""

import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch
import transformers
from models import FAMILIES, build, t5_config
from torch.profiler import ProfilerActivity, profile

TOKENS = 32
SYSTEMS = ("eager", "sdpa", "relgen")


def generator(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[int], object]:
    def run(tokens: int = TOKENS) -> object:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
            )

    return run


def decode_step_ms(run: Callable[[int], object]) -> float:
    def timed(tokens: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return (timed(TOKENS) - timed(4)) / (TOKENS - 4) * 1e3


def profiles(system: str, run: Callable[[int], object]) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(TOKENS)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"{system}: profiled {TOKENS}-token call: {gpu_ms:.1f} ms of GPU kernels in {sum(e.count for e in kernels)}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    host = cProfile.Profile()
    host.enable()
    run(TOKENS)
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
    runs = {}
    for system in SYSTEMS:
        runs[system] = generator(build(FAMILIES["t5"], cfg, weights, system).eval(), ids, mask)
        runs[system](TOKENS)  # compiles, and fills each system's caches
        runs[system](4)
    steps: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    for _ in range(repeats):
        for system in SYSTEMS:
            steps[system].append(decode_step_ms(runs[system]))
    for system in SYSTEMS:
        ms = steps[system]
        print(
            f"{system}: B={batch} N={n} {statistics.median(ms):.2f} ms a decode step (median of {repeats} rounds; "
            f"{min(ms):.2f} to {max(ms):.2f}; by round {', '.join(f'{m:.2f}' for m in ms)})",
            flush=True,
        )
    for system in SYSTEMS:
        profiles(system, runs[system])


if __name__ == "__main__":
    main()
