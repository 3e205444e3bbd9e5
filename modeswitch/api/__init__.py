"""The OpenAI-compatible HTTP layer (Flask). It validates, tokenizes, and formats; it never runs a model."""
