"""The dispatchers in jaxspec.speculative.verify pick the Mosaic kernels on TPU
(jaxspec.pallas.verify_tpu), the Triton ones on GPU and the references on CPU;
the Triton wrappers refuse on TPU rather than import their references (a kernel
never imports its callers)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxspec.pallas as kernels
import jaxspec.pallas.verify as pv
import jaxspec.pallas.verify_tpu as pvt
from jaxspec.speculative import verify as V
from jaxspec.speculative.tree import build_chain_tree


class _KernelCalled(Exception):
    pass


def _boom(*_, **__):
    raise _KernelCalled


def _chain_case(vocab=16):
    tokens = np.array([[3, 5, 7, 9]], np.int32)
    info = build_chain_tree(tokens, np.zeros(1, np.int32))
    nt, ns = np.asarray(info.retrieve_next_token), np.asarray(info.retrieve_next_sibling)
    pred = np.array([[5, 7, 2, 1]], np.int32)  # accepts 5, 7; bonus 2
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(vocab), size=(1, 4)).astype(np.float32)
    u = rng.random((1, 4)).astype(np.float32)
    e = rng.exponential(size=(1, vocab)).astype(np.float32) + 1e-6
    return tokens, nt, ns, pred, p, u, e


def _calls(case):
    tokens, nt, ns, pred, p, u, e = case
    return {
        "greedy": (lambda: V.verify_greedy(tokens, nt, ns, pred, max_depth=3),
                   lambda: V.verify_greedy_ref(tokens, nt, ns, pred, max_depth=3)),
        "target_only": (lambda: V.verify_target_only(tokens, nt, ns, p, u, e, max_depth=3),
                        lambda: V.verify_target_only_ref(tokens, nt, ns, p, u, e, max_depth=3)),
        "rejection": (lambda: V.verify_rejection(tokens, nt, ns, p, None, u, e, max_depth=3),
                      lambda: V.verify_rejection_ref(tokens, nt, ns, p, None, u, e, max_depth=3)),
    }


class _TpuKernelCalled(Exception):
    pass


def _boom_tpu(*_, **__):
    raise _TpuKernelCalled


@pytest.mark.parametrize("rule", ["greedy", "target_only", "rejection"])
def test_verify_dispatch_picks_kernel_set_per_platform(monkeypatch, rule):
    for name in ("verify_greedy_pallas", "verify_target_only_pallas", "verify_rejection_pallas"):
        monkeypatch.setattr(pv, name, _boom)
    for name in ("verify_greedy_tpu", "verify_target_only_tpu", "verify_rejection_tpu"):
        monkeypatch.setattr(pvt, name, _boom_tpu)
    public, ref = _calls(_chain_case())[rule]
    # CPU: the reference, no kernel.
    monkeypatch.setattr(V, "kernel_backend", lambda: None)
    monkeypatch.setattr(kernels, "kernel_backend", lambda: None)
    for g, w in zip(public(), ref()):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # TPU: the Mosaic kernel (stubbed), never the Triton one.
    monkeypatch.setattr(V, "kernel_backend", lambda: "tpu")
    monkeypatch.setattr(kernels, "kernel_backend", lambda: "tpu")
    with pytest.raises(_TpuKernelCalled):
        public()
    # GPU: the Triton kernel (stubbed).
    monkeypatch.setattr(V, "kernel_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "kernel_backend", lambda: "gpu")
    with pytest.raises(_KernelCalled):
        public()


@pytest.mark.parametrize("name", ["verify_greedy_pallas", "verify_target_only_pallas",
                                  "verify_rejection_pallas"])
def test_verify_kernels_refuse_where_they_cannot_run(monkeypatch, name):
    tokens, nt, ns, pred, p, u, e = _chain_case()
    args = {"verify_greedy_pallas": (tokens, nt, ns, pred),
            "verify_target_only_pallas": (tokens, nt, ns, p, u, e),
            "verify_rejection_pallas": (tokens, nt, ns, p, None, u, e)}[name]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    # __wrapped__: the refusal happens at trace time; bypass jit's trace cache.
    with pytest.raises(NotImplementedError, match="jaxspec.speculative.verify"):
        getattr(pv, name).__wrapped__(*args, max_depth=3)
