"""Run the project's offline lm-eval tasks (shipped in the package, see :mod:`modeswitch.resources`)."""

from __future__ import annotations

from ..resources import EVAL_TASKS_DIR

TASKS = ("jargon_cloze", "jargon_ppl", "jargon_copy")


def task_manager(tasks=TASKS):
    """lm-eval's task index with the shipped tasks (their data loads relative to the task files, not the
    working directory). lm-eval's own tasks, thousands of them, are indexed only when ``tasks`` names one of
    them: indexing them takes seconds, at every evaluation of every mode of a gate run."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(EVAL_TASKS_DIR), include_defaults=not set(tasks) <= set(TASKS))


def evaluate(model, tasks=TASKS, limit: int | None = None, model_args: str | dict | None = None,
             log_samples: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` on the project's tasks; ``model`` is an LM instance or a registry name.
    ``log_samples``: the result's ``samples`` hold every document's scores (what the gate's intervals resample)."""
    import lm_eval

    from . import adapter  # noqa: F401  (registers the 'modeswitch' model)

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), limit=limit,
                                   task_manager=task_manager(tasks), batch_size=1, log_samples=log_samples)
