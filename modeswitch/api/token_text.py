"""The text of each token a logprobs answer lists, as vLLM's server writes it.

A token is written as the tokenizer decodes it alone, except a byte-fallback token that ends inside a UTF-8
character (it decodes to text ending in U+FFFD): vLLM's server (``vllm/v1/engine/logprobs.py``,
``_correct_decoded_token``) decodes it after up to four of the tokens chosen before it in the same sequence and
writes the text it adds to them (the character it completes, with what the byte-fallback tokens before it left
unwritten), or ``""`` while the character is still incomplete. The chosen token and each alternative at a
position are read against the same tokens chosen before: a sequence's texts are read position by position, in
order, by one :class:`TokenTexts`, across the chunks of a stream.
"""

from __future__ import annotations

from typing import Callable, Iterable

REPLACEMENT = "\ufffd"
#: tokens chosen before a position that a token ending inside a character is decoded after: a UTF-8 character has
#: at most four bytes
CONTEXT = 4


class TokenTexts:
    """One sequence's token texts, read position by position (:meth:`position`)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        #: the tokens chosen at the last positions read, oldest first
        self.context: list[int] = []

    def position(self, chosen: int, alternatives: Iterable[int] = ()) -> dict[int, str]:
        """The texts of the token chosen at the next position and of its alternatives, by token id (the chosen token
        is most often among its alternatives: each token is decoded once)."""
        texts = {token: self._text(token) for token in dict.fromkeys((chosen, *alternatives))}
        self.context = [*self.context, chosen][-CONTEXT:]
        return texts

    def _text(self, token: int) -> str:
        text = self.decode([token])
        return self._completed(token) if text.endswith(REPLACEMENT) else text

    def _completed(self, token: int) -> str:
        """What ``token`` adds after the fewest tokens chosen before it that make a whole character, less the text
        of those among them that are whole themselves (a byte-fallback token before it wrote nothing of its own);
        ``""`` when no such context completes it."""
        for n in range(1, min(len(self.context), CONTEXT) + 1):
            context = self.context[-n:]
            full = self.decode([*context, token])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(context)
            while clean and self.decode([context[clean - 1]]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.decode(context[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0  # the tokenizer normalised the joined text: what follows the common start
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""
