"""The recipe fuzz campaign of issue 32 (`just fuzz [N] [SEED]`; 10,000 by default, minutes, not in CI): N recipes,
every one valid UTF-8, through the real compile path; prints each traceback class once and the counts.

    python -m tests.fuzz_recipes [N] [SEED]

Three families, in turn: shipped recipes mutated as data (keys dropped, values replaced by odd shapes and YAML or
shell hazards, unknown keys), shipped recipes mutated as text (lines dropped, duplicated, re-indented, cut short,
hazards spliced in) and hazard documents (aliases, tags, merge keys, deep nesting, several documents, a BOM, NUL and
control characters, huge numbers). About a third of the recipes also get random `--set` arguments. Every recipe goes
through `compile_recipe` in-process with MOLT_COMPILE_DEBUG=1 (a crash of a pass raises instead of becoming
INTERNAL001); every CLI_EVERY-th also through the `molt-compile` command (click's runner, the plan and summary
rendered) and the first SUBPROCESSES of those as a real `molt-compile` process. A case that takes over
CASE_TIMEOUT_S counts as a hang. Exit status 1 when any case raised or hung.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLI_EVERY = 10
SUBPROCESSES = 20
CASE_TIMEOUT_S = 20

SHELL = ["$(rm -rf /tmp/x)", "`id`", "; reboot", "a|b", "a && b", "'", '"', "\\", "$HOME", "${HOME}", "${env:}",
         "${env:MOLT_FUZZ_UNSET}", "${env:1A}", "%s%n", "*", "~", "-rf", "--help", "a\nb", "\r\n", "\t", "#x", "\x7f",
         "\x1b[31m", "é\u200bü", "\U0001f600", "\u202e", "\ufeff", "a" * 300, "/" * 5000, "../../../../etc/passwd",
         "/dev/zero", "/proc/self/mem", "", " ", "null", "~", "yes", "no", "on", "0x10", "0o7", "1e309", "-0", ".nan"]
SCALARS: list[Any] = [None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**400, 0.5, -0.0, 1e308, float("inf"),
                      float("-inf"), float("nan"), "", "auto", "none", "cpu", "rl", "sft", "1d", "00:10:00"]
HAZARD_DOCS = [
    "a: &a [1, 2]\nb: *a\nc: *a\n",
    "x: &x {k: 1}\n<<: *x\nname: m\n",
    "<<: [1, 2]\n",
    "<<: *missing\n",
    "name: !!python/object/apply:os.system ['echo hi']\n",
    "name: !custom 1\n",
    "name: !!binary aGVsbG8=\n",
    "name: !!set {a, b}\n",
    "name: !!timestamp 2001-12-14\n",
    "? [a, b]\n: 1\n",
    "? {a: 1}\n: 1\n",
    "~: 1\n",
    "1: 2\n",
    "1.5: x\n",
    "true: x\n",
    "name: a\nname: b\n",
    "---\nname: a\n---\nname: b\n",
    "---\n...\n",
    "",
    "\ufeffversion: 1\n",
    "version: 1\n\tname: x\n",
    "name: 'unterminated\n",
    'name: "\\x00\\x01\\x1f"\n',
    "name: \x85x\n",
    "%YAML 1.1\n---\nname: x\n",
    "%TAG ! tag:x,2000:\n---\nname: !a b\n",
    "- 1\n- 2\n",
    "just a string\n",
    "42\n",
    "{",
    "[" * 200 + "]" * 200 + "\n",
    "a: " + "[" * 5000 + "]" * 5000 + "\n",
    "a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n",
    "a: &a ['x','x','x','x','x','x','x','x','x']\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
    "extends: " + "b" * 300 + "\n",
    "extends: [a, b, c]\n",
    "extends: /etc/passwd\n",
    "extends: ../../../../../../etc/hostname\n",
    "extends: r.yaml\n",
    "extends: {a: 1}\n",
    "extends: 'base/\x00.yaml'\n",
]


def leaf_paths() -> list[str]:
    from molt_compile import schema_walk as sw
    from schemas.recipe import RlRecipe

    return sorted({"kind", "version", "extends", "name", "env", "agent.env", *sw.all_leaf_paths(RlRecipe)})


def odd_text(rng: random.Random) -> str:
    return rng.choice(SHELL) if rng.random() < 0.7 else "".join(
        rng.choice("aZ_09=-. :$[]{}'\"\\\n\x00\x01é\u2028#&*!|>%@`,?") for _ in range(rng.randint(0, 12)))


def odd_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.35 or depth > 2:
        return rng.choice(SCALARS)
    if r < 0.7:
        return odd_text(rng)
    if r < 0.85:
        return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {odd_text(rng): odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def set_path(doc: dict, path: str | tuple[str, ...], value: Any) -> None:
    *parents, last = path.split(".") if isinstance(path, str) else path
    node = doc
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value


def walk(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path in a parsed document (mappings only; a key may hold dots)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            out.extend(walk(v, (*prefix, k)))
    return out


def dump(doc: Any, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return json.dumps(doc, ensure_ascii=rng.random() < 0.5, allow_nan=True) + "\n"  # JSON is YAML
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def mutate_data(text: str, rng: random.Random, paths: list[str]) -> str:
    doc = yaml.safe_load(text)
    for _ in range(rng.randint(1, 4)):
        present = walk(doc)
        r = rng.random()
        if r < 0.25 and present:
            *parents, last = rng.choice(present)
            node = doc
            for key in parents:
                node = node[key]
            del node[last]
        elif r < 0.6 and present:
            set_path(doc, rng.choice(present), odd_value(rng))
        elif r < 0.9:
            set_path(doc, rng.choice(paths), odd_value(rng))
        else:
            set_path(doc, f"{rng.choice(paths)}.{odd_text(rng) or 'x'}", odd_value(rng))
    return dump(doc, rng)


def mutate_text(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randint(1, 4)):
        if not lines:
            lines = [""]
        i = rng.randrange(len(lines))
        r = rng.random()
        if r < 0.2:
            del lines[i]
        elif r < 0.35:
            lines.insert(i, lines[i])
        elif r < 0.5:
            lines[i] = rng.choice(["", " ", "  ", "\t", "    "]) + lines[i].lstrip()
        elif r < 0.65:
            cut = rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:cut] + odd_text(rng) + lines[i][cut:]
        elif r < 0.75:
            lines = lines[:i] + [lines[i][: rng.randrange(len(lines[i]) + 1)]]
        elif r < 0.9:
            key = lines[i].split(":", 1)[0]
            if ":" in lines[i]:
                lines[i] = f"{key}: {json.dumps(odd_text(rng)) if rng.random() < 0.5 else odd_text(rng)}\n"
        else:
            lines.insert(i, rng.choice(HAZARD_DOCS))
    return "".join(lines)


def hazard_doc(rng: random.Random, base: str) -> str:
    doc = rng.choice(HAZARD_DOCS)
    if rng.random() < 0.5:  # on top of a real recipe, so that the later passes see it too
        return (base + "\n" + doc) if rng.random() < 0.5 else (doc + base)
    return doc


def random_sets(rng: random.Random, paths: list[str]) -> list[str]:
    out = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.6:
            out.append(f"{rng.choice(paths)}={json.dumps(odd_value(rng), allow_nan=True)}")
        elif r < 0.8:
            out.append(f"{rng.choice(paths)}={odd_text(rng)}")
        else:
            out.append(rng.choice(["=", "a", "a.b.c=", "..=1", ".=1", "a..b=1", "=1", "name", "env.=x", "env.A B=1",
                                   "agent.env.X=\x00", "kind=sft", "kind=[]", "extends=r.yaml", "model=", "x" * 300]))
    return out


def make_case(i: int, rng: random.Random, shipped: dict[str, str], paths: list[str]) -> tuple[str, str, list[str]]:
    name = rng.choice(sorted(shipped))
    base = shipped[name]
    family = i % 3
    try:
        text = [mutate_data, lambda t, r: mutate_text(t, r), lambda t, r: hazard_doc(r, t)][family](
            *((base, rng, paths) if family == 0 else (base, rng)))
    except yaml.YAMLError:
        text = mutate_text(base, rng)
    text.encode("utf-8")  # valid UTF-8: a lone surrogate would raise here, not in the compiler
    sets = random_sets(rng, paths) if rng.random() < 0.33 else []
    return name, text, sets


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"over {CASE_TIMEOUT_S} s")


def where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if str(ROOT) in f.filename and not f.filename.endswith("fuzz_recipes.py")]
    f = frames[-1] if frames else (traceback.extract_tb(exc.__traceback__) or [None])[-1]
    return f"{Path(f.filename).relative_to(ROOT) if f and str(ROOT) in f.filename else f and f.filename}:" \
           f"{f.lineno if f else '?'}"


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 10_000
    seed = int(argv[1]) if len(argv) > 1 else 0
    return 1 if campaign(n, seed) else 0


def campaign(n: int, seed: int = 0, *, cli_every: int = CLI_EVERY, subprocesses: int = SUBPROCESSES,
             quiet: bool = False) -> dict[str, int]:
    """Compile `n` fuzzed recipes; the traceback classes found ("<type> at <file:line>": count)."""
    old_debug = os.environ.get("MOLT_COMPILE_DEBUG")
    os.environ["MOLT_COMPILE_DEBUG"] = "1"
    try:
        return _campaign(n, seed, cli_every, subprocesses, quiet)
    finally:
        if old_debug is None:
            os.environ.pop("MOLT_COMPILE_DEBUG", None)
        else:
            os.environ["MOLT_COMPILE_DEBUG"] = old_debug


def _campaign(n: int, seed: int, cli_every: int, subprocesses: int, quiet: bool) -> dict[str, int]:
    from click.testing import CliRunner

    from molt_compile.cli import cli
    from molt_compile.compile import compile_recipe

    say = (lambda *a, **k: None) if quiet else print
    work = Path(tempfile.mkdtemp(prefix="molt-fuzz-"))
    (work / ".git").mkdir()  # the recipe's repository: `extends` stays inside it
    shutil.copytree(ROOT / "recipes", work / "recipes", symlinks=True)
    shipped = {p.name: p.read_text() for p in sorted((ROOT / "recipes").glob("*.yaml"))}
    paths = leaf_paths()
    rng = random.Random(seed)
    classes: dict[str, tuple[int, str, list[str], str]] = {}
    counts: Counter[str] = Counter()
    exits: Counter[str] = Counter()
    cli_runs = procs = 0
    previous = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ruamel's duplicate-anchor warnings: the loader's diagnostics say it
        for i in range(n):
            name, text, sets = make_case(i, rng, shipped, paths)
            recipe = work / "recipes" / f"fuzz_{i % 7}.yaml"
            recipe.write_text(text, encoding="utf-8")
            try:
                signal.alarm(CASE_TIMEOUT_S)
                try:
                    result = compile_recipe(recipe, sets)
                    if result.plan is not None:
                        result.plan.to_json()
                    exits[str(result.exit_status)] += 1
                    if i % cli_every == 0:
                        cli_runs += 1
                        argv_ = [str(recipe), *(a for s in sets for a in ("--set", s)),
                                 "--plan-out", str(work / "p.json")]
                        out = CliRunner().invoke(cli, argv_, prog_name="molt-compile", catch_exceptions=True)
                        if out.exception is not None and not isinstance(out.exception, SystemExit):
                            raise out.exception.with_traceback(out.exc_info[2])
                        if "Traceback" in out.output or out.exit_code not in (0, 1, 2):
                            raise RuntimeError(f"CLI exit {out.exit_code}: {out.output[-300:]}")
                        if procs < subprocesses and "\0" not in " ".join(argv_):  # argv cannot carry NUL
                            procs += 1
                            cmd = [str(Path(sys.executable).parent / "molt-compile"), *argv_]
                            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                                               env={**os.environ, "MOLT_COMPILE_DEBUG": ""})
                            if "Traceback" in p.stderr + p.stdout or p.returncode not in (0, 1, 2):
                                raise RuntimeError(f"molt-compile exit {p.returncode}: "
                                                   f"{(p.stderr or p.stdout)[-300:]}")
                finally:
                    signal.alarm(0)
            except (Exception, RecursionError, Hang) as exc:  # noqa: BLE001 - each is a finding
                key = f"{type(exc).__name__} at {where(exc)}"
                counts[key] += 1
                if key not in classes:
                    classes[key] = (i, name, sets, text if len(text) < 3000 else text[:3000] + "...")
                    say(f"\n=== case {i} (from {name}, sets {sets}): {key}: {str(exc)[:300]}", flush=True)
                    if not quiet:
                        traceback.print_exception(exc, limit=-4)
            if (i + 1) % 1000 == 0:
                say(f"{i + 1} cases, {sum(counts.values())} tracebacks, {time.time() - t0:.0f} s", flush=True)
    signal.signal(signal.SIGALRM, previous)
    shutil.rmtree(work, ignore_errors=True)
    say(f"\n{n} recipes (seed {seed}) in {time.time() - t0:.0f} s: exit statuses {dict(exits)}; "
        f"{cli_runs} also through the CLI, {procs} as a process; {sum(counts.values())} tracebacks in "
        f"{len(counts)} classes")
    for key, c in counts.most_common():
        i, name, sets, _ = classes[key]
        say(f"  {c:5d}  {key}  (first: case {i}, from {name}, sets {sets})")
    return dict(counts)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
