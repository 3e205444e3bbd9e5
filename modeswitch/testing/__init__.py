"""Test doubles that need no model: a byte tokenizer, a scripted engine and a backend that builds it.

They exist so the controller, the service and the HTTP API can be tested in-process in seconds, with the
faults and slowness a test needs injected here instead of in the production request path. The real
engines keep their own end-to-end tests.
"""
