"""Read back what the real `wandb` client wrote offline: a run's `.wandb` file is a LevelDB-style log of protobuf
`Record`s (32 KiB blocks, a 7-byte header per chunk, after a 7-byte `:W&B` file header); the records are parsed with
wandb's own protobuf schema. The client has no Python reader of its own any more (its datastore moved to wandb-core)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, out, pending = 7, [], b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def read_run(run_dir: Path) -> dict:
    """{"project", "name", "id", "config": {...}, "history": [{key: value}]} of one offline run directory."""
    (log,) = run_dir.glob("run-*.wandb")
    run: dict = {"history": [], "config": {}}
    for r in records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.update(project=r.run.project, name=r.run.display_name, id=r.run.run_id)
            run["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            run["history"].append({k: v for k, v in row.items() if not k.startswith("_") or k == "_step"})
    return run
