"""The NeMo adapter's host time per encoder forward, without a GPU: a stack of NeMo's RelPositionMultiHeadAttention
layers patched onto relgen, all handed the same mask and pos_emb as ConformerEncoder hands its layers (a new mask
each forward, as the encoder builds it), relgen's launches stubbed as in `host_time.py`; and the reads of a device
value on the host per forward (`.item()`, `bool()`, `.tolist()`), each of which makes the host wait for the GPU
there, so that the GPU idles while the host issues the next layer. NeMo's own layers are not timed: on the CPU they
compute their attention.

At Parakeet's 30 s segments (375 frames after 8× subsampling, batch 8) an encoder forward is short enough on the
H200 that its host path counts (benchmarks/nemo_encoder.py). The layers here are narrow (d_model 32, 2 heads:
NeMo's projections on the CPU would otherwise be most of the time); the torch ops of the glue run on the CPU, one
thread.

    python benchmarks/nemo_host_time.py [--layers 17] [--batch 8] [--frames 375] [--padding] [--calls 20]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from host_time import stubbed_launches

import relgen.integrations

#: the aten op through which a tensor's value reaches the host (`.item()`, `bool()`, `int()`)
_HOST_READS = ("aten._local_scalar_dense",)


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host: the ops above, and `Tensor.tolist` (a CPU tensor's
    dispatches no op; a GPU tensor's copies it to the host first), one read per call."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        tolist = self._tolist

        def counted(tensor: torch.Tensor):
            self.count += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).split(".default")[0] in _HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _stack(mha, layers: int, d_model: int, heads: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        module = mha.RelPositionMultiHeadAttention(
            n_head=heads, n_feat=d_model, dropout_rate=0.0, pos_bias_u=None, pos_bias_v=None
        )
        with torch.no_grad():
            module.pos_bias_u.normal_()
            module.pos_bias_v.normal_()
        modules.append(module.eval())
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=17)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=375)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--padding", action="store_true", help="segments of unequal length (a padding mask)")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mha = importlib.import_module("test_integration_nemo").nemo_attention_file()
    from test_integration_nemo import nemo_mask, positions

    x = torch.randn(args.batch, args.frames, args.d_model)
    real = torch.ones(args.batch, args.frames, dtype=torch.bool)
    if args.padding:
        for b in range(args.batch):
            real[b, args.frames - 7 * b :] = False
    mask = nemo_mask(real)
    pos_emb = positions(mha, x)
    stack = _stack(mha, args.layers, args.d_model, args.heads)
    for module in stack:
        relgen.integrations.patch(module)

    def run():
        h, m = x, mask.clone()  # the encoder's mask of this forward
        for layer in stack:
            h = layer(query=h, key=h, value=h, mask=m, pos_emb=pos_emb)
        return h

    with torch.no_grad(), stubbed_launches():
        run()
        reads = _HostReads()
        with reads:
            run()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls):
                run()
            best = min(best, (time.perf_counter() - start) / args.calls)
    print(
        f"relgen, {args.layers} layers, B={args.batch} T={args.frames}{' padded' if args.padding else ''}: "
        f"{best * 1e3:7.2f} ms per forward ({best / args.layers * 1e6:6.1f} µs per layer), host reads of device "
        f"values {reads.count}",
        flush=True,
    )


if __name__ == "__main__":
    main()
