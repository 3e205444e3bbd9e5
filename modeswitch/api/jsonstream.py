"""One JSON value read a character at a time and written out as it comes, as ``json.dumps(json.loads(value))``
writes it.

Streamed tool-call arguments must add up to what the answer's whole text gives (``json.dumps`` of the parsed
arguments, as vLLM writes them), yet go out before the value is complete: so each character is re-written the
moment its place in the canonical text is certain. Whitespace goes, separators become ``", "`` and ``": "``,
string characters are escaped as ``json.dumps`` escapes them (non-ASCII as ``\\uXXXX``), and a number or literal
(``true``, ``1.50``) is written once it ends, through ``json.loads`` and ``json.dumps``. Keys repeated in an
object are all written (``json.loads`` would keep the last).
"""

from __future__ import annotations

import json
from string import hexdigits
from typing import Callable

WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _atomic(c: str) -> bool:
    """Whether ``c`` may be part of a number or literal (``json.loads`` judges the whole once it ends)."""
    return c.isalnum() or c in "+-."


class JsonValue:
    """An incremental reader of one JSON value. :meth:`feed` it characters; :meth:`take` what they wrote.

    ``text_string``: a value that is a string is written as its text (decoded, without quotes), not as JSON, as
    a tool call's arguments given as a string are sent as that string."""

    def __init__(self, text_string: bool = False) -> None:
        self.done = False  # the value is complete
        self.failed = False  # it is not JSON
        self._text_string = text_string
        self._closers: list[str] = []  # what closes each container open, innermost last
        self._state: Callable[[str], bool] = self._value
        self._key = False  # the string being read is an object's key
        self._atom = ""
        self._escape = ""  # an escape read so far, after its backslash
        self._high = ""  # a ``\\uD8xx`` waiting for its low half: the pair is one character
        self._out: list[str] = []

    def feed(self, c: str) -> bool:
        """Read ``c``. False when it is not part of the value: the value ended before it (``done``: a number is
        known to end only at the character after it) or it is not JSON (``failed``)."""
        if self.done or self.failed:
            return False
        return self._state(c)

    def take(self) -> str:
        """What the characters fed since the last call wrote."""
        out = "".join(self._out)
        self._out.clear()
        return out

    # ------------------------------------------------------------------ states: each reads one character
    def _value(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c in "{[":
            self._closers.append("}" if c == "{" else "]")
            self._out.append(c)
            self._state = self._first_key if c == "{" else self._first_item
        elif c == '"':
            self._start_string(key=False)
        elif _atomic(c):
            self._atom, self._state = c, self._in_atom
        else:
            return self._fail()
        return True

    def _first_key(self, c: str) -> bool:
        return self._close(c) if c == "}" else self._next_key(c)

    def _first_item(self, c: str) -> bool:
        return self._close(c) if c == "]" else self._value(c)

    def _next_key(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c != '"':
            return self._fail()
        self._start_string(key=True)
        return True

    def _colon(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c != ":":
            return self._fail()
        self._out.append(": ")
        self._state = self._value
        return True

    def _after_item(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c == ",":
            self._out.append(", ")
            self._state = self._next_key if self._closers[-1] == "}" else self._value
            return True
        return self._close(c) if c == self._closers[-1] else self._fail()

    def _start_string(self, key: bool) -> None:
        self._key, self._state = key, self._in_string
        if not self._as_text():
            self._out.append('"')

    def _in_string(self, c: str) -> bool:
        if c == "\\":
            self._escape, self._state = "", self._in_escape
        elif c == '"':
            self._flush_high()
            if not self._as_text():
                self._out.append('"')
            if self._key:
                self._state = self._colon
            else:
                self._ended()
        elif c < " ":  # control characters must be escaped in JSON
            return self._fail()
        else:
            self._char(c)
        return True

    def _in_escape(self, c: str) -> bool:
        self._escape += c
        if self._escape[0] != "u":
            if c not in _ESCAPES:
                return self._fail()
            self._state = self._in_string
            self._char(_ESCAPES[c])
        elif len(self._escape) > 1 and c not in hexdigits:
            return self._fail()
        elif len(self._escape) == 5:
            self._state = self._in_string
            self._code_point(int(self._escape[1:], 16))
        return True

    def _in_atom(self, c: str) -> bool:
        if _atomic(c):
            self._atom += c
            return True
        try:
            value = json.loads(self._atom)
        except ValueError:
            return self._fail()
        self._out.append(json.dumps(value))
        self._ended()
        return False if self.done else self._state(c)

    # ------------------------------------------------------------------ helpers
    def _close(self, c: str) -> bool:
        self._closers.pop()
        self._out.append(c)
        self._ended()
        return True

    def _ended(self) -> None:
        """A value is complete: the whole one, or an item of the container still open."""
        if self._closers:
            self._state = self._after_item
        else:
            self.done = True

    def _as_text(self) -> bool:
        return self._text_string and not self._closers

    def _code_point(self, code: int) -> None:
        if 0xD800 <= code < 0xDC00:
            self._flush_high()
            self._high = chr(code)
        elif 0xDC00 <= code < 0xE000 and self._high:
            pair = 0x10000 + ((ord(self._high) - 0xD800) << 10) + (code - 0xDC00)
            self._high = ""
            self._char(chr(pair))
        else:
            self._char(chr(code))

    def _flush_high(self) -> None:
        if self._high:
            high, self._high = self._high, ""
            self._char(high)

    def _char(self, c: str) -> None:
        self._flush_high()
        self._out.append(c if self._as_text() else json.dumps(c)[1:-1])

    def _fail(self) -> bool:
        self.failed = True
        return False
