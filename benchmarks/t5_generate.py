"""T5-base's greedy generate() on a GPU, HF eager and sdpa against the patched model (relgen.integrations.patch),
each in a fresh model with the same random weights: the time per decode step (a 32-token call less a 4-token one,
divided by the 28 steps between them, so that the encoder and the prefill cancel) and one 32-token call under
torch.profiler (its operators by host time, its kernels by GPU time). The last sequence's final eighth is
padding. A development aid beside benchmarks/models.py, whose generate() figure is one whole call.

    python benchmarks/t5_generate.py BATCH SEQ_LEN
"""

import sys
import time

import torch
import transformers
from models import FAMILIES, build, t5_config
from torch.profiler import ProfilerActivity, profile

TOKENS = 32


def generate_calls(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, system: str, batch: int, n: int):
    def run(t: int = TOKENS):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=t, min_new_tokens=t
            )

    run()
    run(4)
    torch.cuda.synchronize()
    times = {}
    for t in (4, TOKENS):
        t0 = time.perf_counter()
        run(t)
        torch.cuda.synchronize()
        times[t] = time.perf_counter() - t0
    per_step = (times[TOKENS] - times[4]) / (TOKENS - 4)
    print(
        f"{system}: B={batch} N={n} generate {times[TOKENS] * 1e3:.1f} ms for {TOKENS} tokens, "
        f"{per_step * 1e3:.2f} ms a decode step",
        flush=True,
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    cfg = t5_config(False)
    batch, n = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (batch, n), generator=g).cuda()
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, n - n // 8 :] = 0
    mask = mask.cuda()
    torch.manual_seed(0)
    weights = transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager").state_dict()
    for system in ["eager", "sdpa", "relgen"]:
        model = build(FAMILIES["t5"], cfg, weights, system).eval()
        generate_calls(model, ids, mask, system, batch, n)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
