"""The names a generated module reads from the runtime, and nothing else: argument checking and a call's geometry
(`prepare_call`, `Call`, `finish`, …), the plan value it declares (`PlanInfo`), kernel launching (`Launcher`), launch
grids and tiles, TMA descriptors, and the custom-op registration that lets calls trace under torch.compile.

Importing it first sets Triton up (its interpreter on a machine without a CUDA device) before any of relgen's
kernels is defined."""

from relgen.backend import configure_triton

configure_triton()

from relgen.runtime.arguments import Call, finish, lastdim_contiguous, prepare_call, seed_snapshot  # noqa: E402
from relgen.runtime.custom_ops import Passes, compiled_packing  # noqa: E402
from relgen.runtime.custom_ops import register as register_custom_ops  # noqa: E402
from relgen.runtime.descriptors import kv_descriptors  # noqa: E402
from relgen.runtime.geometry import ROW_ALIGN, PlanInfo, int64_offsets  # noqa: E402
from relgen.runtime.launch import Launcher  # noqa: E402
from relgen.tiles.grid import cdiv, column_splits, group_splits, table_partials  # noqa: E402

__all__ = [
    "ROW_ALIGN",
    "Call",
    "Launcher",
    "Passes",
    "PlanInfo",
    "cdiv",
    "column_splits",
    "compiled_packing",
    "finish",
    "group_splits",
    "int64_offsets",
    "kv_descriptors",
    "lastdim_contiguous",
    "prepare_call",
    "register_custom_ops",
    "seed_snapshot",
    "table_partials",
]
