"""The families relgen serves: importing this module registers their adapters (each loads its library lazily)."""

from relgen.integrations import (
    hf_deberta,  # noqa: F401
    hf_t5,  # noqa: F401
    hf_wav2vec2,  # noqa: F401
    nemo_conformer,  # noqa: F401
)
