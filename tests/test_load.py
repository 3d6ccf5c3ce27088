"""The loader: positions, extends, --set, provenance, and a positioned diagnostic for every bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fuzz_support import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_compile.load import MAX_FILE_BYTES, load_recipe
from molt_compile.yaml_tree import MAX_DEPTH, MAX_NODES

BAD = "tests/data/bad"


def only(loaded, code: str):
    """The single diagnostic with `code` (and no other code present)."""
    codes = [d.code for d in loaded.diagnostics]
    assert codes == [code], codes
    d = loaded.diagnostics[0]
    assert d.severity == "error" and d.blocker
    return d


# ----------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("name", "code", "line", "col"),
    [
        ("syntax_error.yaml", "YAML001", 5, 5),
        ("two_documents.yaml", "YAML001", 4, 1),
        ("tabs.yaml", "YAML002", 5, 1),
        ("duplicate_key.yaml", "YAML003", 6, 3),
        ("python_tag.yaml", "YAML004", 5, 9),
        ("custom_tag.yaml", "YAML004", 4, 15),
        ("alias_bomb.yaml", "YAML005", None, None),
        ("recursive_alias.yaml", "YAML005", 4, 8),
        ("not_utf8.yaml", "YAML006", 4, 19),
        ("non_string_key.yaml", "YAML009", 7, 3),
        ("empty.yaml", "LOAD003", 1, 1),
        ("comments_only.yaml", "LOAD003", 1, 1),
        ("top_level_list.yaml", "LOAD004", 1, 1),
        ("cycle_a.yaml", "LOAD005", 2, 11),
        ("self_extends.yaml", "LOAD005", 4, 10),
        ("extends_missing.yaml", "LOAD006", 6, 5),
        ("extends_bad_value.yaml", "LOAD007", 4, 10),
    ],
)
def test_bad_file_gets_positioned_diagnostic(in_root: Path, name: str, code: str, line: int | None, col: int | None):
    d = only(load_recipe(Path(BAD) / name), code)
    assert d.file is not None and d.file.startswith(BAD)
    if line is not None:
        assert (d.line, d.col) == (line, col), d
    assert d.message and d.help


def test_syntax_error_names_where_the_unclosed_bracket_started(in_root):
    d = only(load_recipe(Path(BAD) / "syntax_error.yaml"), "YAML001")
    assert [(r.line, r.col) for r in d.related] == [(4, 8)]


def test_duplicate_key_points_at_the_second_and_names_the_first(in_root):
    d = only(load_recipe(Path(BAD) / "duplicate_key.yaml"), "YAML003")
    assert d.path == "model.path"
    assert [(r.file, r.line, r.col) for r in d.related] == [(f"{BAD}/duplicate_key.yaml", 5, 3)]


def test_cycle_lists_the_chain(in_root):
    d = only(load_recipe(Path(BAD) / "cycle_a.yaml"), "LOAD005")
    assert d.file == f"{BAD}/cycle_b.yaml"  # the entry that closes the cycle
    assert d.message.endswith("cycle_a.yaml -> tests/data/bad/cycle_b.yaml -> tests/data/bad/cycle_a.yaml")


def test_missing_file(in_root):
    d = only(load_recipe(Path(BAD) / "nope.yaml"), "LOAD001")
    assert d.file == f"{BAD}/nope.yaml" and d.line is None


def test_directory(in_root):
    d = only(load_recipe(Path(BAD)), "LOAD002")
    assert "lint" in d.help


def test_file_over_the_size_cap_is_rejected_before_reading(tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(50 * 1024 * 1024)  # sparse: 50 MB on paper, nothing on disk
    d = only(load_recipe(big), "YAML007")
    assert f"{MAX_FILE_BYTES:,}" in d.message and "52,428,800" in d.message


def test_deep_nesting_is_bounded(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n")
    assert [d.code for d in load_recipe(deep).diagnostics] == ["YAML008"]


def test_very_deep_nesting_does_not_overflow_the_parser(tmp_path):
    deep = tmp_path / "deeper.yaml"
    deep.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    d = only(load_recipe(deep), "YAML008")
    assert (d.line, d.col) == (1, 4 + MAX_DEPTH)
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text("a: '" + "[" * 200 + "'\nb: 1 # " + "{" * 200 + "\n")
    assert load_recipe(quoted).data == {"a": "[" * 200, "b": 1}


def test_deep_block_nesting_that_overflows_the_parser_stack(tmp_path):
    deep = tmp_path / "block.yaml"
    deep.write_text("a:\n  " + "- " * 3000 + "x\n")
    d = only(load_recipe(deep), "YAML008")
    assert "parser" in d.message


def test_alias_bomb_stops_at_the_node_budget(in_root):
    d = only(load_recipe(Path(BAD) / "alias_bomb.yaml"), "YAML005")
    assert f"{MAX_NODES:,}" in d.message and d.path.startswith("env.")


def test_python_tag_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f'version: 1\nx: !!python/object/apply:os.system ["touch {marker}"]\n'
                      f'y: !!python/name:os.system ""\n')
    loaded = load_recipe(recipe)
    assert [d.code for d in loaded.diagnostics] == ["YAML004", "YAML004"]
    assert not marker.exists()


def test_tagged_value_that_does_not_parse(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("a: !!int twelve\nb: !!float 1.5\nc: !!str 7\n")
    loaded = load_recipe(recipe)
    assert [(d.code, d.line) for d in loaded.diagnostics] == [("YAML004", 1)]


def test_extends_target_that_is_a_directory(tmp_path):
    (tmp_path / "base").mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nextends: base\n")
    d = only(load_recipe(recipe), "LOAD006")
    assert (d.line, d.col) == (2, 10)


def test_errors_in_a_base_point_into_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text("a: 1\na: 2\n")
    (tmp_path / "r.yaml").write_text("extends: base.yaml\nname: x\n")
    d = only(load_recipe(tmp_path / "r.yaml"), "YAML003")
    assert d.file.endswith("base.yaml") and d.line == 2


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab:-[]{}&*!#|>'\"\t\n ,?%@`19.")), max_size=80))
def test_any_text_gives_diagnostics_not_exceptions(tmp_path, text):
    recipe = tmp_path / "fuzz.yaml"
    recipe.write_text(text)
    loaded = load_recipe(recipe)
    assert loaded.data is None or isinstance(loaded.data, dict)
    assert all(d.code[:4] in ("YAML", "LOAD") for d in loaded.diagnostics)
    if loaded.data is None:
        assert loaded.diagnostics


# ----------------------------------------------------------------------------------------- positions
def test_every_value_keeps_file_line_col(in_root):
    loaded = load_recipe(Path("tests/data/good/rl_min.yaml"))
    assert loaded.ok and loaded.diagnostics == []
    pos = loaded.source.positions
    f = "tests/data/good/rl_min.yaml"
    assert (pos["name"].file, pos["name"].line, pos["name"].col) == (f, 4, 7)
    assert (pos["cluster.gpus_per_node"].line, pos["cluster.gpus_per_node"].col) == (6, 36)
    assert (pos["rollout.engines"].line, pos["rollout.engines"].col) == (14, 12)
    assert pos["rollout"].line == 13  # a block section points at its key
    assert loaded.key_positions["rollout.engines"].col == 3
    assert loaded.source.lines[f][13] == "  engines: 4"
    assert loaded.source.pos("actor.mesh.tp").layer == "default"  # not written: a default


def test_list_items_have_positions(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo:\n  reward_clip: [-5, 5]\nmounts:\n  - a\n  - b\n")
    pos = load_recipe(recipe).source.positions
    assert (pos["algo.reward_clip.0"].line, pos["algo.reward_clip.0"].col) == (2, 17)
    assert (pos["algo.reward_clip.1"].col) == 21
    assert (pos["mounts.1"].line, pos["mounts.1"].col) == (5, 5)


def test_yaml_scalars_are_plain_data(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("a: 1e-6\nb: 0x10\nc: yes\nd: ~\ne: 1_000\nf: '8'\ng: 2026-01-01\nh: .inf\ni: True\n")
    data = load_recipe(recipe).data
    assert data == {"a": 1e-6, "b": 16, "c": "yes", "d": None, "e": 1000, "f": "8", "g": "2026-01-01",
                    "h": float("inf"), "i": True}


def test_merge_keys_follow_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("x: &base {a: 1, b: 2}\ny:\n  <<: *base\n  b: 3\n")
    assert load_recipe(recipe).data["y"] == {"a": 1, "b": 3}


# ----------------------------------------------------------------------------------------- extends
def test_extends_merges_maps_and_replaces_lists(in_root):
    loaded = load_recipe(Path("tests/data/good/child.yaml"))
    assert loaded.ok, loaded.diagnostics
    data = loaded.data
    assert data["model"] == {"path": "/models/child", "attn": "sdpa"}  # maps merge, later wins
    assert data["algo"]["reward_clip"] == [-5, 5]  # lists replace
    assert data["algo"]["kl"] == {"coef": 0.001, "estimator": "k2"}
    assert data["train"]["async"] == {"queue_size": 2, "partial_rollout": False}
    assert data["actor"]["optimizer"]["betas"] == [0.9, 0.99]
    assert data["env"] == {"A": "from-base", "B": "from-optim", "C": "from-child"}  # list order: later wins
    assert data["extends"] == ["base/common.yaml", "base/optim.yaml"]  # the recipe's own, not its bases'
    assert loaded.files == ["tests/data/good/child.yaml", "tests/data/good/base/common.yaml",
                            "tests/data/good/base/optim.yaml"]


def test_extends_provenance(in_root):
    loaded = load_recipe(Path("tests/data/good/child.yaml"))
    pos = loaded.source.positions
    assert (pos["model.path"].file, pos["model.path"].line) == ("tests/data/good/child.yaml", 4)
    assert (pos["model.attn"].file, pos["model.attn"].line) == ("tests/data/good/base/common.yaml", 7)
    assert pos["env.B"].file == "tests/data/good/base/optim.yaml"
    assert "algo.reward_clip.1" in pos and pos["algo.reward_clip.1"].file.endswith("child.yaml")
    over = loaded.overridden["model.path"]
    assert [(p.file, p.line) for p in over] == [("tests/data/good/base/common.yaml", 6)]
    assert "train.async.partial_rollout" not in loaded.overridden


def test_replaced_subtree_drops_stale_positions(tmp_path):
    (tmp_path / "base.yaml").write_text("ref: {path: /a, placement: separate}\n")
    (tmp_path / "r.yaml").write_text("extends: base.yaml\nref: null\n")
    loaded = load_recipe(tmp_path / "r.yaml")
    assert loaded.data["ref"] is None
    assert "ref.path" not in loaded.source.positions and loaded.source.positions["ref"].line == 2


def test_diamond_applies_a_shared_base_once(tmp_path):
    (tmp_path / "d.yaml").write_text("x: d\ny: d\n")
    (tmp_path / "a.yaml").write_text("extends: d.yaml\nx: a\n")
    (tmp_path / "b.yaml").write_text("extends: d.yaml\nz: b\n")
    (tmp_path / "r.yaml").write_text("extends: [a.yaml, b.yaml]\n")
    loaded = load_recipe(tmp_path / "r.yaml")
    assert loaded.diagnostics == []
    assert loaded.data == {"x": "a", "y": "d", "z": "b", "extends": ["a.yaml", "b.yaml"]}


def test_extends_is_relative_to_the_file_that_says_it(tmp_path):
    (tmp_path / "lib" / "deep").mkdir(parents=True)
    (tmp_path / "lib" / "deep" / "leaf.yaml").write_text("leaf: 1\n")
    (tmp_path / "lib" / "mid.yaml").write_text("extends: deep/leaf.yaml\nmid: 1\n")
    (tmp_path / "r.yaml").write_text("extends: lib/mid.yaml\n")
    assert load_recipe(tmp_path / "r.yaml").data == {"leaf": 1, "mid": 1, "extends": "lib/mid.yaml"}


def test_base_fragments_are_recognised(in_root):
    assert load_recipe(Path("tests/data/good/base/common.yaml")).is_fragment  # under base/
    assert not load_recipe(Path("tests/data/good/child.yaml")).is_fragment
    assert not load_recipe(Path("tests/data/good/rl_min.yaml")).is_fragment
    assert not load_recipe(Path("tests/data/bad/cycle_b.yaml")).is_fragment  # only `lint` sees who extends it


# ----------------------------------------------------------------------------------------- --set
def test_set_overrides_with_yaml_values_and_records_provenance(in_root):
    loaded = load_recipe(Path("tests/data/good/child.yaml"),
                         ["train.async.queue_size=4", "train.async.force_sync=true", "algo.reward_clip=[-1, 1]",
                          "model.path=/models/other", "ref.path=/models/ref", "algo.reward_clip.0=-2",
                          "env.NEW=x=y"])
    assert loaded.ok, loaded.diagnostics
    d = loaded.data
    assert d["train"]["async"] == {"queue_size": 4, "partial_rollout": False, "force_sync": True}
    assert d["algo"]["reward_clip"] == [-2, 1]
    assert d["model"]["path"] == "/models/other" and d["ref"] == {"path": "/models/ref"}
    assert d["env"]["NEW"] == "x=y"
    pos = loaded.source.positions
    for key in ("train.async.queue_size", "model.path", "ref.path", "algo.reward_clip.0", "algo.reward_clip.1"):
        assert pos[key].layer == "--set" and pos[key].file is None, key
    assert pos["model.attn"].layer == "file"


@pytest.mark.parametrize(
    ("item", "code", "hint"),
    [
        ("train.async.queue_sise=2", "LOAD009", "train.async.queue_size"),
        ("algo.kl.coeff=1", "LOAD009", "algo.kl.coef"),
        ("rolout.engines=2", "LOAD009", "rollout.engines"),
        ("model.path.x=1", "LOAD009", ""),
        ("queue_size=2", "LOAD009", "train.async"),
        ("algo.reward_clip.5=1", "LOAD009", ""),
        ("rollout.engines=[1,", "LOAD010", "quote"),
        ("rollout.engines=!!python/name:os.system", "LOAD010", ""),
        ("rollout.engines", "LOAD008", "train.async.queue_size=2"),
        ("=3", "LOAD008", ""),
        ("a..b=3", "LOAD008", ""),
    ],
)
def test_bad_set(in_root, item: str, code: str, hint: str):
    d = only(load_recipe(Path("tests/data/good/child.yaml"), [item]), code)
    assert d.origin == "--set" and d.file is None
    assert hint in d.help


def test_set_is_checked_against_the_recipe_kind(in_root):
    # `rollout` exists only in RL recipes.
    d = only(load_recipe(Path("tests/data/good/sft_min.yaml"), ["rollout.engines=2"]), "LOAD009")
    assert "rollout" in d.message


def test_set_on_a_free_form_mapping(in_root):
    loaded = load_recipe(Path("tests/data/good/rl_min.yaml"), ["env.NCCL_DEBUG=INFO", "ignore.PLACE007=on purpose"])
    assert loaded.ok
    assert loaded.data["env"] == {"NCCL_DEBUG": "INFO"} and loaded.data["ignore"] == {"PLACE007": "on purpose"}


def test_set_is_not_applied_after_a_blocker(in_root):
    loaded = load_recipe(Path(BAD) / "duplicate_key.yaml", ["nope=1"])
    assert [d.code for d in loaded.diagnostics] == ["YAML003"]


def test_relative_display_path_outside_cwd(tmp_path, in_root):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("a: [\n")
    d = load_recipe(recipe).diagnostics[0]
    assert d.file == str(recipe) and os.path.isabs(d.file)


def test_repeated_loads_do_not_share_or_leak_state(tmp_path):
    (tmp_path / "base.yaml").write_text("env: {A: a}\nalgo: {reward_clip: [1, 2]}\n")
    (tmp_path / "r.yaml").write_text("extends: [base.yaml]\nname: r\n")
    first = load_recipe(tmp_path / "r.yaml", ["extends.0=other.yaml", "algo.reward_clip.0=9"])
    assert first.diagnostics == [] and first.data["algo"]["reward_clip"] == [9, 2]
    first.data["env"]["A"] = "changed"
    second = load_recipe(tmp_path / "r.yaml")
    assert second.data == {"env": {"A": "a"}, "algo": {"reward_clip": [1, 2]}, "name": "r",
                           "extends": ["base.yaml"]}
    (tmp_path / "base.yaml").write_text("env: {A: edited}\n")  # a changed file is parsed again
    assert load_recipe(tmp_path / "r.yaml").data["env"] == {"A": "edited"}


def test_set_into_a_missing_list_changes_nothing(in_root):
    loaded = load_recipe(Path("tests/data/good/rl_min.yaml"), ["algo.reward_clip.0=-2"])
    assert [d.code for d in loaded.diagnostics] == ["LOAD009"]
    assert "algo" not in loaded.data and "set the whole list" in loaded.diagnostics[0].help


_KEYS = st.sampled_from(["a", "b", "c", "model", "path", "x1"])
_SCALARS = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.text("xyz", max_size=3))
_VALUES = st.recursive(_SCALARS | st.lists(_SCALARS, max_size=3),
                       lambda inner: st.dictionaries(_KEYS, inner, max_size=3), max_leaves=8)
_DOCS = st.dictionaries(_KEYS, _VALUES, max_size=4)


def _reference_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _reference_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=_DOCS, mid=_DOCS, child=_DOCS)
def test_extends_is_a_deep_merge_where_later_wins(tmp_path, base, mid, child):
    import json

    (tmp_path / "base.yaml").write_text(json.dumps(base) + "\n")  # JSON is YAML
    (tmp_path / "mid.yaml").write_text(json.dumps(mid) + "\n")
    (tmp_path / "r.yaml").write_text(json.dumps({"extends": ["base.yaml", "mid.yaml"], **child}) + "\n")
    loaded = load_recipe(tmp_path / "r.yaml")
    assert loaded.diagnostics == []
    expected = _reference_merge(_reference_merge(base, mid), child)
    assert loaded.data == {**expected, "extends": ["base.yaml", "mid.yaml"]}
    # Every value's position is in the last file that wrote that path.
    from molt_compile.load import _paths

    for path, pos in loaded.source.positions.items():
        layers = [("base.yaml", base), ("mid.yaml", mid), ("r.yaml", {"extends": [], **child})]
        last = [name for name, doc in layers if path in _paths(doc) or (path.startswith("extends") and name == "r.yaml")]
        assert last and Path(pos.file).name == last[-1], (path, pos)


# ----------------------------------------------------------------------------------------- fuzz: --set and extends
_SET_TEXT = st.text(alphabet=st.sampled_from(list("kind.=[]{}:,rlsft 1\"'-_aev")), max_size=24)
_SET_VALUE = st.one_of(st.sampled_from(["[]", "{}", "[rl]", "{rl: 1}", "null", "1", "rl", '{"A=B": x}']), _SET_TEXT)


@settings(max_examples=examples(60), deadline=None)
@given(items=st.lists(st.one_of(_SET_TEXT, st.builds("kind={}".format, _SET_VALUE),
                                st.builds("env={}".format, _SET_VALUE)), max_size=3))
def test_any_set_gives_diagnostics_not_exceptions(items):
    """Issue 13.5: `--set kind=[rl]` raised in the schema lookup of the next `--set` and in validate."""
    from molt_compile.validate import validate

    loaded = load_recipe(Path(__file__).parents[1] / "recipes" / "demo_math.yaml", items)
    recipe, diags = validate(loaded)
    assert recipe is not None or diags or loaded.diagnostics


_SEGMENTS = st.sampled_from(["..", ".", "base", "x.yaml", "etc", "passwd", "inside.yaml", "link.yaml", "/", "out"])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(targets=st.lists(st.lists(_SEGMENTS, min_size=1, max_size=5).map("/".join), min_size=1, max_size=3))
def test_extends_never_reads_outside_the_roots(tmp_path, targets, monkeypatch):
    monkeypatch.delenv("MOLT_RECIPE_ROOTS", raising=False)
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / ".git").mkdir(parents=True)
        (repo / "base").mkdir()
        (repo / "base" / "inside.yaml").write_text("cluster: {nodes: 1}\n")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x.yaml").write_text("- secret\n")
        (repo / "base" / "link.yaml").symlink_to(tmp_path / "out" / "x.yaml")
    (repo / "base" / "r.yaml").write_text(f"extends: {json.dumps(targets)}\n")
    loaded = load_recipe(repo / "base" / "r.yaml")
    read = [Path(os.path.realpath(f)) for f in loaded.files]
    assert all(p.is_relative_to(repo) and p.suffix == ".yaml" for p in read), read
    assert set(loaded.source.lines) <= set(loaded.files)


