"""A changing workload: one trace of phases, each with its own concurrency and kind of request.

* ``lull``: one client; half of the requests answer by copying their prompt (repeat a list, rename a function
  in code and return the code, rewrite a paragraph correcting its spelling), half write free prose. Copying is
  where drafting from the prompt's own n-grams pays most.
* ``burst``: many clients, prose windows of the corpus continued (plain completions).
* ``shared_prefix``: a few clients asking questions about one shared document (chat).
* ``lull2``: a lull again, with other prompts.

Prompts are token ids (chat prompts through the model's own chat template), so every server gets exactly the
same tokens. Each ``run`` draws other text, so no run finds an earlier run's prompts in a prefix cache. A ``salt``
opens every prompt of a run with a marker of its own: the same text behind another opening, of which a server
that has served the run unsalted (or with another salt) finds in its prefix cache at most the few tokens before
the marker (a chat template's header; a prefix cache matches from a prompt's first token): a server pinned to
each mode in turn runs the adaptive run's own text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..weights.corpus import paragraphs
from .workloads import Slot, TextSource

#: free-prose topics of the lulls
TOPICS = ("a lighthouse keeper", "the history of the bicycle", "a robot learning to paint", "autumn in a small town",
          "how bread is made", "a journey across a desert", "the first day at a new school", "a lost umbrella",
          "the life of a honeybee", "a city under the sea", "why people keep diaries", "a storm at night")
NAMES = ("count", "total", "items", "value", "index", "result", "buffer", "limit", "offset", "record", "price",
         "name", "score", "width", "height", "weight")
QUESTIONS = ("What is this text about?", "Who is mentioned in the text?", "Summarize the text in one sentence.",
             "What is the main idea?", "Which words in the text are jargon?", "What happened first?",
             "Give a title for this text.", "What is the tone of the text?")


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    slots: tuple[Slot, ...]


def _sentences(rng: random.Random, count: int, words: tuple[int, int]) -> list[str]:
    pool = [s.strip() for p in paragraphs() for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= words[1]]
    return [" ".join(rng.choice(pool).split()[:rng.randint(*words)]).rstrip(",;:") for _ in range(count)]


def _code(rng: random.Random, function: str) -> str:
    a, b, c = rng.sample(NAMES, 3)
    return (f"def {function}({a}, {b}):\n    {c} = 0\n    for i in range({a}):\n        {c} += {b} * i\n"
            f"        if {c} > {rng.randint(10, 99)}:\n            {c} -= {a}\n    return {c}\n\n\n"
            f"def main():\n    {a} = {rng.randint(2, 9)}\n    {b} = {rng.randint(2, 9)}\n"
            f"    print({function}({a}, {b}))\n")


def copy_prompt(rng: random.Random, kind: int) -> str:
    """A request whose answer quotes or edits its prompt (``kind``: 0 a list, 1 code, 2 a paragraph)."""
    if kind == 0:
        items = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(_sentences(rng, 12, (4, 7))))
        return f"Repeat this list exactly, one item per line, and add nothing:\n\n{items}"
    if kind == 1:
        old, new = rng.sample(("compute", "accumulate", "run_total", "tally", "process", "combine"), 2)
        return (f"Rename the function `{old}` to `{new}` in this Python code and return the whole code:\n\n"
                f"```python\n{_code(rng, old)}```")
    text = " ".join(_sentences(rng, 4, (10, 16)))
    return f"Rewrite this paragraph exactly as it is, correcting any spelling mistakes:\n\n{text}"


def prose_prompt(rng: random.Random) -> str:
    return rng.choice(("Write a short story about {}.", "Write a few paragraphs about {}.",
                       "Describe {} in detail.")).format(rng.choice(TOPICS))


def chat_ids(tokenizer, text: str) -> list[int]:
    """A one-message chat as the server's chat endpoint would tokenize it."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def phases(tokenizer, run: int, lull: int = 6, burst: int = 24, burst_clients: int = 12, shared: int = 12,
           shared_clients: int = 4, lull_tokens: int = 48, burst_tokens: int = 48, burst_prompt: int = 256,
           shared_tokens: int = 32, document_tokens: int = 512, salt: int = 0) -> list[Phase]:
    """The four phases of run ``run`` (seeded: the same prompts for every server), every prompt opened by
    ``salt``'s marker where it is not 0 (a burst window keeps its length: its last tokens make room). The defaults
    are sized so that a trace of the demo model on a small CPU takes minutes, not hours."""
    rng = random.Random(run)
    take = TextSource(tokenizer).reader(run)
    marker = f"[{salt}] " if salt else ""
    opening = tokenizer.encode(marker, add_special_tokens=False) if salt else []
    index = 0

    def chat(text: str) -> list[int]:
        return chat_ids(tokenizer, marker + text)

    def slot(workload: str, ids: list[int], max_tokens: int) -> Slot:
        nonlocal index
        index += 1
        return Slot(index - 1, workload, ids, max_tokens)

    def lull_phase(name: str) -> Phase:
        slots = []
        for i in range(lull):
            copy = i % 2 == 0
            text = copy_prompt(rng, (i // 2) % 3) if copy else prose_prompt(rng)
            slots.append(slot(f"{name}:{'copy' if copy else 'prose'}", chat(text), lull_tokens))
        return Phase(name, 1, tuple(slots))

    first = lull_phase("lull")
    burst_phase = Phase("burst", burst_clients, tuple(
        slot("burst", (opening + take(burst_prompt))[:burst_prompt], burst_tokens) for _ in range(burst)))
    document = tokenizer.decode(take(document_tokens))
    shared_phase = Phase("shared_prefix", shared_clients, tuple(
        slot("shared_prefix", chat(f"Read this text:\n\n{document}\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}"),
             shared_tokens) for i in range(shared)))
    return [first, burst_phase, shared_phase, lull_phase("lull2")]
