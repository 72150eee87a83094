"""Kernel launches that skip Triton's per-call specialisation once a call of the same kind was launched.

`kernel[grid](*args, **constexprs)` makes Triton re-derive, on every call, each argument's specialisation (a
tensor's dtype and 16-byte alignment, an integer's width, divisibility by 16 and whether it equals 1, which
arguments are None) and the cache key of the compiled kernel, before its C launcher runs. A relgen forward passes
~40 arguments per launch, so at N ≤ 1K, where a call is host-bound on the H200, that bookkeeping is a visible share
of the call (docs/performance.md, host time).

`Launcher` keeps the compiled kernel Triton returned under a *fingerprint* of the launch: the integers' values
(only their width for the kernel's `do_not_specialize` parameters, e.g. a per-step dropout seed, so that a new
value is no miss), the other arguments' specialisation read in Python, the current device and the keyword
arguments. A fingerprint never merges two launches Triton would tell apart (it tells apart launches Triton merges:
that costs one more miss, not a wrong kernel), and any argument of a kind it does not know sends the launch
through Triton's path.
On a hit the launch goes through the compiled kernel's own launcher (`CompiledKernel[grid](*all_args)`), with
the same stream, launch hooks and scratch allocation as Triton's path. A launch whose integers are new (a decode
step's key length, a batch's longest sequence) is looked up once more by Triton's own classes of them (type, equal
to 1, a multiple of 16): the kernel Triton would pick for it is then one already kept, and it is kept under the
new values too.

Under the interpreter every launch takes Triton's path (there is no compiled kernel to keep), one launch at a
time: the interpreter keeps its grid position and its patches of triton.language in process-wide state, so
launches from several threads would corrupt each other.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from relgen.backend import SYNTAX_TREES

#: fingerprint of an argument Launcher does not know: the launch takes Triton's own path
_UNKNOWN = object()
#: the element types of a tuple fingerprinted as it is (a tensor's strides)
_INT = frozenset((int,))

#: launch kinds kept per kernel (least recently used first out): calls of one shape repeat the same few
CAPACITY = 64
#: held by every launch in Triton's interpreter (see the module's docstring), which also rewrites its kernels'
#: syntax trees there
_INTERPRETER_LOCK = SYNTAX_TREES


def _width(value: int) -> str:
    """What Triton tells apart in an integer it does not specialise on: the type it passes it as."""
    if -(2**31) <= value < 2**31:
        return "i32"
    return "i64" if -(2**63) <= value < 2**63 else "u64"


def _int_class(value: int) -> tuple[str, bool, bool]:
    """What Triton specialises an integer on (triton's native_specialize_impl): its type, whether it is 1 (compiled
    as a constant) and whether it is a multiple of 16."""
    return (_width(value), value == 1, value % 16 == 0)


def _class_of(arg: Any) -> Any:
    """_fingerprint with integers, in tuples too, by Triton's class of them instead of their value."""
    kind = type(arg)
    if kind is int:
        return _int_class(arg)
    if kind is tuple:
        parts = tuple(_class_of(a) for a in arg)
        return _UNKNOWN if any(part is _UNKNOWN for part in parts) else (tuple, parts)
    return _fingerprint(arg)


def _fingerprint(arg: Any) -> Any:
    """What Triton specialises a non-integer kernel argument on (or finer), or _UNKNOWN. Integers are keyed by
    their value (see Launcher.launch), in a tuple too (a tensor's (batch, head, token) strides): Triton specialises
    a tuple's elements one by one, and never leaves them to run time (do_not_specialize names whole parameters)."""
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is tuple and _INT.issuperset(map(type, arg)):  # strides: read in C, half the time of the loop below
        return (tuple, arg)
    if kind is float or kind is bool or arg is None:
        return kind
    if kind is tuple:
        parts = tuple(a if type(a) is int else _fingerprint(a) for a in arg)
        return _UNKNOWN if any(part is _UNKNOWN for part in parts) else (tuple, parts)
    if kind.__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor: its type names dtype and box
        return (arg.base.dtype, tuple(arg.block_shape), arg.padding)
    return _UNKNOWN


