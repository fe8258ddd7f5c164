"""The runtime's device mesh: Megatron-style sharding over ("data", "model").

* "model" (tensor parallel): q/k/v/gate/up are split by output column, o/down
  by input row, so each layer needs one all-reduce after attention and one
  after the MLP; the LM head is split over the vocabulary. The KV cache is split
  over KV heads, which keeps each head's cache beside the q heads that read it.
  Head counts TP does not divide are zero-padded by the Engine first
  (`jaxspec.models.padding`), exactly.
* "data": batch rows (and everything else with a leading batch axis) are split
  over it when the batch divides, else replicated.

Pages over "data" (`split_pages`, the Engine's default under a mesh with data > 1):
each data shard owns a slice of the page axis and its own page pool
(`cache.paged.ShardedPageAllocator`), and the whole prefill / decode function
runs per data shard (`per_data_shard`), so attention and cache writes gather
and scatter locally. The server does the same: its scheduler pins each
sequence to one data shard, whose slice of every batch bucket holds its row
(`engine.runner.ModelRunner.place`).

Every helper is the identity when `mesh` is None, so single-device code paths
call them unconditionally.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxspec.cache.paged import KVCache
from jaxspec.models.config import ModelConfig

from jaxspec.pallas.shard import AXES
# Runtime layout ([in, out] matrices): which axis "model" splits.
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # out dim; each shard owns whole heads / MLP columns
ROW = ("wo", "w_down")  # in dim; the partial sums are all-reduced
BIAS = ("bq", "bk", "bv")  # follow their column-split matrix


class MeshError(ValueError):
    """A mesh that cannot be built or cannot shard this model; the message names the value."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    data: int
    model: int

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """"4x2" -> MeshShape(data=4, model=2)."""
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
        if not m:
            raise MeshError(f"mesh {text!r}: expected DATAxMODEL, e.g. 4x2")
        data, model = int(m.group(1)), int(m.group(2))
        if data < 1 or model < 1:
            raise MeshError(f"mesh {text!r}: both axis sizes must be >= 1")
        return cls(data, model)

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"{self.data}x{self.model}"


