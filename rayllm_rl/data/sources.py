"""Load a `datasets.Dataset` from a local file, a `save_to_disk` folder or a hub dataset (with a config).

Loaded once, on the driver: env workers get rows from the collector, never a path.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from rayllm_rl.hub import hub_offline

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}

RowCheck = Callable[[Mapping[str, Any]], None]
"""A task's own check of one row: raises ValueError saying what is wrong (the caller adds where)."""

_JSON_WS = re.compile(r"[ \t\n\r]*")


class DatasetSourceError(ValueError):
    """A data source that names no loadable dataset: a wrong hub id, a missing or ambiguous config,
    a missing split, an offline cache miss. The message names the config field, the id and what was
    looked for."""


def load_rows(source: str, split: str = "train", *, required: Sequence[str] = (),
              check_row: RowCheck | None = None, default_config: str | None = None, field: str = "data.path"):
    """The rows of `source` as a `datasets.Dataset`, every row checked before it is returned.

    `source` is a local file (.jsonl/.json/.parquet/.arrow/.csv), a folder written by
    `Dataset.save_to_disk` (or a DatasetDict folder, then `split` picks), a folder of such files,
    or a hub dataset `name[:config[:split]]` ("openai/gsm8k", "openai/gsm8k:main",
    "openai/gsm8k:main:test"; a split there overrides `split`). With no config given, a dataset
    with several configs uses `default_config` (the task's, e.g. "main" for GSM8K) if it has it,
    else DatasetSourceError lists the configs. A hub dataset loads through the `datasets` cache
    (HF_HOME / HF_DATASETS_CACHE; offline with HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1). A
    missing local path raises FileNotFoundError naming it; `field` ("data.path") names the setting.

    A .jsonl/.json file is read line by line first (`check_json_file`), so a line that is not
    JSON, not an object, lacks a `required` field or fails `check_row` raises ValueError naming
    the file and its 1-based line. Other sources are checked row by row once loaded
    (`check_fields`). A source without rows raises ValueError.
    """
    import datasets

    if not isinstance(source, (str, os.PathLike)):  # rows given in Python: the same checks as a file's
        dataset = dataset_of(source, field)
        check_fields(dataset, required, field, check_row)
        return dataset
    if not source:
        raise ValueError(f"{field} is empty: give a local .jsonl/.parquet/.arrow/.csv file or a dataset name")
    path = Path(os.path.expanduser(source))
    checked = False
    kind = source_kind(source)
    if kind == "file":
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{source}: unknown file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}")
        if builder == "json":
            check_json_file(path, required, check_row)
            checked = True
        dataset = _load_file(builder, path)
    elif kind == "disk":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict) and split not in ds:
            raise DatasetSourceError(f"{field}={source!r}: no split {split!r}; splits: {sorted(ds)}")
        dataset = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        name, config, split = parse_source(source, split)
        local = Path(os.path.expanduser(name))
        if kind == "folder":  # a folder of data files, or laid out as a hub dataset repo (README configs)
            for part in sorted(local.rglob("*.jsonl")):  # syntax only: the split's fields are checked below
                check_json_file(part)
            dataset = _load_named(str(local), config, split, default_config, source, field)
        elif kind == "missing":
            raise FileNotFoundError(f"data file {source!r} does not exist")
        else:
            dataset = _load_named(name, config, split, default_config, source, field)
    if len(dataset) == 0:
        raise ValueError(f"{source}: no rows (split {split!r}); a task needs at least one prompt row")
    if not checked:
        check_fields(dataset, required, source, check_row)
    return dataset


def dataset_of(rows: Any, field: str):
    """`rows` given in Python as a `datasets.Dataset`: one as it is, a list of dicts made one (`from_list`);
    ValueError naming `field` for a DatasetDict (which split?), a streaming dataset, an empty list or an item
    that is not a dict."""
    import datasets

    if isinstance(rows, datasets.Dataset):
        dataset = rows
    elif isinstance(rows, datasets.DatasetDict):
        raise ValueError(f"{field} is a DatasetDict with splits {sorted(rows)}: pass one split, e.g. "
                         f"{field}=ds[{sorted(rows)[0]!r}]")
    elif isinstance(rows, (list, tuple)):
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
        if bad is not None:
            raise ValueError(f"{field}[{bad}] is {type(rows[bad]).__name__} {_short(rows[bad])}: expected a dict of "
                             "columns per row")
        dataset = datasets.Dataset.from_list([dict(r) for r in rows]) if rows else None
    else:
        raise ValueError(f"{field} is a {type(rows).__name__}: expected a datasets.Dataset or a list of dicts "
                         "(a streaming dataset: materialize it, e.g. Dataset.from_list(list(stream)))")
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"{field}: no rows; a task needs at least one prompt row")
    return dataset


