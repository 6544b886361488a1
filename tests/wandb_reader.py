"""Read a W&B offline run file (run-*.wandb) back, for tests.

The file is W&B's LevelDB-log-style record stream: a 7-byte file header (":W&B", magic,
version), then 32 KiB blocks of records, each with a 7-byte header (checksum, length,
type: full / first / middle / last fragment) and a protobuf `Record` as payload.
wandb ships no Python reader since its Go core took over, so the tests carry this one.
"""

from __future__ import annotations

import json
import struct

from wandb.proto import wandb_internal_pb2

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", f"not a W&B run file: {path}"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: str) -> list[dict]:
    """Every logged step as {key: value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item})
    return rows


def summary_and_config(path: str) -> tuple[dict, dict]:
    summary, config = {}, {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "config":
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "run":
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.run.config.update})
    return summary, config


def run_meta(path: str) -> dict:
    """The run record: group and display name."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return {"group": rec.run.run_group, "name": rec.run.display_name, "project": rec.run.project}
    return {}


def metric_definitions(path: str) -> dict:
    """define_metric records: {name or glob: {"step_metric": ..., "summary": [...] }}."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "metric":
            m = rec.metric
            summary = [f.name for f, v in m.summary.ListFields() if v is True]
            out[m.name or m.glob_name] = {"step_metric": m.step_metric, "summary": summary,
                                          "hidden": bool(m.options.hidden), "none": bool(m.summary.none)}
    return out
