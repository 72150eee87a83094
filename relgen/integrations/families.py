"""The families relgen serves: importing this module registers their adapters (each loads its library lazily)."""
