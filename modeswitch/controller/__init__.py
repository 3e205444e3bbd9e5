"""The per-request mode controller: features -> gates (filter, typed verdicts) -> policy (score, choose)
-> Decision; completed requests come back through ``Controller.observe``.

Modules, lowest first (each imports only those above it): ``verdicts``, ``view``, ``features``,
``quality``, ``completed``; ``policy`` (the protocol and shared blocks); ``rules`` and ``learned`` (the two
policies); ``load`` (policy files); ``gates``; ``decide`` (the controller).
"""
