"""The drafter registry (names, aliases, capabilities, heads, owned fields, plugins) and [spec] validation."""

from __future__ import annotations

import dataclasses

import pytest

import jaxspec.speculative.drafters  # noqa: F401  (registers the built-ins the lookups read)
from jaxspec.config import SpecSection, load_config
from jaxspec.speculative import algorithm as A
from jaxspec.speculative.algorithm import AlgorithmInfo, SpecConfigError
from jaxspec.speculative.tree import max_draft_tokens


@pytest.fixture
def plugin():
    """Register plugins for one test and always remove them afterwards."""
    names = []

    def add(name, info=AlgorithmInfo(), factory=None):
        names.append(A.register(name, info, factory))
        return names[-1]

    yield add
    for n in names:
        A.unregister(n)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name, expected", [
    ("none", "none"), ("NGRAM", "ngram"), ("Standalone", "standalone"), ("eagle", "eagle"),
    ("EAGLE3", "eagle3"), ("medusa", "medusa"), ("DFlash", "dflash"), ("dspark", "dspark"),
    ("NEXTN", "eagle"), ("nextn", "eagle"), (" eagle ", "eagle"), ("FROZEN_KV_MTP", "frozen_kv_mtp"),
])
def test_names_are_case_insensitive_with_aliases(name, expected):
    assert A.canonical_name(name) == expected
    assert A.registration(name).name == expected


def test_unknown_name_lists_valid_names(plugin):
    plugin("MyDraft")
    with pytest.raises(SpecConfigError) as e:
        A.canonical_name("eagle2")
    msg = str(e.value)
    assert "'eagle2'" in msg
    for n in A.builtin_names():
        assert n in msg
    assert "nextn (alias of eagle)" in msg and "mydraft (plugin)" in msg
    assert isinstance(e.value, ValueError)


def test_non_string_name():
    with pytest.raises(SpecConfigError, match="must be a string"):
        A.canonical_name(3)


# ---------------------------------------------------------------- capabilities

CAPS = ("needs_draft_model", "supports_tree", "drafts_in_steps", "implemented", "speculative")
EXPECTED = {
    #                  model  tree   steps  impl   spec
    "none":           (False, False, True, True, False),
    "ngram":          (False, True, False, True, True),
    "standalone":     (True, True, True, True, True),
    "eagle":          (True, True, True, True, True),
    "eagle3":         (True, True, True, True, True),
    "frozen_kv_mtp":  (True, True, True, True, True),
    "medusa":         (True, True, True, True, True),
    "mlp_speculator": (True, False, True, True, True),
    "dflash":         (True, False, False, True, True),
    "dspark":         (True, False, False, True, True),
}


def test_capabilities_of_every_builtin():
    assert set(EXPECTED) == set(A.builtin_names())
    for name, caps in EXPECTED.items():
        info = A.algorithm_info(name)
        assert info is A.registration(name).info and A.registration(name).builtin
        assert tuple(getattr(info, c) for c in CAPS) == caps, name
    assert A.algorithm_info("nextn") is A.algorithm_info("eagle")
    assert A.implemented_names() == ("none", "ngram", "standalone", "eagle", "eagle3", "medusa", "mlp_speculator",
                                     "frozen_kv_mtp", "dflash", "dspark")


def test_auto_verify_is_the_coupled_rule_for_every_drafter():
    # Coupled verify needs no q, so every drafter has it (test_coupled.py: it is plain sampling).
    assert A.sampling_verify("auto") == "coupled"
    assert A.sampling_verify("rejection") == "rejection"
    assert A.sampling_verify("target-only") == "target-only"


def test_info_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        A.algorithm_info("ngram").supports_tree = False


# ---------------------------------------------------------------- plugins


def test_register_plugin(plugin):
    factory = lambda cfg: "drafter"  # noqa: E731
    info = AlgorithmInfo(supports_tree=True, description="mine")
    assert plugin("MyDraft", info, factory) == "mydraft"
    assert A.algorithm_info("MYDRAFT") is info
    reg = A.registration("mydraft")
    assert reg.build is factory and not reg.builtin and reg.load is None
    assert "mydraft" in A.valid_names() and "mydraft" in A.implemented_names()
    A.unregister("mydraft")
    with pytest.raises(SpecConfigError, match="unknown"):
        A.algorithm_info("mydraft")


@pytest.mark.parametrize("name", ["eagle", "NGRAM", "none", "NextN", "dspark"])
def test_builtin_names_are_reserved(name):
    with pytest.raises(SpecConfigError, match="reserved"):
        A.register(name, AlgorithmInfo())
    with pytest.raises(SpecConfigError, match="built-in"):
        A.unregister(name)


def test_duplicate_plugin(plugin):
    plugin("dup")
    with pytest.raises(SpecConfigError, match="already registered"):
        A.register("DUP", AlgorithmInfo())


