"""Where documents come from, and which of them are held out.

pycode: the running Python's standard-library sources, sorted, without site-packages; the
last data.val_files are held out and training reads the first data.max_files of the others.
hf: any `datasets` dataset (hub or local files); the held-out documents are data.val_split,
or the last data.val_fraction of the training split's (non-empty) documents,
round(fraction * documents) and at least one. synthetic: eval_batches global batches of
tokens drawn with another seed (framework/data/tokens.py). The training stream leaves the
held-out documents out whether or not evaluation is on, so turning it on never changes training.

Documents are read through `datasets` into its Arrow cache (a memory-mapped file) and handed
on in batches (`Documents.batches`): a corpus is never a Python list. `sources` describes what
a part is read from, for the cache's metadata (framework/data/cache.py).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from framework.config import ConfigError, DataConfig
from framework.validate import check_text_field, first_line, local_data_files


def stdlib_files(max_files: Optional[int], val_files: int = 0) -> list[str]:
    """The training files: the running Python's standard-library sources, sorted, without
    site-packages and without the `val_files` held out at the end; the first max_files."""
    files = _all_stdlib_files()
    rest = files[:len(files) - val_files]
    if not rest:
        raise ConfigError("data.val_files", val_files, f"holds out all {len(files)} stdlib files, none is left "
                          "to train on", f"use data.val_files < {len(files)}, e.g. 20")
    return rest[:max_files] if max_files else rest


def heldout_files(val_files: int) -> list[str]:
    """pycode's held-out files: the last `val_files` of the sorted stdlib sources."""
    files = _all_stdlib_files()
    return files[len(files) - min(val_files, len(files)):] if val_files > 0 else []


def _all_stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_py_files(root))
    if not files:
        raise ConfigError("data.name", "pycode", f"no .py sources under {root}",
                          "use data=synthetic, or data=hf with a local file")
    return files


def _py_files(root: Path) -> Iterator[str]:
    """*.py under root, pruning site-packages as it walks: `prepare` lists the stdlib on every run
    (the cache records its files), and walking installed packages only to drop them took ~1 s."""
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (os.path.join(parent, n) for n in names if n.endswith(".py"))


def part_files(d: DataConfig, part: str) -> list[str]:
    """pycode's files of `part` ("train" | "val")."""
    return heldout_files(d.val_files) if part == "val" else stdlib_files(d.max_files, d.val_files)


def part_split(d: DataConfig, part: str) -> str:
    """The hf split a part's documents come from."""
    return d.val_split if part == "val" and d.val_split else d.split


def held_out_count(documents: int, fraction: float) -> int:
    """Documents data.val_fraction holds out of the training split: round(f * n), at least one."""
    return max(1, round(documents * fraction)) if fraction > 0 else 0


READ_BATCH_ROWS = 1000  # rows turned into Python strings at a time


@dataclass
class Documents:
    """A part's non-empty documents, in order. They stay in the datasets Arrow cache (a
    memory-mapped file) and become Python strings a batch of rows at a time, never all at once."""

    table: Any  # a one-column datasets.Dataset in arrow format: the text
    start: int  # the part's non-empty documents are [start, stop) of the split's
    stop: int
    text_bytes: int  # UTF-8 bytes of those documents (pro rata when a fraction is held out)

    @property
    def count(self) -> int:
        return self.stop - self.start

    def batches(self) -> Iterator[list[str]]:
        seen = 0  # non-empty documents before this batch
        for batch in self.table.iter(batch_size=READ_BATCH_ROWS):
            texts = [t for t in batch.column(0).to_pylist() if t]
            lo, hi = max(self.start - seen, 0), min(self.stop - seen, len(texts))
            seen += len(texts)
            if lo < hi:
                yield texts[lo:hi]
            if seen >= self.stop:
                return


def load_part(d: DataConfig, cache: Path, part: str = "train") -> Documents:
    """The part's documents: one counting pass over the Arrow columns (no Python strings) finds
    how many there are and where the held-out fraction starts."""
    import pyarrow.compute as pc

    ds = _load_dataset(d, cache, part)
    check_text_field(d, ds.column_names)
    table = ds.select_columns(["text" if d.name == "pycode" else d.text_field]).with_format("arrow")
    documents = text_bytes = 0
    for batch in table.iter(batch_size=64 * READ_BATCH_ROWS):
        lengths = pc.binary_length(batch.column(0))  # null for a missing text
        documents += pc.sum(pc.greater(lengths, 0)).as_py() or 0
        text_bytes += pc.sum(lengths).as_py() or 0
    start, stop = 0, documents
    if d.name == "hf" and part_split(d, part) == d.split:
        keep = documents - held_out_count(documents, d.val_fraction)  # the fraction's documents are the last
        start, stop = (keep, documents) if part == "val" else (0, keep)
    return Documents(table, start, stop, text_bytes * (stop - start) // max(documents, 1))


def _load_dataset(d: DataConfig, cache: Path, part: str):
    from datasets import load_dataset

    hf_cache = str(cache / "hf")
    if d.name == "pycode":
        return load_dataset("text", data_files=part_files(d, part), sample_by="document", split="train",
                            cache_dir=hf_cache)
    try:
        return load_dataset(d.path, data_files=d.data_files, split=part_split(d, part), cache_dir=hf_cache)
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a bad file or name
        if part_split(d, part) != d.split:
            raise ConfigError("data.val_split", d.val_split, f"could not be loaded by datasets.load_dataset("
                              f"{d.path!r}) ({first_line(e)})", "name a split the dataset has (a local directory "
                              "as data.path: its files named by split, e.g. train.jsonl, validation.jsonl)") from None
        raise ConfigError("data.data_files" if d.data_files else "data.path", d.data_files or d.path,
                          f"could not be loaded by datasets.load_dataset({d.path!r}) ({first_line(e)})",
                          "check the file's format matches the loader (json lines for json), or the dataset "
                          "name and split") from None


def sources(d: DataConfig, part: str = "train") -> dict:
    """What the part's documents are read from. pycode lists every file with its size, so a
    Python upgraded in place (same stdlib path, changed files) rebuilds the cache, and so does
    one built before the held-out files were left out. hf names a held-out fraction (which
    documents of the split a part keeps) when there is one, so a change rebuilds."""
    if d.name == "pycode":
        out = {"stdlib": [[f, os.path.getsize(f)] for f in part_files(d, part)]}
    else:
        out = {"path": d.path, "data_files": d.data_files, "split": part_split(d, part), "text_field": d.text_field,
               "local_files": _local_files(d.data_files)}
        if d.val_fraction > 0 and part_split(d, part) == d.split:
            out["held_out_fraction"] = d.val_fraction
    return {**out, "part": "held out"} if part == "val" else out


def _local_files(data_files) -> list:
    """Local data files with size and modification time: a file edited in place rebuilds the
    cache (remote ones, URLs, are named by data_files alone)."""
    files = sorted({m for matches in local_data_files(data_files).values() for m in matches})
    return [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files]
