"""Real models on relgen's kernels (relgen.integrations.patch) against the models' own Hugging Face code.

Random-init models of real sizes, from configs built here (no download): DeBERTa-v3-base and T5-base. Weights are
fp32, computation under autocast in each --dtype (fp32: no autocast), dropout on as in training.

* DeBERTa-v3 fine-tuning step (DebertaV2ForSequenceClassification: forward, backward, AdamW) at N = 512 … 8K with
  --tokens tokens a batch (B = tokens / N): HF eager against the same model patched.
* T5-base training step (T5ForConditionalGeneration, N = 512 … 4K encoder tokens, --decoder-len decoder tokens)
  against HF eager and HF sdpa (`attn_implementation`), and greedy `generate()` throughput (tokens/s, exactly
  --new-tokens tokens a sequence); only if `patch` serves T5 (else skipped with a message).

Step times are medians of --steps timed steps after --warmup steps (CUDA events; on a CPU, wall time), peak memory
torch.cuda.max_memory_allocated over the timed steps (parameters, gradients and AdamW's state included). Before
anything is timed, every system computes the loss and every parameter's gradient on the same batch with the same
weights, dropout off, and the patched model is compared with the unpatched one: the relative difference of the
loss, of all gradients together (ℓ2), and the largest max|g_patched − g_hf| / max|g_hf| over the parameters (T5:
also sdpa against eager, the size of a difference two correct implementations have in that dtype). An unpatched
model that runs out of memory there is retried with gradient checkpointing (same values, recomputed). Every case
that runs out of memory is recorded as "OOM". Where the memory goes: the tensors one forward saves for the
backward, summed by the module that saved them (e.g. ``T5Attention/Dropout``: an attention dropout's [B, H, N, N]
mask), next to the parameters, their gradients and AdamW's moments. Where the time goes (--profile, relgen's model
only): torch.profiler over a few steps, the GPU kernels by time summed by kind (relgen's attention kernels, GEMMs,
copies and casts, optimizer, ...), the top aten operators and the forward / backward / optimizer times. Writes
models.json and models.md (date, git commit, command line, versions, GPU) into --out.

    python benchmarks/models.py --models deberta,t5 --dtype bf16,fp16 --steps 10 --out DIR
    python benchmarks/models.py --smoke --dtype fp16,fp32 --out /tmp/models   # tiny sizes, runs on a CPU
    python benchmarks/models.py --plot FIGURE.png --json RECORDS.jsonl [--dtype bf16]

--plot draws the training steps of --json's records (the last of each model, dtype, length and system) in the
first --dtype: step time and peak memory against N, a panel each per model, every system, relgen's speed-up and
memory saving over HF eager written at its points; the dates and commits of the points drawn in the caption.

On a CPU the kernels run in Triton's interpreter: its times say nothing, and its bf16 dot products are not exact
(use fp16 or fp32 there); --smoke only proves that every measurement runs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before Triton is imported: the kernels then run in its interpreter (--smoke)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import copy
import datetime
import gc
import itertools
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from torch import nn

import relgen.integrations
from relgen.runtime.launch import Launcher

ROOT = Path(__file__).resolve().parent.parent
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------------------
def deberta_config(smoke: bool) -> transformers.DebertaV2Config:
    """DeBERTa-v3-base (microsoft/deberta-v3-base's config), or a tiny model with the same options."""
    sizes = (
        dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64, vocab_size=128)
        if smoke
        else dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072)
    )
    return transformers.DebertaV2Config(
        **{"vocab_size": 128100, **sizes},
        position_buckets=8 if smoke else 256,
        max_position_embeddings=64 if smoke else 512,
        max_relative_positions=-1,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        hidden_act="gelu",
        layer_norm_eps=1e-7,
        type_vocab_size=0,
        num_labels=2,
    )


