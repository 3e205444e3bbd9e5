"""Hermes tool calls read from an answer as it is generated: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

Streamed, a client sees the content at once and each call as it is written, in the delta shape of vLLM's Hermes
parser: a call's first delta carries its index, id, type and name, the next ones fragments of its arguments.
Only text that may still become a call is held back: a suffix that may be the start of ``<tool_call>``, and
whitespace, which is dropped where it touches a call. The whole answer is read the same way (:func:`tools.parse`
feeds it at once), so a stream adds up to the non-streamed message of the same answer. Decisions are final once
sent, which sets these rules:

* A block is a call from the moment its ``name`` is read and names an offered function (before that it is
  held); its arguments (``{}`` when it has none) go out as they come, written as ``json.dumps`` writes them
  (:mod:`.jsonstream`). If its JSON breaks off (``max_tokens``, or text that is not JSON) the arguments stop
  where it broke; the rest of the block, to ``</tool_call>``, is not content.
* A block that is not a call (not JSON before its name, no name, a function not offered, unfinished) is content,
  as written. So is everything outside the blocks; whitespace next to a call is dropped, except between two
  pieces of content, where it stays.
* Without ``parallel_tool_calls`` a block after the first call is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .jsonstream import WHITESPACE, JsonValue

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Piece:
    """What a stretch of the answer adds to the message: content, and tool-call deltas (``index`` and what is
    new of that call)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def delta(self) -> dict:
        """The stream delta: content (also when empty, as a text delta is sent) unless it is calls alone."""
        out: dict = {"content": self.content} if self.content or not self.calls else {}
        if self.calls:
            out["tool_calls"] = self.calls
        return out


class _Block:
    """The JSON object of one block read a character at a time: its name once complete, its arguments as they
    come. ``raw``: the block's text read so far, content again if it is not a call."""

    def __init__(self) -> None:
        self.raw = OPEN
        self.name: str | None = None
        self.arguments = ""  # written, not yet taken
        self.has_arguments = False
        self.done = False  # the object is complete
        self.failed = False  # it is not a call's JSON
        self._state = self._open
        self._key: str | None = None
        self._value: JsonValue | None = None

    def feed(self, c: str) -> bool:
        """Read ``c``; False when it is not the object's (it ended, or broke, before ``c``)."""
        if self.done or self.failed:
            return False
        consumed = self._state(c)
        if consumed:
            self.raw += c
        return consumed

    def take_arguments(self) -> str:
        out, self.arguments = self.arguments, ""
        return out

    def _open(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c != "{":
            return self._fail()
        self._state = self._first_key
        return True

    def _first_key(self, c: str) -> bool:
        if c == "}":
            self.done = True
            return True
        return self._next_key(c)

    def _next_key(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c != '"':
            return self._fail()
        self._value = JsonValue()
        self._state = self._in_key
        return self._value.feed(c)

    def _in_key(self, c: str) -> bool:
        if not self._value.feed(c):
            return self._fail()
        if self._value.done:
            self._key = json.loads(self._value.take())
            self._state = self._colon
        return True

    def _colon(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c != ":":
            return self._fail()
        # only the first "arguments" counts; a string value is the arguments' text itself
        self._value = JsonValue(text_string=self._arguments_key())
        self._state = self._in_value
        return True

    def _in_value(self, c: str) -> bool:
        value = self._value
        consumed = value.feed(c)
        if self._arguments_key():
            self.arguments += value.take()
        if value.failed:
            return self._fail()
        if not value.done:
            return True
        if self._key == "name" and self.name is None:
            name = json.loads(value.take())
            if not isinstance(name, str):
                return self._fail()
            self.name = name
        self.has_arguments |= self._key == "arguments"
        self._state = self._after
        return consumed or self._after(c)

    def _after(self, c: str) -> bool:
        if c in WHITESPACE:
            return True
        if c == ",":
            self._state = self._next_key
        elif c == "}":
            self.done = True
        else:
            return self._fail()
        return True

    def _arguments_key(self) -> bool:
        return self._key == "arguments" and not self.has_arguments

    def _fail(self) -> bool:
        self.failed = True
        return False


class ToolCallStream:
    """One choice's answer read as it comes (:meth:`feed`, then :meth:`finish`): each returns the :class:`Piece`
    its text decided. ``content`` and ``calls`` hold the whole message so far."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.content = ""
        self.calls: list[dict] = []
        self._ws = ""  # whitespace held: it stays only if content follows it
        self._tag = ""  # held: what may be the start of OPEN
        self._block: _Block | None = None  # the block being read, until it is a call or content
        self._skipped = ""  # the end of what a call's block left, watched for CLOSE
        self._piece = Piece()
        self._read = self._text

    def feed(self, text: str) -> Piece:
        for c in text:
            self._read(c)
        piece, self._piece = self._piece, Piece()
        return piece

    def finish(self) -> Piece:
        """The answer ended: what was held is decided (an unfinished block is content; so is whitespace at the
        end, unless the answer made calls)."""
        if self._read == self._in_block:
            self._say(self._block.raw)
        if self._read == self._text and self._tag:
            self._say(self._tag)
        if not self.calls:
            self._content(self._ws)
        self._ws = self._tag = ""
        return self.feed("")

    # ------------------------------------------------------------------ readers: one character each
    def _text(self, c: str) -> None:
        held = self._tag + c
        if held == OPEN:
            self._tag = ""
            self._block, self._read = _Block(), self._in_block
        elif OPEN.startswith(held):
            self._tag = held
        elif self._tag:  # not the tag after all, but c may begin one
            self._tag = ""
            self._say(held[:-1])
            self._text(c)
        elif c.isspace():  # what str.strip() strips
            self._ws += c
        else:
            self._say(c)

    def _in_block(self, c: str) -> None:
        block = self._block
        consumed = block.feed(c)
        if block.name in self.names:  # read just now, at its closing quote
            if self.calls and not self.parallel:
                self._read = self._skip
                return
            self._call(block.name)
            self._arguments(block.take_arguments())
            self._read = self._call_body
            return
        if block.name is None and not (block.done or block.failed):
            return
        self._say(block.raw)  # not a call
        self._read = self._text
        if not consumed:
            self._text(c)

    def _call_body(self, c: str) -> None:
        block = self._block
        consumed = block.feed(c)
        self._arguments(block.take_arguments())
        if not (block.done or block.failed):
            return
        if block.done and not block.has_arguments:
            self._arguments("{}")
        self._read = self._skip
        if not consumed:
            self._skip(c)

    def _skip(self, c: str) -> None:
        """In a call's block after its JSON (or a dropped call's block): nothing is content up to CLOSE."""
        self._skipped = (self._skipped + c)[-len(CLOSE):]
        if self._skipped == CLOSE:
            self._skipped = ""
            self._read = self._text

    # ------------------------------------------------------------------ what goes out
    def _say(self, text: str) -> None:
        """Content, after the whitespace held before it (dropped where it would lead the content after a call)."""
        lead = self._ws if self.content or not self.calls else ""
        self._ws = ""
        self._content(lead + text)

    def _content(self, text: str) -> None:
        self.content += text
        self._piece.content += text

    def _call(self, name: str) -> None:
        call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        self._piece.calls.append({"index": len(self.calls) - 1, **call, "function": dict(call["function"])})

    def _arguments(self, text: str) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        self.calls[index]["function"]["arguments"] += text
        last = self._piece.calls[-1] if self._piece.calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self._piece.calls.append({"index": index, "function": {"arguments": text}})
