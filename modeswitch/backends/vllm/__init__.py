"""The vLLM backend: modes served by vLLM engines in their own processes, by job (layout, starts, the engines as
served); :class:`.backend.VllmBackend` composes them."""
