"""MkDocs hook: put the benchmark results digest into the benchmarks page.

``benchmarks/results/README.md`` is generated next to the results it summarises, outside ``docs/``. The page
``benchmarks.md`` holds the marker below; this hook replaces it with the digest, its headings one level down and
its relative links turned into code spans naming the file (MkDocs cannot link outside ``docs/``). Where the digest
is absent the page says so, and the build still passes.
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- results-digest -->"
DIGEST = Path("benchmarks") / "results" / "README.md"
_LINK = re.compile(r"!?\[([^\]]*)\]\((?![a-z]+:|#)([^)\s]+)[^)]*\)")
_HEADING = re.compile(r"^(#{1,5}) ", re.MULTILINE)


def digest(root: Path) -> str:
    path = root / DIGEST
    if not path.is_file():
        return f"The digest `{DIGEST.as_posix()}` is not in this checkout."
    text = path.read_text(encoding="utf-8")
    base = DIGEST.parent.as_posix()
    text = _LINK.sub(lambda m: f"{m.group(1)} (`{base}/{m.group(2)}`)" if m.group(1) else f"`{base}/{m.group(2)}`",
                     text)
    return _HEADING.sub(lambda m: "#" + m.group(1) + " ", text)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, digest(Path(config.config_file_path).parent))
