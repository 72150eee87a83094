"""Settings a user may change: Triton's set-up on a machine without a GPU, the storage of the stored projections,
the memory budget that chooses between stored and in-tile relation products (a call's projections="auto"), and a
forced tile configuration. Each lives in the stage it belongs to; this module only gathers them."""

from relgen.backend import configure_triton
from relgen.runtime.memory import (
    PROJECTION_BUDGET_ENV,
    PROJECTION_STRATEGIES,
    projection_budget,
    set_projection_budget,
)
from relgen.runtime.storage import (
    PROJECTION_STORAGE_ENV,
    PROJECTION_STORAGES,
    projection_storage,
    set_projection_storage,
)
from relgen.tiles.configs import AttnTiles, KernelConfig, ProjectTiles, ReduceTiles
from relgen.tiles.select import override_config

__all__ = [
    "PROJECTION_BUDGET_ENV",
    "PROJECTION_STORAGES",
    "PROJECTION_STORAGE_ENV",
    "PROJECTION_STRATEGIES",
    "AttnTiles",
    "KernelConfig",
    "ProjectTiles",
    "ReduceTiles",
    "configure_triton",
    "override_config",
    "projection_budget",
    "projection_storage",
    "set_projection_budget",
    "set_projection_storage",
]
