"""Draft heads of published drafter formats (EAGLE-1, EAGLE-3, DeepSeek/MiMo MTP, Medusa, MLP speculator, DFLASH/DSPARK).

Pure JAX functions over params loaded by `loading` (numpy safetensors, no torch); the
drafters in `jaxspec.speculative` call them inside the on-device loop. Source semantics
and the layouts each loader accepts are described where they are implemented.
"""

# The family modules register at import (family.py): importing any module of this package imports
# them first, so a lookup by head kind always sees every family.
from jaxspec.models.heads import mlp_speculator, medusa, block, frozen_kv, eagle3, eagle  # noqa: E402, F401
