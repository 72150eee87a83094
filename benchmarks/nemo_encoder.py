"""NeMo FastConformer / Parakeet encoders on relgen's kernels (relgen.integrations.patch) against NeMo's own
attention, eager and SDPA (`use_pytorch_sdpa`), on long recordings.

Random-init encoders of real sizes (NeMo's config values, written here; no download), synthetic 80-dim features at
100 frames per second, weights fp32, computation under autocast in each --dtypes (fp32: no autocast). Systems:

* ``nemo``: NeMo's eager attention (a dense [B, H, T, 2T − 1] relative score per layer);
* ``nemo-sdpa``: ``use_pytorch_sdpa=True`` (SDPA with the dense relative score as its additive mask);
* ``relgen``: patched with ``attention_dtype=torch.float32``, the kernels in fp32 (the other systems' error is
  measured against it);
* ``relgen-bf16``, ``relgen-fp16``: patched with ``attention_dtype`` bf16 / fp16 (under autocast the patched model's
  default is NeMo's own attention dtype, bf16 on GPUs with bf16: ``relgen-bf16``);
* ``relgen-recompute`` (training only): patched with ``recompute_projections=True``;
* ``relgen-bf16-tiled``: ``relgen-bf16`` with ``projections="tiled"`` (the relation products inside the tiles:
  no stored Z̃ of about T × 2T entries a head, slower kernels).

Inference: RTFx (audio seconds / wall seconds of the encoder's forward, median of the timed runs) and peak memory
on batches of 30 s segments (lengths 80–100 % of 30 s: padded) and on whole recordings of 10, 30 and 60 minutes
(batch 1). Each system's output is compared with the ``relgen`` output of the same case (relative ℓ2 and
max|a − e| / max|e|): the error of the half-precision options against the fp32 path, and of NeMo's own attention.
Training: one step (forward, backward of a mean square; no optimizer) in train mode (dropout on) at 30 s, 2, 5, 9
and 15 minutes. Every case that runs out of memory is recorded as "OOM"; the JSON is rewritten after every case
and ``--resume`` skips the cases it holds. ``--profile`` runs each training case once more under torch.profiler:
its GPU kernels' time and launches, the host's own time, the kernels and the host's operators that took longest,
and each place where the step made the host wait for the GPU (torch.cuda's sync debug mode; into the JSON).

NeMo need not be installed: ``--nemo-site DIR`` appends a folder to sys.path, made by

    pip install --no-deps --target DIR nemo_toolkit==3.0.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 einops wrapt
    pip install --target DIR huggingface_hub packaging pyyaml tqdm   # where they are not installed

(NeMo's module files then need nothing else beside torch). Where NeMo's ASR collection imports, the encoder is
NeMo's own ``ConformerEncoder``; otherwise a stack of NeMo's own modules (ConvSubsampling, RelPositionalEncoding,
ConformerLayer) run as ConformerEncoder's offline forward runs them, masks included (the output says which).

    python benchmarks/nemo_encoder.py --model parakeet --dtypes bf16,fp16 --out DIR [--nemo-site DIR] [--resume]
    python benchmarks/nemo_encoder.py --smoke --out /tmp/nemo_smoke      # tiny sizes, runs on a CPU

On a CPU the kernels run in Triton's interpreter: its times say nothing, and its bf16 dot products are not exact
(--smoke runs fp32 and the fp16 option); --smoke only proves that every measurement runs, and, where the ASR
collection imports, how far the stack is from ConformerEncoder's output (0 on a CPU).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before Triton is imported: the kernels then run in its interpreter (--smoke)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

ROOT = Path(__file__).resolve().parent.parent
FRAMES_PER_SECOND = 100  # NeMo's 10 ms feature hop

#: NeMo's encoder configs (FastConformer): Parakeet's 0.6B encoder and FastConformer-L
COMMON = dict(
    feat_in=80,
    n_heads=8,
    subsampling="dw_striding",
    subsampling_factor=8,
    subsampling_conv_channels=256,
    ff_expansion_factor=4,
    self_attention_model="rel_pos",
    att_context_size=[-1, -1],
    xscaling=True,
    untie_biases=True,
    pos_emb_max_len=5000,
    conv_kernel_size=9,
    conv_norm_type="batch_norm",
    dropout=0.1,
    dropout_pre_encoder=0.1,
    dropout_emb=0.0,
    dropout_att=0.1,
)
MODELS = {
    "parakeet": dict(COMMON, n_layers=24, d_model=1024),
    "fastconformer-l": dict(COMMON, n_layers=17, d_model=512),
    # --smoke: head dim 16, T ≤ 48 tokens, so that Triton's interpreter finishes in seconds
    "smoke": dict(COMMON, n_layers=2, d_model=32, n_heads=2, subsampling_conv_channels=16, ff_expansion_factor=2),
}

#: system → (use_pytorch_sdpa, patch options or None for NeMo's own attention)
SYSTEMS: dict[str, tuple[bool, dict[str, Any] | None]] = {
    "nemo": (False, None),
    "nemo-sdpa": (True, None),
    "relgen": (False, {"attention_dtype": torch.float32}),
    "relgen-bf16": (False, {"attention_dtype": torch.bfloat16}),
    "relgen-fp16": (False, {"attention_dtype": torch.float16}),
    "relgen-recompute": (False, {"recompute_projections": True}),
    "relgen-bf16-tiled": (False, {"attention_dtype": torch.bfloat16, "projections": "tiled"}),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# NeMo's package __init__s import the whole toolkit (Lightning, Hydra, Lhotse, ...); the encoder's module files
# need only these packages' modules, so the packages stand in empty for their __init__s
STUBBED_PACKAGES = (
    "nemo.collections",
    "nemo.collections.asr",
    "nemo.collections.asr.parts",
    "nemo.collections.asr.parts.submodules",
    "nemo.collections.asr.parts.submodules.adapters",
    "nemo.collections.asr.parts.utils",
    "nemo.collections.common",
    "nemo.collections.common.parts",
    "nemo.core",
    "nemo.core.classes",
)
ASR_DEPENDENCIES = ("omegaconf", "hydra", "lightning", "lhotse", "librosa")


# --- NeMo's modules --------------------------------------------------------------------------------------------------


@dataclass
class Nemo:
    """NeMo's classes the benchmark builds from: `encoder` is ConformerEncoder where the ASR collection imports."""

    encoder: type | None
    ConvSubsampling: type
    RelPositionalEncoding: type
    ConformerLayer: type
    version: str


