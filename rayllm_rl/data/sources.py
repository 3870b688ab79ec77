"""Load a `datasets.Dataset` from a local file, a `save_to_disk` folder or a hub name."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Sequence

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def load_rows(source: str, split: str = "train"):
    """The rows of `source` as a `datasets.Dataset`.

    `source` is a local file (.jsonl/.json/.parquet/.arrow/.csv), a folder written by
    `Dataset.save_to_disk` (or a DatasetDict folder, then `split` picks), a folder of such files,
    or a hub dataset name ("openai/gsm8k", "openai/gsm8k:main" for a config) when a hub is
    reachable. A missing local path raises FileNotFoundError naming it.
    """
    import datasets

    if not source:
        raise ValueError("data.path is empty: give a local .jsonl/.parquet/.arrow/.csv file or a dataset name")
    path = Path(os.path.expanduser(source))
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{source}: unknown file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(path))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(str(path), split=split)
    if source.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS:
        raise FileNotFoundError(f"data file {source!r} does not exist")
    name, _, config = source.partition(":")
    return datasets.load_dataset(name, config or None, split=split)


def check_fields(dataset, required: Sequence[str], source: str) -> None:
    """Raise ValueError naming the first row that lacks (or has an empty) required field."""
    missing = [f for f in required if f not in dataset.column_names]
    if missing:
        raise ValueError(f"{source}: rows have no field(s) {missing}; fields present: {dataset.column_names}")
    for i, row in enumerate(dataset.select_columns(list(required))):
        for f in required:
            if row[f] is None or (isinstance(row[f], str) and not row[f].strip()):
                raise ValueError(f"{source}: row {i} has an empty {f!r} field")


def split_held_out(dataset, eval_size: int, seed: int = 0, eval_source=None):
    """(train, eval): `eval_source` if given, else `eval_size` rows held out by a seeded shuffle.

    A small file with fewer rows than `eval_size` keeps a fifth of them for evaluation (logged)."""
    if eval_source is not None:
        return dataset, eval_source
    if eval_size <= 0:
        return dataset, dataset.select([])
    if eval_size >= len(dataset):
        if len(dataset) < 2:
            raise ValueError(f"data.eval_size={eval_size} leaves no training rows out of {len(dataset)}")
        capped = max(1, len(dataset) // 5)
        logging.getLogger(__name__).warning(
            "data.eval_size=%d is not below the %d rows of the dataset; holding out %d rows instead",
            eval_size, len(dataset), capped)
        eval_size = capped
    parts = dataset.train_test_split(test_size=eval_size, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def add_messages(dataset, make_messages: Callable[[dict], list[dict]]):
    """A copy of `dataset` with a `messages` column built per row (the prompt chat)."""
    return dataset.map(lambda row: {"messages": make_messages(row)})
