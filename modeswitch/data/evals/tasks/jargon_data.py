"""Datasets of the jargon tasks, located next to this file (lm-eval's ``!function`` imports it by path).

Loading through this module instead of ``dataset_kwargs.data_files`` keeps the tasks independent of the
working directory: lm-eval and ``datasets`` resolve relative data paths against the current directory, and
the tasks ship inside the installed package.
"""

from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(DATA / f"{name}.jsonl")})


def jargon_cloze(**kwargs) -> datasets.DatasetDict:
    return _load("jargon_cloze")


def jargon_copy(**kwargs) -> datasets.DatasetDict:
    return _load("jargon_copy")


def jargon_ppl(**kwargs) -> datasets.DatasetDict:
    return _load("jargon_ppl")
