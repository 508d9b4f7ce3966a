"""The package's import contracts (pyproject.toml ``[tool.importlinter]``, run by
``lint-imports`` in ``make lint``): the package keeps them, and the same contracts fail a
fixture package laid out like it with one import that goes up a layer or across faces."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ..helpers import ROOT

pytestmark = [pytest.mark.unit, pytest.mark.fast]


def lint_imports(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports --config CONFIG`` (its console script's code) in ``cwd``."""
    code = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    return subprocess.run([sys.executable, "-c", code, "--config", str(config), "--no-cache"],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def contracts() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def fixture(tmp_path: Path, extra: dict[str, str]) -> Path:
    """A package ``fixturepkg`` with a module for every name the contracts mention, the
    contracts pointed at it, and ``extra`` (module -> the line it adds)."""
    config = (ROOT / "pyproject.toml").read_text()
    config = config[config.index("\n[tool.importlinter]\n"):config.index("\n[tool.ruff]\n")]
    names: set[str] = set()
    for contract in contracts()["contracts"]:
        for layer in contract.get("layers", []):
            names.update(f"cosyvoice.{n.strip()}" for n in re.split(r"[|:]", layer))
        for key in ("modules", "source_modules", "forbidden_modules"):
            names.update(contract.get(key, []))
    for name in names | {"cosyvoice"}:
        package = tmp_path / name.replace("cosyvoice", "fixturepkg").replace(".", "/")
        package.mkdir(parents=True, exist_ok=True)
        module = name.replace("cosyvoice", "fixturepkg")
        (package / "__init__.py").write_text(extra.get(module, "") + "\n")
    path = tmp_path / "contracts.toml"
    path.write_text(config.replace("cosyvoice", "fixturepkg"))
    return path


def test_the_package_keeps_its_contracts():
    result = lint_imports(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_fixture_without_a_violation_keeps_them(tmp_path):
    result = lint_imports(fixture(tmp_path, {}), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module, line, broken", [
    ("fixturepkg.wire", "from fixturepkg import gateway", "Layers"),  # up a layer
    ("fixturepkg.store", "from fixturepkg import text", "Layers"),  # across siblings
    ("fixturepkg.faces.deepgram", "from fixturepkg.faces import openai",
     "No face imports another face"),
    ("fixturepkg.faces.openai", "from fixturepkg import store", "through the gateway"),
])
def test_a_deliberate_violation_fails(tmp_path, module, line, broken):
    result = lint_imports(fixture(tmp_path, {module: line}), tmp_path)
    assert result.returncode != 0
    report = result.stdout.split("Broken contracts")[-1]
    assert broken in report and module in report, result.stdout
