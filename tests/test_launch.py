"""relgen.runtime.launch.Launcher: a launch reuses the compiled kernel only where Triton would pick the same one.

The fingerprint is checked against Triton's own specialisation (`native_specialize_impl`, which needs no GPU): two
arguments with the same fingerprint must specialise alike. The launcher's bookkeeping is checked with a stand-in
kernel (the interpreter compiles nothing, so the fast path only runs on the GPU: every GPU test launches through
it)."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from relgen.runtime import launch
from relgen.runtime.launch import Launcher, _class_of, _fingerprint, _int_class, _width


def triton_specialisation(arg):
    return native_specialize_impl(CUDABackend, arg, False, True, True)


def descriptors():
    from triton.tools.tensor_descriptor import TensorDescriptor

    made = []
    for dtype in (torch.float16, torch.float32):
        k = torch.zeros(2, 3, 128, 64, dtype=dtype)
        for box in ([1, 1, 64, 64], [1, 1, 32, 64]):
            made.append(TensorDescriptor(k, list(k.shape), list(k.stride()), box))
    return made


def test_fingerprints_no_coarser_than_triton():
    buffer = torch.zeros(64, dtype=torch.float16)
    tensors = [buffer, buffer[1:], buffer[8:], buffer.float(), buffer.float()[1:], buffer.to(torch.bfloat16)]
    others = [None, True, False, 0.5, 3.0, 0, 1, 16, 17, 2**31, *descriptors()]
    fingerprint = lambda arg: arg if type(arg) is int else _fingerprint(arg)  # noqa: E731 (Launcher.launch's)
    for a in tensors + others:
        for b in tensors + others:
            if fingerprint(a) == fingerprint(b):
                assert triton_specialisation(a) == triton_specialisation(b), (a, b)
    assert _fingerprint(buffer) != _fingerprint(buffer[1:])  # 2 bytes in: no longer on 16 bytes
    assert _fingerprint(buffer) == _fingerprint(buffer[8:])  # 16 bytes in


def test_tuple_fingerprints_no_coarser_than_triton():
    """A tuple argument (a tensor's strides) is specialised element by element, and do_not_specialize does not
    reach into it: a tuple of integers is keyed by their values."""
    buffer = torch.zeros(64, dtype=torch.float16)
    tuples = [(0, 1, 16), (0, 1, 17), (0, 16, 1), (1, 16, 32), (16, 16, 16), (2**31, 1, 1), (17,), (buffer, 1)]
    tuples += [(buffer[1:], 1), (None, 0.5), (True, 16)]
    for a in tuples:
        for b in tuples:
            if _fingerprint(a) == _fingerprint(b):
                assert triton_specialisation(a) == triton_specialisation(b), (a, b)
        # what Triton gives a tuple it is told not to specialise: the same as it gives it otherwise
        assert native_specialize_impl(CUDABackend, a, False, False, True) == triton_specialisation(a), a
    assert _fingerprint((0, 1, 16)) != _fingerprint(16)
    assert _fingerprint((0, np.int64(3))) is launch._UNKNOWN


EDGES = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), 2**63 - 16, 2**63]


@given(a=st.one_of(st.sampled_from(EDGES), st.integers(-(2**63), 2**64 - 1)), b=st.sampled_from(EDGES))
def test_integer_classes_are_tritons(a, b):
    """Two integers of one class are specialised alike by Triton, and two it specialises alike share a class."""
    assert (_int_class(a) == _int_class(b)) == (triton_specialisation(a) == triton_specialisation(b)), (a, b)
    assert (_class_of((a, 3)) == _class_of((b, 3))) == (triton_specialisation((a, 3)) == triton_specialisation((b, 3)))


def test_unspecialised_integers_keyed_by_width_as_triton_tells_them_apart():
    values = [0, 1, 16, 17, -5, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**63 - 1, 2**63]
    for a in values:
        for b in values:
            same = native_specialize_impl(CUDABackend, a, False, False, True) == native_specialize_impl(
                CUDABackend, b, False, False, True
            )
            assert (_width(a) == _width(b)) == same, (a, b)


def test_generated_kernels_do_not_specialise_on_the_dropout_seed():
    """A training run draws a seed per step: specialised, 1 and the multiples of 16 would each compile the
    attention kernels again (and Launcher would miss on every new seed)."""
    import relgen

    module = relgen.compile_mechanism(Path(__file__).resolve().parents[1] / "specs" / "t5.yaml").module
    with_seed = [
        launcher
        for launcher in vars(module).values()
        if isinstance(launcher, Launcher) and "seed" in inspect.signature(launcher.fn).parameters
    ]
    assert len(with_seed) == 6  # forward, query pass, key pass and their any-length twins
    for launcher in with_seed:
        kernel = launcher.kernel  # a JITFunction, or under the interpreter what keeps triton.jit's options
        unspecialised = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
        assert "seed" in unspecialised


@pytest.mark.parametrize("spec", ["t5", "txl"])
def test_generated_kernels_name_only_their_own_scalar_parameters_as_unspecialised(spec):
    """do_not_specialize takes effect only on a parameter of that name, and never inside a tuple argument (Triton
    specialises a tuple's elements regardless): a name bundled away or renamed would be ignored in silence, and
    every new window size, stride or seed would compile the kernels again."""
    import relgen

    module = relgen.compile_mechanism(Path(__file__).resolve().parents[1] / "specs" / f"{spec}.yaml").module
    checked = 0
    for launcher in vars(module).values():
        if not isinstance(launcher, Launcher):
            continue
        kernel = launcher.kernel
        unspecialised = (kernel.kwargs if hasattr(kernel, "kwargs") else vars(kernel)).get("do_not_specialize") or []
        parameters = inspect.signature(launcher.fn).parameters
        assert set(unspecialised) <= set(parameters), (launcher.fn.__name__, set(unspecialised) - set(parameters))
        checked += bool(unspecialised)
    assert checked == 6  # forward, query pass, key pass and their any-length twins


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", grid, args))


class _Kernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call, returns a compiled kernel."""

    def __init__(self, compiles=True):
        self.log, self.compiles = [], compiles

    @staticmethod
    def fn(X, n, flag, BLOCK: int = 16, MODE: int = 0):
        pass

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log) if self.compiles else None

        return run


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(launch, "_device", lambda: 0)


def paths(kernel):
    return [entry[0] for entry in kernel.log]


def test_repeat_launch_takes_the_compiled_kernel(on_device):
    kernel = _Kernel()
    launcher = Launcher(kernel)
    x = torch.zeros(32, dtype=torch.float16)
    launcher[(4, 2)](x, 17, True, BLOCK=32, num_warps=4)
    y = x[8:]  # 16 bytes on: aligned as x
    launcher[(8,)](y, 17, False, BLOCK=32, num_warps=4)  # a bool is never specialised
    assert paths(kernel) == ["triton", "fast"]
    # every parameter in signature order, defaults filled in; the grid padded to three dimensions
    _, grid, args = kernel.log[1]
    assert grid == (8, 1, 1) and args[0] is y and args[1:] == (17, False, 32, 0)


@pytest.mark.parametrize(
    "changed",
    [
        {"n": 32},  # a multiple of 16 now
        {"n": 1},  # Triton compiles 1 as a constant
        {"n": 2**31 + 1},  # 64-bit now
        {"x": torch.zeros(32, dtype=torch.float16)[1:]},  # off 16 bytes
        {"x": torch.zeros(32, dtype=torch.float32)},
        {"x": None},
        {"BLOCK": 64},
        {"num_warps": 8},
    ],
)
def test_a_launch_triton_would_compile_apart_takes_its_path(on_device, changed):
    kernel = _Kernel()
    launcher = Launcher(kernel)
    call = {"x": torch.zeros(32, dtype=torch.float16), "n": 17, "BLOCK": 32, "num_warps": 4}

    def run(x, n, BLOCK, num_warps):
        launcher[(1,)](x, n, True, BLOCK=BLOCK, num_warps=num_warps)

    run(**call)
    run(**{**call, **changed})
    run(**{**call, **changed})
    assert paths(kernel) == ["triton", "triton", "fast"]


def test_new_integers_of_a_kept_class_take_its_kernel(on_device):
    """A decode step's key length grows by one each step: a value never launched whose Triton class (type, equal to
    1, a multiple of 16) a kept kernel was compiled for takes that kernel, and is kept under its value too."""
    kernel = _Kernel()
    launcher = Launcher(kernel)
    x = torch.zeros(32, dtype=torch.float16)
    for n in (17, 18, 18, 32, 48, 1, 2**31 + 3, 2**31 + 5, (0, 17), (0, 19), (1, 19)):
        launcher[(1,)](x, n, True, BLOCK=32)
    assert paths(kernel) == [
        "triton",
        "fast",
        "fast",
        "triton",
        "fast",
        "triton",
        "triton",
        "fast",
        "triton",
        "fast",
        "triton",
    ]
    assert kernel.log[1][2][1] == 18  # the new value itself
    assert len(launcher._compiled) == 10 and len(launcher._by_class) == 6  # every value; every class


def test_integers_given_to_constexpr_parameters_stay_keyed_by_value(on_device):
    """A positional argument of a constexpr parameter is compiled in: a new value is a new kernel."""
    kernel = _Kernel()
    kernel.params = [type("Param", (), {"is_constexpr": name == "n"})() for name in ("X", "n", "flag")]
    launcher = Launcher(kernel)
    x = torch.zeros(32, dtype=torch.float16)
    for n in (17, 18, 18):
        launcher[(1,)](x, n, True)
    assert paths(kernel) == ["triton", "triton", "fast"]


def test_unspecialised_integers_reuse_the_compiled_kernel_until_their_width_changes(on_device):
    kernel = _Kernel()
    kernel.do_not_specialize = ["n"]
    launcher = Launcher(kernel)
    x = torch.zeros(32, dtype=torch.float16)
    for n in (17, 1, 32, 2**31 - 1, 2**31, 2**40):  # one width, then 64 bits
        launcher[(1,)](x, n, True, BLOCK=32)
    assert paths(kernel) == ["triton", "fast", "fast", "fast", "triton", "fast"]
    assert kernel.log[2][2][1] == 32  # the fast path passes the value itself


def test_an_interpreted_kernels_launches_are_keyed_as_the_compiled_kernels():
    """Triton's interpreter keeps the decorator's arguments as given (`kwargs`) and parses no parameters: the
    keys read from it (those of benchmarks/host_time.py's stubbed launches) are the compiled kernel's, an
    unspecialised integer by its width and a constexpr one by its value."""

    def fn(X, seed, n, BLOCK: tl.constexpr = 16):
        pass

    interpreted = type("InterpretedFunction", (), {"fn": staticmethod(fn), "kwargs": {"do_not_specialize": ["seed"]}})
    compiled = type("JITFunction", (), {"fn": staticmethod(fn), "do_not_specialize": ["seed"]})
    compiled.params = [type("Param", (), {"is_constexpr": name == "BLOCK"})() for name in ("X", "seed", "n", "BLOCK")]
    x = torch.zeros(32, dtype=torch.float16)
    for args in ((x, 5, 17, 64), (x, 6, 17, 64), (x, 6, 18, 64), (x, 6, 17, 32)):
        keys = [Launcher(kernel()).key(args, {}) for kernel in (interpreted, compiled)]
        classes = [Launcher(kernel()).class_key(args, {}) for kernel in (interpreted, compiled)]
        assert keys[0] == keys[1] and classes[0] == classes[1]
    launcher = Launcher(interpreted())
    assert launcher.key((x, 5, 17, 64), {}) == launcher.key((x, 6, 17, 64), {})
    assert launcher.class_key((x, 5, 17, 64), {}) != launcher.class_key((x, 5, 17, 32), {})


def test_tuple_arguments_take_the_compiled_kernel_until_an_element_changes(on_device):
    kernel = _Kernel()
    launcher = Launcher(kernel)
    x = torch.zeros(32, dtype=torch.float16)
    for strides in ((0, 64, 1), (0, 64, 1), (0, 65, 1), (0, 65, 1), (0, 65, np.int64(1))):
        launcher[(1,)](x, strides, True)
    assert paths(kernel) == ["triton", "fast", "triton", "fast", "triton"]
    assert kernel.log[1][2][1] == (0, 64, 1)  # the tuple itself, for the compiled kernel's launcher to unpack


def test_launch_kinds_beyond_capacity_evict_the_least_recent(on_device, monkeypatch):
    monkeypatch.setattr(launch, "CAPACITY", 2)
    kernel = _Kernel()
    launcher = Launcher(kernel)
    x = torch.zeros(4)
    for n in (17, 32, 17, 2**31 + 1, 17):  # three classes: 32 is evicted by 2³¹ + 1 (17 was used since)
        launcher[(1,)](x, n, True)
    assert paths(kernel) == ["triton", "triton", "fast", "triton", "fast"]
    assert set(launcher._compiled) == {(0, ((x.dtype, True), n, bool)) for n in (17, 2**31 + 1)}
    # the class table keeps its own recency: 2³¹ + 1's class pushed out 17's (first in), not 32's
    launcher[(1,)](x, 48, True)
    launcher[(1,)](x, 31, True)
    assert paths(kernel)[5:] == ["fast", "triton"]


def test_unknown_arguments_and_the_interpreter_always_take_tritons_path(on_device):
    kernel = _Kernel()
    launcher = Launcher(kernel)
    for _ in range(2):
        launcher[(1,)](torch.zeros(4), np.int64(3), True)
    interpreted = _Kernel(compiles=False)
    for _ in range(2):
        Launcher(interpreted)[(1,)](torch.zeros(4), 3, True)
    assert paths(kernel) == paths(interpreted) == ["triton", "triton"]
