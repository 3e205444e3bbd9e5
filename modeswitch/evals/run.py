"""Run the project's offline lm-eval tasks (evals/tasks) on a model or a mode."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TASKS_DIR = ROOT / "evals" / "tasks"
TASKS = ("jargon_cloze", "jargon_ppl", "jargon_copy")


@contextlib.contextmanager
def _in_repo_root():
    """Task YAML names its data files relative to the repository root."""
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(previous)


def evaluate(model, tasks=TASKS, limit: int | None = None, model_args: str | dict | None = None) -> dict:
    """``lm_eval.simple_evaluate`` on the project's tasks; ``model`` is an LM instance or a registry name."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from . import adapter  # noqa: F401  (registers the 'modeswitch' model)

    with _in_repo_root():
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), limit=limit,
                                       task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                       batch_size=1, log_samples=False)