def first_row(source: str, split: str = "train") -> dict[str, Any] | None:
    """The first row of a local source, read without loading the rest (for the dry run): a JSON/JSONL file's
    first object, a parquet file's first row, a csv file's first row as `datasets` types it (pandas), an arrow
    file's or a `save_to_disk` folder's (memory-mapped); None for a folder of files or a hub dataset."""
    kind = source_kind(source)
    path = Path(os.path.expanduser(source))
    if kind == "file":
        suffix = path.suffix.lower()
        if FILE_BUILDERS.get(suffix) == "json":
            return next((row for _, row in _json_rows(path)), None)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            rows = parquet.read_row_group(0).slice(0, 1).to_pylist() if parquet.num_row_groups else []
            return rows[0] if rows else None
        if suffix == ".csv":
            import pandas

            frame = pandas.read_csv(path, nrows=1)  # typed as the `datasets` csv reader (pandas) types it
            if not len(frame):
                return None
            return {k: (v.item() if hasattr(v, "item") else v) for k, v in frame.iloc[0].to_dict().items()}
        if suffix == ".arrow":
            import datasets

            dataset = datasets.Dataset.from_file(str(path))
            return dataset[0] if len(dataset) else None
    if kind == "disk":
        import datasets

        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) and split in ds else ds
        return ds[0] if isinstance(ds, datasets.Dataset) and len(ds) else None
    return None


def json_file_rows(source: str) -> Iterator[Any] | None:
    """Every row of a local .jsonl/.json file, one at a time (nothing cached); None for any other source."""
    path = Path(os.path.expanduser(source))
    if source_kind(source) != "file" or FILE_BUILDERS.get(path.suffix.lower()) != "json":
        return None
    return (row for _, row in _json_rows(path))


def source_kind(source: str) -> str:
    """How `load_rows` reads `source`: "file" (a local file), "disk" (a `save_to_disk` folder), "folder"
    (a local folder of data files, `folder[:config[:split]]`), "hub" (a hub dataset id), or "missing"
    (it names a local path, by a leading ./, / or ~, a data-file suffix or several slashes, that does not exist)."""
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return "file"
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return "disk"
    name = parse_source(source, "")[0]
    if Path(os.path.expanduser(name)).is_dir():
        return "folder"
    if source.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS or name.count("/") > 1:
        return "missing"
    return "hub"


def parse_source(source: str, split: str) -> tuple[str, str | None, str]:
    """`name[:config[:split]]` -> (name, config or None, split); a split in `source` overrides `split`."""
    name, config, given = (source.split(":") + ["", ""])[:3] if ":" in source else (source, "", "")
    return name, config or None, given or split


EVAL_SPLIT = "test"
"""The split `data.eval_path` reads when it names none (a hub dataset, a DatasetDict folder): evaluating
on `data.split` ("train") would score the policy on rows it trains on."""


def source_identity(source: str, split: str, dataset) -> tuple[str, str | None, str | None]:
    """(where, config, split) of `dataset`, loaded by `load_rows(source, split)`: two sources with the same
    identity hold the same rows. `where` is a resolved local path or the hub id; config and split are
    None where the source has none (a single file, a plain `save_to_disk` Dataset)."""
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return str(path.resolve()), None, None
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return str(path.resolve()), None, split if (path / "dataset_dict.json").exists() else None
    name, _, split = parse_source(source, split)
    local = Path(os.path.expanduser(name))
    return (str(local.resolve()) if local.is_dir() else name), dataset.info.config_name, split


def datasets_cache_dir() -> str:
    """Where `datasets` keeps prepared datasets: HF_DATASETS_CACHE, else $HF_HOME/datasets (read now)."""
    from rayllm_rl.hub import hf_home

    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    return os.path.join(hf_home(), "datasets")


def datasets_offline() -> bool:
    """True when `datasets` will not reach the hub: HF_DATASETS_OFFLINE or HF_HUB_OFFLINE set (now or at import)."""
    import datasets

    explicit = os.environ.get("HF_DATASETS_OFFLINE")
    if explicit is not None:
        return explicit.strip().upper() in {"1", "ON", "YES", "TRUE"} or bool(datasets.config.HF_HUB_OFFLINE)
    return hub_offline() or bool(datasets.config.HF_HUB_OFFLINE)