@pytest.mark.parametrize("args, message", [
    (("", AlgorithmInfo()), "non-empty"),
    (("x", {"supports_tree": True}), "AlgorithmInfo"),
    (("x", AlgorithmInfo(), 3), "callable"),
])
def test_register_bad_arguments(args, message):
    with pytest.raises(SpecConfigError, match=message):
        A.register(*args)
    assert "x" not in A.valid_names()


# ---------------------------------------------------------------- validation

GOOD = dict(algorithm="ngram", num_steps=3, topk=1, num_draft_tokens=4)


def spec(**kw) -> SpecSection:
    return SpecSection(**{**GOOD, **kw})


def _assert_validated(given: SpecSection, algorithm: str, **validate_kw) -> SpecSection:
    """validate_spec_config returns `given` with only `algorithm` canonicalised."""
    out = A.validate_spec_config(given, **validate_kw)
    assert isinstance(out, SpecSection)
    assert out.algorithm == algorithm
    for f in dataclasses.fields(SpecSection):
        if f.name != "algorithm":
            assert getattr(out, f.name) == getattr(given, f.name), f.name
    return out


def test_valid_configs_pass_and_canonicalise():
    _assert_validated(SpecSection(), "none")  # defaults
    _assert_validated(spec(algorithm="NGRAM"), "ngram")
    _assert_validated(spec(algorithm=" NGram "), "ngram")
    out = _assert_validated(spec(algorithm="Standalone", draft_model="m", topk=2,
                                 num_draft_tokens=max_draft_tokens(3, 2), verify="rejection"), "standalone")
    assert (out.draft_model, out.topk, out.num_draft_tokens, out.verify) == ("m", 2, 11, "rejection")
    assert _assert_validated(spec(algorithm="standalone", draft_layers=2), "standalone").draft_layers == 2
    # eagle3 / medusa without spec.draft_model mean the heads shipped for the embedded model.
    assert _assert_validated(spec(algorithm="eagle3"), "eagle3").draft_model == ""
    _assert_validated(spec(algorithm="medusa", num_steps=3, num_draft_tokens=4), "medusa")
    out = _assert_validated(spec(simulate_accept_length=4), "ngram")  # a config may hold it; running it is checked
    assert out.simulate_accept_length == 4
    # N-gram depth is bounded by num_draft_tokens alone, not by num_steps.
    out = _assert_validated(spec(num_steps=1, num_draft_tokens=8), "ngram")
    assert (out.num_steps, out.num_draft_tokens) == (1, 8)
    # "none" ignores the drafter fields: a leftover tree config does not fail and is kept as given.
    out = _assert_validated(spec(algorithm="None", topk=8, num_draft_tokens=1000), "none")
    assert (out.topk, out.num_draft_tokens) == (8, 1000)
    # The loaded default config validates.
    _assert_validated(load_config(None).spec, "none")


@pytest.mark.parametrize("kw, message", [
    (dict(algorithm="eagle2"), r"spec.algorithm: unknown speculative algorithm 'eagle2'; valid: none, ngram"),
    (dict(algorithm="mlp_speculator"), "algorithm 'mlp_speculator' needs a draft model: set spec.draft_model"),
    (dict(algorithm="dflash", topk=2), "spec.topk=2 needs a tree drafter, but algorithm 'dflash' drafts chains only"),
    (dict(algorithm="dspark", num_draft_tokens=1), "spec.num_draft_tokens must be >= 2 for algorithm 'dspark'"),
    (dict(verify="typical"), r"spec.verify must be one of auto, greedy, target-only, rejection, coupled; got 'typical'"),
    (dict(verify="target_only"), "spec.verify must be one of"),
    (dict(threshold_single=0.0), r"spec.threshold_single must be in \(0, 1\]; got 0.0"),
    (dict(threshold_single=1.5), r"spec.threshold_single must be in \(0, 1\]"),
    (dict(threshold_acc=-0.1), r"spec.threshold_acc must be in \(0, 1\]; got -0.1"),
    (dict(num_steps=0), "spec.num_steps must be >= 1; got 0"),
    (dict(topk=0), "spec.topk must be >= 1; got 0"),
    (dict(num_draft_tokens=0), "spec.num_draft_tokens must be >= 1; got 0"),
    (dict(num_draft_tokens=1), "spec.num_draft_tokens must be >= 2 for algorithm 'ngram'"),
    (dict(algorithm="standalone", draft_layers=2, num_draft_tokens=5),
     r"spec.num_draft_tokens: num_draft_tokens=5 exceeds .* = 4"),
    (dict(algorithm="standalone", draft_layers=2, topk=2, num_steps=2, num_draft_tokens=8),
     r"1 \+ topk \+ \(num_steps-1\)\*topk\^2 = 7"),
    (dict(ngram_min_match=0), "spec.ngram_min_match must be >= 1; got 0"),
    (dict(ngram_min_match=5, ngram_max_match=4),
     r"spec.ngram_min_match \(5\) must be <= spec.ngram_max_match \(4\)"),
    (dict(ngram_draft_tokens_by_match=(3, 0)),
     r"spec.ngram_draft_tokens_by_match needs at most ngram_max_match \(4\) entries, each >= 1; got \[3, 0\]"),
    (dict(ngram_draft_tokens_by_match=(1, 1, 1, 1, 1)), "spec.ngram_draft_tokens_by_match needs at most"),
    (dict(draft_layers=-1), "spec.draft_layers must be >= 0; got -1"),
    (dict(simulate_accept_length=-1), r"spec.simulate_accept_length must be >= 0 \(0 = off\)"),
    (dict(algorithm="standalone"), "algorithm 'standalone' needs a draft model: set spec.draft_model"),
    (dict(algorithm="none", simulate_accept_length=1),
     "spec.simulate_accept_length > 0 needs a speculative algorithm"),
    # "none" still checks field ranges, so typos surface.
    (dict(algorithm="none", verify="greedyy"), "spec.verify must be one of"),
])
def test_validate_errors(kw, message):
    with pytest.raises(SpecConfigError, match=message):
        A.validate_spec_config(spec(**kw))