def t5_config(smoke: bool) -> transformers.T5Config:
    """T5-base (google-t5/t5-base's config), or a tiny model with the same options."""
    sizes = (
        dict(d_model=32, d_kv=16, num_heads=2, num_layers=1, d_ff=64, vocab_size=128)
        if smoke
        else dict(d_model=768, d_kv=64, num_heads=12, num_layers=12, d_ff=3072, vocab_size=32128)
    )
    return transformers.T5Config(
        **sizes,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.1,
        feed_forward_proj="relu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


@dataclass(frozen=True)
class Family:
    """A model family: its config (real or --smoke size), its model class, the HF attention implementations relgen
    is measured against, whether generate() is timed, and its default lengths."""

    name: str
    config: Callable[[bool], transformers.PretrainedConfig]
    cls: type
    systems: tuple[str, ...]  # the HF attention implementations relgen is measured against
    generates: bool
    lengths: tuple[int, ...]  # the default --seq-lens


FAMILIES = {
    "deberta": Family(
        "deberta",
        deberta_config,
        transformers.DebertaV2ForSequenceClassification,
        ("eager",),
        generates=False,
        lengths=(512, 2048, 4096, 8192),
    ),
    "t5": Family(
        "t5",
        t5_config,
        transformers.T5ForConditionalGeneration,
        ("eager", "sdpa"),
        generates=True,
        lengths=(512, 1024, 2048, 4096),
    ),
}


def build(family: Family, config: transformers.PretrainedConfig, weights: dict, system: str) -> nn.Module:
    """The family's model for one system with the given weights: HF's own attention (eager, sdpa) or patched."""
    implementation = "eager" if system == "relgen" else system
    model = family.cls._from_config(copy.deepcopy(config), attn_implementation=implementation)
    model.load_state_dict(weights)
    model.to(DEVICE)
    if system == "relgen" and not relgen.integrations.patch(model):
        raise ValueError(f"relgen.integrations.patch serves none of {family.cls.__name__}'s attention modules")
    return model


def batch(family: Family, config: transformers.PretrainedConfig, n: int, size: int, args) -> dict[str, torch.Tensor]:
    """Random tokens, the last sequence's final eighth padded (the padding path runs), and labels."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(2, config.vocab_size, (size, n), generator=g)
    mask = torch.ones(size, n, dtype=torch.long)
    mask[-1, n - n // 8 :] = 0
    if family.name == "deberta":
        labels = torch.randint(0, config.num_labels, (size,), generator=g)
    else:
        labels = torch.randint(2, config.vocab_size, (size, args.decoder_len), generator=g)
    return {k: v.to(DEVICE) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


# ------------------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------------------
def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE, dtype=dtype)


def free_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def timed(fn: Callable[[], Any], warmup: int, steps: int) -> dict[str, Any]:
    """Median time of `steps` calls after `warmup` calls, and the peak memory over the timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        peak = None
    return {"ms": statistics.median(times), "peak_mib": peak, "times_ms": times}


def gradients(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype, reference: bool) -> dict:
    """Loss and every parameter's gradient, dropout off. A reference (an unpatched model) out of memory is retried
    with gradient checkpointing: the same values, recomputed."""
    model.eval()
    try:
        loss = backward(model, inputs, dtype)
        checkpointed = False
    except torch.OutOfMemoryError:
        if not reference:
            raise
        loss = None
    if loss is None:  # outside the except block: the failed call's tensors are released by now
        model.zero_grad(set_to_none=True)
        free_memory()
        model.gradient_checkpointing_enable()
        model.train()  # HF checkpoints only in training mode; dropout stays off
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.eval()
        loss = backward(model, inputs, dtype)
        model.gradient_checkpointing_disable()
        checkpointed = True
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"loss": loss, "grads": grads, "checkpointed": checkpointed}


def backward(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    model.zero_grad(set_to_none=True)
    with autocast(dtype):
        loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach())