def make_mesh(shape: MeshShape | str, devices=None) -> Mesh:
    """A ("data", "model") mesh over all of `devices` (default: every global device)."""
    shape = MeshShape.parse(shape) if isinstance(shape, str) else shape
    devices = list(jax.devices() if devices is None else devices)
    if shape.size != len(devices):
        raise MeshError(
            f"mesh {shape} needs {shape.size} devices (data {shape.data} x model {shape.model}), "
            f"but {len(devices)} are available"
        )
    # Auto axes: GSPMD propagates shardings (jax.make_mesh defaults to Explicit).
    return jax.make_mesh((shape.data, shape.model), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def _shape_of(mesh_or_shape) -> MeshShape:
    if isinstance(mesh_or_shape, MeshShape):
        return mesh_or_shape
    return MeshShape(mesh_or_shape.shape["data"], mesh_or_shape.shape["model"])


def pad_for_mesh(params: dict | None, cfg: ModelConfig, mesh: Mesh | None, what: str, progress: bool = True):
    """(params, cfg, HeadPadding | None): heads / MLP columns zero-padded so the mesh's TP size divides
    them (exact; `models.padding`). Reported on stderr, since padding costs memory and FLOPs."""
    import sys

    from jaxspec.models.padding import padded_config, pad_params

    if mesh is None:
        return params, cfg, None
    padded, info = padded_config(cfg, mesh.shape["model"])
    if not info.none:
        if params is not None and "head" in params:
            raise MeshError(f"{what}: padding heads for tensor-parallel size {info.tp} needs the loaded "
                            "(Hugging Face) params layout, not runtime params (prepare_params)")
        params = pad_params(params, cfg, padded) if params is not None else None
        if progress:
            print(f"jaxspec: {info.summary(what)}", file=sys.stderr)
    validate_for_model(mesh, padded, what)
    return params, padded, info


def validate_for_model(shape: MeshShape | Mesh, cfg: ModelConfig, what: str = "model") -> None:
    """Tensor parallelism splits whole heads and MLP columns: each must divide by TP.

    The Engine pads a model until this holds (`jaxspec.models.padding`); params
    placed by hand (`shard_params`) must already divide."""
    shape = _shape_of(shape)
    for name in ("num_kv_heads", "num_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % shape.model:
            raise MeshError(
                f"mesh {shape}: the {what}'s {name} = {n} is not divisible by the model "
                f"(tensor-parallel) axis size {shape.model}"
            )


# ---- placement ---------------------------------------------------------------


def _put(x, sharding: NamedSharding) -> jax.Array:
    """device_put that also works when the mesh spans other processes (each passes the same value)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _layer_spec(name: str, ndim: int) -> P:
    lead = (None,) * (ndim - 2)  # [L] when layers are stacked
    if name in COLUMN:
        return P(*lead, None, "model")
    if name in ROW:
        return P(*lead, "model", None)
    if name in BIAS:
        return P(*(None,) * (ndim - 1), "model")
    return P()  # norms (q/k norms act per head_dim: replicated)


def param_shardings(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """NamedSharding per leaf of runtime params (stacked [L, ...] or a per-layer list). An int8
    matrix (`layers.Int8Weight`) splits like its float one; its column scales follow the out dim."""
    from jaxspec.models.layers import Int8Weight

    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731

    def matrix(spec: P, w):
        if not isinstance(w, Int8Weight):
            return ns(spec)
        return Int8Weight(q=ns(spec), scale=ns(P(*spec[:-2], spec[-1])))

    layer = lambda lp: {k: matrix(_layer_spec(k, getattr(v, "q", v).ndim), v) for k, v in lp.items()}  # noqa: E731
    layers = params["layers"]
    head_split = cfg.vocab_size % mesh.shape["model"] == 0
    out = {k: ns(P()) for k in params if k != "layers"}
    out["head"] = matrix(P(None, "model") if head_split else P(None, None), params["head"])  # logits split over vocab
    out["layers"] = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
    return out


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh | None) -> dict:
    """Place runtime-layout params (`prepare_params`) on the mesh."""
    if mesh is None:
        return params
    validate_for_model(mesh, cfg)
    return jax.tree.map(_put, params, param_shardings(params, cfg, mesh))


def replicate(tree, mesh: Mesh | None):
    """Every leaf whole on every device (small drafter heads)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), tree)


def cache_sharding(mesh: Mesh, split_pages: bool = False) -> NamedSharding:
    # k/v [L, P, page_size, kvh, hd]: heads over "model"; pages over "data" only when each data
    # shard runs its own rows on its own page pool (`per_data_shard`), else replicated.
    return NamedSharding(mesh, P(None, "data" if split_pages else None, None, "model", None))


def zeros_cache(shape: tuple[int, ...], dtype, mesh: Mesh | None, split_pages: bool = False) -> KVCache:
    """A zero cache created already sharded: it need not fit on one device first."""
    device = None if mesh is None else cache_sharding(mesh, split_pages)
    return KVCache(k=jnp.zeros(shape, dtype, device=device), v=jnp.zeros(shape, dtype, device=device))


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Axis 0 over "data" when it divides, else replicated (batch 1, the [1, K] corpus)."""
    d = mesh.shape["data"]
    split = len(shape) > 0 and d > 1 and shape[0] % d == 0
    return NamedSharding(mesh, P("data") if split else P())


def shard_batch(tree, mesh: Mesh | None):
    """Host or device arrays with a leading batch axis -> device arrays laid out by `batch_sharding`."""
    if mesh is None:
        return jax.tree.map(jax.device_put, tree)  # jnp.asarray would compile a copy op per new shape
    return jax.tree.map(lambda x: _put(x, batch_sharding(mesh, np.shape(x))), tree)


def state_shardings(tree, mesh: Mesh, split_pages: bool = False):
    """Shardings for a loop state pytree: KVCache leaves by `cache_sharding`, the rest by `batch_sharding`."""
    def one(x):
        if isinstance(x, KVCache):
            return KVCache(k=cache_sharding(mesh, split_pages), v=cache_sharding(mesh, split_pages))
        return batch_sharding(mesh, x.shape)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def abstract_state(tree, mesh: Mesh | None, split_pages: bool = False):
    """ShapeDtypeStructs (e.g. from eval_shape) with the shardings `constrain_state` gives, for AOT lowering."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        state_shardings(tree, mesh, split_pages))


