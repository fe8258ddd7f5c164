"""Loading the draft weights a plan needs: a draft model, or a head in its published format.

Shared by `jaxspec.generate` and the server. Returns (params, config): a
`ModelConfig` for the standalone drafter (a model, or the target's first
layers), a `HeadConfig` for the feature drafters (EAGLE, EAGLE-3, MTP/NEXTN,
Medusa, the MLP speculator; format detected from the head's config.json by
`jaxspec.models.heads.config.detect_format`), or None for drafters without
weights (n-gram, plugins).
"""

from __future__ import annotations

from pathlib import Path

from jaxspec.models.config import ConfigError
from jaxspec.speculative.algorithm import SpecConfigError, validate_spec_config

# Which head formats each feature algorithm drives.
HEAD_KINDS = {
    "eagle": ("eagle", "mtp_deepseek", "mtp_mimo"),
    "eagle3": ("eagle3",),
    "medusa": ("medusa",),
    "mlp_speculator": ("mlp_speculator",),
    "dflash": ("dflash",),
    "dspark": ("dspark",),
}


def load_draft(spec, model, dtype, *, cache_dir: str | None = None, progress: bool = True):
    """(params, config) of the draft for `spec` ([spec] section) against the loaded target `model`."""
    from jaxspec.models.loading import load_model

    # The CLI may set simulate_accept_length (benchmark mode); its output is labelled non-exact.
    spec = validate_spec_config(spec, benchmark=True)
    name = spec.algorithm
    if name == "standalone":
        from jaxspec.speculative.drafters.standalone import truncate_layers

        if spec.draft_model:
            d = load_model(spec.draft_model, dtype=dtype, cache_dir=cache_dir, progress=progress)
            params, dcfg = d.params, d.config
        else:
            params, dcfg = model.params, model.config
        if spec.draft_layers:
            params, dcfg = truncate_layers(params, dcfg, spec.draft_layers)
        return params, dcfg
    if spec.draft_layers:
        raise SpecConfigError(f"spec.draft_layers (--draft-layers) truncates the standalone drafter's model; "
                              f"--spec {name} would ignore it")
    if name not in HEAD_KINDS:
        return None
    from jaxspec.models.heads.loading import load_draft_head, load_mtp_head

    from jaxspec.paths import SHIPPED_HEADS, shipped_head

    implicit = not spec.draft_model and name in SHIPPED_HEADS  # --spec eagle3 alone: the shipped head
    if spec.draft_model == "default" or implicit:  # the head shipped for the embedded model
        try:
            path = shipped_head(name)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        try:
            head = load_draft_head(path, model.config, aux_layer_convention="output", dtype=dtype)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"the shipped {name} head ({path.name}) is for the embedded SmolLM2-135M-Instruct "
                              f"and does not fit this target: give --draft-model DIR ({e})") from None
    elif spec.draft_model:
        head = load_draft_head(Path(spec.draft_model).expanduser(), model.config,
                               aux_layer_convention=spec.eagle3_layer_ids, dtype=dtype)
    else:  # eagle without a head directory: the target's own MTP layers (NEXTN)
        head = load_mtp_head(model.path, model.config, dtype=dtype)
    if head.config.kind not in HEAD_KINDS[name]:
        raise ConfigError(
            f"spec.algorithm={name!r} drives {', '.join(HEAD_KINDS[name])} heads, but {head.path} holds a "
            f"{head.config.kind} head: use --spec " + next(a for a, k in HEAD_KINDS.items() if head.config.kind in k))
    return head.params, head.config
