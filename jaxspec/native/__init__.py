"""Native (C++ via `jax.ffi`) kernels for XLA:CPU, each beside its jnp reference."""
