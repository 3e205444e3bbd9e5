"""The per-request mode controller: features → gates (filter) → policy (score/choose) → Decision."""