class Launcher:
    """Wraps a @triton.jit kernel; `Launcher(kernel)[grid](*args, **constexprs_and_options)` launches it."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._by_class: OrderedDict[tuple, Any] = OrderedDict()  # the same kernels, by class_key
        self._lock = threading.Lock()  # calls from several threads share the kept kernels
        self._interpreted = type(kernel).__name__ == "InterpretedFunction"
        self._tail: tuple[int, list[str], list[Any]] = (-1, [], [])
        parameters = list(inspect.signature(kernel.fn).parameters.values())
        # the interpreter's kernels keep the decorator's arguments as given, and no parsed parameters: read alike,
        # the keys of benchmarks/host_time.py's stubbed launches (on the CPU) are those of the GPU's launches
        options = getattr(kernel, "kwargs", {})
        unspecialised = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ()
        #: positions of the parameters Triton does not specialise on (names or positions in do_not_specialize)
        self._by_width = tuple(i for i, p in enumerate(parameters) if p.name in unspecialised or i in unspecialised)
        #: positions of constexpr parameters: a value given there is compiled in, so class_key keeps it
        params = getattr(kernel, "params", None)
        constexpr = [p.is_constexpr for p in params] if params is not None else map(_is_constexpr, parameters)
        self._by_value = frozenset(i for i, is_constexpr in enumerate(constexpr) if is_constexpr)

    @property
    def fn(self) -> Callable[..., Any]:
        """The Python function under the kernel (for twins compiled with other specialisations)."""
        return self.kernel.fn

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """The launch's key among the kept kernels, or None for a launch that takes Triton's path."""
        # integers by value: finer than Triton's classes (1, multiple of 16, width) and twice as fast to read; the
        # sizes and strides of a training loop or a benchmark repeat. An unspecialised one (a seed that changes
        # per call) by its width, as Triton tells it apart
        fingerprint = [a if type(a) is int else _fingerprint(a) for a in args]
        for i in self._by_width:
            if i < len(args) and type(args[i]) is int:
                fingerprint[i] = _width(args[i])
        fingerprint = tuple(fingerprint)
        return (_device(), fingerprint, *kwargs.items()) if _UNKNOWN not in fingerprint else None

    def class_key(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """The launch's key by Triton's classes of its integers (_int_class; unspecialised ones by width, constexpr
        ones by value): launches with equal class keys are compiled alike by Triton."""
        fingerprint = []
        for i, a in enumerate(args):
            if type(a) is int and i in self._by_value:
                fingerprint.append(a)
            elif type(a) is int and i in self._by_width:
                fingerprint.append(_width(a))
            else:
                fingerprint.append(_class_of(a))
        fingerprint = tuple(fingerprint)
        return (_device(), fingerprint, *kwargs.items()) if _UNKNOWN not in fingerprint else None

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if self._interpreted:
            with _INTERPRETER_LOCK:
                self.kernel[grid](*args, **kwargs)
            return  # (the interpreter returns nothing to keep)
        key = self.key(args, kwargs)
        compiled = self.lookup(key, args, kwargs) if key is not None else None
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if compiled is not None and key is not None:
                # the first launch may have initialised CUDA: both keys again, with the device
                self.keep((_device(), *key[1:]), args, kwargs, compiled)
            return
        compiled[_grid3(grid)](*args, *self._constexprs(len(args), kwargs))

    def lookup(self, key: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The kernel kept for the launch of this key, or one kept for its class (class_key), then kept under the
        key too; None for a launch Triton has to specialise and compile."""
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        by_class = self.class_key(args, kwargs)
        with self._lock:
            compiled = self._by_class.get(by_class)
            if compiled is not None:
                self._by_class.move_to_end(by_class)
        if compiled is not None:
            self._keep(self._compiled, key, compiled)
        return compiled

    def keep(self, key: tuple, args: tuple, kwargs: dict[str, Any], compiled: Any) -> None:
        """Keep the kernel Triton compiled for this launch under its key and its class key."""
        self._keep(self._compiled, key, compiled)
        self._keep(self._by_class, self.class_key(args, kwargs), compiled)

    def _keep(self, kept: OrderedDict, key: tuple, compiled: Any) -> None:
        with self._lock:
            kept[key] = compiled
            if len(kept) > CAPACITY:
                kept.popitem(last=False)

    def _constexprs(self, given: int, kwargs: dict[str, Any]) -> map:
        """The kernel's parameters after the positional ones, in signature order (the compiled kernel's launcher
        takes every parameter, constexprs included; it skips those itself)."""
        tail = self._tail  # read once: another thread may replace it
        if tail[0] != given:
            rest = list(inspect.signature(self.kernel.fn).parameters.values())[given:]
            tail = self._tail = (given, [p.name for p in rest], [p.default for p in rest])
        _, names, defaults = tail
        return map(kwargs.get, names, defaults)


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    # as Triton's KernelParam.is_constexpr reads the annotation (a class, or a string under postponed annotations)
    return "constexpr" in str(parameter.annotation)


def _device() -> int | None:
    """The current CUDA device (Triton launches there), or None before CUDA is initialised."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