def difference(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The loss's relative difference, the relative ℓ2 difference of all gradients together, and the largest
    per-parameter max|Δg| / max|g_ref| (with that parameter). A bias is measured against its layer's weight
    gradient too: a key bias shifts a whole row of scores, so its exact gradient is 0 and what both sides hold is
    the rounding of a sum of the weight gradient's terms."""
    if candidate["grads"].keys() != reference["grads"].keys():
        missing = sorted(candidate["grads"].keys() ^ reference["grads"].keys())
        raise RuntimeError(f"gradients of different parameters: {missing[:5]}")
    worst, worst_name, squared_diff, squared_norm = 0.0, None, 0.0, 0.0
    for name, want in reference["grads"].items():
        delta = candidate["grads"][name].double() - want.double()
        squared_diff += float(delta.square().sum())
        squared_norm += float(want.double().square().sum())
        scale = float(want.abs().max())
        weight = reference["grads"].get(name.removesuffix("bias") + "weight") if name.endswith("bias") else None
        if weight is not None:
            scale = max(scale, float(weight.abs().max()))
        diff = float(delta.abs().max())
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        if rel > worst:
            worst, worst_name = rel, name
    return {
        "loss_rel_diff": abs(candidate["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-30),
        "grad_rel_l2": (squared_diff / squared_norm) ** 0.5 if squared_norm > 0 else 0.0,
        "grad_max_rel_diff": worst,
        "worst_parameter": worst_name,
    }


def train_step(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> Callable[..., None]:
    """One optimisation step (forward, backward, AdamW; fp16 with a gradient scaler), dropout on. `mark(phase)`
    is called as each phase ends (forward, backward, optimizer), in stream order: Profile's phase times."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler(DEVICE, enabled=dtype == torch.float16 and DEVICE == "cuda")

    def step(mark: Callable[[str], None] = lambda _phase: None) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(dtype):
            loss = model(**inputs).loss
        mark("forward")
        scaler.scale(loss).backward()
        mark("backward")
        scaler.step(optimizer)
        scaler.update()
        mark("optimizer")

    return step


def measure_step(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype, args) -> dict[str, Any]:
    """A training step's median time and peak memory."""
    step = train_step(model, inputs, dtype)
    result = timed(step, args.warmup, args.steps)
    del step  # the optimizer's state
    model.zero_grad(set_to_none=True)
    return {"step_ms": result["ms"], "peak_mib": result["peak_mib"], "step_times_ms": result["times_ms"]}


#: kernel-name fragments by what they compute, first match wins (cuBLAS/CUTLASS names vary by version and GPU)
KERNEL_KINDS = (
    (
        "GEMM (projections, FFN, heads)",
        ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk", "aten::mm", "bmm", "addmm"),
    ),
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach")),
    ("copies and casts", ("copy", "aten::cat", "clone", "contiguous")),
    ("dropout outside the kernels", ("dropout", "bernoulli", "philox")),
    ("normalisation", ("norm",)),
    ("softmax outside the kernels", ("softmax",)),
    ("reductions", ("reduce", "sum", "mean")),
)


def relgen_kernels() -> set[str]:
    """The names of relgen's Triton kernels (the generated modules' and the runtime's), as the profiler names them,
    and of its autograd functions (what a CPU profile shows: the interpreter's kernels run inside them)."""
    names = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("relgen"):
            continue
        for obj in vars(module).values():
            # triton's JITFunction (and the interpreter's) and relgen's Launcher around one wrap the Python function
            fn = getattr(obj, "fn", None)
            if callable(fn) and (isinstance(obj, Launcher) or type(obj).__module__.startswith("triton")):
                names.add(fn.__name__)
            elif isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and obj.__module__ == name:
                names.update((obj.__name__, f"{obj.__name__}Backward"))
    return names


#: relgen's kernels that form and reduce the stored relation projections Z̃ (the rest run the attention passes)
RELGEN_PROJECTION_KERNELS = ("_project", "_reduce", "_fold")


def kernel_kind(name: str, relgen_names: set[str]) -> str:
    if name in relgen_names or name.split("(")[0] in relgen_names:
        if name.startswith(RELGEN_PROJECTION_KERNELS):
            return "relgen: relation projections Z̃ and their reductions"
        return "relgen: attention passes"
    lower = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(part in lower for part in parts)), "other")


def profile_step(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype, args) -> dict[str, Any]:
    """Where a training step's time goes: torch.profiler over --profile-steps steps (after --warmup), the GPU
    kernels by CUDA time per step (on a CPU, the operators by CPU time), summed by kind (relgen's attention
    kernels, GEMMs, copies and casts, optimizer, ...), the top aten operators by the CUDA time of the kernels
    they launch, and the forward / backward / optimizer times (CUDA events between the phases, medians)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = train_step(model, inputs, dtype)
    for _ in range(args.warmup):
        step()
    cuda = DEVICE == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = args.profile_steps
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    relgen_names = relgen_kernels()

    def per_step(us: float) -> float:
        return us / 1e3 / steps

    if cuda:  # the kernels themselves (Triton's launches have no aten operator above them)
        kernels = [(e.key, e.self_device_time_total, e.count) for e in events if e.device_type == DeviceType.CUDA]
    else:  # no device: the operators' own CPU time (the interpreter's kernels count in their callers)
        kernels = [(e.key, e.self_cpu_time_total, e.count) for e in events if not e.is_user_annotation]
    kernels = [k for k in kernels if k[1] > 0]
    total = sum(us for _, us, _ in kernels)
    kinds: dict[str, float] = {}
    for name, us, _ in kernels:
        kind = kernel_kind(name, relgen_names)
        kinds[kind] = kinds.get(kind, 0.0) + per_step(us)
    top = sorted(kernels, key=lambda k: -k[1])[: args.profile_top]
    ops = sorted(
        (e for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")),
        key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total),
    )[: args.profile_top]
    return {
        "steps": steps,
        "clock": "GPU kernels (CUDA time)" if cuda else "CPU operators (self time; Triton's interpreter)",
        "kernel_ms_per_step": per_step(total),
        "by_kind_ms_per_step": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top_kernels": [
            {
                "name": name[:200],
                "kind": kernel_kind(name, relgen_names),
                "ms_per_step": per_step(us),
                "calls_per_step": count / steps,
                "share": us / total if total else 0.0,
            }
            for name, us, count in top
        ],
        "top_operators": [
            {
                "name": e.key,
                "device_ms_per_step": per_step(e.self_device_time_total),
                "cpu_ms_per_step": per_step(e.self_cpu_time_total),
                "calls_per_step": e.count / steps,
            }
            for e in ops
        ],
        "phases_ms": phase_times(step, steps),
    }


def phase_times(step: Callable[..., None], steps: int) -> dict[str, float]:
    """Median forward, backward and optimizer times of `steps` steps (CUDA events in stream order; on a CPU, wall
    time)."""
    cuda = DEVICE == "cuda"
    marks: list[tuple[str, Any]] = []

    def mark(phase: str) -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((phase, event))
        else:
            marks.append((phase, time.perf_counter()))

    phases: dict[str, list[float]] = {}
    for _ in range(steps):
        marks.clear()
        mark("start")
        step(mark)
        if cuda:
            torch.cuda.synchronize()
        for (_, begin), (phase, end) in itertools.pairwise(marks):
            ms = begin.elapsed_time(end) if cuda else (end - begin) * 1e3
            phases.setdefault(phase, []).append(ms)
    return {phase: statistics.median(ms) for phase, ms in phases.items()}


def measure_generate(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype, args) -> dict[str, Any]:
    """Greedy decoding of exactly --new-tokens tokens a sequence (random weights would stop at random places)."""
    model.eval()

    def run() -> None:
        with torch.no_grad(), autocast(dtype):
            model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                do_sample=False,
                num_beams=1,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
            )

    result = timed(run, 1, args.generate_runs)
    tokens = inputs["input_ids"].shape[0] * args.new_tokens
    return {"generate_ms": result["ms"], "tokens_per_s": tokens / result["ms"] * 1e3, "peak_mib": result["peak_mib"]}


def saved_memory(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype, args) -> dict[str, Any]:
    """Where a training step's memory goes: the tensors one forward (train mode, dropout on) saves for the
    backward, by the module that saved them (its class and its parent's, e.g. ``T5Attention/Dropout``; each storage
    counted once, for the first module that saved it), and by module, shape and dtype (which tensors: q, k, v,
    relgen's relation projections Z̃, ...), and the parameters with their gradients and AdamW's two moments (fp32).
    MiB each."""
    model.train()
    stack: list[str] = []
    seen: set[int] = set()
    by_module: dict[str, float] = {}
    by_tensor: dict[tuple[str, str], list[float]] = {}  # (module, "[shape] dtype") → [MiB, count]

    def enter(module: nn.Module, _args: Any) -> None:
        stack.append(type(module).__name__)

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            where = "/".join(stack[-2:]) or "(outside any module)"
            by_module[where] = by_module.get(where, 0.0) + storage.nbytes() / 2**20
            kind = by_tensor.setdefault((where, f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"), [0.0, 0])
            kind[0] += storage.nbytes() / 2**20
            kind[1] += 1
        # not t itself: a saved output would then hold its own grad_fn, a cycle through autograd's C++ graph that
        # the garbage collector cannot see, and the whole graph would outlive the forward
        return t.detach()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype):
            loss = model(**inputs).loss
        del loss
    finally:
        for handle in handles:
            handle.remove()
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    top = dict(sorted(by_module.items(), key=lambda item: -item[1])[:8])
    tensors = sorted(by_tensor.items(), key=lambda item: -item[1][0])[:12]
    return {
        "saved_mib": sum(by_module.values()),
        "saved_mib_by_module": top,
        "saved_mib_by_tensor": [
            {"module": where, "tensor": kind, "mib": mib, "count": count} for (where, kind), (mib, count) in tensors
        ],
        "parameters_mib": params,
        "gradients_and_adamw_mib": 3 * params,
    }


def guarded(measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any] | None:
    """`measure(*args)`, or None if it ran out of memory."""
    try:
        result = measure(*args)
    except torch.OutOfMemoryError:
        result = None
    if result is None:  # outside the except block: the failed call's tensors are released by now
        free_memory()
    return result


# ------------------------------------------------------------------------------------------------------------
# one family
# ------------------------------------------------------------------------------------------------------------
def unserved(model: nn.Module) -> str | None:
    """None if `patch` serves the model (which is then unpatched again), else why not."""
    try:
        names = relgen.integrations.patch(model)
    except ValueError as why:
        return str(why)
    relgen.integrations.unpatch(model)
    return None if names else "patch left every attention module on the model's own code"


def run_family(family: Family, args, records: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Appends `family`'s records to `records`, calling `save` after each (a run cut short keeps its cases)."""
    config = family.config(args.smoke)
    torch.manual_seed(0)
    model = family.cls(copy.deepcopy(config))
    why = unserved(model)
    if why is not None:
        print(f"[{family.name}] skipped: {why}", flush=True)
        records.append({"model": family.name, "skipped": why})
        save()
        return
    weights = model.state_dict()
    del model
    systems = (*family.systems, "relgen")
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        for n in args.seq_lens or ([16, 32] if args.smoke else family.lengths):
            size = max(1, args.tokens // n)
            inputs = batch(family, config, n, size, args)
            case = {"model": family.name, "dtype": dtype_name, "seq_len": n, "batch": size}
            grads: dict[str, dict[str, Any]] = {}
            for system in systems:
                print(f"[{family.name}] {dtype_name} N={n} B={size} {system}", flush=True)
                record = {**case, "system": system}
                model = build(family, config, weights, system)
                result = measure_system(family, system, model, inputs, dtype, args)
                del model
                if "grads" in result:
                    grads[system] = {"loss": result["loss"], "grads": result.pop("grads")}
                record.update(result)
                free_memory()
                records.append(record)
                save()
                print(f"    {summary(record)}", flush=True)
            if dtype != torch.float32:
                grads["eager_fp32"] = fp32_reference(family, config, weights, inputs)
            records.append({**case, "system": "check", **checks(grads, family.systems)})
            save()
            del grads
            free_memory()


def measure_system(family: Family, system: str, model: nn.Module, inputs: dict, dtype: torch.dtype, args) -> dict:
    """The check's loss and gradients (under "grads"), then the step and generate() measurements; "OOM" for each
    one that ran out of memory."""
    record: dict[str, Any] = {}
    check = guarded(gradients, model, inputs, dtype, system != "relgen")
    if check is None:
        record["check"] = "OOM"
    else:
        record.update(loss=check["loss"], reference_checkpointed=check["checkpointed"], grads=check["grads"])
    record.update(guarded(measure_step, model, inputs, dtype, args) or {"step_ms": "OOM"})
    record["memory"] = guarded(saved_memory, model, inputs, dtype, args) or "OOM"
    if args.profile and system == "relgen":
        record["profile"] = guarded(profile_step, model, inputs, dtype, args) or "OOM"
    if family.generates:
        record["generate"] = guarded(measure_generate, model, inputs, dtype, args) or "OOM"
    return record


def fp32_reference(family: Family, config, weights: dict, inputs: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """HF eager's loss and gradients without autocast: what the autocast dtype's differences are measured against."""
    print(f"[{family.name}] fp32 reference (eager, no autocast)", flush=True)
    model = build(family, config, weights, "eager")
    result = guarded(gradients, model, inputs, torch.float32, True)
    del model
    free_memory()
    return result


def checks(grads: dict[str, dict[str, Any] | None], baselines: tuple[str, ...]) -> dict[str, Any]:
    """relgen against each HF implementation in the same dtype, each further HF implementation against eager, and,
    under autocast, every system against eager in fp32 (the size of the dtype's own rounding)."""
    out: dict[str, Any] = {}
    pairs = [("relgen", b) for b in baselines] + [(b, "eager") for b in baselines if b != "eager"]
    if "eager_fp32" in grads:
        pairs += [(system, "eager_fp32") for system in (*baselines, "relgen")]
    for candidate, reference in pairs:
        key = f"{candidate}_vs_{reference}"
        if grads.get(candidate) is not None and grads.get(reference) is not None:
            out[key] = difference(grads[candidate], grads[reference])
        else:
            out[key] = "OOM"
    return out


def summary(record: dict[str, Any]) -> str:
    parts = [f"step {fmt(record.get('step_ms'))} ms", f"peak {fmt(record.get('peak_mib'))} MiB"]
    if isinstance(record.get("memory"), dict):
        parts.append(f"saved {record['memory']['saved_mib']:.0f} MiB")
    if "generate" in record:
        parts.append(f"generate {fmt(record['generate'], 'tokens_per_s')} tok/s")
    return ", ".join(parts)


def fmt(value: Any, key: str | None = None, spec: str = ".1f") -> str:
    if isinstance(value, dict) and key is not None:
        value = value.get(key)
    if value is None:
        return "–"
    return value if isinstance(value, str) else format(value, spec)


# ------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD") + (" (modified tree)" if git("status", "--porcelain", "-uno") else ""),
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none (CPU: Triton's interpreter)",
    }


def markdown(env: dict[str, Any], records: list[dict[str, Any]]) -> str:
    lines = ["# Real models on relgen (benchmarks/models.py)", ""]
    lines += [f"- {key}: `{value}`" for key, value in env.items()]
    lines += ["", "Step: forward, backward and AdamW, median of the timed steps; peak: max_memory_allocated.", ""]
    lines += ["| model | dtype | N | B | system | step ms | peak MiB | speed-up (eager ms / ms) | peak / eager's |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    steps = [r for r in records if r.get("system") not in (None, "check")]
    for r in steps:
        eager = next(
            (e for e in steps if e["system"] == "eager" and all(e[k] == r[k] for k in ("model", "dtype", "seq_len"))),
            None,
        )
        speed = ratio(eager and eager.get("step_ms"), r.get("step_ms"))
        memory = ratio(r.get("peak_mib"), eager and eager.get("peak_mib"))
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['seq_len']} | {r['batch']} | {r['system']} | "
            f"{fmt(r.get('step_ms'))} | {fmt(r.get('peak_mib'), spec='.0f')} | {speed} | {memory} |"
        )
    lines += ["", "Where the memory goes: tensors one forward saves for the backward (MiB, by the module that saved"]
    lines += ["them, largest first), and parameters + gradients + AdamW's moments:", ""]
    lines += [
        "| model | dtype | N | system | saved | largest savers | parameters, gradients, AdamW |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        memory = r.get("memory")
        if isinstance(memory, dict):
            savers = ", ".join(f"{name} {mib:.0f}" for name, mib in list(memory["saved_mib_by_module"].items())[:4])
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['seq_len']} | {r['system']} | {memory['saved_mib']:.0f} | "
                f"{savers} | {memory['parameters_mib'] + memory['gradients_and_adamw_mib']:.0f} |"
            )
    lines += ["", "Largest tensors saved for the backward (module: shape dtype, MiB in all × count):", ""]
    for r in steps:
        memory = r.get("memory")
        if isinstance(memory, dict) and memory.get("saved_mib_by_tensor"):
            kinds = "; ".join(
                f"{k['module']}: {k['tensor']} {k['mib']:.1f} × {k['count']}" for k in memory["saved_mib_by_tensor"][:5]
            )
            lines.append(f"- {r['model']} {r['dtype']} N={r['seq_len']} {r['system']}: {kinds}")
    lines += profile_markdown(steps)
    generated = [r for r in steps if "generate" in r]
    if generated:
        lines += ["", "Greedy generate(), tokens/s (batch × new tokens / time of one call):", ""]
        lines += ["| dtype | N | B | system | tokens/s | ms a call |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {r['dtype']} | {r['seq_len']} | {r['batch']} | {r['system']} | "
            f"{fmt(r['generate'], 'tokens_per_s', '.0f')} | {fmt(r['generate'], 'generate_ms')} |"
            for r in generated
        ]
    lines += ["", "Loss and gradients, same batch and weights, dropout off (max rel. diff: the largest"]
    lines += ["max|Δg| / max|g_ref| over the parameters, a bias also against its weight's gradient; `eager_fp32`:"]
    lines += ["HF eager without autocast, the yardstick of the dtype's own rounding):", ""]
    lines += [
        "| model | dtype | N | comparison | loss rel. diff | grads rel. ℓ2 | grad max rel. diff | worst parameter |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r.get("system") == "check"):
        for key, value in r.items():
            if "_vs_" not in key:
                continue
            if isinstance(value, str):
                lines.append(f"| {r['model']} | {r['dtype']} | {r['seq_len']} | {key} | {value} | | | |")
            else:
                lines.append(
                    f"| {r['model']} | {r['dtype']} | {r['seq_len']} | {key} | {value['loss_rel_diff']:.2e} | "
                    f"{value['grad_rel_l2']:.2e} | {value['grad_max_rel_diff']:.2e} | `{value['worst_parameter']}` |"
                )
    lines += [f"- {r['model']}: skipped ({r['skipped']})" for r in records if "skipped" in r]
    return "\n".join(lines) + "\n"


def profile_markdown(steps: list[dict[str, Any]]) -> list[str]:
    """Each profiled case (--profile): its phases, its kernel time by kind, and its top kernels."""
    lines: list[str] = []
    for r in steps:
        prof = r.get("profile")
        if not isinstance(prof, dict):
            continue
        phases = ", ".join(f"{phase} {ms:.1f}" for phase, ms in prof["phases_ms"].items())
        lines += ["", f"Profile of {r['model']} {r['dtype']} N={r['seq_len']} B={r['batch']} {r['system']}, "]
        lines[-1] += f"{prof['clock']}, per step: {prof['kernel_ms_per_step']:.1f} ms in all; phases (ms): {phases}"
        lines += ["", "| kind | ms / step | share |", "|---|---|---|"]
        total = prof["kernel_ms_per_step"] or 1.0
        lines += [f"| {kind} | {ms:.2f} | {ms / total:.1%} |" for kind, ms in prof["by_kind_ms_per_step"].items()]
        lines += ["", "| kernel | kind | ms / step | calls / step | share |", "|---|---|---|---|---|"]
        for k in prof["top_kernels"][:15]:
            lines.append(
                f"| `{k['name'][:90]}` | {k['kind']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} | "
                f"{k['share']:.1%} |"
            )
    return lines


def ratio(numerator: Any, denominator: Any) -> str:
    if isinstance(numerator, int | float) and isinstance(denominator, int | float) and denominator > 0:
        return f"{numerator / denominator:.2f}×"
    return "–"


# ------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    def lengths(text: str) -> list[int]:
        return [int(part) for part in names(text)]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=names, default=["deberta", "t5"], help="deberta,t5")
    parser.add_argument(
        "--seq-lens",
        type=lengths,
        default=None,
        help="default DeBERTa 512,2048,4096,8192, T5 512,1024,2048,4096 (smoke: 16,32)",
    )
    parser.add_argument("--dtype", type=names, default=["bf16", "fp16"], help="autocast dtypes: bf16,fp16,fp32")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10, smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, smoke 1)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a batch, B = tokens / N (8192; smoke 32)")
    parser.add_argument("--decoder-len", type=int, default=None, help="T5 decoder tokens (default 128, smoke 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generate(): tokens (default 64, smoke 4)")
    parser.add_argument("--generate-runs", type=int, default=None, help="timed generate() calls (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="directory for models.json and models.md")
    parser.add_argument("--plot", type=Path, default=None, help="draw --json's records into this PNG, then stop")
    parser.add_argument("--json", type=Path, default=None, help="records to --plot (models.jsonl)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and lengths (proves the script on a CPU)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="relgen's training step under torch.profiler: kernels by time and kind, phases (into models.json)",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument("--profile-top", type=int, default=25, help="kernels and operators listed (default 25)")
    args = parser.parse_args(argv)
    defaults = dict(
        steps=1 if args.smoke else 10,
        warmup=1 if args.smoke else 3,
        tokens=32 if args.smoke else 8192,
        decoder_len=8 if args.smoke else 128,
        new_tokens=4 if args.smoke else 64,
        generate_runs=1 if args.smoke else 3,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.plot is not None and args.json is None:
        parser.error("--plot: needs --json RECORDS.jsonl")
    if args.plot is None and args.out is None:
        parser.error("--out: required (the directory for models.json and models.md)")
    for name in args.models:
        if name not in FAMILIES:
            parser.error(f"--models: expected names among {', '.join(FAMILIES)}, got {name!r}")
    for name in args.dtype:
        if name not in DTYPES:
            parser.error(f"--dtype: expected names among {', '.join(DTYPES)}, got {name!r}")
    if any(n < 1 or n > args.tokens for n in args.seq_lens or ()):
        parser.error(f"--seq-lens: expected lengths in [1, --tokens={args.tokens}], got {args.seq_lens}")
    return args


PLOTTED_SYSTEMS = {"eager": ("HF eager", "C1", "--"), "sdpa": ("HF sdpa", "C2", ":"), "relgen": ("relgen", "C0", "-")}


def plot(records: list[dict[str, Any]], dtype: str, path: Path) -> None:
    """Step time and peak memory against N per model (rows) for every system, in `dtype`; relgen's ratios to HF
    eager at its points. The last record of each (model, N, system) counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("dtype") == dtype and r.get("system") in PLOTTED_SYSTEMS and r.get("step_ms") is not None:
            kept[(r["model"], r["seq_len"], r["system"])] = r
    models = [m for m in FAMILIES if any(key[0] == m for key in kept)]
    if not models:
        raise SystemExit(f"--plot: no training step in {dtype} among the records")
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for col, (field, label) in enumerate((("step_ms", "step (ms)"), ("peak_mib", "peak memory (GiB)"))):
            ax = axes[row][col]
            for system, (name, color, style) in PLOTTED_SYSTEMS.items():
                points = sorted((n, r[field]) for (m, n, s), r in kept.items() if m == model and s == system)
                if not points:
                    continue
                ys = [y / 1024 if field == "peak_mib" else y for _, y in points]
                ax.plot([n for n, _ in points], ys, style, marker="o", color=color, label=name,
                        linewidth=2.4 if system == "relgen" else 1.2)  # fmt: skip
                if system == "relgen":
                    for (n, y), shown in zip(points, ys, strict=True):
                        eager = kept.get((model, n, "eager"))
                        if eager is not None and y > 0:
                            ax.annotate(f"{eager[field] / y:.2f}×", (n, shown), textcoords="offset points",
                                        xytext=(0, -13), ha="center", fontsize=8, color=color)  # fmt: skip
            ax.set_xscale("log", base=2)
            lengths = sorted({n for (m, n, _) in kept if m == model})
            ax.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
            ax.minorticks_off()
            ax.set_xlabel("N (tokens a sequence; 8K tokens a batch)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{model}: {label.split(' (')[0]}, {dtype} autocast")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    trees = sorted({(r.get("date", "?"), r.get("commit", "?")) for r in kept.values()})
    gpus = sorted({r.get("gpu") for r in kept.values() if r.get("gpu")})
    caption = "; ".join(f"{d} {c}" for d, c in trees) + (f" ({', '.join(gpus)})" if gpus else "")
    fig.text(0.5, 0.005, f"benchmarks/models.py records: {caption}", ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot is not None:
        records = [json.loads(line) for line in args.json.read_text().splitlines() if line.strip()]
        plot(records, args.dtype[0], args.plot)
        return
    env = environment()
    records: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "models.json").write_text(json.dumps({"environment": env, "records": records}, indent=1) + "\n")
        (args.out / "models.md").write_text(markdown(env, records))

    for name in args.models:
        run_family(FAMILIES[name], args, records, save)
    save()
    print(f"wrote {args.out / 'models.json'} and {args.out / 'models.md'}")


if __name__ == "__main__":
    main()
