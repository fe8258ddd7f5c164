"""Kernels under a device mesh: a Pallas (or FFI) call is opaque to GSPMD, so its dispatcher
runs it per shard through shard_map. A leaf (JAX only), so the dispatchers of the kernels
(`jaxspec.cache.attention`, `jaxspec.speculative.tree` / `.verify`) reach it without importing
the runtime's mesh module (`jaxspec.mesh`), which sits above them.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, PartitionSpec as P

AXES = ("data", "model")  # the mesh axes jaxspec.mesh builds: batch rows, tensor parallel


def shard_kernel_attention(kernel, q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask):
    """Run a paged-attention kernel per shard when a ("data", "model") mesh is in context.

    A Pallas kernel is opaque to GSPMD, so it gets per-shard shapes through
    shard_map: batch rows over "data" (when they divide), heads over "model"
    (whole KV groups stay together because q and kv heads split alike). Without
    such a mesh (or inside a manual region) the kernel is called as is.

    q [B, T, H, hd]; k_pages, v_pages [P, page_size, kvh, hd]; page_table [B, max_pages];
    q_start, kv_len [B]; tree_mask [B, T, T] | None. Returns [B, T, H, hd].
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return kernel(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask)
    manual = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual}
    if "model" in manual:
        return kernel(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask)
    # Inside `per_data_shard` "data" is already manual (local rows and pages): split heads only.
    axes = {"model"} if "data" in manual else set(AXES)
    b = "data" if "data" in axes and q.shape[0] % mesh.shape["data"] == 0 else None
    heads, pages = P(b, None, "model", None), P(None, None, "model", None)
    args, specs = [q, k_pages, v_pages, page_table, q_start, kv_len], [heads, pages, pages, P(b), P(b), P(b)]
    if tree_mask is not None:
        args.append(tree_mask)
        specs.append(P(b))

    def local(*a):
        return kernel(*a[:6], a[6] if len(a) > 6 else None)

    # check_vma off: the kernel is opaque, and with b=None its output is replicated over "data".
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, axis_names=axes,
                         check_vma=False)(*args)


def shard_kernel_rows(kernel, *args):
    """Run a row-wise kernel (tree build, verify) per shard when a mesh with auto axes is in context.

    GSPMD cannot partition an opaque kernel, and Mosaic TPU calls refuse to be
    (they must sit under shard_map). Rows split over "data" when it is auto and
    divides the batch; every other axis sees whole (replicated) inputs, so each
    device runs the kernel on its rows. Array args and outputs lead with the
    batch axis or are replicated; non-array args (Python scalars, None) pass as is."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = set() if mesh.empty else {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    if not auto:
        return kernel(*args)
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    b = args[arrays[0]].shape[0]
    split = "data" in auto and mesh.shape["data"] > 1 and b % mesh.shape["data"] == 0

    def call(*arr):
        full = list(args)
        for i, a in zip(arrays, arr):
            full[i] = a
        return kernel(*full)

    spec = lambda x: P("data") if split and x.ndim and x.shape[0] == b else P()  # noqa: E731
    arr = [args[i] for i in arrays]
    out_specs = jax.tree.map(spec, jax.eval_shape(call, *arr))
    return jax.shard_map(call, mesh=mesh, in_specs=tuple(spec(a) for a in arr), out_specs=out_specs,
                         axis_names=auto, check_vma=False)(*arr)
