"""The benchmark harness: workloads of real text, an HTTP streaming client, comparisons and plots.

``benchmarks/run.py`` drives it: every static mode (pinned), the rule policy, the learned policy and the
per-request oracle on the same trace, against a running server, on the user's own hardware.
"""
