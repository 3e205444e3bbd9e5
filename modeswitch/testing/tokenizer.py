"""A byte-level tokenizer with the slice of the transformers tokenizer API the server uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Encoding:
    input_ids: list[int]


class ByteTokenizer:
    """Token ``b`` is byte ``b``; three special tokens follow the 256 bytes. Multi-byte characters span
    several tokens, as with real BPE vocabularies, so incremental detokenization is exercised."""

    bos_token, eos_token, pad_token = "<s>", "</s>", "<pad>"
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + list(text.encode("utf-8"))

    def __call__(self, text: str) -> Encoding:
        return Encoding(self.encode(text))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for t in ids:
            if t < 256:
                pending.append(t)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append((self.bos_token, self.eos_token, self.pad_token)[t - 256])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True,
                            return_dict: bool = True) -> dict:
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("unknown role")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return {"input_ids": self.encode(text)}
