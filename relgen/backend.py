"""Where relgen's kernels run: a CUDA GPU, or Triton's interpreter on the CPU. Every stage may ask (it imports
nothing of relgen's); `configure_triton` sets the interpreter up for the Python API, the CLI and the tests."""

from __future__ import annotations

import os
import sys
import threading

import torch

#: held wherever relgen converts Python syntax trees (codegen's normal form of τ) and by every launch in Triton's
#: interpreter (which parses and compiles its kernels' trees on their first run): CPython 3.11 counts the
#: converter's recursion in process-wide state, so two threads converting at once can fail with "SystemError: AST
#: constructor recursion depth mismatch"
SYNTAX_TREES = threading.RLock()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (CUDA graphs; torch.compile's mode='reduce-overhead')."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------------------------------------
# Triton's set-up: its interpreter on a machine without a CUDA device
# ------------------------------------------------------------------------------------------------------------
#: the first numpy whose integer semantics break the interpreter's loops with bounds known only at run time
INTERPRETER_NUMPY_LIMIT = (2, 4)


def configure_triton() -> None:
    """Run relgen's kernels in Triton's interpreter on the CPU when no CUDA device exists and TRITON_INTERPRET is
    unset (the Python API, the CLI and the tests call this before relgen's first kernel is defined), and check
    that the interpreter can run them. An explicit TRITON_INTERPRET is left as it is.

    Triton reads TRITON_INTERPRET when a kernel is decorated, so importing triton earlier does no harm; kernels
    relgen decorated before (relgen.runtime.dropout) without it cannot be redone, which is a one-line RuntimeError."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        dropout = sys.modules.get("relgen.runtime.dropout")  # relgen's kernels outside the generated modules
        if dropout is not None and type(dropout.dropout_keep).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "relgen: no CUDA device, and relgen's kernels were defined before TRITON_INTERPRET was set: set "
                "TRITON_INTERPRET=1 in the environment before Python starts (relgen then runs them in Triton's "
                "interpreter on the CPU)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreting():
        import numpy

        check_interpreter_numpy(numpy.__version__)


def check_interpreter_numpy(version: str) -> None:
    """A RuntimeError when numpy `version` is one Triton's interpreter cannot run relgen's kernels with."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a development build: let it try
    if (major, minor) >= INTERPRETER_NUMPY_LIMIT:
        raise RuntimeError(
            f"relgen: Triton's interpreter (TRITON_INTERPRET=1, used without a CUDA device) cannot run relgen's "
            f"kernels with numpy {version}: install numpy<2.4 (pip install 'numpy<2.4')"
        )
