"""The rule catalog: data-file tests, compiled docstring examples, and catalog integrity.

Data files live in tests/rules/:
- `<CODE>_<n>.yaml`: a bad recipe (usually `extends: _base_rl.yaml`); each offending line ends with `# E: CODE`,
  `# W: CODE` or `# I: CODE`. The test asserts the exact set of (code, line) of the error and warning diagnostics
  (extra ones fail), and of the info diagnostics whose code appears in an `# I:` comment.
- `<CODE>_ok.yaml`: a good neighbour that must compile without errors and without that code.
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from molt_compile.compile import compile_recipe
from molt_compile.rules import ALL_RULES, RULES_BY_CODE
from molt_compile.rules.docs import SECTIONS, reference

RULES_DIR = Path(__file__).parent / "rules"
EXPECT = re.compile(r"#\s*([EWI]):\s*([A-Z]+[0-9]{3})")
SEVERITY = {"E": "error", "W": "warning", "I": "info"}
BAD_FILES = sorted(p for p in RULES_DIR.glob("*.yaml") if re.fullmatch(r"[A-Z]+[0-9]{3}_[0-9]+", p.stem))
OK_FILES = sorted(RULES_DIR.glob("*_ok.yaml"))


def _expected(path: Path) -> set[tuple[str, str, int]]:
    out = set()
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        for sev, code in EXPECT.findall(line):
            out.add((SEVERITY[sev], code, lineno))
    return out


def _compile(path: Path):
    return compile_recipe(path, lower=False)


def _where(d, path: Path) -> int | None:
    """The diagnostic's line when it points into this file, else None (a line elsewhere is a failure)."""
    return d.line if d.file and Path(d.file).resolve() == path.resolve() else None


def test_data_files_were_collected():
    assert len(BAD_FILES) >= len(ALL_RULES) and len(OK_FILES) >= len(ALL_RULES)


@pytest.mark.parametrize("path", BAD_FILES, ids=lambda p: p.stem)
def test_bad_recipe_reports_exactly_the_marked_lines(path: Path):
    expected = _expected(path)
    assert expected, f"{path.name} marks no expected diagnostic"
    info_codes = {c for s, c, _ in expected if s == "info"}
    result = _compile(path)
    blockers = [d for d in result.diagnostics if d.blocker or d.code.startswith("SCHEMA")]
    assert not blockers, f"{path.name} does not load: {[(d.code, d.message) for d in blockers]}"
    found = {(d.severity, d.code, _where(d, path)) for d in result.diagnostics
             if d.severity != "info" or d.code in info_codes}
    assert found == expected, "\n".join(
        [f"missing: {sorted(expected - found, key=str)}", f"unexpected: {sorted(found - expected, key=str)}"]
        + [f"  {d.severity} {d.code} {d.path} line {d.line}: {d.message}" for d in result.diagnostics])
    for d in result.diagnostics:
        if (d.severity, d.code, _where(d, path)) in expected:
            assert d.message and d.help, f"{d.code} has no message or help"
            assert d.name == RULES_BY_CODE[d.code].name


@pytest.mark.parametrize("path", OK_FILES, ids=lambda p: p.stem)
def test_good_neighbour_does_not_raise_its_code(path: Path):
    code = path.stem.removesuffix("_ok")
    result = _compile(path)
    codes = [(d.severity, d.code, d.line, d.message) for d in result.diagnostics]
    assert code not in {d.code for d in result.diagnostics}, codes
    assert result.exit_status == 0, codes


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_every_rule_has_a_bad_and_a_good_test_file(rule):
    assert any(p.stem.startswith(rule.code + "_") for p in BAD_FILES), f"no tests/rules/{rule.code}_1.yaml"
    assert (RULES_DIR / f"{rule.code}_ok.yaml").exists(), f"no tests/rules/{rule.code}_ok.yaml"


def test_test_files_name_existing_codes():
    for path in BAD_FILES + OK_FILES:
        assert path.stem.split("_")[0] in RULES_BY_CODE, f"{path.name}: no such rule"


# ---------------------------------------------------------------------------------------------- catalog integrity
def test_codes_are_unique_sorted_and_well_formed():
    codes = [r.code for r in ALL_RULES]
    assert len(codes) == len(set(codes))
    assert codes == sorted(codes)
    for r in ALL_RULES:
        assert re.fullmatch(r"[A-Z]+[0-9]{3}", r.code), r.code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", r.name), r.name
        assert r.severity in ("error", "warning", "info")
        assert set(r.kinds) <= {"rl", "sft"} and r.kinds


def test_names_are_unique():
    names = [r.name for r in ALL_RULES]
    assert len(names) == len(set(names))


def test_every_rule_function_is_in_the_catalog():
    import molt_compile.rules as pkg

    registered = {r.check for r in ALL_RULES}
    modules = [p.stem for p in Path(pkg.__file__).parent.glob("*.py") if not p.stem.startswith("_")
               and p.stem != "docs"]
    assert len(modules) >= 12
    for name in modules:
        module = __import__(f"molt_compile.rules.{name}", fromlist=["_"])
        for fname, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not fname.startswith("_"):
                assert fn in registered, f"molt_compile.rules.{name}.{fname} is not in ALL_RULES"


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_docstring_has_every_section(rule):
    doc = rule.doc
    positions = [doc.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in positions), f"{rule.code} lacks {[s for s, p in zip(SECTIONS, positions, strict=True) if p < 0]}"
    assert positions == sorted(positions), f"{rule.code}: sections out of order"
    assert len(_yaml_blocks(doc)) == 2, f"{rule.code}: Example and Use instead need one ```yaml block each"
    assert re.search(r"molt_rules\.md|molt_0_2_1\.md|DESIGN\.md|style_anchors|vLLM|catalog", doc.split("## References")[1])


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_check_functions_are_small(rule):
    lines = inspect.getsource(rule.check).splitlines()
    doc_lines = len((rule.check.__doc__ or "").splitlines())
    assert len(lines) - doc_lines <= 36, f"{rule.code}: {len(lines) - doc_lines} lines of code"


