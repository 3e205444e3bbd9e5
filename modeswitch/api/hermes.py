"""Hermes tool calls read from an answer as it is generated: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

Streamed, a client sees the content at once and each call as it is written, in the delta shape of vLLM's Hermes
parser: a call's first delta carries its index, id, type and name, the next ones fragments of its arguments.
Only text that may still become a call is held back: a suffix that may be the start of ``<tool_call>``, and
whitespace, which is dropped where it touches a call. The whole answer is read the same way (:func:`tools.parse`
feeds it at once), so a stream adds up to the non-streamed message of the same answer. Decisions are final once
sent, which sets these rules:

* A block's JSON is read again whole as each piece of it comes, by ``partial_json_parser`` (as vLLM's tool
  parsers read a call being written), which completes it with the closers it lacks.
* A block is a call from the moment its ``name`` is complete and names an offered function (before that it is
  held). Its arguments (``{}`` when it has none) go out as ``json.dumps`` writes them, each part once it can no
  longer change: the closers the parser added are held back, and a number or literal counts only once what
  follows ends it. If its JSON breaks off (``max_tokens``, or text that is not JSON) the arguments stop at what
  was certain; the rest of the block, to ``</tool_call>``, is not content.
* A block that is not a call (not JSON before its name, no name, a function not offered, unfinished) is content,
  as written. So is everything outside the blocks; whitespace next to a call is dropped, except between two
  pieces of content, where it stays.
* Without ``parallel_tool_calls`` a block after the first call is dropped.

A forced call (:class:`ForcedCallStream`) has no tag: its grammar writes the call's JSON itself, read by the same
rules.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from string import ascii_letters, digits

from partial_json_parser import Allow, fix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_SPACE = " \t\n\r"
#: what may be read unfinished: strings and containers. A number or literal is read once complete, since its
#: text may still change (``1`` may become ``1.5``; ``0.00001`` is written ``1e-05``)
PARTIAL = Allow.STR | Allow.COLLECTION
_DECODER = json.JSONDecoder()
_ATOM = ascii_letters + digits + ".+-\\"  # what may go on writing a number, literal or escape


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


def _partial(text: str) -> tuple[dict, str] | None:
    """An unfinished JSON object as ``partial_json_parser`` completes it, and the closers it added; None when
    the text is not the start of one."""
    try:
        head, tail = fix(text, PARTIAL)
        value = json.loads(head + tail)
    except ValueError:
        return None
    return (value, tail) if isinstance(value, dict) else None


class _Block:
    """The JSON object of one block, as far as it has come. ``text``: the block's text after ``<tool_call>``;
    ``key``: the member the call's arguments are in (a forced ``required`` call's grammar names it ``parameters``)."""

    def __init__(self, key: str = "arguments") -> None:
        self.key = key
        self.text = ""
        self.value: dict = {}  # the object, completed
        self.tail = ""  # the closers the parser added to complete it: not written yet
        self.complete = False
        self.failed = False  # not JSON (from ``end`` on)
        self.end = 0  # where the JSON ended or broke, once it did

    def feed(self, text: str) -> None:
        self.text += text
        start = len(self.text) - len(self.text.lstrip(JSON_SPACE))
        if start == len(self.text):
            return
        if self.text[start] != "{":
            self.failed, self.end = True, start
            return
        try:
            self.value, self.end = _DECODER.raw_decode(self.text, start)
            self.tail, self.complete = "", True
            return
        except json.JSONDecodeError as error:
            # json reads the text up to its first fault, which is final unless the text ran out there, or in a
            # number, literal or escape that may still go on (partial_json_parser is lenient past some faults)
            read_to = len(self.text) if error.msg.startswith("Unterminated") else error.pos
        if read_to < len(self.text.rstrip(_ATOM)):  # broken: the JSON is what came before the fault
            self.failed, self.end = True, read_to
        read = _partial(self.text[start:read_to].rstrip("\\"))  # an escape counts once complete
        if read is not None:
            self.value, self.tail = read

    def _open_key(self) -> str | None:
        """The key whose value is being written (the closers beyond the object's own ``}`` are its)."""
        return next(reversed(self.value), None) if len(self.tail) > 1 else None

    @property
    def name(self):
        """The ``name`` once written whole (None before)."""
        return self.value.get("name") if self._open_key() != "name" else None

    def arguments(self) -> str:
        """The arguments as far as they can no longer change, as ``json.dumps`` writes them (a string: its
        text, as arguments given as a string are sent as that string)."""
        if self.key not in self.value:
            return "{}" if self.complete else ""
        arguments = self.value[self.key]
        held = len(self.tail) - 1 if self._open_key() == self.key else 0
        if isinstance(arguments, str):
            if held and "\ud800" <= arguments[-1:] <= "\udbff":  # half of a pair: the character may change
                arguments = arguments[:-1]
            return arguments
        text = json.dumps(arguments)
        return text[:len(text) - held]


class _Message:
    """What a reader of one choice's answer has decided: ``content`` and ``calls`` (the whole message so far), and
    the :class:`Piece` of it not sent yet."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[dict] = []
        self._piece = Piece()

    def _take(self) -> Piece:
        piece, self._piece = self._piece, Piece()
        return piece

    def _content(self, text: str) -> None:
        self.content += text
        self._piece.content += text

    def _call(self, name: str) -> None:
        call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        self._piece.calls.append({"index": len(self.calls) - 1, **call, "function": dict(call["function"])})

    def _arguments(self, certain: str) -> None:
        """The last call's arguments as far as they are certain: what is new of them goes out."""
        index = len(self.calls) - 1
        sent = self.calls[index]["function"]["arguments"]
        if len(certain) <= len(sent) or not certain.startswith(sent):  # nothing new (or a key written twice)
            return
        text = certain[len(sent):]
        self.calls[index]["function"]["arguments"] = certain
        last = self._piece.calls[-1] if self._piece.calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self._piece.calls.append({"index": index, "function": {"arguments": text}})


class ToolCallStream(_Message):
    """One choice's answer read as it comes (:meth:`feed`, then :meth:`finish`): each returns the :class:`Piece`
    its text decided. ``content`` and ``calls`` hold the whole message so far."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        super().__init__()
        self.names, self.parallel = names, parallel
        self._ws = ""  # whitespace held: it stays only if content follows it
        self._tag = ""  # held: what may be the start of OPEN
        self._block = _Block()  # the block being read
        self._dropped = False  # the block is a call, dropped (not parallel)
        self._skipped = ""  # the end of what a call's block left, watched for CLOSE
        self._read = self._text  # reads what it can of a text, returns the rest

    def feed(self, text: str) -> Piece:
        while text:
            text = self._read(text)
        return self._take()

    def finish(self) -> Piece:
        """The answer ended: what was held is decided (an unfinished block is content; so is whitespace at the
        end, unless the answer made calls)."""
        if self._read == self._in_block:
            self._say(OPEN + self._block.text)
        if self._read == self._text and self._tag:
            self._say(self._tag)
        if not self.calls:
            self._content(self._ws)
        self._ws = self._tag = ""
        return self.feed("")

    # ------------------------------------------------------------------ readers: each returns what it left
    def _text(self, text: str) -> str:
        for i, c in enumerate(text):
            if self._char(c):
                self._block, self._read = _Block(), self._in_block
                return text[i + 1:]
        return ""

    def _char(self, c: str) -> bool:
        """One character of text; True when it completes OPEN."""
        held = self._tag + c
        if held == OPEN:
            self._tag = ""
            return True
        if OPEN.startswith(held):
            self._tag = held
        elif self._tag:  # not the tag after all, but c may begin one
            self._tag = ""
            self._say(held[:-1])
            return self._char(c)
        elif c.isspace():  # what str.strip() strips
            self._ws += c
        else:
            self._say(c)
        return False

    def _in_block(self, text: str) -> str:
        block = self._block
        block.feed(text)
        name = block.name
        if isinstance(name, str) and name in self.names:
            self._dropped = bool(self.calls) and not self.parallel
            if not self._dropped:
                self._call(name)
            self._read = self._call_body
            return self._call_body("")
        if name is None and not (block.complete or block.failed):
            return ""
        self._say(OPEN)  # not a call: content, its text read again as text
        self._read = self._text
        return block.text

    def _call_body(self, text: str) -> str:
        block = self._block
        if text:
            block.feed(text)
        if not self._dropped:
            self._arguments(block.arguments())
        if not (block.complete or block.failed):
            return ""
        self._read = self._skip
        return block.text[block.end:]

    def _skip(self, text: str) -> str:
        """In a call's block after its JSON: nothing is content up to CLOSE."""
        seen = self._skipped + text
        at = seen.find(CLOSE)
        if at < 0:
            self._skipped = seen[-len(CLOSE) + 1:]
            return ""
        self._skipped, self._read = "", self._text
        return seen[at + len(CLOSE):]

    # ------------------------------------------------------------------ what goes out
    def _say(self, text: str) -> None:
        """Content, after the whitespace held before it (dropped where it would lead the content after a call)."""
        lead = self._ws if self.content or not self.calls else ""
        self._ws = ""
        self._content(lead + text)


class ForcedCallStream(_Message):
    """A forced call's answer read as it comes, like :class:`ToolCallStream`'s (``feed``, ``finish``, ``content``,
    ``calls``). Its grammar holds it to JSON of the call's shape, with no tag around it: for a named function
    (``name``) the arguments object itself, the call known before the first token; for ``required`` (``name``
    None) an array of ``{"name", "parameters"}`` objects, each a call once its name is written. Arguments go out
    as the :class:`ToolCallStream` rules say, as far as they are certain (a named call's first piece is the call,
    before any text). A ``required`` answer that made no call (cut before its first name) is content, as
    written."""

    def __init__(self, name: str | None) -> None:
        super().__init__()
        self.name = name
        self.text = ""
        self._block: _Block | None = None  # the call being read
        self._named = False  # the block's call was sent
        self._broken = False  # required: the array broke off; nothing more is read
        if name is not None:  # the arguments, read as a block that named its function already
            self._block, self._named = _Block(), True
            self._block.feed(json.dumps({"name": name})[:-1] + ', "arguments": ')
            self._call(name)

    def feed(self, text: str) -> Piece:
        self.text += text
        if self.name is not None:
            self._block.feed(text)
            self._arguments(self._block.arguments())
            return self._take()
        while text and not self._broken:
            text = self._element(text) if self._block is not None else self._between(text)
        return self._take()

    def finish(self) -> Piece:
        if not self.calls:
            self._content(self.text)
        return self._take()

    def _between(self, text: str) -> str:
        """Outside the array's objects: its ``[``, commas, whitespace and ``]`` say nothing; an object starts a
        call's block."""
        rest = text.lstrip(JSON_SPACE + "[,]")
        if rest[:1] == "{":
            self._block, self._named = _Block("parameters"), False
            return rest
        self._broken = bool(rest)
        return ""

    def _element(self, text: str) -> str:
        block = self._block
        block.feed(text)
        if not self._named and isinstance(block.name, str):
            self._call(block.name)
            self._named = True
        if self._named:
            self._arguments(block.arguments())
        if not (block.complete or block.failed):
            return ""
        self._block, self._broken = None, block.failed
        return block.text[block.end:]
