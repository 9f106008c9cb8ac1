"""``ds-swift logs DIR``: list message-log chunks, verify every checksum, bytes per edge per iteration.

Exit code 0 when every record verifies, 1 when any error was found (each printed with its file
and record), 2 when the location cannot be read at all or holds no chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "logs",
        help="list and verify message-log chunks",
        description="List message-log chunks, verify every record's checksums, print bytes per edge per iteration.",
    )
    p.add_argument("location", metavar="DIR", help="log directory or store URL (file://, hdfs://, s3://, memory://)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ds_swift.msglog.reader import LogReader

    try:
        reader = LogReader(args.location)
        report = reader.verify()
    except OSError as exc:
        print(f"ds-swift logs: error: {exc}", file=sys.stderr)
        return 2
    names = reader.chunk_names()
    if not names and not report.errors:
        print(
            f"ds-swift logs: error: no message-log chunk in {args.location}: give the directory of a job's "
            'message log (its swift section\'s "logging": {"storage": ...})',
            file=sys.stderr,
        )
        return 2
    chunks: list[dict[str, Any]] = []
    for cn in names:
        try:
            info = reader.chunk(cn)
        except OSError:
            continue  # already in report.errors
        chunks.append(
            {
                "file": cn.chunk_file,
                "edge": str(cn.edge),
                "iterations": [cn.first_iteration, cn.end_iteration],
                "records": len(info.order),
                "bytes": info.size,
            }
        )
    per_edge = {
        str(edge): {str(it): n for it, n in sorted(per_it.items())}
        for edge, per_it in sorted(report.bytes_per_edge_iteration.items())
    }
    if args.json:
        out = {
            "location": args.location,
            "chunks": chunks,
            "records": report.records,
            "bytes_on_disk": report.bytes_on_disk,
            "bytes_per_edge_iteration": per_edge,
            "errors": [str(e) for e in report.errors],
            "ok": report.ok,
        }
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{args.location}: {len(chunks)} chunks, {report.records} valid records, {report.bytes_on_disk} bytes on disk"
        )
        width = max((len(c["file"]) for c in chunks), default=4)
        for c in chunks:
            first, end = c["iterations"]
            print(
                f"  {c['file']:<{width}}  iterations {first}..{end - 1}  {c['records']:>6} records  {c['bytes']:>12} B"
            )
        if per_edge:
            print("bytes per edge per iteration:")
            for edge, per_it in per_edge.items():
                cells = "  ".join(f"it{it}={n}" for it, n in per_it.items())
                print(f"  {edge}: {cells}")
        for err in report.errors:
            label = "checksum error" if "checksum" in str(err) else "error"
            print(f"{label}: {err}", file=sys.stderr)
        print("OK" if report.ok else f"FAILED: {len(report.errors)} error(s)")
    return 0 if report.ok else 1
