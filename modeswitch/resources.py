"""Data shipped inside the package: mode files, policies, lm-eval tasks, gate reports, the corpus.

Located through :mod:`importlib.resources`, so a non-editable ``pip install`` serves from any working
directory; the repository's top-level ``modes/``, ``policies/``, ``evals/tasks`` and ``evals/reports`` are
links into ``modeswitch/data`` so paths in the README and docs/ work from a checkout too. The package is installed as
files (not zipped): YAML loaders, lm-eval and ``datasets`` read these by path.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DATA = Path(str(files("modeswitch").joinpath("data")))
MODES_DIR = DATA / "modes"
EXTRA_MODES_DIR = MODES_DIR / "extra"
POLICIES_DIR = DATA / "policies"
DEFAULT_POLICY = POLICIES_DIR / "fastest.yaml"
EVAL_TASKS_DIR = DATA / "evals" / "tasks"
REPORTS_DIR = DATA / "evals" / "reports"
CORPUS = DATA / "jargon_prose.txt.gz"


def shipped_report(model: str, engine: str, reports_dir: Path = REPORTS_DIR) -> Path:
    """The quality gate report for ``model`` scored on ``engine`` (a backend's ``gate_key``; it may not exist: a
    gate run writes it). One per engine: a quantized variant's accuracy is its engine's kernels'."""
    return reports_dir / f"{Path(model).name}-{engine}.json"
