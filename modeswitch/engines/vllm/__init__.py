"""The vLLM engine: runners over vLLM's ``LLMEngine``, per-mode fronts, the plugin vLLM loads in the engines' processes, the worker-side kernel probe, and the prefix-cache shadow."""
