"""The configuration tree: TOML loading, dotted overrides, clear errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from jaxspec.config import Config, ConfigValueError, load_config
from jaxspec.speculative.drafters import canonical_name, validate_spec_config


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[engine]\npage_size = 4\nlength_buckets = [16, 32]\n[sampling]\ntemperature = 0.5\n')
    cfg = load_config(f, {"engine.page_size": "1", "sampling.ignore_eos": "true"})
    assert cfg.engine.page_size == 1
    assert cfg.engine.length_buckets == (16, 32)
    assert cfg.sampling.temperature == 0.5 and cfg.sampling.ignore_eos is True


def test_spec_is_validated_at_load_after_the_flags(tmp_path):
    """[spec] is checked once the whole config is in (where it becomes an engine): a file may leave
    the draft model to a flag; the result holds the canonical algorithm name; what stays wrong is
    refused naming the field."""
    from jaxspec.speculative.drafters import SpecConfigError, validate_config

    f = tmp_path / "s.toml"
    f.write_text('[spec]\nalgorithm = "MLP_Speculator"\n')
    with pytest.raises(SpecConfigError, match="'mlp_speculator' needs a draft model"):
        validate_config(load_config(f))
    cfg = validate_config(load_config(f, {"spec.draft_model": "/heads/mlp"}))
    assert (cfg.spec.algorithm, cfg.spec.draft_model) == ("mlp_speculator", "/heads/mlp")
    with pytest.raises(SpecConfigError, match=r"spec.tree_choices .* read by .*medusa.* only; --spec mlp_speculator would ignore it"):
        validate_config(load_config(f, {"spec.draft_model": "/heads/mlp", "spec.tree_choices": "[[0]]"}))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"engine.nope": 1}, "unknown key engine.nope"),
        ({"bogus.x": 1}, r"unknown config section \[bogus\]"),
        ({"engine.page_size": "abc"}, "engine.page_size: expected int"),
        ({"engine.page_size": 0}, "page_size must be >= 1"),
        ({"sampling.top_p": 0}, "top_p"),
        ({"model.dtype": "float16"}, "model.dtype"),
        ({"engine.cpu_kernels": "fast"}, "engine.cpu_kernels must be auto, native or xla"),
        ({"serve.follow_up_window": -1}, r"serve.follow_up_window must be >= 0 seconds \(0 = off\)"),
        ({"serve.follow_up_grace": -0.1}, r"serve.follow_up_grace must be >= 0 seconds \(0 = off\)"),
        ({"serve.adaptive_margin": -0.05}, r"serve.adaptive_margin must be >= 0 \(0 = off\)"),
        ({"serve.adaptive_hysteresis": -1}, "serve.adaptive_hysteresis must be >= 0"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigValueError, match=message):
        load_config(None, overrides)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigValueError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    with pytest.raises(ConfigValueError, match="invalid TOML"):
        load_config(bad)


SHIPPED = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_shipped_configs_exist():
    # The parametrised test below would pass vacuously on an empty glob.
    assert {f.name for f in SHIPPED} >= {"default.toml", "serve.toml"}, SHIPPED
    # Some shipped value differs from the built-in default, so the value check below
    # would notice a loader that ignored the files.
    defaults = Config()
    differs = [(f.name, s, k) for f in SHIPPED for s, kv in tomllib.loads(f.read_text()).items()
               for k, v in kv.items() if getattr(getattr(defaults, s), k) != (tuple(v) if isinstance(v, list) else v)]
    assert differs


@pytest.mark.parametrize("path", SHIPPED, ids=[f.name for f in SHIPPED])
def test_shipped_configs_load_validate_and_keep_their_values(path):
    """Every shipped config loads, passes [spec] validation, and every key it sets
    (read independently with tomllib) arrives in the Config with that value."""
    cfg = load_config(path)
    spec = validate_spec_config(cfg.spec)
    assert spec.algorithm == canonical_name(cfg.spec.algorithm)
    data = tomllib.loads(path.read_text())
    assert data, f"{path.name} sets nothing"
    checked = 0
    for section, values in data.items():
        assert isinstance(values, dict), f"{path.name}: top-level key {section!r} outside a section"
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            want = tuple(value) if isinstance(value, list) else value
            assert got == want, f"{path.name}: {section}.{key} = {got!r}, file says {want!r}"
            checked += 1
    assert checked >= 5
