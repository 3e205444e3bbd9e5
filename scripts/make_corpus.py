"""Rebuild modeswitch/data/jargon_prose.txt.gz from Debian's jargon-text package (run once; output is committed).

Source: The Jargon File 4.4.7 (Eric S. Raymond et al.), which its authors put in the public domain
("to be freely used, shared, and modified"), as packaged by Debian (jargon-text 4.4.7-4.1,
/usr/share/doc/jargon-text/jargon.txt.gz). Only prose paragraphs of 200+ characters are kept, in file
order, with whitespace normalised and {cross-reference} braces removed: the index, headings and tables are dropped.

    apt-get download jargon-text && dpkg -x jargon-text_*.deb /tmp/jargon
    python scripts/make_corpus.py /tmp/jargon/usr/share/doc/jargon-text/jargon.txt.gz
"""

import gzip
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "modeswitch" / "data" / "jargon_prose.txt.gz"


def main(src: str) -> None:
    text = gzip.open(src, "rt", encoding="utf-8", errors="replace").read()
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    paragraphs = [re.sub(r"\{([^{}]*)\}", r"\1", p) for p in paragraphs]  # {cross-reference} -> cross-reference
    prose = [p for p in paragraphs if len(p) >= 200 and not p.startswith(("*", "+", "|", "-"))]
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write("\n\n".join(prose) + "\n")
    print(f"{len(prose)} paragraphs, {sum(map(len, prose))} characters -> {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
