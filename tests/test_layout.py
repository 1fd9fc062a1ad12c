"""Where things live, and which way the dependencies point: the commands (sled_cli) on top, the
lab below them, the product (edge_client, verify_server, drafters) below the lab, the shared
runtime (sled) at the bottom; protos/ holds the contract and nothing that runs. Every import in
the source, a function's own included, is read with ast."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sled", "drafters", "edge_client", "verify_server", "sdsat", "lab", "sled_cli")
# package -> the project packages it must never import
FORBIDDEN = {
    "sled": {"drafters", "edge_client", "verify_server", "sdsat", "lab", "sled_cli"},
    "drafters": {"edge_client", "verify_server", "sdsat", "lab", "sled_cli"},
    "edge_client": {"verify_server", "sdsat", "lab", "sled_cli"},
    "verify_server": {"drafters", "edge_client", "sdsat", "lab", "sled_cli"},
    "sdsat": {"drafters", "edge_client", "lab", "sled_cli"},
    "lab": {"sled_cli"},
    "sled_cli": set(),
}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in a file; relative imports are the file's own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def back_imports(package: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for path in sorted((ROOT / package).rglob("*.py"))
            for line, name in imported_packages(path) if name in FORBIDDEN[package]]


@pytest.mark.parametrize("package", PACKAGES)
def test_dependencies_point_one_way(package):
    assert back_imports(package) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from lab.profiles import device_profile\n    import sled_cli.main\n")
    assert imported_packages(source) == [(2, "lab"), (3, "sled_cli")]


def test_protos_holds_the_contract_and_nothing_that_runs():
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert files == ["protos/sled/v1/verifier.proto"]
    assert (ROOT / "sled" / "v1" / "verifier_pb2.py").is_file()


def test_the_wire_contract_imports_nothing_of_sled_but_itself_and_the_stubs():
    """sled.wire is what both sides agree on byte for byte: a reader needs only it and sled.v1."""
    found = []
    for path in sorted((ROOT / "sled" / "wire").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            found += [f"{path.name} imports {name}" for name in names
                      if name.split(".")[0] == "sled"
                      and not name.startswith(("sled.wire", "sled.v1"))]
    assert (ROOT / "sled" / "wire" / "topics.py").is_file() and found == []


def imports_inside_functions(path: Path) -> int:
    """Import statements inside a function (or a function within one) of a file."""
    inside = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(sub) for sub in ast.walk(node)
                          if isinstance(sub, (ast.Import, ast.ImportFrom)))
    return len(inside)


def test_a_modules_dependencies_are_read_at_its_top():
    """Package code imports at module level; what stays inside a function does so for a stated
    reason (an optional extra, torch kept off the device, a cycle, what a bench times), and
    there are few of those. The commands' modules are imported only when their command runs."""
    counts = {package: sum(imports_inside_functions(path)
                           for path in (ROOT / package).rglob("*.py") if "_pb2" not in path.name)
              for package in PACKAGES}
    assert sum(counts.values()) < 100, counts
    assert counts["verify_server"] <= 5 and counts["sled_cli"] <= 10, counts


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages a wheel (and so a lab image) carries: every folder with
    an __init__.py below the project's packages is among them."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for package in PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
