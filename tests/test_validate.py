"""Schema validation: every pydantic error becomes a positioned diagnostic with a plain message and a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from molt_compile.codes import BUILTIN, LOADER_CODES
from molt_compile.load import load_recipe
from molt_compile.validate import validate
from schemas.recipe import RlRecipe, SftRecipe

BAD = "tests/data/bad"


def schema_diags(path: str | Path, sets=()):
    loaded = load_recipe(Path(path), sets)
    assert loaded.ok, loaded.diagnostics
    recipe, diags = validate(loaded)
    assert diags and all(not d.blocker and d.severity == "error" for d in diags)  # recipe errors: exit 1
    return diags


@pytest.mark.parametrize(
    ("name", "code", "path", "line", "col", "help_has"),
    [
        ("typo_nested.yaml", "SCHEMA001", "train.async.queue_sise", 8, 5, "did you mean `queue_size`?"),
        ("misplaced_key.yaml", "SCHEMA001", "algo.queue_size", 7, 3, "`train.async`"),
        ("wrong_type.yaml", "SCHEMA002", "actor.nodes", 6, 10, "integer"),
        ("out_of_range.yaml", "SCHEMA003", "rollout.gpu_memory_utilization", 6, 27, "<= 1.0"),
        ("short_list.yaml", "SCHEMA003", "algo.reward_clip", 7, 16, "exactly 2 items"),
        ("missing_key.yaml", "SCHEMA004", "model.path", 4, 1, "add `path:` under `model`"),
        ("missing_kind.yaml", "SCHEMA004", "kind", None, None, "kind: rl"),
        ("bad_enum.yaml", "SCHEMA005", "algo.estimator", 6, 14, "did you mean `grpo`?"),
        ("bad_kind.yaml", "SCHEMA005", "kind", 3, 7, "did you mean `rl`?"),
        ("no_version.yaml", "SCHEMA006", "version", None, None, "version: 1"),
        ("version_2.yaml", "SCHEMA006", "version", 1, 10, "version: 1"),
        ("bad_name.yaml", "SCHEMA007", "name", 2, 7, "name: bad-name"),
    ],
)
def test_schema_error_is_positioned(in_root, name, code, path, line, col, help_has):
    diags = schema_diags(Path(BAD) / name)
    assert [(d.code, d.path) for d in diags] == [(code, path)]
    d = diags[0]
    assert d.file == f"{BAD}/{name}"
    assert (d.line, d.col) == (line, col)
    assert help_has in d.help, d.help
    assert d.name == BUILTIN[code].name


def test_many_errors_are_all_reported(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "version: 1\nname: many\nkind: rl\nmodel: {pth: /m}\nactor:\n  mesh: {tp: 0, epp: 2}\n"
        "  loss: {mode: ppo2}\nrollout: 8\ndata: {prompts: p}\n")
    diags = schema_diags(recipe)
    assert sorted((d.code, d.path, d.line) for d in diags) == [
        ("SCHEMA001", "actor.mesh.epp", 6, ),
        ("SCHEMA001", "model.pth", 4),
        ("SCHEMA002", "rollout", 8),
        ("SCHEMA003", "actor.mesh.tp", 6),
        ("SCHEMA004", "model.path", 4),
        ("SCHEMA005", "actor.loss.mode", 7),
    ]


def test_unknown_top_level_key_suggests(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: x\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p}\nrollouts: {engines: 2}\n")
    (d,) = schema_diags(recipe)
    assert (d.code, d.line, d.col) == ("SCHEMA001", 6, 1)
    assert d.message == "unknown key `rollouts` at the top level" and "`rollout`" in d.help


def test_sft_recipe_has_no_rollout(in_root, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: x\nkind: sft\nmodel: {path: /m}\ndata: {dataset: d}\nrollout: {engines: 2}\n")
    (d,) = schema_diags(recipe)
    assert d.code == "SCHEMA001" and d.path == "rollout"


def test_union_type_error_is_one_diagnostic(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: x\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p}\n"
                      "train: {dynamic_batch: 5}\ncluster: {cpus_per_node: many}\n")
    diags = schema_diags(recipe)
    assert sorted((d.code, d.path) for d in diags) == [("SCHEMA002", "cluster.cpus_per_node"),
                                                        ("SCHEMA002", "train.dynamic_batch")]


def test_error_in_a_base_points_into_the_base(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "b.yaml").write_text("version: 1\nkind: rl\nactor:\n  nodes: -1\n")
    (tmp_path / "r.yaml").write_text("extends: base/b.yaml\nname: x\nmodel: {path: /m}\ndata: {prompts: p}\n")
    (d,) = schema_diags(tmp_path / "r.yaml")
    assert d.code == "SCHEMA003" and d.file.endswith("base/b.yaml") and (d.line, d.col) == (4, 10)


def test_error_in_a_set_value_says_so(in_root):
    (d,) = schema_diags("tests/data/good/rl_min.yaml", ["rollout.engines=0"])
    assert d.code == "SCHEMA003" and d.path == "rollout.engines"
    assert d.origin == "--set" and d.line is None


def test_valid_recipes(in_root):
    rl, diags = validate(load_recipe(Path("tests/data/good/rl_min.yaml")))
    assert diags == [] and isinstance(rl, RlRecipe)
    assert rl.rollout.engines == 4 and rl.actor.mesh.tp == 1
    sft, diags = validate(load_recipe(Path("tests/data/good/sft_min.yaml")))
    assert diags == [] and isinstance(sft, SftRecipe) and sft.data.dataset == "data/sft.jsonl"
    child, diags = validate(load_recipe(Path("tests/data/good/child.yaml")))
    assert diags == [] and child.train.async_.queue_size == 2 and child.algo.reward_clip == (-5.0, 5.0)


def test_async_is_spelled_async(in_root):
    recipe = Path("tests/data/good/rl_min.yaml")
    loaded = load_recipe(recipe)
    loaded.data["train"]["async_"] = {"queue_size": 3}
    _, diags = validate(loaded)
    assert [(d.code, d.path) for d in diags] == [("SCHEMA001", "train.async_")]
    assert "`async`" in diags[0].help
    rl, _ = validate(load_recipe(recipe, ["train.async.queue_size=3"]))
    assert rl.model_dump(mode="json")["train"]["async"]["queue_size"] == 3


def test_validate_skips_unloadable_input(in_root):
    loaded = load_recipe(Path(BAD) / "syntax_error.yaml")
    assert validate(loaded) == (None, [])


def test_every_loader_code_is_documented():
    assert len({c.code for c in LOADER_CODES}) == len(LOADER_CODES)
    for c in LOADER_CODES:
        assert c.code[-3:].isdigit() and c.name == c.name.lower() and len(c.doc) > 40, c


def test_error_names_the_base_value_it_replaced(tmp_path):
    (tmp_path / "base.yaml").write_text("version: 1\nkind: rl\nrollout:\n  engines: 2\n")
    (tmp_path / "r.yaml").write_text("extends: base.yaml\nname: x\nmodel: {path: /m}\ndata: {prompts: p}\n"
                                     "rollout: {engines: 0}\n")
    (d,) = schema_diags(tmp_path / "r.yaml")
    assert (d.code, d.line) == ("SCHEMA003", 5)
    assert [(r.file.endswith("base.yaml"), r.line, r.col, r.note) for r in d.related] == [
        (True, 4, 12, "replaces the value set")]


def test_type_errors_have_specific_help(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: t\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p}\n"
                      "env: {A: 1}\nrollout: {engines: 2.5}\neval:\n")
    diags = {d.path: d for d in schema_diags(recipe)}
    assert set(diags) == {"env.A", "rollout.engines", "eval"}
    assert diags["env.A"].help == 'quote it: `A: "1"`'
    assert diags["rollout.engines"].message == "`rollout.engines` must be a whole number, got `2.5`"
    assert (diags["eval"].line, diags["eval"].col) == (8, 1)
    assert "`eval: {}`" in diags["eval"].help


def test_a_literal_wandb_key_is_refused_without_echoing_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: w\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p.jsonl}\n"
                      "logging:\n  wandb: {project: p, key: 0123456789abcdef-secret}\n")
    diags = schema_diags(recipe)
    assert [(d.code, d.path, d.line) for d in diags] == [("SCHEMA007", "logging.wandb.key", 7)]
    assert "${env:NAME}" in diags[0].message and "secret" not in diags[0].message + diags[0].help


@pytest.mark.parametrize("kind", ["[]", "{}", "[rl]", "{rl: 1}", "1.5", "null"])
def test_a_kind_of_any_shape_is_a_diagnostic(tmp_path, kind):
    """Issue 13.5: an unhashable `kind` raised TypeError in validate (and in `--set`'s schema lookup)."""
    (tmp_path / "r.yaml").write_text(f"version: 1\nname: x\nkind: {kind}\nmodel: {{path: /m}}\ndata: {{prompts: p}}\n")
    for sets in ((), ("train.batch_size=4",)):
        loaded = load_recipe(tmp_path / "r.yaml", sets)
        recipe, diags = validate(loaded)
        assert recipe is None and [(d.code, d.line) for d in diags] == [("SCHEMA005", 3)]  # no kind: no recipe


def test_kind_set_to_a_list_is_a_diagnostic(in_root):
    recipe, diags = validate(load_recipe("recipes/demo_math.yaml", ["kind=[rl]"]))
    assert recipe is None and [d.code for d in diags] == ["SCHEMA005"]


@pytest.mark.parametrize(("section", "key"), [("env", "A=B"), ("env", "1X"), ("env", "X Y"), ("env", ""),
                                              ("agent.env", "PATH=/x"), ("agent.env", "é")])
def test_env_keys_are_posix_names(in_root, section, key):
    """Issue 13.5: `env: {"A=B": x}` compiled and then crashed `--submit`; now a positioned schema error."""
    recipe, diags = validate(load_recipe("recipes/demo_math.yaml", [f"{section}={{{json.dumps(key)}: v}}"]))
    assert [(d.code, d.path) for d in diags] == [("SCHEMA007", f"{section}.{key}")]
    assert recipe is not None and key not in (recipe.env if section == "env" else recipe.agent.env)  # dropped
    assert "not an environment variable name" in diags[0].message


def test_env_key_error_points_at_the_key(tmp_path):
    (tmp_path / "r.yaml").write_text("version: 1\nname: x\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p}\n"
                                     "env:\n  OK_1: a\n  \"A=B\": b\n")
    _, diags = validate(load_recipe(tmp_path / "r.yaml"))
    assert [(d.code, d.line, d.col) for d in diags] == [("SCHEMA007", 8, 3)]
    assert "`A: ...`" in diags[0].help


def test_section_defaults_are_the_validated_defaults():
    """A section left out of a recipe is filled by `model_construct` (schemas.recipe.section: building it would build
    that section's own validator in every compile). That is the object validation would give while no section has a
    model validator (pydantic validates no defaults either way): this test says when that stops being true."""
    import schemas.recipe as recipe_module

    sections = [c for c in vars(recipe_module).values()
                if isinstance(c, type) and issubclass(c, recipe_module.Section) and c is not recipe_module.Section]
    assert len(sections) > 25
    for cls in sections:
        assert not cls.__pydantic_decorators__.model_validators, cls.__name__
        for name, field in cls.model_fields.items():
            if field.default_factory is not None:
                built = field.default_factory()  # type: ignore[call-arg]
                given = {k: getattr(built, k) for k in built.model_fields_set}  # section(X, lr=...)'s values
                validated = type(built).model_validate(given)
                assert built == validated and built.model_fields_set == validated.model_fields_set, (cls, name)
