"""lm-eval's own command line with the ``modeswitch`` model registered (lm-eval discovers no plugins):

    python -m modeswitch.evals run --model modeswitch --model_args model=demo,mode=gptq \
        --tasks jargon_cloze --include_path evals/tasks
"""

from lm_eval.__main__ import cli_evaluate

from . import adapter  # noqa: F401  (registers the model)

cli_evaluate()
