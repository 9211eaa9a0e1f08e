"""The house's floors (miniddp/__init__.py): every import runs down, the parallelisms on floor 2
import none of each other, and no two modules import each other, type-only imports included.

Read from the source with `ast`, so a planted upward import fails here by name, whether or not
anything runs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "miniddp"

# Each top-level module or package of miniddp/, and its floor (miniddp/__init__.py draws them).
FLOORS = {
    "collectives": 1,
    "job": 1,
    "observe": 1,
    "placement": 1,
    "same_model": 1,
    "data_parallel": 2,
    "sharding": 2,
    "tensor_parallel": 2,
    "pipeline": 2,
    "context_parallel": 2,
    "local_sgd": 2,
    "expert_parallel": 2,
    "mesh": 2,
    "models": 2,
    "checkpoint": 3,
    "parallelize": 3,
    "parallelize_formulas": 3,
    "parallelize_experts": 3,
    "steps": 4,
    "plan": 4,
    "instruments": 5,
    "bench": 5,  # `python -m miniddp.bench`: the door to instruments/bench
    "figures": 5,  # and to instruments/figures
}
PARALLELISMS = {
    "data_parallel",
    "sharding",
    "tensor_parallel",
    "pipeline",
    "context_parallel",
    "local_sgd",
    "expert_parallel",
}  # side by side


def part_of(module: str) -> str | None:
    """'miniddp.data_parallel.ddp' -> 'data_parallel'; the package root itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every miniddp module `path` imports, with the line, inside functions and
    `if TYPE_CHECKING:` too. `from package import x` names the module x when x is one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                for a in node.names
            ]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name.split(".")[0] == "miniddp"]
    return found


def import_graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


ROOT_FLOOR = 3  # `from miniddp import MiniDDP`: the front door re-exports floors 1 to 3


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for module, imported in graph.items():
        here = part_of(module)
        if here is None:
            continue  # miniddp/__init__.py: the front door re-exports from every floor
        for name, line in imported:
            there = part_of(name)
            where = f"{module.replace('.', '/')}.py:{line} imports {name}"
            if there is None and FLOORS[here] <= ROOT_FLOOR:
                problems.append(f"{where}: the package root, which imports floors 1 to 3")
            elif there is not None and there != here and FLOORS[there] > FLOORS[here]:
                problems.append(f"{where}: floor {FLOORS[there]} from floor {FLOORS[here]}")
            elif there is not None and there != here and {here, there} <= PARALLELISMS:
                problems.append(f"{where}: one parallelism importing another")
    return problems


def test_every_part_of_the_package_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    parts = {p for p in parts if not p.startswith(("_", "."))}
    assert parts == set(FLOORS), "give the new part a floor here and in miniddp/__init__.py"


def test_no_import_runs_up_a_floor():
    assert upward_imports(import_graph()) == []


def test_no_two_modules_import_each_other():
    graph = {m: {name for name, _ in imported} for m, imported in import_graph().items()}
    circles = sorted(
        f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph.get(b, ())
    )
    assert circles == []


@pytest.mark.parametrize(
    "planted",
    ["from miniddp.steps import LADDER", "from miniddp.pipeline import PipelineStage"],
)
def test_a_planted_upward_import_is_named(tmp_path, planted):
    """The check itself: an import of floor 4 (or of another parallelism) from MiniDDP's own
    file is reported with its file and line."""
    ddp = PACKAGE / "data_parallel" / "ddp.py"
    graph = import_graph()
    graph["miniddp.data_parallel.ddp"] = [*imports_of(ddp), (planted.split()[1], 999)]
    (problem,) = upward_imports(graph)
    assert problem.startswith("miniddp/data_parallel/ddp.py:999 imports")


def assignments_to_dist(source: str) -> list[str]:
    """Every `dist.NAME = ...` (or `torch.distributed.NAME = ...`) in `source`: the library
    changes no part of torch.distributed; the simulated link is a process group instead."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(leaf, ast.Attribute) and ast.unparse(leaf.value) in DIST_NAMES:
                    found.append(f"line {leaf.lineno}: {ast.unparse(leaf)}")
    return found


DIST_NAMES = ("dist", "torch.distributed")


def test_the_library_assigns_nothing_in_torch_distributed():
    found = {
        str(path.relative_to(ROOT)): assignments_to_dist(path.read_text())
        for path in PACKAGE.rglob("*.py")
    }
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_planted_monkey_patch_is_named():
    planted = "import torch.distributed as dist\ndist.all_reduce, dist.send = mine, theirs\n"
    assert assignments_to_dist(planted) == ["line 2: dist.all_reduce", "line 2: dist.send"]