def test_unimplemented_algorithm_is_refused_by_name(plugin):
    plugin("notyet", AlgorithmInfo(implemented=False))
    with pytest.raises(SpecConfigError, match=r"spec.algorithm='notyet' is not implemented yet; implemented: none, "
                                              r"ngram, standalone, eagle, eagle3, medusa, mlp_speculator, frozen_kv_mtp, dflash, dspark"):
        A.validate_spec_config(spec(algorithm="notyet"))


@pytest.mark.parametrize("kw, message", [
    (dict(simulate_accept_length=5), r"simulate_accept_length=5 exceeds .* num_draft_tokens = 4"),
    # A stepped tree is at most num_steps deep, however many nodes it has.
    (dict(algorithm="standalone", draft_layers=2, topk=2, num_steps=2, num_draft_tokens=7,
          simulate_accept_length=4),
     r"1 \+ min\(num_steps, num_draft_tokens - 1\) = 3"),
])
def test_simulate_accept_length_bound(kw, message):
    with pytest.raises(SpecConfigError, match=message):
        A.validate_spec_config(spec(**kw))


def test_capability_errors_via_plugins(plugin):
    plugin("chain", AlgorithmInfo(supports_tree=False))
    with pytest.raises(SpecConfigError, match=r"spec.topk=2 needs a tree drafter, but algorithm "
                                              r"'chain' drafts chains only; use spec.topk=1"):
        A.validate_spec_config(spec(algorithm="chain", topk=2))
    # Rejection needs no capability: a drafter without probabilities is verified as one-hot proposals.
    assert A.validate_spec_config(spec(algorithm="chain", verify="rejection")).verify == "rejection"
    assert A.validate_spec_config(spec(algorithm="CHAIN", verify="target-only")).algorithm == "chain"

    plugin("later", AlgorithmInfo(implemented=False))
    with pytest.raises(SpecConfigError, match="'later' is not implemented yet"):
        A.validate_spec_config(spec(algorithm="later"))
    plugin("heads", AlgorithmInfo(needs_draft_model=True))
    with pytest.raises(SpecConfigError, match="'heads' needs a draft model"):
        A.validate_spec_config(spec(algorithm="heads"))


def test_max_accept_length():
    assert A.max_accept_length(3, 4) == 4  # chain: every draft + bonus
    assert A.max_accept_length(2, 7) == 3  # tree: depth-limited
    assert A.max_accept_length(5, 2) == 2  # node-limited


def test_simulate_accept_length_runs_only_in_a_benchmark():
    A.check_benchmark_only(spec(simulate_accept_length=2), benchmark=True)
    A.check_benchmark_only(spec(), benchmark=False)
    with pytest.raises(SpecConfigError, match="spec.simulate_accept_length=2 is a benchmark-only mode"):
        A.check_benchmark_only(spec(simulate_accept_length=2), benchmark=False)


# ---------------------------------------------------------------- the registry's other entries


