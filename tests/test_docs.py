"""The documentation: `mkdocs build --strict` passes (broken links, anchors and docstrings fail it), every code block
the docs mark runnable runs, and every test the promise table names exists.

A block is runnable when the line right before its fence is ``<!-- runnable -->`` (an HTML comment: invisible on
the page); it must be fast (fakes, not models) and self-contained, and it runs in a process of its own from the
repository's root, so a policy or metric it registers stays out of the other tests.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.M | re.S)
#: a cell of the promise table's second column: `path/test_x.py::test_name` or `::test_name` (the same file)
NAMED_TEST = re.compile(r"`((?:[a-z_]+/)*test_[a-z0-9_]+\.py)?(?:::(test_[a-z0-9_]+))?`")


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        for number, match in enumerate(RUNNABLE.finditer(page.read_text()), start=1):
            blocks.append((f"{page.relative_to(DOCS)}#{number}", match.group(1)))
    return blocks


def promise_references(text: str) -> list[tuple[str, str | None]]:
    """(path under tests/, function or None) for every test the promise table names, a bare ``::name`` read
    against the file named before it in its cell."""
    references = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| promise", "|---")):
            continue
        cell = line.rstrip(" |").split(" | ", 1)[1]
        current = None
        for path, function in NAMED_TEST.findall(cell):
            if not path and not function:
                continue
            current = path or current
            assert current is not None, f"{function} names no file before it: {line[:80]}"
            references.append((current, function or None))
    return references


def missing_tests(references: list[tuple[str, str | None]], tests_root: Path) -> list[str]:
    """The references whose file, or whose top-level test function in that file, does not exist."""
    missing = []
    for path, function in references:
        file = tests_root / path
        if not file.is_file():
            missing.append(path)
            continue
        if function is not None:
            defined = {node.name for node in ast.parse(file.read_text()).body
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if function not in defined:
                missing.append(f"{path}::{function}")
    return missing


@pytest.mark.slow
def test_the_docs_build_strictly(tmp_path: Path) -> None:
    """A broken link, a missing anchor, a page outside the nav or a docstring mkdocstrings cannot read fails."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "site" / "promises" / "index.html").is_file()
    assert "edge_sdk.fusion.top_k_ids" in (tmp_path / "site" / "reference" / "edge_sdk" / "index.html").read_text()


def test_the_docs_mark_runnable_blocks() -> None:
    """The walk-throughs' examples are checked: the marker has not drifted off them."""
    pages = {name.split("#")[0] for name, _ in runnable_blocks()}
    assert {"walkthroughs/new-policy.md", "walkthroughs/new-carrier.md", "walkthroughs/new-route.md",
            "walkthroughs/new-metric.md"} <= pages


@pytest.mark.parametrize(("where", "code"), runnable_blocks(), ids=[name for name, _ in runnable_blocks()])
def test_a_runnable_block_runs(where: str, code: str) -> None:
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 0, f"{where}:\n{ran.stderr[-4000:]}"


def test_every_test_the_promise_table_names_exists() -> None:
    references = promise_references((DOCS / "promises.md").read_text())
    assert len(references) >= 60  # the table, not a page that lost it
    assert missing_tests(references, ROOT / "tests") == []


def test_a_promise_naming_a_test_that_is_gone_is_caught(tmp_path: Path) -> None:
    """The check above can fail: a renamed function, a moved file and a bare ``::name`` after another file."""
    (tmp_path / "promises").mkdir()
    (tmp_path / "promises" / "test_a.py").write_text("def test_kept():\n    pass\n")
    table = ("| promise | the test that fails without it |\n|---|---|\n"
             "| one | `promises/test_a.py::test_kept`, `::test_renamed`; `test_moved.py` |\n")
    references = promise_references(table)
    assert references == [("promises/test_a.py", "test_kept"), ("promises/test_a.py", "test_renamed"),
                          ("test_moved.py", None)]
    assert missing_tests(references, tmp_path) == ["promises/test_a.py::test_renamed", "test_moved.py"]


#: a path cell's names: `pkg/module.py`, `pkg/sub/`, or a bare `other.py` / `sub/` read in the folder of the last path
MAP_NAME = re.compile(r"`([a-z_][a-z0-9_/]*(?:\.py|/))`")
MAPPED_PACKAGES = ("edge_sdk", "cloud_adapter", "eval_harness")


def module_map_names(text: str) -> set[str]:
    """Every path the module map's first column names, a bare name read in the folder of the path before it."""
    names = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in MAP_NAME.findall(line.split(" | ", 1)[0]):
            if "/" in name.rstrip("/"):
                folder = name.rstrip("/").rsplit("/", 1)[0] + "/"
                names.add(name.rstrip("/"))
            else:
                names.add(folder + name.rstrip("/"))
    return names


def unmapped_modules(names: set[str], root: Path) -> list[str]:
    """The packages' top-level modules and subpackages the map does not name (a subpackage is named by itself or by
    a module in it)."""
    unmapped = []
    for package in MAPPED_PACKAGES:
        for child in sorted((root / package).iterdir()):
            is_module = child.suffix == ".py" and child.name != "__init__.py"
            is_subpackage = child.is_dir() and (child / "__init__.py").is_file() and not child.name.startswith("_")
            path = f"{package}/{child.name}"
            named = path in names or (is_subpackage and any(name.startswith(path + "/") for name in names))
            if (is_module or is_subpackage) and not named:
                unmapped.append(path)
    return unmapped


def test_the_module_map_names_every_module_of_the_three_packages() -> None:
    names = module_map_names((DOCS / "design" / "layout.md").read_text())
    assert unmapped_modules(names, ROOT) == []


def test_a_module_missing_from_the_map_is_caught(tmp_path: Path) -> None:
    """The check above can fail: a bare name is read in the folder of the path before it in its cell, and a
    module the map does not name is reported."""
    table = ("| path | what |\n|---|---|\n"
             "| `edge_sdk/server/` | the endpoint |\n"
             "| `edge_sdk/decoding.py`, `client.py` | the loop |\n")
    assert module_map_names(table) == {"edge_sdk/server", "edge_sdk/decoding.py", "edge_sdk/client.py"}
    for package in MAPPED_PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "edge_sdk" / "server").mkdir()
    (tmp_path / "edge_sdk" / "server" / "__init__.py").write_text("")
    for module in ("__init__.py", "decoding.py", "client.py", "steps.py"):
        (tmp_path / "edge_sdk" / module).write_text("")
    assert unmapped_modules(module_map_names(table), tmp_path) == ["edge_sdk/steps.py"]