def load_nemo(site: Path | None) -> Nemo:
    if site is not None:  # last: the packages installed here (torch's own dependencies) keep precedence
        sys.path.append(str(site))
    spec = importlib.util.find_spec("nemo")
    if spec is None:
        raise SystemExit("NeMo is not importable: pass --nemo-site DIR (see this script's docstring)")
    encoder = None
    if all(importlib.util.find_spec(name) is not None for name in ASR_DEPENDENCIES):
        encoder = importlib.import_module("nemo.collections.asr.modules.conformer_encoder").ConformerEncoder
    else:
        root = Path(next(iter(spec.submodule_search_locations)))
        for name in STUBBED_PACKAGES:
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
                sys.modules[name] = package
    prefix = "nemo.collections.asr.parts.submodules."
    modules = {name: importlib.import_module(prefix + name) for name in ("subsampling", "multi_head_attention")}
    layers = importlib.import_module(prefix + "conformer_modules")
    return Nemo(
        encoder,
        modules["subsampling"].ConvSubsampling,
        modules["multi_head_attention"].RelPositionalEncoding,
        layers.ConformerLayer,
        importlib.import_module("nemo.package_info").__version__,
    )


class ConformerStack(nn.Module):
    """ConformerEncoder's offline forward (nemo/collections/asr/modules/conformer_encoder.py: forward and
    forward_internal without caches, reductions, stochastic depth or interCTC) over NeMo's own modules. Parameter
    and buffer names are ConformerEncoder's, so a state_dict moves between the two."""

    def __init__(self, nemo: Nemo, cfg: dict[str, Any]):
        super().__init__()
        d_model, kernel = cfg["d_model"], cfg["conv_kernel_size"]
        self.pre_encode = nemo.ConvSubsampling(
            subsampling=cfg["subsampling"],
            subsampling_factor=cfg["subsampling_factor"],
            feat_in=cfg["feat_in"],
            feat_out=d_model,
            conv_channels=cfg["subsampling_conv_channels"],
            subsampling_conv_chunking_factor=1,
            activation=nn.ReLU(True),
            is_causal=False,
        )
        self.pos_enc = nemo.RelPositionalEncoding(
            d_model=d_model,
            dropout_rate=cfg["dropout_pre_encoder"],
            max_len=cfg["pos_emb_max_len"],
            xscale=math.sqrt(d_model) if cfg["xscaling"] else None,
            dropout_rate_emb=cfg["dropout_emb"],
        )
        self.layers = nn.ModuleList(
            nemo.ConformerLayer(
                d_model=d_model,
                d_ff=d_model * cfg["ff_expansion_factor"],
                self_attention_model="rel_pos",
                n_heads=cfg["n_heads"],
                conv_kernel_size=kernel,
                conv_norm_type=cfg["conv_norm_type"],
                conv_context_size=[(kernel - 1) // 2, (kernel - 1) // 2],
                dropout=cfg["dropout"],
                dropout_att=cfg["dropout_att"],
                pos_bias_u=None,
                pos_bias_v=None,
                att_context_size=[-1, -1],
                use_bias=True,
            )
            for _ in range(cfg["n_layers"])
        )
        self.max_audio_length = 0
        self.set_max_audio_length(cfg["pos_emb_max_len"])

    def set_max_audio_length(self, frames: int) -> None:
        # as NeMo does: the sinusoids cover the feature frames (not the subsampled ones) seen so far
        self.max_audio_length = frames
        weight = next(self.parameters())
        self.pos_enc.extend_pe(frames, weight.device, weight.dtype)

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if audio_signal.size(2) > self.max_audio_length:
            self.set_max_audio_length(audio_signal.size(2))
        x, length = self.pre_encode(x=audio_signal.transpose(1, 2), lengths=length)
        length = length.to(torch.int64)
        x, pos_emb = self.pos_enc(x=x, cache_len=0)
        pad_mask, att_mask = nemo_masks(length, x.size(1))
        for layer in self.layers:
            x = layer(x=x, att_mask=att_mask, pos_emb=pos_emb, pad_mask=pad_mask)
        return x.transpose(1, 2), length


def nemo_masks(length: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ConformerEncoder._create_masks for an unlimited 'regular' context, operation for operation (the dense
    [B, T, T] mask and its temporaries are part of what NeMo's encoder costs)."""
    device = length.device
    att_mask = torch.ones(1, frames, frames, dtype=torch.bool, device=device)
    pad_mask = torch.arange(0, frames, device=device).expand(length.size(0), -1) < length.unsqueeze(-1)
    pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, frames, 1])
    pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask, pad_mask_for_att_mask.transpose(1, 2))
    att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask[:, :frames, :frames])
    return ~pad_mask, ~att_mask