def _cache_folder(name: str) -> str:
    """`<datasets cache>/<namespace>___<name>`: where `load_dataset(name, ...)` prepares a hub dataset."""
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return os.path.join(datasets_cache_dir(), "___".join(parts))


def cached_configs(name: str) -> list[str]:
    """The configs of hub dataset `name` prepared in the local `datasets` cache (what offline can load)."""
    found = set()
    for info in glob.glob(os.path.join(_cache_folder(name), "*", "*", "*", "dataset_info.json")):
        found.add(Path(info).parts[-4])
    return sorted(found)


def cached_splits(name: str, config: str) -> list[str]:
    """The splits of hub dataset `name`, config `config`, prepared in the local `datasets` cache."""
    found: set[str] = set()
    for info in glob.glob(os.path.join(_cache_folder(name), config, "*", "*", "dataset_info.json")):
        try:
            with open(info) as f:
                found.update(json.load(f).get("splits") or {})
        except (OSError, ValueError):
            continue
    return sorted(found)


def dataset_configs(name: str) -> list[str]:
    """The configs of dataset `name` (a hub id or a local dataset folder): from the hub (or the folder's
    README) when reachable, else those in the local `datasets` cache; [] when none can be found."""
    import datasets

    if not os.path.isdir(name) and datasets_offline():
        return cached_configs(name)
    try:
        return list(datasets.get_dataset_config_names(name))
    except Exception:  # noqa: BLE001 - unreachable hub, unknown id: what the cache holds is all we know
        return cached_configs(name)


def _load_named(name: str, config: str | None, split: str, default_config: str | None, source: str, field: str):
    """`datasets.load_dataset(name, config, split)` for a hub id or a local dataset folder, the config
    chosen as `load_rows` says; every failure becomes a DatasetSourceError naming `field` and `name`."""
    import datasets

    configs = dataset_configs(name)
    where = (f"{field}={source!r}" if os.path.isdir(name) else
             f"{field}={source!r} (hub dataset {name!r}; datasets cache {_cache_folder(name)}; "
             f"offline mode {'on' if datasets_offline() else 'off'})")
    known = "" if os.path.isdir(name) or not datasets_offline() else " (those in the local datasets cache)"
    if config is None and len(configs) > 1:
        if default_config not in configs:
            raise DatasetSourceError(
                f"{where}: the dataset has several configs {configs}{known} and none was given; name one, e.g. "
                f"{field}={name}:{configs[0]}")
        config = default_config
        logging.getLogger(__name__).info("%s: no config given, using the task's default config %r", field, config)
    if config is not None and configs and config not in configs:
        raise DatasetSourceError(f"{where}: no config {config!r}; configs: {configs}{known}")
    try:
        return datasets.load_dataset(name, config, split=split, cache_dir=datasets_cache_dir())
    except ValueError as err:  # several configs, an unknown split, a config missing from the cache
        raise DatasetSourceError(f"{where}, config {config!r}, split {split!r}: {err}") from err
    except OSError as err:  # offline miss, unreachable hub, wrong id (DatasetNotFoundError), no data files
        raise DatasetSourceError(f"{where}, config {config!r}, split {split!r}: cannot load it "
                                 f"({type(err).__name__}: {err})") from err


def _load_file(builder: str, path: Path):
    """`datasets.load_dataset(builder)` on one file; a reader failure becomes a ValueError naming the file."""
    import datasets

    if _has_no_rows(builder, path):
        raise ValueError(f"{path}: the file is empty (no rows); a task needs at least one prompt row")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - the readers raise many types; the cause stays chained
        cause = f"; caused by {type(err.__cause__).__name__}: {err.__cause__}" if err.__cause__ else ""
        hint = _first_type_clash(path) if builder == "json" else ""
        raise ValueError(f"{path}: could not be read as a {builder} file ({type(err).__name__}: {err}{cause})"
                         + (f"; {hint}" if hint else "")) from err


def _first_type_clash(path: Path) -> str:
    """'field F is a <kind> on line A but a <kind> on line B' for the first field of a JSON file whose
    values change type (nulls aside), a frequent reason the `datasets` JSON reader fails; else ""."""
    seen: dict[str, tuple[str, int]] = {}
    for lineno, row in _json_rows(path):
        for field, value in row.items():
            if value is None:
                continue
            kind, first = seen.setdefault(field, (_json_kind(value), lineno))
            if kind != _json_kind(value):
                return (f"field {field!r} is {kind} on line {first} but {_json_kind(value)} on line {lineno}; "
                        "give each field one type")
    return ""


