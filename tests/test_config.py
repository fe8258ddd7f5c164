"""The configuration tree: TOML loading, dotted overrides, clear errors."""

from __future__ import annotations

import pytest

from jaxspec.config import ConfigValueError, load_config


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[engine]\npage_size = 4\nlength_buckets = [16, 32]\n[sampling]\ntemperature = 0.5\n')
    cfg = load_config(f, {"engine.page_size": "1", "sampling.ignore_eos": "true"})
    assert cfg.engine.page_size == 1
    assert cfg.engine.length_buckets == (16, 32)
    assert cfg.sampling.temperature == 0.5 and cfg.sampling.ignore_eos is True


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


def test_shipped_configs_load():
    from pathlib import Path

    for f in sorted(Path(__file__).parent.parent.glob("configs/*.toml")):
        load_config(f)
