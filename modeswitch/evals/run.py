"""Run the project's offline lm-eval tasks (shipped in the package, see :mod:`modeswitch.resources`)."""

from __future__ import annotations

from ..resources import EVAL_TASKS_DIR

TASKS = ("jargon_cloze", "jargon_ppl", "jargon_copy")


def task_manager():
    """lm-eval's task index over the shipped tasks (their data loads relative to the task files, not the
    working directory)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(EVAL_TASKS_DIR))


def evaluate(model, tasks=TASKS, limit: int | None = None, model_args: str | dict | None = None) -> dict:
    """``lm_eval.simple_evaluate`` on the project's tasks; ``model`` is an LM instance or a registry name."""
    import lm_eval

    from . import adapter  # noqa: F401  (registers the 'modeswitch' model)

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), limit=limit,
                                   task_manager=task_manager(), batch_size=1, log_samples=False)
