"""Stage 7, the command line: `relgen explain | build | check | tune | warmup` (`main`), each command a thin layer
over the stages before it; `tune` measures tile configurations on a GPU and writes relgen/tiles/tuning_tables/."""
