"""jaxspec: speculative decoding in JAX/XLA."""

__version__ = "0.1.0"