def test_each_builtin_declares_its_heads_shipped_head_and_loader():
    heads = {r.name: r.head_kinds for r in A.registrations() if r.head_kinds}
    assert heads == {"eagle": ("eagle", "mtp_deepseek", "mtp_mimo"), "eagle3": ("eagle3",), "medusa": ("medusa",),
                     "frozen_kv_mtp": ("frozen_kv",),
                     "mlp_speculator": ("mlp_speculator",), "dflash": ("dflash",), "dspark": ("dspark",)}
    assert {r.name for r in A.registrations() if r.shipped_head} == {"eagle3", "medusa", "frozen_kv_mtp",
                                                                         "dflash", "dspark"}
    assert all(A.shipped_head(n).joinpath("config.json").is_file() for n in ("eagle3", "medusa", "frozen_kv_mtp", "dflash",
                                                                                      "dspark"))
    with pytest.raises(FileNotFoundError, match="no head ships for --spec mlp_speculator; shipped: eagle3, medusa"):
        A.shipped_head("mlp_speculator")
    assert A.algorithm_for_head("mtp_mimo") == "eagle" and A.algorithm_for_head("nope") is None
    # Every algorithm with draft weights has a loader; n-gram and plain decoding have none.
    assert {r.name for r in A.registrations() if r.load is not None} == {
        n for n in A.builtin_names() if A.algorithm_info(n).needs_draft_model}


@pytest.mark.parametrize("kw, message", [
    (dict(algorithm="mlp_speculator", draft_model="/heads/mlp", tree_choices="[[0]]"),
     r"spec.tree_choices \(--tree-choices\) is read by standalone, eagle, eagle3, medusa and frozen_kv_mtp only; "
     r"--spec mlp_speculator would ignore it"),
    (dict(algorithm="dflash", sps_table="flat"), r"spec.sps_table \(--sps-table\) is read by dspark only"),
    (dict(algorithm="eagle3", draft_layers=2), r"spec.draft_layers \(--draft-layers\) is read by standalone only"),
    (dict(algorithm="medusa", ngram_corpus="c.jsonl"), r"spec.ngram_corpus .* is read by ngram only"),
    (dict(algorithm="none", tree_choices="[[0]]"), "--spec none would ignore it"),
])
def test_a_field_only_other_drafters_read_is_refused(kw, message):
    with pytest.raises(SpecConfigError, match=message):
        A.validate_spec_config(spec(**kw))


def test_owned_fields_pass_for_their_drafter(plugin):
    assert A.validate_spec_config(spec(algorithm="medusa", topk=2, num_draft_tokens=4,
                                       tree_choices="[[0],[1],[0,0]]")).tree_choices
    assert A.validate_spec_config(spec(algorithm="dspark", num_draft_tokens=4, sps_table="flat")).sps_table == "flat"
    name = A.register("corpusreader", AlgorithmInfo(drafts_in_steps=False), reads=("ngram_corpus",))
    try:  # a plugin may read an owned field too
        assert A.validate_spec_config(spec(algorithm=name, ngram_corpus="c.jsonl")).ngram_corpus == "c.jsonl"
        assert "corpusreader" in str(pytest.raises(SpecConfigError, A.validate_spec_config,
                                                   spec(algorithm="eagle3", ngram_corpus="c.jsonl")).value)
    finally:
        A.unregister(name)
    with pytest.raises(SpecConfigError, match="reads must name owned spec fields"):
        A.register("badreads", AlgorithmInfo(), reads=("topk",))


def test_plugin_aliases_register_and_unregister(plugin):
    assert plugin("mine", AlgorithmInfo()) == "mine"
    A.unregister("mine")
    name = A.register("withalias", AlgorithmInfo(), aliases=("WA",))
    try:
        assert A.canonical_name("wa") == "withalias"
        assert "wa (alias of withalias)" in A._describe_valid()
        with pytest.raises(SpecConfigError, match="already registered"):
            A.register("wa", AlgorithmInfo())
        with pytest.raises(SpecConfigError, match="reserved"):
            A.register("other", AlgorithmInfo(), aliases=("nextn",))
    finally:
        A.unregister(name)
    with pytest.raises(SpecConfigError, match="unknown"):
        A.canonical_name("wa")


def test_cli_flags_come_from_the_config_and_the_registry(plugin):
    """--spec lists every registered algorithm with its description (a plugin's too); each [spec] field
    with a flag maps back to its config key."""
    from jaxspec.generate import build_parser, spec_flag_keys

    plugin("helpme", AlgorithmInfo(description="a drafter only this test knows"))
    text = " ".join(build_parser().format_help().split())
    assert "helpme: a drafter only this test knows" in text and "eagle (nextn): EAGLE-1" in text
    keys = spec_flag_keys()
    assert keys["spec"] == "spec.algorithm" and keys["tree_choices"] == "spec.tree_choices"
    assert "adaptive" not in keys and set(keys.values()) <= {f"spec.{f.name}" for f in dataclasses.fields(SpecSection)}
    args = build_parser().parse_args(["--prompt", "x", "--spec", "ngram", "--ngram-draft-tokens-by-match", "2,1"])
    from jaxspec.generate import config_from_args

    assert config_from_args(args).spec.ngram_draft_tokens_by_match == (2, 1)
