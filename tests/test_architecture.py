"""The package's structure: no import circle, a torch-only math core, commands on top."""

from __future__ import annotations

import ast
from pathlib import Path

import flowcredit

ROOT = Path(flowcredit.__file__).parent
MATH_CORE = (
    *(
        "schedule",
        "sde",
        "values",
        "advantages",
        "contribution",
        "calibration",
        "losses",
        "tree_plans",
        "step_plan",
    ),
    *("updates", "update_rules", "step_schedules", "entropy_merge", "step_weights", "credit_audit"),
    "guard_signals",
    "step_schedule_flash",
    "update_dgpo",
    "granular",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every ``flowcredit`` module ``path`` imports, at any depth (lazy imports inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "flowcredit"}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in imports_of(p) if m in modules and m != name} for name, p in modules.items()}


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " → ".join(cycle))
            if state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_the_graph_sees_imports():
    """The check above can fail: the graph holds known edges (a lazy import included)."""
    g = graph()
    assert "flowcredit.run.session" in g["flowcredit.train"]
    assert "flowcredit.train" in g["flowcredit.commands.train"]  # imported inside main()
    assert "flowcredit.advantages" in g["flowcredit.validation"]


def test_math_core_imports_only_torch_and_itself():
    for name in MATH_CORE:
        source = (ROOT / f"{name}.py").read_text()
        tops = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                tops.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
        allowed = {"torch", "flowcredit", "__future__", "math", "inspect", "collections", "dataclasses"}
        assert tops <= allowed, (name, tops - allowed)
        for m in imports_of(ROOT / f"{name}.py"):
            assert m.removeprefix("flowcredit.").split(".")[0] in MATH_CORE, (name, m)


def test_layers_point_down():
    """commands → train → run → (models, rewards, tasks, config) → math core: never upwards."""
    rank = {"commands": 4, "cli": 4, "__main__": 4, "train": 3, "run": 2}
    for name, deps in graph().items():
        own = rank.get(name.split(".")[1] if "." in name else "", 1)
        for dep in deps:
            dep_rank = rank.get(dep.split(".")[1] if "." in dep else "", 1)
            assert dep_rank <= own, f"{name} (layer {own}) imports {dep} (layer {dep_rank})"


def references(source: str, package: str, prefix: str) -> set[str]:
    """The modules under ``prefix`` that ``source`` (a module of ``package``) reaches: ``import`` and
    ``from … import`` at any depth (lazy ones inside functions too), relative ones resolved, and string
    constants that are a dotted target such as ``"pkg.mod:attr"`` (what ``importlib`` is handed)."""
    parts = package.split(".")
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            name = ".".join(p for p in (base, node.module or "") if p)
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = node.value.partition(":")[0]
            if target.replace(".", "").replace("_", "").isalnum() and " " not in node.value:
                out.add(target)
    return {m for m in out if m == prefix or m.startswith(prefix + ".")}


def test_tasks_never_reach_rewards():
    """One direction between the two: the reward registry (``flowcredit.rewards``) builds on the tasks'
    scorers (ShapeEval's reward, GenEval's rules and detectors) and hands them what they need (the CLIP
    loader of GenEval's colour classifier); task code never imports ``flowcredit.rewards``."""
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        name = module_name(path)
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        found = references(path.read_text(), package, "flowcredit.rewards")
        assert not found, f"{name} reaches {sorted(found)}: tasks must not import rewards"


def test_the_direction_check_sees_lazy_relative_and_named_imports():
    """The check above can fail, and the graph holds the allowed direction."""
    lazy = "def f():\n    from flowcredit.rewards.clip import load_clip\n"
    assert references(lazy, "flowcredit.tasks", "flowcredit.rewards") >= {"flowcredit.rewards.clip"}
    relative = "def f():\n    from ...rewards import clip\n"  # in flowcredit/tasks/geneval/
    assert "flowcredit.rewards.clip" in references(relative, "flowcredit.tasks.geneval", "flowcredit.rewards")
    assert not references("from . import rules\n", "flowcredit.tasks.geneval", "flowcredit.rewards")
    named = 'LOADER = "flowcredit.rewards.clip:load_clip"\n"""Docs may name flowcredit.rewards.clip."""\n'
    assert references(named, "flowcredit.tasks", "flowcredit.rewards") == {"flowcredit.rewards.clip"}
    g = graph()
    assert {"flowcredit.tasks.shapes", "flowcredit.tasks.geneval.reward"} <= g["flowcredit.rewards"]
