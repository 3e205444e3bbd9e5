"""Build the offline lm-eval tasks in evals/tasks/data from the shipped corpus (deterministic; output committed).

Source text: held-out prose of The Jargon File 4.4.7 (public domain; modeswitch/data, see
scripts/make_corpus.py). Held-out paragraphs never calibrate the GPTQ checkpoint.

* jargon_cloze (multiple_choice): 20-60 words of a held-out paragraph, then the true next word against 3
  distractors of nearly the same corpus frequency (a LAMBADA-like cloze; chance = 25 %).
* jargon_ppl (loglikelihood_rolling): held-out paragraphs; word/byte perplexity and bits per byte.
* jargon_copy (generate_until): a short list of corpus words, then the list again with its last word
  missing; exact match on that word. It tests in-context copying, which quantization can break.

    python evals/build_tasks.py
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.weights.corpus import calibration_paragraphs, heldout_paragraphs  # noqa: E402

OUT = Path(__file__).resolve().parent / "tasks" / "data"
WORD = re.compile(r"^[a-z]{3,}$")


def words(text: str) -> list[str]:
    return text.split()


def cloze(rng: random.Random, vocab_by_rank: list[str], rank: dict[str, int], n: int) -> list[dict]:
    items = []
    paragraphs = [p for p in heldout_paragraphs() if len(words(p)) > 40]
    while len(items) < n:
        ws = words(rng.choice(paragraphs))
        k = rng.randint(20, min(60, len(ws) - 1))
        answer = ws[k]
        if not WORD.match(answer) or answer not in rank or rank[answer] < 20:  # skip function words / rare
            continue
        r = rank[answer]
        pool = [w for w in vocab_by_rank[max(0, r - 40): r + 40] if w != answer and WORD.match(w)]
        if len(pool) < 3:
            continue
        choices = rng.sample(pool, 3) + [answer]
        rng.shuffle(choices)
        items.append({"context": " ".join(ws[:k]), "choices": choices, "gold": choices.index(answer)})
    return items


def copy_items(rng: random.Random, vocab: list[str], n: int) -> list[dict]:
    items = []
    for _ in range(n):
        ws = rng.sample(vocab, 5)
        items.append({"prompt": f"Words: {' '.join(ws)}.\nThe same words again: {' '.join(ws[:-1])}",
                      "answer": ws[-1]})
    return items


def main() -> None:
    rng = random.Random(1234)
    counts = Counter(w for p in calibration_paragraphs() for w in words(p.lower()) if WORD.match(w))
    vocab_by_rank = [w for w, _ in counts.most_common()]
    rank = {w: i for i, w in enumerate(vocab_by_rank)}
    common = [w for w in vocab_by_rank[100:1100]]
    OUT.mkdir(parents=True, exist_ok=True)
    datasets = {
        "jargon_cloze.jsonl": cloze(rng, vocab_by_rank, rank, 400),
        "jargon_ppl.jsonl": [{"text": p} for p in heldout_paragraphs()[:60]],
        "jargon_copy.jsonl": copy_items(rng, common, 100),
    }
    for name, rows in datasets.items():
        with open(OUT / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{name}: {len(rows)} items")


if __name__ == "__main__":
    main()
