"""The package's layers, held (issue AA): the import graph computed from the source, every import that runs
(a module's top, a function's body), and none that only a type checker reads (`if TYPE_CHECKING:`).

Each package of `rayllm_rl/` (or top-level module) has a floor (`FLOORS`, drawn in docs/architecture.md). An
import may only point to a lower floor or stay inside its own package; no two modules may import each other,
directly or round a loop, except the engine registry's lazy imports (`ALLOWED_CYCLE_EDGES`): a job side
(`inference/<engine>/job.py`) names its engine class, whose module imports the job side's options.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rayllm_rl"

FLOORS: dict[str, int] = {
    # 0: config loading and the config types (field limits) every layer's options use
    "config": 0,
    # 1: leaves: import paths, run paths, rendezvous, the loop thread, the sampling mask, model files, losses and
    # their options, the trace records
    "__init__": 1, "object_path": 1, "storage": 1, "rendezvous": 1, "loop_thread": 1,
    "sampling_mask": 1, "models": 1, "objectives": 1, "view": 1,
    # 2: transports, adapters, trackers, the callback contract, hub ids
    "weight_sync": 2, "lora": 2, "tracking": 2, "callbacks": 2, "hub": 2,
    # 3: the learner, extras, data
    "learner": 3, "extras": 3, "export_lora": 3, "data": 3,
    # 4-9: engines and the rollout buffer, then workflows, rewards, envs, tools, agents
    "inference": 4, "rollout": 4, "workflows": 5, "rewards": 6, "envs": 7, "tools": 8, "agents": 9,
    # 10: environments as tasks (OpenEnv, TRL's environment_factory, verifiers): envs' Task, tools' tool-call parser,
    # workflows, the agents' OpenAI proxy; and the algorithm between rollout and learner (batch pipeline, SFT warmup)
    "environments": 10, "algorithm": 10,
    # 11: the job before it runs (config, checks, plan); 12: the runtime; 13: public API; 14-15: command line
    "job": 11, "orchestration": 12, "api": 13, "tinker": 13, "cli": 14, "__main__": 15,
}

ALLOWED_CYCLE_EDGES = frozenset({
    ("rayllm_rl.inference.transformers.job", "rayllm_rl.inference.transformers.engine"),
    ("rayllm_rl.inference.vllm.job", "rayllm_rl.inference.vllm.engine"),
})
"""The engine registry's lazy imports (`JobSide.engine_class()`), the only edges a cycle may use."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Import nodes that run: skips the bodies of `if TYPE_CHECKING:` (read by type checkers only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: the line of its first import}."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}
    graph: dict[str, dict[str, int]] = {}
    for mod, path in paths.items():
        edges = graph.setdefault(mod, {})
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name in paths and name != mod:
                    edges.setdefault(name, node.lineno)
    return graph


def package_of(mod: str, root: Path = PACKAGE) -> str:
    """`rayllm_rl.orchestration.ray.cluster` -> "orchestration"; `rayllm_rl.cli` -> "cli"; `rayllm_rl` -> "__init__"."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, dict[str, int]], floors: dict[str, int] = FLOORS) -> list[str]:
    """Each import from one package to another on the same or a higher floor, as 'module:line -> module'."""
    out = []
    for mod, edges in graph.items():
        for target, line in edges.items():
            a, b = package_of(mod), package_of(target)
            if a != b and floors[a] <= floors[b]:
                out.append(f"{mod}:{line} -> {target} (floor {floors[a]} {a} -> floor {floors[b]} {b})")
    return sorted(out)


def cycles(graph: dict[str, dict[str, int]], allowed=ALLOWED_CYCLE_EDGES) -> list[list[str]]:
    """The strongly connected sets of modules (more than one) once the allowed edges are taken out."""
    succ = {m: [t for t in e if (m, t) not in allowed] for m, e in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ.get(nxt, []))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.append(m)
                    if m == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "rayllm_rl"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_checker_finds_an_upward_import_a_cycle_and_ignores_type_only_imports(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "", "config.py": "import os\n",
        "job/__init__.py": "", "job/plan.py": "from ..config import x\n",
        "job/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rayllm_rl.api import run\n"
                         "def f():\n    from rayllm_rl.job import plan\n",
        "api.py": "from rayllm_rl.job.plan import make\n",
        "orchestration/__init__.py": "", "orchestration/a.py": "from rayllm_rl.orchestration import b\n",
        "orchestration/b.py": "def g():\n    import rayllm_rl.orchestration.a\n",
    })
    graph = import_graph(pkg)
    assert graph["rayllm_rl.job.plan"] == {"rayllm_rl.config": 1}  # a relative import, resolved
    # TYPE_CHECKING skipped; the lazy import kept, with the package whose __init__ it runs
    assert graph["rayllm_rl.job.config"] == {"rayllm_rl.job": 5, "rayllm_rl.job.plan": 5}
    assert upward_imports(graph) == []
    assert cycles(graph, allowed=frozenset()) == [["rayllm_rl.orchestration.a", "rayllm_rl.orchestration.b"]]
    assert cycles(graph, allowed={("rayllm_rl.orchestration.b", "rayllm_rl.orchestration.a")}) == []
    (pkg / "config.py").write_text("def h():\n    from rayllm_rl.job.plan import make\n")  # floor 0 -> 11
    graph = import_graph(pkg)
    assert upward_imports(graph) == [
        "rayllm_rl.config:2 -> rayllm_rl.job.plan (floor 0 config -> floor 11 job)"]
    assert cycles(graph, allowed=frozenset()) == [
        ["rayllm_rl.config", "rayllm_rl.job.plan"], ["rayllm_rl.orchestration.a", "rayllm_rl.orchestration.b"]]


def test_every_package_has_a_floor():
    packages = {package_of(m) for m in import_graph()}
    assert {"orchestration", "job", "inference", "api", "algorithm"} <= packages
    assert packages == set(FLOORS), f"packages without a floor: {packages - set(FLOORS)}; " \
                                    f"floors without a package: {set(FLOORS) - packages}"


def test_no_import_points_up():
    graph = import_graph()
    assert sum(len(e) for e in graph.values()) > 300  # the package was read
    assert upward_imports(graph) == []


def test_no_modules_import_each_other_but_the_engine_registrys():
    graph = import_graph()
    for edge in ALLOWED_CYCLE_EDGES:  # each allowed edge is still there: a stale allowance would hide nothing
        assert edge[1] in graph[edge[0]], edge
    assert cycles(graph) == []
