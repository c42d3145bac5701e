"""The SDK stays light, the wire code is generated, and the package layering holds."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "llama_cpp", "grpc", "google.protobuf", "cloud_adapter", "eval_harness",
         "edge_sdk.server", "fastapi", "uvicorn", "starlette")
#: what only the endpoint's app may load (the optional `server` extra)
SERVER_STACK = ("fastapi", "uvicorn", "starlette", "pydantic")


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return set(out.stdout.split())


def test_import_edge_sdk_is_light() -> None:
    modules = imported_after(
        "import edge_sdk, edge_sdk.fusion, edge_sdk.policies, edge_sdk.models, edge_sdk.privacy.meter, edge_sdk.decoding, "
        "edge_sdk.steps, edge_sdk.privacy.ledger, edge_sdk.protocol.status, edge_sdk.protocol.wire, edge_sdk.protocol.connection, edge_sdk.testing"
    )
    loaded = sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], f"import edge_sdk pulled in {loaded}"


@pytest.mark.slow
def test_dp_accounting_loads_only_when_a_dp_policy_is_accounted() -> None:
    account = ("import edge_sdk, edge_sdk.privacy.accountant as a, edge_sdk.policies as p; "
               "x = a.PrivacyAccountant(p.{}.release_event('edge')); x.record(0, steered=True); x.summary()")
    heuristic = imported_after(account.format("CoVeil()"))
    assert not [m for m in heuristic if m.split(".")[0] in ("dp_accounting", "scipy")]
    dp = imported_after(account.format("InvisibleInk()"))
    assert "dp_accounting" in dp
    assert not [m for m in dp if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def imported_modules(path: Path) -> list[str]:
    """The modules a file imports, wherever the import statement is (absolute imports: the project writes no
    relative ones)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += names
    return found


def test_edge_sdk_never_imports_the_cloud_or_the_harness() -> None:
    offenders = [f"{path.name}: {name}" for path in (ROOT / "edge_sdk").rglob("*.py")
                 if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
                 for name in imported_modules(path) if name.split(".")[0] in ("cloud_adapter", "eval_harness")]
    assert offenders == []


def imports_of(package: Path) -> dict[str, set[str]]:
    """Every module each source file under ``package`` imports (``from x import y`` counts ``x`` and ``x.y``)."""
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_protocol_imports_neither_the_policies_nor_the_loop() -> None:
    """``edge_sdk.protocol`` is what both ends share: the cloud adapter loads it without the defences or the loop."""
    loop = ("edge_sdk.policies", "edge_sdk.decoding", "edge_sdk.steps", "edge_sdk.sides", "edge_sdk.client")
    offenders = [f"{path}: {name}" for path, names in imports_of(ROOT / "edge_sdk" / "protocol").items()
                 for name in names if any(name == m or name.startswith(m + ".") for m in loop)]
    assert offenders == []
    modules = imported_after("import edge_sdk.protocol.connection, edge_sdk.protocol.channels")
    assert not [m for m in modules if m.startswith(("edge_sdk.policies", "edge_sdk.decoding", "edge_sdk.steps",
                                                    "edge_sdk.sides"))]


def test_the_cloud_adapter_takes_only_the_protocol_fusion_grammar_and_settings_from_the_sdk() -> None:
    """Besides those: the generated wire code, logprobs (a fused row's), and three stateless helpers (flags, the
    model source, the registry class)."""
    allowed = ("edge_sdk.protocol", "edge_sdk._wire", "edge_sdk.fusion", "edge_sdk.grammar", "edge_sdk.logprobs",
               "edge_sdk.decode_settings", "edge_sdk.cli_flags", "edge_sdk.models", "edge_sdk.registry")
    offenders = [f"{path}: {name}" for path, names in imports_of(ROOT / "cloud_adapter").items() for name in names
                 if name.split(".")[0] == "edge_sdk" and name != "edge_sdk"
                 and not any(name == m or name.startswith(m + ".") for m in allowed)]
    assert offenders == []


#: what edge_sdk.privacy may import of the SDK: itself, the settings, and the signal types and wire rows it
#: accounts for (never the loop, the transport, the client, the server or the defences themselves)
PRIVACY_MAY_IMPORT = ("edge_sdk.privacy", "edge_sdk.decode_settings", "edge_sdk.protocol.signals", "edge_sdk.protocol.wire",
                      "edge_sdk.backends")


def test_the_privacy_package_imports_neither_the_loop_nor_the_defences() -> None:
    """``edge_sdk.privacy`` (what the cloud may learn and what it cost) stands under the loop and the policies:
    they import it, never the other way round; and the other modules import its parts, not a package facade."""
    package = ROOT / "edge_sdk" / "privacy"
    offenders = [f"{path.name}: {name}" for path in package.glob("*.py") for name in imported_modules(path)
                 if name.split(".")[0] == "edge_sdk"
                 and not any(name == m or name.startswith(m + ".") for m in PRIVACY_MAY_IMPORT)]
    assert offenders == []
    assert imported_modules(package / "__init__.py") == []  # no facade: each module loads only when used


def test_wire_code_is_generated_from_the_proto() -> None:
    from edge_sdk.protocol import wire

    pb = wire.pb()
    assert pb.DESCRIPTOR.package == "coveil.v1"
    assert "Decode" in pb.DESCRIPTOR.services_by_name["CollaborativeDecoding"].methods_by_name


