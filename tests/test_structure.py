"""The code's shape, pinned: no import circles in the library, no module attribute assigned from
outside its module (behaviour is chosen by values passed down, not by globals a tool overwrites),
the design document cited where the code cites it. Read from the source with `ast`: nothing is
imported or run."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARY = {"moefp8": REPO / "moefp8", "moefp8.kernels": REPO / "kernels", "moefp8.dispatch": REPO / "dispatch"}


def library_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed package (kernels/ and dispatch/ are
    installed as moefp8.kernels and moefp8.dispatch)."""
    out = {}
    for pkg, folder in LIBRARY.items():
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The library modules `name` imports, at module level or inside functions (a lazy import
    still makes a circle)."""
    pkg = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def test_no_import_circles_in_the_library():
    modules = library_modules()
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    # a package's __init__ importing its own submodules (dispatch/__init__.py's build_dispatcher) is
    # how a package is built, not a circle
    for m, p in modules.items():
        if p.stem == "__init__":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_module_attribute_is_assigned_from_outside_its_module():
    """`some_module.NAME = value`, `some_module.TABLE[key] = value` or `setattr(some_module, ...)` in
    the library or the tools: a switch thrown from a distance. Tests may monkeypatch; nothing else may."""
    files = [*library_modules().values(), *sorted((REPO / "tools").glob("*.py"))]
    found = []
    for f in files:
        tree = ast.parse(f.read_text())
        modules = set()  # local names bound to imported modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute):  # mod.TABLE[k] = v
                    t = t.value
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in modules \
                        and isinstance(t.value, (ast.Name, ast.Attribute)) and _is_module_chain(t.value, modules):
                    found.append(f"{f.relative_to(REPO)}:{node.lineno}: {ast.unparse(t)} = ...")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
                found.append(f"{f.relative_to(REPO)}:{node.lineno}: setattr({node.args[0].id}, ...)")
    assert not found, "module attributes assigned from outside their module:\n" + "\n".join(found)


def _is_module_chain(node, modules) -> bool:
    """`mod` or `mod.sub.subsub` where mod is an imported module name and the rest lower-case
    attribute names (submodules), not an object's attribute like `torch.backends.cudnn` flags."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules and node.id not in ("torch", "os", "np", "numpy")


def test_the_design_is_cited_inside_the_repository():
    """Every `DESIGN.md §n` the code once cited (a file outside the repository) now points into
    docs/, and the sections cited exist there."""
    design = (REPO / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    stale, missing = [], []
    for f in [*library_modules().values(), *REPO.glob("tools/*.py"), *REPO.glob("tests/**/*.py")]:
        text = f.read_text()
        if f.name != "test_structure.py" and re.search(r"(?<!docs/design\.md)(?<![\w/])DESIGN\.md", text):
            stale.append(str(f.relative_to(REPO)))
        missing += [f"{f.relative_to(REPO)}: §{n}" for n in re.findall(r"docs/design\.md §(\d+)", text)
                    if n not in sections]
    assert not stale, f"cite docs/design.md, not DESIGN.md: {stale}"
    assert not missing, missing