def build(nemo: Nemo, cfg: dict[str, Any], prefer_stack: bool) -> nn.Module:
    if nemo.encoder is not None and not prefer_stack:
        return nemo.encoder(**cfg)
    return ConformerStack(nemo, cfg)


def set_system(model: nn.Module, system: str) -> None:
    """Switch `model` (one set of weights for every system) to `system`: NeMo's eager or SDPA attention (its own
    forward reads the flag per call) or relgen's kernels."""
    import relgen.integrations

    relgen.integrations.unpatch(model)
    sdpa, options = SYSTEMS[system]
    for layer in model.layers:
        layer.self_attn.use_pytorch_sdpa = sdpa
    if options is not None:
        relgen.integrations.patch(model, strict=True, **options)


# --- measurement ---------------------------------------------------------------------------------------------------


def autocast(dtype: torch.dtype, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed(run: Callable[[], Any], device: torch.device, reps: int) -> tuple[list[float], float | None, Any]:
    """Wall seconds of `reps` runs after one warm-up run (kernels compile there), the peak GiB over them, and the
    last run's result."""
    result = run()
    synchronize(device)
    del result
    free_memory(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return times, peak, result


def features(seconds: float, batch: int, feat_in: int, device: torch.device, padded: bool):
    frames = round(seconds * FRAMES_PER_SECOND)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, feat_in, frames, generator=generator)
    lengths = torch.full((batch,), frames, dtype=torch.int64)
    if padded and batch > 1:  # a batch of segments: 80–100 % of the longest
        lengths = (frames * torch.linspace(0.8, 1.0, batch)).round().to(torch.int64)
    return x.to(device), lengths.to(device)


def error(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    a, e = actual.double(), expected.double()
    scale = e.abs().max().item() or 1.0
    return {
        "rel_l2": ((a - e).norm() / e.norm().clamp_min(1e-30)).item(),
        "max_abs_rel": (a - e).abs().max().item() / scale,
    }


def guarded(measure: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    try:
        return measure()
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as err:  # one failing case must not end the run: recorded, with its message
        return {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    finally:
        free_memory(device)


def inference_case(model, system, x, lengths, dtype, device, reps, reference) -> dict[str, Any]:
    def measure() -> dict[str, Any]:
        set_system(model, system)
        model.eval()

        def run():
            with torch.no_grad(), autocast(dtype, device):
                return model(audio_signal=x, length=lengths)[0]

        times, peak, out = timed(run, device, reps)
        record = {"status": "ok", "times_s": times, "peak_gib": peak}
        out = out.float().cpu()
        if system == "relgen":
            reference["out"] = out
        elif "out" in reference:
            record["error_vs_relgen_fp32"] = error(out, reference["out"])
        return record

    return guarded(measure, device)


def profiled(run: Callable[[], Any], device: torch.device, top: int = 12) -> dict[str, Any]:
    """One run under torch.profiler: the GPU time of its kernels and their launches, the host's own time over all
    operators, and the `top` kernels by GPU time ([name, ms, calls])."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    events = prof.key_averages()
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "kernels_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "launches": sum(e.count for e in kernels),
        "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "top": [[e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count] for e in kernels[:top]],
        "host_top": [[e.key[:90], round(e.self_cpu_time_total / 1e3, 3), e.count] for e in host[:top]],
        "host_waits": host_waits(run, device),
    }


def host_waits(run: Callable[[], Any], device: torch.device) -> list[list]:
    """Where one run made the host wait for the GPU, by torch.cuda's sync debug mode: [the innermost two frames
    outside torch, count], most frequent first. Each wait empties the GPU's queue, so the host's next launches
    run while the GPU idles."""
    if device.type != "cuda":
        return []
    import traceback
    import warnings
    from collections import Counter

    skipped = (str(Path(torch.__file__).parent), warnings.__file__)
    places: Counter[str] = Counter()

    def record(message: Any, *_args: Any, **_kwargs: Any) -> None:
        if "synchroniz" not in str(message):  # another warning (a deprecation in NeMo's code, say)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(skipped)]
        if frames[-1].name == "host_waits":  # setting the mode itself, seen on the H200: not the run's
            return
        places[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))] += 1

    synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)  # the run's end, not one of its waits
    return [[place, count] for place, count in places.most_common()]


def training_case(model, system, x, lengths, dtype, device, reps, profile: bool = False) -> dict[str, Any]:
    def measure() -> dict[str, Any]:
        set_system(model, system)
        model.train()

        def step() -> None:
            model.zero_grad(set_to_none=True)
            with autocast(dtype, device):
                out = model(audio_signal=x, length=lengths)[0]
            out.float().square().mean().backward()

        times, peak, _ = timed(step, device, reps)
        record = {"status": "ok", "times_s": times, "peak_gib": peak}
        if profile:
            record["profile"] = profiled(step, device)
        model.zero_grad(set_to_none=True)
        return record

    return guarded(measure, device)


# --- the run -------------------------------------------------------------------------------------------------------


def cases(args) -> list[dict[str, Any]]:
    """(mode, dtype, seconds, batch) of every case, in the order they run."""
    out = []
    for dtype in args.dtypes:
        for seconds, batch in [(args.segment_s, args.segment_batch)] + [(60 * m, 1) for m in args.recordings_min]:
            out.append({"mode": "inference", "dtype": dtype, "seconds": seconds, "batch": batch})
        for seconds in args.train_s:
            batch = max(1, round(args.train_audio_s / seconds))
            out.append({"mode": "training", "dtype": dtype, "seconds": seconds, "batch": batch})
    return out


def run(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nemo = load_nemo(args.nemo_site)
    cfg = MODELS["smoke" if args.smoke else args.model]
    torch.manual_seed(0)
    model = build(nemo, cfg, args.stack).to(device)
    kind = type(model).__name__
    env = environment(args, nemo, kind, cfg, device)
    if nemo.encoder is not None and kind == "ConformerEncoder":
        env["stack_matches_encoder"] = stack_matches(nemo, cfg, model, device)
    out_json = args.out / "nemo_encoder.json"
    records: list[dict[str, Any]] = []
    if args.resume and out_json.exists():
        records = json.loads(out_json.read_text())["records"]
    done = {key(r) for r in records}
    for case in cases(args):
        dtype = DTYPES[case["dtype"]]
        x, lengths = features(case["seconds"], case["batch"], cfg["feat_in"], device, padded=case["batch"] > 1)
        systems = [s for s in args.systems if case["mode"] == "training" or s != "relgen-recompute"]
        if all(key(dict(case, system=s)) in done for s in systems):
            continue
        # the fp32 path first (run again when resuming): every other system's output is compared with it
        systems.sort(key=lambda s: s != "relgen")
        reference: dict[str, torch.Tensor] = {}
        reps = args.reps if case["seconds"] <= 600 else args.long_reps
        for system in systems:
            record = dict(case, system=system)
            if key(record) in done and system != "relgen":
                continue
            if case["mode"] == "inference":
                record.update(inference_case(model, system, x, lengths, dtype, device, reps, reference))
            else:
                record.update(training_case(model, system, x, lengths, dtype, device, reps, args.profile))
            if record.get("status") == "ok":
                median = statistics.median(record["times_s"])
                record["median_s"] = median
                if case["mode"] == "inference":
                    record["rtfx"] = case["seconds"] * case["batch"] / median
            records = [r for r in records if key(r) != key(record)] + [record]
            print(summary(record), flush=True)
            write(args.out, env, records)
        set_system(model, "nemo")
    write(args.out, env, records)
    print(f"wrote {out_json} and {args.out / 'nemo_encoder.md'}")


def stack_matches(nemo: Nemo, cfg: dict[str, Any], encoder: nn.Module, device: torch.device) -> dict[str, float]:
    """How far the stack run on ConformerEncoder's weights is from its output (fp32, eval; 0 on a CPU, where the
    two run the same operations; a GPU's convolutions may choose other algorithms)."""
    stack = ConformerStack(nemo, cfg).to(device).eval()
    stack.load_state_dict(encoder.state_dict())
    encoder.eval()
    x, lengths = features(2.0, 2, cfg["feat_in"], device, padded=True)
    with torch.no_grad():
        return error(stack(x, lengths)[0], encoder(audio_signal=x, length=lengths)[0])


def key(record: dict[str, Any]) -> tuple:
    return (record["mode"], record["dtype"], record["seconds"], record["batch"], record["system"])


def summary(record: dict[str, Any]) -> str:
    case = f"{record['mode']:9} {record['dtype']} {duration(record['seconds']):>6} ×{record['batch']:<3}"
    head = f"{case} {record['system']:16}"
    if record.get("status") != "ok":
        return f"{head} {record.get('status')} {record.get('error', '')}"
    text = f"{head} {record['median_s']:.3f} s"
    if "rtfx" in record:
        text += f"  RTFx {record['rtfx']:.1f}"
    if record["peak_gib"] is not None:
        text += f"  peak {record['peak_gib']:.2f} GiB"
    if "error_vs_relgen_fp32" in record:
        text += "  rel ℓ2 vs relgen fp32 {rel_l2:.2e}".format(**record["error_vs_relgen_fp32"])
    if "profile" in record:
        prof = record["profile"]
        text += f"  (profiled: kernels {prof['kernels_ms']:.1f} ms in {prof['launches']} launches, host "
        text += (
            f"{prof['host_ms']:.1f} ms; " + ", ".join(f"{name[:40]} {ms:.2f}" for name, ms, _ in prof["top"][:6]) + ")"
        )
        text += "\n    host: " + ", ".join(f"{name[:40]} {ms:.2f} ({n})" for name, ms, n in prof["host_top"][:8])
        waits = prof["host_waits"]
        text += f"\n    host waits for the GPU: {sum(n for _, n in waits)}"
        text += "".join(f"\n      {n:4d}  {place}" for place, n in waits[:8])
    return text


def duration(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 60 else f"{seconds / 60:g} min"


def environment(args, nemo: Nemo, kind: str, cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD") + (" (modified tree)" if git("status", "--porcelain", "-uno") else ""),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "nemo": nemo.version},
        "model": "smoke" if args.smoke else args.model,
        "config": cfg,
        "encoder": kind
        if kind == "ConformerEncoder"
        else "ConformerStack: NeMo's ConvSubsampling, RelPositionalEncoding and ConformerLayer run as "
        "ConformerEncoder's offline forward (NeMo's ASR collection was not importable)",
    }


def write(out: Path, env: dict[str, Any], records: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "nemo_encoder.json").write_text(json.dumps({"environment": env, "records": records}, indent=1) + "\n")
    (out / "nemo_encoder.md").write_text(markdown(env, records))


def markdown(env: dict[str, Any], records: list[dict[str, Any]]) -> str:
    cfg = env["config"]
    lines = [
        f"# NeMo {env['model']} encoder: NeMo's attention against relgen's kernels",
        "",
        f"{env['date']}, commit {env['git_commit']}, {env['device']}; "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        "",
        f"`{env['command']}`",
        "",
        f"Encoder: {env['encoder']}. d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, "
        f"{cfg['subsampling_factor']}× subsampling, feat_in {cfg['feat_in']}, random init, fp32 weights, autocast "
        "in the dtype shown (fp32: none).",
        "",
    ]
    if "stack_matches_encoder" in env:
        gap = env["stack_matches_encoder"]
        lines += [
            f"The stack of NeMo's modules against ConformerEncoder on its weights: rel ℓ2 {gap['rel_l2']:.1e}",
            "",
        ]
    systems = list(dict.fromkeys(r["system"] for r in records))
    for mode, value in (("inference", "RTFx / peak GiB / rel ℓ2 vs relgen fp32"), ("training", "step s / peak GiB")):
        rows = [r for r in records if r["mode"] == mode]
        if not rows:
            continue
        names = [s for s in systems if any(r["system"] == s for r in rows)]
        lines += [f"## {mode.capitalize()}: {value}", "", "| dtype | audio | batch | " + " | ".join(names) + " |"]
        lines += ["|---" * (3 + len(names)) + "|"]
        for case in dict.fromkeys((r["dtype"], r["seconds"], r["batch"]) for r in rows):
            cells = []
            for name in names:
                found = [r for r in rows if (r["dtype"], r["seconds"], r["batch"], r["system"]) == (*case, name)]
                cells.append(cell(found[0] if found else None, mode))
            lines.append(f"| {case[0]} | {duration(case[1])} | {case[2]} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "RTFx: audio seconds of the batch / median wall seconds of the encoder's forward. Peak: "
        "torch.cuda.max_memory_allocated over the timed runs (weights included). rel ℓ2: the output against the "
        "`relgen` system's (fp32 kernels) in the same case. Training: forward and backward of a mean square, no "
        "optimizer, dropout on.",
        "",
    ]
    return "\n".join(lines)


def cell(record: dict[str, Any] | None, mode: str) -> str:
    if record is None:
        return ""
    if record.get("status") != "ok":
        return record.get("status", "?")
    peak = "–" if record["peak_gib"] is None else f"{record['peak_gib']:.1f}"
    if mode == "training":
        return f"{record['median_s']:.3g} / {peak}"
    err = record.get("error_vs_relgen_fp32")
    return f"{record['rtfx']:.1f} / {peak}" + ("" if err is None else f" / {err['rel_l2']:.1e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def names(choices):
        def parse(text: str) -> list[str]:
            items = [t for t in text.split(",") if t]
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; expected some of {sorted(choices)}")
            return items

        return parse

    def numbers(text: str) -> list[float]:
        try:
            return [float(t) for t in text.split(",") if t]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[m for m in MODELS if m != "smoke"], default="parakeet")
    parser.add_argument("--systems", type=names(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--dtypes", type=names(DTYPES), default=None, help="default: bf16,fp16 (--smoke: fp32)")
    parser.add_argument("--segment-s", type=float, default=30.0, help="segment length of the batched case")
    parser.add_argument("--segment-batch", type=int, default=32)
    parser.add_argument("--recordings-min", type=numbers, default=[10.0, 30.0, 60.0])
    parser.add_argument("--train-s", type=numbers, default=[30.0, 120.0, 300.0, 540.0, 900.0])
    parser.add_argument("--train-audio-s", type=float, default=240.0, help="audio per training batch (B ≥ 1)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs of a case of at most 10 minutes of audio")
    parser.add_argument("--long-reps", type=int, default=1, help="timed runs of a longer case")
    parser.add_argument("--nemo-site", type=Path, default=None, help="a folder holding NeMo (see the docstring)")
    parser.add_argument("--stack", action="store_true", help="the stack of NeMo's modules even if the encoder imports")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/h200 (--smoke: a temp dir)")
    parser.add_argument("--resume", action="store_true", help="keep the cases --out's JSON holds")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU: proves the script runs")
    parser.add_argument("--profile", action="store_true", help="each training case once more under torch.profiler")
    args = parser.parse_args(argv)
    if args.smoke:
        # ≤ 48 tokens after 8× subsampling, one layer pair; fp16 instead of bf16 (the interpreter's bf16 dot)
        args.dtypes = args.dtypes or ["fp32"]
        args.segment_s, args.segment_batch, args.recordings_min = 2.4, 2, [0.06]
        args.train_s, args.train_audio_s, args.reps = [2.4], 4.8, 1
        args.systems = [s for s in args.systems if not s.startswith("relgen-bf16")]
        args.out = args.out or Path(tempfile.gettempdir()) / "relgen_nemo_smoke"
    args.dtypes = args.dtypes or ["bf16", "fp16"]
    args.out = args.out or ROOT / "benchmarks/results/h200"
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
