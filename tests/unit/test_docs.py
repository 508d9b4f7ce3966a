"""The documents against the code: the README's commands, every docs/ page's tables that
name things the code defines (error codes, the ``session`` event, modules, settings), and
the README's links into docs/ (mkdocs checks the links between the pages)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import tomllib

import pytest
import yaml

from cosyvoice.faces.socketio import session_event
from cosyvoice.gateway.core import Connection, session_limits
from cosyvoice.settings import Settings
from cosyvoice.wire.errors import ERROR_CODES

from ..helpers import ROOT

pytestmark = [pytest.mark.fast, pytest.mark.unit]

DOCS = ROOT / "docs"


def _table(page: str, header: str) -> list[list[str]]:
    """The rows of the table on ``page`` whose header line starts with ``header``."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_error_codes_are_the_closed_set_the_protocol_page_documents():
    documented = [row[0].strip("`") for row in _table("protocol.md", "| code | when |")]
    assert sorted(documented) == sorted(ERROR_CODES)
    assert "unsupported_mode" in ERROR_CODES


def test_the_protocol_page_names_every_key_of_the_session_event():
    conn = Connection(session="abc", rate=8000, conn_id="sock", client="1.2.3.4", bucket=None,
                      next_seq=7, mode="pocketsphinx")
    event = session_event(conn, True, session_limits(Settings()))
    row = next(line for line in (DOCS / "protocol.md").read_text().splitlines()
               if line.startswith("| s→c | `session` |"))
    for key in [*event, *event["limits"]]:
        assert f"{key}" in row, key


def test_the_module_table_lists_every_module_and_only_those():
    listed = {row[0].strip("`") for row in _table("architecture.md", "| module | concern |")}
    # the engines inside asr/ are one row; chunk_pb.py is generated (a row of its own
    # would only repeat protocol's)
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "cosyvoice").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py", "chunk_pb.py")
               and (p.parent.name != "asr" or p.name == "model_data.py")}
    # a package whose __init__ holds code (not only its docstring) is a row of its own,
    # by its folder (the engines' protocols in asr/, the command's parser in cli/)
    packages = {str(p.parent.relative_to(ROOT)) + "/"
                for p in (ROOT / "cosyvoice").rglob("__init__.py")
                if len(ast.parse(p.read_text()).body) > 1}
    assert packages >= {"cosyvoice/asr/", "cosyvoice/cli/"}
    assert listed == modules | packages


def test_the_configuration_page_documents_every_setting_with_its_default():
    rows = {row[0].strip("`"): row[1].strip("`")
            for row in _table("configuration.md", "| variable | default | meaning |")}
    defaults = Settings().as_env()
    assert set(rows) == set(defaults)
    # an empty model dir means the cache directory, which the page names
    wrong = {name: (rows[name], value) for name, value in defaults.items()
             if name != "COSYVOICE_MODEL_DIR" and not _same(rows[name], value)}
    assert wrong == {}


def _same(documented: str, value: str) -> bool:
    if documented == "empty":
        return value == ""
    try:
        return float(documented) == float(value)
    except ValueError:
        return documented == value


def make_dry_run(*targets: str) -> list[str]:
    """The commands ``make`` would run for ``targets``. The suite itself runs under
    ``make test`` in CI (.ci/run), so the make it starts is a sub-make: without the parent's
    flags and with no directory lines, it prints only the commands."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", "-n", *targets], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()


def test_the_task_runner_runs_the_readme_test_command():
    """`make install test` is the README's command to install and run every test,
    docs/development.md gives the same command, and .ci/run runs it as `make install
    test`."""
    pattern = r"^(?:python -m )?pip install -e '\.\[test\]' && .*python -m pytest$"
    command = re.search(pattern, (ROOT / "README.md").read_text(), re.M)
    assert command is not None
    dry = make_dry_run("install", "test")
    steps = [s.replace("python -m pip ", "pip ") for s in dry]
    assert steps == command.group(0).split(" && ")
    found = re.search(pattern, (DOCS / "development.md").read_text(), re.M)
    assert found is not None
    assert found.group(0).replace("python -m pip ", "pip ") == command.group(0)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "make install test"


def test_the_changelog_names_the_version_being_released():
    """The newest release in CHANGELOG.md is pyproject.toml's version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    releases = re.findall(r"^## (\d+\.\d+\.\d+) \(\d{4}-\d{2}-\d{2}\)$",
                          (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == project["version"]


def test_the_commit_hooks_run_the_gates_of_the_task_runner():
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = {hook["entry"] for repo in hooks["repos"] for hook in repo["hooks"]}
    dry = make_dry_run("lint", "types")
    assert entries == set(dry)


def test_the_readme_links_to_pages_and_anchors_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme)
    assert len({page for page, _ in links}) >= 10
    for page, anchor in links:
        target = ROOT / page
        assert target.is_file(), page
        if anchor:
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}
            assert anchor in headings, f"{page}#{anchor}"


def _slug(heading: str) -> str:
    """The anchor mkdocs's toc extension gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_every_docs_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(re.findall(r":\s*(\w[\w-]*\.md)$", nav, re.M))
