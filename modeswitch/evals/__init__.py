"""Quality measurement with lm-eval: the ``modeswitch`` model adapter and the project's offline tasks."""
