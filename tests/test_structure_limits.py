"""The package's size limits (issue U): no class over 25 methods, no module over 500 lines, no folder over 15
modules. Counted from the source text, so a class split by mixins or a module grown past its idea shows here."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rayllm_rl"
MAX_METHODS, MAX_LINES, MAX_MODULES = 25, 500, 15


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _methods(cls: ast.ClassDef) -> int:
    """The functions defined in the class's own body (methods, properties, static and class methods)."""
    return sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in cls.body)


def methods_per_class() -> dict[str, int]:
    """`path:line Class` -> its method count, for every class in the package."""
    out = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"] = _methods(node)
    return out


def test_the_counter_counts_methods_of_a_class():
    tree = ast.parse("class A:\n    x = 1\n    def a(self): ...\n    async def b(self): ...\n    @property\n"
                     "    def c(self): ...\n    class Inner:\n        def d(self): ...\n")
    assert {n.name: _methods(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} == {"A": 3, "Inner": 1}


def test_no_class_has_more_than_25_methods():
    counts = methods_per_class()
    assert len(counts) > 100  # the package was read
    over = {k: n for k, n in counts.items() if n > MAX_METHODS}
    assert not over, f"classes over {MAX_METHODS} methods (split them into parts they hold): {over}"


def test_no_module_has_more_than_500_lines():
    lines = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in _modules()}
    over = {k: n for k, n in lines.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_no_folder_has_more_than_15_modules():
    folders: dict[str, int] = {}
    for p in _modules():
        key = str(p.parent.relative_to(PACKAGE.parent))
        folders[key] = folders.get(key, 0) + 1
    assert "rayllm_rl/inference/vllm" in folders
    over = {k: n for k, n in folders.items() if n > MAX_MODULES}
    assert not over, f"folders over {MAX_MODULES} modules (__init__.py counted): {over}"