def constrain_state(tree, mesh: Mesh | None, split_pages: bool = False):
    """Inside jit: pin a state pytree to `state_shardings`, so an executable's outputs
    have exactly the shardings its (or the next executable's) inputs were compiled for."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh, split_pages))


def _data_specs(tree, data: int):
    """shard_map specs over "data" alone: KVCache pages split, batch-leading arrays split, the rest whole."""
    def one(x):
        if isinstance(x, KVCache):
            return KVCache(k=P(None, "data"), v=P(None, "data"))
        return P("data") if x.ndim and x.shape[0] % data == 0 else P()

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def per_data_shard(fn, mesh: Mesh, replicated: tuple[int, ...], static: tuple[int, ...] = ()):
    """`fn` run once per "data" shard (shard_map manual over "data", "model" left to GSPMD).

    Each shard sees its own batch rows and its own slice of every cache's page
    axis, so page tables hold shard-local page ids and every gather and scatter
    of the cache stays on its shard: no code inside `fn` changes. Positional args
    in `replicated` (params) are whole on every shard; those in `static` pass
    through as Python values. Needs a batch that "data" divides. Output specs
    follow the same rule at the global shapes (from eval_shape)."""
    data = mesh.shape["data"]

    def run(*args):
        dyn = [i for i in range(len(args)) if i not in static]

        def call(*dargs):
            full = list(args)
            for i, a in zip(dyn, dargs):
                full[i] = a
            return fn(*full)

        dargs = [args[i] for i in dyn]
        specs = tuple(jax.tree.map(lambda _: P(), a) if i in replicated else _data_specs(a, data)
                      for i, a in zip(dyn, dargs))
        out_specs = _data_specs(jax.eval_shape(call, *dargs), data)
        # check_vma off: outputs a shard computes alone (its rows) are declared split, not checked.
        return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names={"data"},
                             check_vma=False)(*dargs)

    return run


def mesh_context(mesh: Mesh | None):
    """Trace under this so kernels find the mesh (`shard_kernel_attention`); no-op for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def to_host(tree):
    """device_get that also gathers arrays spread over other processes."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


# ---- command line --------------------------------------------------------------


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """--mesh and the multi-host flags, shared by `jaxspec.generate` and `jaxspec.serve`."""
    g = parser.add_argument_group("device mesh")
    g.add_argument("--mesh", metavar="DPxTP", help="shard over a data x model mesh, e.g. 4x2 (product = devices)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: address of process 0")
    g.add_argument("--num-processes", type=int, metavar="N", help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, metavar="I", help="multi-host: this process's index")


def init_distributed(args) -> bool:
    """jax.distributed.initialize from the multi-host flags; must run before anything touches devices."""
    flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    given = [k for k, v in flags.items() if v is not None]
    if not given:
        return False
    if len(given) != len(flags):
        missing = ", ".join(k for k in flags if k not in given)
        raise MeshError(f"multi-host needs --coordinator, --num-processes and --process-id; missing {missing}")
    if not 0 <= args.process_id < args.num_processes:
        raise MeshError(f"--process-id {args.process_id} must be in [0, --num-processes {args.num_processes})")
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return True


def setup_mesh(args) -> Mesh | None:
    """Multi-host init (when asked), then the --mesh mesh (None without --mesh).

    Call it first, before loading weights. Any model fits any mesh: the Engine
    zero-pads heads the TP size does not divide (`jaxspec.models.padding`)."""
    if args.mesh is None:
        init_distributed(args)
        return None
    shape = MeshShape.parse(args.mesh)  # a bad string fails before any device work
    init_distributed(args)
    return make_mesh(shape)
