"""Stage 4, tiles: how each kernel is cut into programs. `configs` holds the tile/warp/stage configuration of every
kernel (KernelConfig), the interpreter's, and the resource heuristic; `tuning` the tables `relgen tune` measures per
GPU, kernel family, dtype, head dim and length bucket (tuning_tables/); `select` picks one per call (an override,
else the table, else the heuristic); `grid` sizes the launch grids."""
