"""The documentation site builds with ``mkdocs build --strict``, its nav names pages that exist, and the README stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200


def _nav_pages(nav) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages += _nav_pages(value)
        elif isinstance(value, str) and not value.startswith(("http://", "https://")):
            pages.append(value)
    return pages


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"


def test_readme_short_and_nav_pages_exist():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}"
    # mkdocs.yml may hold !relative / !ENV tags: load it with a loader that ignores unknown tags
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("", lambda l, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=loader)
    docs = ROOT / config.get("docs_dir", "docs")
    pages = _nav_pages(config["nav"])
    assert pages, "mkdocs.yml has no nav"
    missing = [page for page in pages if not (docs / page).is_file()]
    assert not missing, f"pages in mkdocs.yml's nav that do not exist: {missing}"


def test_the_module_map_lists_every_module_and_nothing_else():
    """docs/architecture.md's module map has one row per module under modeswitch/: a module added, moved or
    removed without its row fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Module map"):text.index("## Outside the package")]
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", section, re.M))
    package = ROOT / "modeswitch"
    actual = {str(p.relative_to(package)) for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    assert listed == actual, f"not in the map: {sorted(actual - listed)}; in the map, not in the package: {sorted(listed - actual)}"
