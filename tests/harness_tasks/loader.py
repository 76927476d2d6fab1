"""lm-eval `custom_dataset` loaders for the tasks of this folder: each reads the JSONL next to this
file, so the tasks load from any working directory (a `dataset_kwargs.data_files` path is read
relative to the current directory), and no dataset is cached. A task YAML names one with
`custom_dataset: !function loader.<name>`; lm-eval calls it with the task's metadata."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _split(name: str):
    import datasets

    with (HERE / name).open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def facts_mc(**kwargs):
    return _split("facts_mc.jsonl")


def facts_gen(**kwargs):
    return _split("facts_gen.jsonl")
