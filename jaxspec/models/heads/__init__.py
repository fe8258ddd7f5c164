"""Draft heads of published drafter formats (EAGLE-1, EAGLE-3, DeepSeek/MiMo MTP, Medusa, MLP speculator).

Pure JAX functions over params loaded by `loading` (numpy safetensors, no torch); the
drafters in `jaxspec.speculative` call them inside the on-device loop. Source semantics
and the layouts each loader accepts are described where they are implemented.
"""