def test_reference_page_is_current():
    committed = (Path(__file__).parents[1] / "molt_compile/rules/REFERENCE.md").read_text()
    assert committed == reference(), "run: python -m molt_compile.rules.docs > molt_compile/rules/REFERENCE.md"


def test_rule_modules_import_nothing_heavy():
    pkg_dir = Path(__file__).parents[1] / "molt_compile"
    files = list((pkg_dir / "rules").glob("*.py")) + [pkg_dir / n for n in ("memory.py", "model_facts.py",
                                                                               "agent_check.py")]
    files += [Path(__file__).parents[1] / "schemas" / n for n in ("catalog.py", "datafiles.py", "schedule.py")]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert n.split(".")[0] not in {"torch", "ray", "vllm", "transformers", "datasets", "pyarrow", "runtime"}, \
                    f"{f}: {n}"


# ---------------------------------------------------------------------------------------------- docstring examples
def _yaml_blocks(doc: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _example_result(rule, block: str, tmp_path: Path):
    yaml = YAML(typ="safe")
    fragment = yaml.load(block) or {}
    kind = fragment.get("kind") or ("sft" if rule.kinds == ("sft",) else "rl")
    base = yaml.load((RULES_DIR / f"_base_{kind}.yaml").read_text())
    for sub in ("agents", "data", "models"):
        if not (tmp_path / sub).exists():
            shutil.copytree(RULES_DIR / sub, tmp_path / sub)
    if not (tmp_path / "big").exists():  # a data file over the 4 MiB row-scan budget (DATA011): linked, not copied
        (tmp_path / "big").symlink_to(RULES_DIR / "big")
    recipe = tmp_path / "example.yaml"
    with recipe.open("w") as f:
        YAML().dump(_merge(base, fragment), f)
    return _compile(recipe)


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_docstring_example_raises_its_code(rule, tmp_path: Path):
    bad, good = _yaml_blocks(rule.doc)
    result = _example_result(rule, bad, tmp_path)
    assert not any(d.blocker or d.code.startswith("SCHEMA") for d in result.diagnostics), [(d.code, d.message) for d in result.diagnostics]
    assert rule.code in {d.code for d in result.diagnostics}, [(d.code, d.message) for d in result.diagnostics]


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_docstring_use_instead_does_not_raise_its_code(rule, tmp_path: Path):
    bad, good = _yaml_blocks(rule.doc)
    result = _example_result(rule, good, tmp_path)
    assert not any(d.blocker or d.code.startswith("SCHEMA") for d in result.diagnostics), [(d.code, d.message) for d in result.diagnostics]
    assert rule.code not in {d.code for d in result.diagnostics}, [(d.code, d.message) for d in result.diagnostics]


def test_coverage_table_names_every_rule_and_only_real_ones():
    text = (Path(__file__).parents[1] / "molt_compile/rules/COVERAGE.md").read_text()
    mentioned = set(re.findall(r"\b[A-Z]+[0-9]{3}\b", text)) - {"SCHEMA003", "SCHEMA004", "SCHEMA005"}
    mentioned = {c for c in mentioned if not c.startswith("PLACE1")}  # lower/'s codes
    assert mentioned == set(RULES_BY_CODE), sorted(mentioned ^ set(RULES_BY_CODE))


def test_coverage_counts_match_the_item_rows():
    """COVERAGE.md is edited by hand: its per-tier counts must agree with its item rows."""
    text = (Path(__file__).parents[1] / "molt_compile/rules/COVERAGE.md").read_text()
    items = text.split("## Items")[1].split("## Rules beyond")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in items.splitlines()
            if line.startswith("| ") and not line.startswith("| item")]
    assert len(rows) >= 140

    def tier(t: str) -> str:
        return "CLI" if t.startswith("CLI") else "IMPLICIT" if "IMPLICIT" in t else \
            "LATE" if t in ("LATE", "EXT", "EXT/README") else "untagged"

    counts: dict[str, list[int]] = {}
    for _item, t, cov, _note in rows:
        c = counts.setdefault(tier(t), [0, 0, 0, 0])
        c[0] += 1
        c[1 if re.search(r"[A-Z]+[0-9]{3}", cov) else 2 if cov != "—" else 3] += 1
    for t, c in counts.items():
        assert f"| {t} | {c[0]} | {c[1]} | {c[2]} | {c[3]} |" in text, (t, c)


def test_every_cited_document_ships():
    """Issue 30.8: rule pages and comments cited molt_rules.md, DESIGN.md and reference/environment.md, which were
    not in the repository; they ship under docs/ (reference/ beside DESIGN.md, as it says)."""
    root = Path(__file__).parents[1]
    shipped = {p.name for p in (root / "docs").rglob("*.md")}
    cited = set()
    for folder in ("molt_compile", "schemas", "runtime"):
        for path in (root / folder).rglob("*.py"):
            cited |= set(re.findall(r"\b([A-Za-z_0-9]+\.md)\b", path.read_text()))
    cited -= {"REFERENCE.md", "COVERAGE.md", "README.md"}
    assert cited and cited <= shipped, sorted(cited - shipped)
