"""Grammars for constrained output, with xgrammar (the library vLLM constrains with by default).

:func:`grammar` parses a request's :class:`~modeswitch.engines.base.Constraint` without a tokenizer, so the HTTP
edge can refuse a bad schema or regex with a 400 before anything starts; :class:`Grammars` compiles it against
the model's vocabulary for the transformers engines, which apply it with xgrammar's own logits processor. vLLM
engines get the constraint itself and compile it in their engine core.
"""

from __future__ import annotations

import functools
import json
import threading

from ..sampling_params import Constraint


#: what ``json_object`` asks for: a JSON object, as OpenAI defines it (xgrammar's built-in JSON grammar, which vLLM
#: applies for it, also admits arrays and bare values)
JSON_OBJECT = '{"type": "object"}'


@functools.lru_cache(maxsize=64)
def grammar(c: Constraint):
    """The constraint as an ``xgrammar.Grammar``; raises ``ValueError`` saying what is wrong with it. Cached: the
    HTTP edge parses a request's constraint to check it, and a transformers engine compiles the same one."""
    import xgrammar as xgr

    try:
        if c.kind == "json":
            return xgr.Grammar.from_json_schema(c.spec)
        if c.kind == "json_object":
            return xgr.Grammar.from_json_schema(JSON_OBJECT)
        if c.kind == "regex":
            return xgr.Grammar.from_regex(c.spec)
        if c.kind == "choice":
            choices = json.loads(c.spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices))
        if c.kind == "grammar":
            return xgr.Grammar.from_ebnf(c.spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(str(exc).strip().splitlines()[-1]) from None
    raise ValueError(f"unknown constraint kind {c.kind!r}")


class Grammars:
    """Constraints compiled against one tokenizer and vocabulary (the logits' width), cached by xgrammar."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def processor(self, c: Constraint):
        """A fresh transformers logits processor for one generation under ``c`` (xgrammar's processors keep the
        generation's parse state, so one serves one request)."""
        import xgrammar as xgr
        from xgrammar.contrib.hf import LogitsProcessor

        with self._lock:  # the compiler is built on first use: most servers never constrain a request
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
        return LogitsProcessor(self._compiler.compile_grammar(grammar(c)))
