"""Incremental detokenization: stop strings across token boundaries, multi-byte characters held back."""

from __future__ import annotations

import pytest

from modeswitch.weights.presets import prepare_demo_checkpoint
from modeswitch.serving.service import TextAssembler


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_demo_checkpoint())


def feed(tokenizer, text: str, stop=()) -> tuple[list[str], TextAssembler]:
    asm = TextAssembler(tokenizer, tuple(stop))
    pieces = []
    for tid in tokenizer(text).input_ids:  # one token at a time, as an engine streams them
        pieces.append(asm.add([tid]))
        if asm.stopped:
            break
    if not asm.stopped:
        pieces.append(asm.flush())
    return pieces, asm


def test_pieces_concatenate_to_the_decoded_text(tokenizer):
    text = "Héllo, wörld! Ünïcode — and emoji 🙂 survive streaming."
    pieces, asm = feed(tokenizer, text)
    assert "".join(pieces) == asm.text == tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer):
    pieces, asm = feed(tokenizer, "The answer is 42. END OF ANSWER and more text", stop=["END OF", "zzz"])
    assert asm.stopped
    assert "".join(pieces) == "The answer is 42. "
    assert not any("END" in p for p in pieces)
