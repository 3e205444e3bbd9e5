"""ModeSwitch past one GPU: N ModeSwitch servers as Ray Serve replicas behind one OpenAI-compatible ingress,
each request placed by a prefix-, load- and gate-aware request router (``python -m modeswitch.cluster``).

Needs the ``cluster`` extra (``pip install -e '.[cluster]'``: Ray Serve)."""