@pytest.mark.slow
def test_the_front_door_names_import_lazily() -> None:
    # naming the exports loads nothing heavy until one is used
    modules = imported_after("import edge_sdk; dir(edge_sdk); edge_sdk.CoVeil; edge_sdk.Undefended")
    assert not [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    code = (
        "from edge_sdk import EdgeClient, CoVeil, LlamaCppSLM, Credentials; "
        "import edge_sdk.client, edge_sdk.backends.llama_cpp, edge_sdk.policies; "
        "assert EdgeClient is edge_sdk.client.EdgeClient and Credentials is edge_sdk.client.Credentials; "
        "assert LlamaCppSLM is edge_sdk.backends.llama_cpp.LlamaCppSLM and CoVeil is edge_sdk.policies.CoVeil"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    result = subprocess.run([sys.executable, "-c", "import edge_sdk; edge_sdk.Nope"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode != 0 and "has no attribute 'Nope'" in result.stderr


@pytest.mark.slow
def test_llama_cpp_prints_nothing_unless_asked() -> None:
    load = "from edge_sdk.backends.llama_cpp import LlamaCppSLM; s = LlamaCppSLM(n_ctx=128, verbose={})"
    quiet = subprocess.run([sys.executable, "-c", load.format(False)], capture_output=True, text=True, cwd=ROOT)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""
    loud = subprocess.run([sys.executable, "-c", load.format(True)], capture_output=True, text=True, cwd=ROOT)
    assert loud.returncode == 0 and "llama" in loud.stderr


def test_the_endpoint_is_an_extra_that_only_serving_loads() -> None:
    """``import edge_sdk`` (and its client) never loads the endpoint nor FastAPI; the ``coveil`` command line builds
    ``coveil edge serve``'s flags without them, so ``coveil demo`` runs without the ``server`` extra."""
    modules = imported_after("import edge_sdk, edge_sdk.client, edge_sdk.prompts; edge_sdk.EdgeClient")
    assert not [m for m in modules if m.startswith("edge_sdk.server") or m.split(".")[0] in SERVER_STACK]
    modules = imported_after("from eval_harness.cli.coveil import build_parser; build_parser()")
    assert not [m for m in modules if m.split(".")[0] in SERVER_STACK]


def test_the_live_page_ships_in_the_package() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p.name for p in (ROOT / "edge_sdk" / "server" / "static").iterdir()}
    patterns = data["edge_sdk.server"]
    assert shipped == {"index.html", "app.js", "style.css"}
    assert all(any(Path("static", name).match(pattern) for pattern in patterns) for name in shipped)


def test_each_package_ships_its_type_hints() -> None:
    """PEP 561: a ``py.typed`` marker in each top-level package, matched by the package data."""
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    for package in ("edge_sdk", "cloud_adapter", "eval_harness"):
        assert (ROOT / package / "py.typed").is_file(), package
    assert any(Path("py.typed").match(pattern) for pattern in patterns)


#: the Python release that added each name to ``typing`` (from the typing module's documentation)
TYPING_ADDED = {"Self": (3, 11), "LiteralString": (3, 11), "Never": (3, 11), "assert_never": (3, 11),
                "assert_type": (3, 11), "reveal_type": (3, 11), "dataclass_transform": (3, 11), "Required": (3, 11),
                "NotRequired": (3, 11), "override": (3, 12), "TypeAliasType": (3, 12), "TypeIs": (3, 13),
                "ReadOnly": (3, 13), "NoDefault": (3, 13)}


@pytest.mark.slow
def test_requires_python_admits_only_releases_that_run_the_code() -> None:
    """Every source parses with the grammar of the lowest release ``requires-python`` admits, and imports
    from ``typing`` only what that release has."""
    import re
    import tomllib

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    lowest = tuple(int(part) for part in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip()).groups())
    too_new = []
    for folder in ("edge_sdk", "cloud_adapter", "eval_harness", "benchmarks", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), feature_version=lowest)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "typing":
                    too_new += [f"{path.relative_to(ROOT)}: typing.{a.name}" for a in node.names
                                if TYPING_ADDED.get(a.name, (0, 0)) > lowest]
    assert not too_new, f"requires-python {spec} admits releases without {too_new}"


def test_the_construction_prompts_and_review_page_ship_in_the_package() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["eval_harness.construction"]
    base = ROOT / "eval_harness" / "construction"
    shipped = [path.relative_to(base) for folder in ("prompts", "static") for path in (base / folder).iterdir()]
    assert {p.name for p in shipped} == {"screen_clinical.txt", "screen_narrative.txt", "extract.txt",
                                         "review.html", "review.js", "review.css"}
    assert all(any(path.match(pattern) for pattern in patterns) for path in shipped)


def test_every_decodeleak_help_reads_as_written() -> None:
    """Each command's ``--help`` renders, and no description carries a printf escape argparse leaves as is."""
    import argparse
    import contextlib
    import io

    from eval_harness.cli.decodeleak import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"sweep", "run", "report", "plot", "compare-quant", "build-benchmark", "review", "finalize"} <= set(
        commands.choices)
    for name, command in commands.choices.items():
        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            command.parse_args(["--help"])
        assert text.getvalue().startswith(f"usage: decodeleak {name}"), name
        assert "%%" not in text.getvalue(), name


def test_ruff_passes_with_the_project_rule_list() -> None:
    """``ruff check`` (the dev extra's) passes with ``[tool.ruff.lint]``, whose RUF100 also refuses any ``noqa``
    that suppresses nothing or names a rule that is off."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs exactly README's second command: pytest, then the TypeScript SDK's tests from the lock."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 2
    test_command = commands[1].strip()
    assert "python -m pytest" in test_command and "npm ci" in test_command and "npm test" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