def _has_no_rows(builder: str, path: Path) -> bool:
    """A parquet file with 0 rows, or a csv file with at most a header (`datasets` fails obscurely on both)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # noqa: BLE001 - not parquet at all: `_load_file` reports the reader's error
            return False
    if builder == "csv":
        with open(path, "rb") as f:
            rows = (line for line in f if line.strip())
            return next(rows, None) is None or next(rows, None) is None
    return False


def check_json_file(path: str | os.PathLike, required: Sequence[str] = (), check_row: RowCheck | None = None) -> int:
    """Check a .jsonl/.json file row by row before `datasets` reads it; the number of rows.

    The file is JSON Lines (one JSON object per line, blank lines skipped) or, for a .json file
    whose text starts with "[", one JSON array of objects. ValueError names the file and the
    1-based line of the first line that is not valid UTF-8 or JSON, is not an object, lacks a
    `required` field (or has it null or blank) or fails `check_row`, and of an empty file.
    """
    path = Path(path)
    count = 0
    for lineno, row in _json_rows(path):
        check_row_fields(row, required, check_row, f"{path}, line {lineno}")
        count += 1
    if count == 0:
        raise ValueError(f"{path}: the file is empty (no rows); expected JSON objects, one per line")
    return count


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, value) per row: a .json file holding one array item by item, else JSON Lines."""
    if path.suffix.lower() == ".json" and _starts_with_array(path):
        return _json_array_rows(path)
    return _json_lines_rows(path)


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _json_lines_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, parsed value) for each non-blank line; ValueError for bad UTF-8 or JSON."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from err
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                                 "each line must be one JSON object") from err


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line where the item starts, item) for each item of a file holding one JSON array."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from err
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from err
    decoder, pos, line = json.JSONDecoder(), _JSON_WS.match(text, text.index("[") + 1).end(), 1
    line += text.count("\n", 0, pos)
    for item in items:  # the text is valid JSON here, so this walk over its items cannot fail
        yield line, item
        _, end = decoder.raw_decode(text, pos)
        after = _JSON_WS.match(text, end).end() + 1  # past the "," (or the closing "]")
        nxt = _JSON_WS.match(text, after).end()
        line += text.count("\n", pos, nxt)
        pos = nxt


def check_row_fields(row: Any, required: Sequence[str], check_row: RowCheck | None, where: str) -> None:
    """Raise ValueError prefixed by `where` if `row` is not a mapping, lacks a required field (or
    has it null or blank) or fails `check_row`."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object with fields {list(required)}, got {_json_kind(row)} "
                         f"{_short(row)}")
    for field in required:
        if field not in row:
            raise ValueError(f"{where}: missing required field {field!r} (required: {list(required)}; "
                             f"present: {sorted(row)})")
        value = row[field]
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{where}: required field {field!r} is empty ({_short(value)})")
    if check_row is not None:
        try:
            check_row(row)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err


def _json_kind(value: Any) -> str:
    """'a JSON object', 'a JSON number', ... for a parsed JSON value."""
    names = {dict: "a JSON object", list: "a JSON array", str: "a JSON string", bool: "a JSON boolean",
             type(None): "JSON null"}
    return names.get(type(value), "a JSON number" if isinstance(value, (int, float)) else type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_fields(dataset, required: Sequence[str], source: str, check_row: RowCheck | None = None) -> None:
    """Raise ValueError naming `source` and the first (1-based) row that lacks a required field,
    has it empty, or fails `check_row`."""
    missing = [f for f in required if f not in dataset.column_names]
    if missing:
        raise ValueError(f"{source}: rows have no field(s) {missing}; fields present: {dataset.column_names}")
    if check_row is None and not required:
        return
    rows = dataset if check_row is not None else dataset.select_columns(list(required))
    for i, row in enumerate(rows):
        check_row_fields(row, required, check_row, f"{source}, row {i + 1}")


def split_held_out(dataset, eval_size: int, seed: int = 0, eval_source=None):
    """(train, eval): `eval_size` rows of `eval_source` if given (a seeded sample when it has more; 0 =
    none), else `eval_size` rows held out of `dataset` by a seeded shuffle.

    A small file with fewer rows than `eval_size` keeps a fifth of them for evaluation (logged)."""
    if eval_source is not None:
        if eval_size >= len(eval_source):
            return dataset, eval_source
        return dataset, eval_source.shuffle(seed=seed).select(range(eval_size))
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
