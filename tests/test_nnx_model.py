"""The Flax NNX module view: same weights, same logits as Hugging Face."""

from __future__ import annotations

import jax
import numpy as np
import torch

from jaxspec.models.loading import load_model
from jaxspec.models.nnx_model import LlamaForCausalLM


def test_nnx_module_matches_hf_and_round_trips_params(tiny_dirs):
    path, hf = tiny_dirs["qwen3"]
    loaded = load_model(str(path), progress=False)
    module = LlamaForCausalLM.from_loaded(loaded)
    # The module's state is exactly the loader's params pytree.
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), module.params(), loaded.params)
    assert all(jax.tree.leaves(same))
    tokens = np.array([[5, 17, 33, 9, 100, 42, 7], [200, 3, 1, 4, 1, 5, 9]], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(module(tokens).logits)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
