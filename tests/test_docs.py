"""The docs are maps: what docs/DESIGN.md names exists, and the sections other files point to are there.

- every `path`, `path:name`, `path:Class.method` docs/DESIGN.md (and docs/KERNELS.md) mentions names a file or
  folder of the checkout, and the name is defined in it: for Python by the module's AST (a top-level function,
  class or assignment; a method or attribute of a class), never by importing; for C by a definition at the
  start of a line (a function, or a typedef'd struct);
- docs/DESIGN.md fits its line budget;
- a reference such as `docs/TIERS.md, "Loading"` (in the docs, the README or the code) names a heading or a
  bold run of that file.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
MAPS = (DESIGN, ROOT / "docs" / "KERNELS.md")
DESIGN_MAX_LINES = 250

# A path starts with a top-level folder of the checkout, or a package of colibri/ (then it is read under
# colibri/); it ends with a file suffix or a slash (a folder). `:name` may follow, dotted for a member.
_TOP = r"colibri|tests|benchmarks|tools|docs|scripts"
_PKG = r"models|engine|store|kernels|server|cli|format|convert|analysis"
_REF = re.compile(
    rf"(?<![\w/.<-])((?:{_TOP}|{_PKG})/(?:[\w.-]+/)*(?:[\w.-]+\.(?:py|c|h|md|toml|sh|json|txt)|))"
    r"(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?")


def references(text: str) -> list[tuple[str, str | None]]:
    """(path, name or None) for every path-shaped word of `text`, in order, without repeats."""
    seen: dict[tuple[str, str | None], None] = {}
    for m in _REF.finditer(text):
        seen.setdefault((m.group(1), m.group(2)), None)
    return list(seen)


def resolve(path: str) -> Path | None:
    """The checkout's file or folder a doc path names: from the root, else under colibri/."""
    for base in (ROOT, ROOT / "colibri"):
        p = base / path
        if (p.is_dir() if path.endswith("/") else p.is_file()):
            return p
    return None


@cache
def _python_names(path: Path) -> dict[str, set[str]]:
    """{"": top-level names, "Class": its members} of a module, from its AST."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def bound(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    out: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        out[""].update(bound(node))
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n for child in node.body for n in bound(child)}
    return out


def defined(path: Path, name: str) -> bool:
    if path.suffix == ".py":
        names = _python_names(path)
        head, _, member = name.partition(".")
        if not member:
            return head in names[""]
        return "." not in member and member in names.get(head, set())
    if path.suffix in (".c", ".h"):
        text = path.read_text(encoding="utf-8")
        n = re.escape(name)
        return bool(re.search(rf"^(?:[A-Za-z_][\w \t*]*[\s*])?{n}\s*\(", text, re.M)  # a function
                    or re.search(rf"^}}\s*{n}\s*;", text, re.M)  # the end of a typedef'd struct
                    or re.search(rf"^#define\s+{n}\b", text, re.M))
    return False


@pytest.mark.parametrize("doc", MAPS, ids=lambda p: p.name)
def test_every_path_and_name_a_map_gives_exists(doc: Path) -> None:
    if not doc.exists():
        pytest.skip(f"{doc.name} is not there")
    refs = references(doc.read_text(encoding="utf-8"))
    assert len(refs) >= 20, f"{doc.name}: the parser found only {len(refs)} paths"
    missing = []
    for path, name in refs:
        p = resolve(path)
        if p is None:
            missing.append(f"{path} (no such file or folder)")
        elif name is not None and not defined(p, name):
            missing.append(f"{path}:{name} (not defined there)")
    assert not missing, f"{doc.name} names what does not exist:\n  " + "\n  ".join(missing)


def test_design_fits_its_budget() -> None:
    n = len(DESIGN.read_text(encoding="utf-8").splitlines())
    assert n <= DESIGN_MAX_LINES, f"docs/DESIGN.md has {n} lines, the budget is {DESIGN_MAX_LINES}"


def test_the_parser_reads_paths_names_and_members() -> None:
    text = ("`colibri/engine/runner.py:Runner._step` calls models/base.py:build; kernels/step.c:coli_decode_step;"
            " the store (colibri/store/) and docs/TIERS.md")
    assert references(text) == [("colibri/engine/runner.py", "Runner._step"), ("models/base.py", "build"),
                                ("kernels/step.c", "coli_decode_step"), ("colibri/store/", None),
                                ("docs/TIERS.md", None)]
    assert resolve("models/base.py") == ROOT / "colibri" / "models" / "base.py"
    assert resolve("colibri/no_such_module.py") is None
    assert defined(ROOT / "colibri" / "engine" / "runner.py", "Runner._step")
    assert not defined(ROOT / "colibri" / "engine" / "runner.py", "Runner.no_such_method")
    assert defined(ROOT / "colibri" / "kernels" / "step.c", "coli_decode_step")


# A doc's path (docs/ optional), then a comma, a space or an opening parenthesis, then a section's title in quotes.
_SECTION = re.compile(r"\b((?:docs/)?[A-Z]+\.md),?\s+\(?\"([^\"\n]+)\"")


def _sections(doc: Path) -> str:
    """The headings and bold runs of a doc, one a line."""
    text = doc.read_text(encoding="utf-8")
    heads = re.findall(r"^#+\s+(.*)$", text, re.M)
    bold = re.findall(r"\*\*([^*\n]+)\*\*", text)
    return "\n".join(heads + bold)


def _section_refs() -> list[tuple[Path, str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in ("colibri", "tests", "benchmarks", "tools"):
        files += sorted((ROOT / top).rglob("*.py"))
    out = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".py":  # a comment's reference may wrap onto the next comment line
            text = re.sub(r"\n\s*#\s*", " ", text)
        for m in _SECTION.finditer(text):
            out.append((f, m.group(1), m.group(2)))
    return out


def test_sections_other_files_point_to_exist() -> None:
    refs = _section_refs()
    assert len(refs) >= 10
    missing = []
    for f, doc, section in refs:
        target = ROOT / (doc if doc.startswith("docs/") else f"docs/{doc}")
        if doc == "README.md":
            target = ROOT / "README.md"
        if not target.exists():
            missing.append(f"{f.relative_to(ROOT)}: {doc} does not exist")
        elif section not in _sections(target):
            missing.append(f'{f.relative_to(ROOT)}: {doc} has no section "{section}"')
    assert not missing, "\n".join(missing)
