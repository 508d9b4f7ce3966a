"""The package's import map at a git revision: modules per folder, the largest modules,
module-level import cycles (every import, at module level or inside a function).

    python benchmarks/import_map.py            # the working tree
    python benchmarks/import_map.py 88d7be0    # a revision, read with git show

docs/development.md ("The package's layout") has the figures before and after the
layout by role.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.import_graph import cyclic, graph  # noqa: E402


def sources(rev: str | None) -> dict[str, str]:
    """Every ``cosyvoice/**/*.py`` at ``rev`` (None: the working tree): path -> text."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text()
                for p in (ROOT / "cosyvoice").rglob("*.py")}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "cosyvoice"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
            for n in names if n.endswith(".py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", default=None)
    args = parser.parse_args()
    files = sources(args.rev)
    lines = {p: len(t.splitlines()) for p, t in files.items() if not p.endswith("__init__.py")
             or t.strip().count("\n") > 12}
    folders = Counter(str(Path(p).parent) for p in files if not p.endswith("__init__.py"))
    print(f"revision {args.rev or 'working tree'}: {len(files)} files, "
          f"{sum(len(t.splitlines()) for t in files.values())} lines")
    print("modules per folder: " + ", ".join(f"{f} {n}" for f, n in sorted(folders.items())))
    largest = sorted(lines.items(), key=lambda kv: -kv[1])
    print("largest: " + ", ".join(f"{p} {n}" for p, n in largest[:6]))
    print(f"modules over 500 lines: {sum(1 for _, n in largest if n > 500)}")
    print(f"modules in an import cycle: {len(cyclic(graph(files)))}")


if __name__ == "__main__":
    main()
