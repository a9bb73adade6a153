"""The parts hold: every import in ``proxy/`` and ``insights/`` (read from the source, functions included) keeps
the dependency direction of ARCHITECTURE.md.

- ``proxy/memory/**`` (the memory core) imports nothing from the rest of ``proxy`` (the HTTP shell) nor from
  ``insights``; ``insights/**`` imports nothing from the shell. ``bench/``, ``tests/`` and ``scripts/`` may import
  anything and are not walked.
- The shell and ``insights`` import the core only through its faces: ``proxy.memory`` and its sub-packages
  ``read``, ``store``, ``write`` and ``embedders`` (names from their ``__all__``, or their modules).
- Inside the core: ``proxy.memory.store`` imports nothing from ``read``, ``write`` or ``embedders``;
  ``proxy.memory.read`` nothing from ``write``; ``proxy.memory.write`` nothing from ``read``. A rule applies once
  its importer is a package (a directory with ``__init__.py``) under ``proxy/memory/``.

Imports are found with ``ast`` (module level, inside functions, under ``if TYPE_CHECKING``), relative ones resolved,
and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name counted too.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALKED = ("proxy", "insights")
SHELL, CORE, INSIGHTS = "proxy", "proxy.memory", "insights"
# importer sub-package of the core -> sub-packages it must not import
# What the shell and insights may name in an import of the core: the core's faces (each package's ``__all__``).
FACES = frozenset({CORE, *(f"{CORE}.{sub}" for sub in ("read", "store", "write", "embedders"))})
CORE_RULES = {
    "store": ("read", "write", "embedders"),
    "read": ("write",),
    "write": ("read",),
}


@dataclasses.dataclass(frozen=True)
class Import:
    """One imported module name, where it is imported."""

    importer: str
    target: str
    path: Path
    line: int
    written: str = ""  # the module name as the import statement writes it (``from <written> import ...``)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_name(root: Path, path: Path) -> str:
    """``proxy/memory/x.py`` -> ``proxy.memory.x``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _dynamic(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` or ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(root: Path, path: Path, modules: frozenset[str]) -> Iterator[Import]:
    """Every module ``path`` imports; ``from package import name`` counts as ``package.name`` when that is a module."""
    importer = module_name(root, path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        written = ""
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = written = _resolve(importer, is_package, node)
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        elif isinstance(node, ast.Call) and (dynamic := _dynamic(node)) is not None:
            targets = [dynamic]
        for target in dict.fromkeys(targets):
            yield Import(importer, target, path, node.lineno, written or target)


def core_packages(root: Path) -> frozenset[str]:
    """The sub-packages of the memory core that exist (directories with an ``__init__.py``)."""
    core = root / "proxy" / "memory"
    return frozenset(p.parent.name for p in core.glob("*/__init__.py"))


def violation(found: Import, packages: frozenset[str]) -> str | None:
    """Why this import breaks a boundary, or None."""
    importer, target = found.importer, found.target
    if _within(importer, CORE):
        if _within(target, SHELL) and not _within(target, CORE):
            return "the memory core imports the HTTP shell"
        if _within(target, INSIGHTS):
            return "the memory core imports insights"
        for sub, banned in CORE_RULES.items():
            if sub in packages and _within(importer, f"{CORE}.{sub}"):
                for other in banned:
                    if _within(target, f"{CORE}.{other}"):
                        return f"{CORE}.{sub} imports {CORE}.{other}"
    elif _within(importer, INSIGHTS) and _within(target, SHELL) and not _within(target, CORE):
        return "insights imports the HTTP shell"
    if not _within(importer, CORE) and _within(target, CORE) and found.written not in FACES:
        return f"the core is imported past its faces ({', '.join(sorted(FACES))})"
    return None


def violations(root: Path) -> list[str]:
    """``file:line: importer -> target (why)`` for every import in ``proxy/`` and ``insights/`` that breaks a rule."""
    files = sorted(path for top in WALKED for path in (root / top).rglob("*.py"))
    modules = frozenset(module_name(root, path) for path in files)
    packages = core_packages(root)
    found = []
    for path in files:
        for imported in sorted(imports_of(root, path, modules), key=lambda found: found.line):
            why = violation(imported, packages)
            if why is not None:
                where = f"{path.relative_to(root)}:{imported.line}"
                found.append(f"{where}: {imported.importer} -> {imported.target} ({why})")
    return found


def test_the_parts_keep_their_dependency_direction() -> None:
    """No module of the memory core or of insights imports across a boundary (each violation is named file:line)."""
    found = violations(ROOT)
    assert not found, "import boundaries broken:\n" + "\n".join(found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_walk_sees_hidden_relative_and_dynamic_imports(tmp_path: Path) -> None:
    """Imports inside functions, relative ones, ``import proxy`` and ``import_module`` literals are all caught."""
    root = _tree(
        tmp_path,
        {
            "proxy/__init__.py": "",
            "proxy/routes.py": "",
            "proxy/memory/__init__.py": "",
            "proxy/memory/ok.py": "from proxy.memory import errors\nfrom . import errors as e\n",
            "proxy/memory/errors.py": "",
            "proxy/memory/shell.py": "import proxy\n\ndef f():\n    from ..routes import x\n",
            "proxy/memory/dyn.py": "import importlib\nimportlib.import_module('insights.service')\n",
            "insights/__init__.py": "",
            "insights/service.py": "from proxy.memory import E\nfrom proxy import routes\n",
        },
    )
    assert violations(root) == [
        "insights/service.py:2: insights.service -> proxy.routes (insights imports the HTTP shell)",
        "proxy/memory/dyn.py:2: proxy.memory.dyn -> insights.service (the memory core imports insights)",
        "proxy/memory/shell.py:1: proxy.memory.shell -> proxy (the memory core imports the HTTP shell)",
        "proxy/memory/shell.py:4: proxy.memory.shell -> proxy.routes (the memory core imports the HTTP shell)",
    ]


def test_sub_package_rules_apply_once_the_package_exists(tmp_path: Path) -> None:
    """The store may not import the read path, nor read and write each other, once they are packages."""
    files = {
        "proxy/__init__.py": "",
        "proxy/memory/__init__.py": "",
        "proxy/memory/store.py": "from proxy.memory.read import fusion\n",
        "proxy/memory/read/__init__.py": "",
        "proxy/memory/read/fusion.py": "from proxy.memory.store.records import R\nfrom ..write import queue\n",
        "proxy/memory/write/__init__.py": "",
        "proxy/memory/write/queue.py": "from proxy.memory.embedders import onnx\n",
    }
    assert violations(_tree(tmp_path / "flat", files)) == [
        "proxy/memory/read/fusion.py:2: proxy.memory.read.fusion -> proxy.memory.write.queue "
        "(proxy.memory.read imports proxy.memory.write)",
    ]
    files["proxy/memory/store/__init__.py"] = ""
    files["proxy/memory/store/records.py"] = "from proxy.memory.read.fusion import Candidate\n"
    del files["proxy/memory/store.py"]
    assert violations(_tree(tmp_path / "packaged", files)) == [
        "proxy/memory/read/fusion.py:2: proxy.memory.read.fusion -> proxy.memory.write.queue "
        "(proxy.memory.read imports proxy.memory.write)",
        "proxy/memory/store/records.py:1: proxy.memory.store.records -> proxy.memory.read.fusion "
        "(proxy.memory.store imports proxy.memory.read)",
    ]


def test_the_shell_imports_the_core_through_its_faces(tmp_path: Path) -> None:
    """The shell (and insights) may name ``proxy.memory`` or one of its sub-packages in an import, never a module
    behind them."""
    root = _tree(
        tmp_path,
        {
            "proxy/__init__.py": "",
            "proxy/routes.py": "from proxy.memory.read import inject\nfrom proxy.memory.read.block import MemoryItem\n",
            "proxy/memory/__init__.py": "",
            "proxy/memory/read/__init__.py": "",
            "proxy/memory/read/block.py": "",
        },
    )
    assert violations(root) == [
        "proxy/routes.py:2: proxy.routes -> proxy.memory.read.block (the core is imported past its faces "
        "(proxy.memory, proxy.memory.embedders, proxy.memory.read, proxy.memory.store, proxy.memory.write))"
    ]
