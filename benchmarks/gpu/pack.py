"""Pack a results directory into one ``.tar.gz`` small enough to come back from a device
call (at most 16 MiB a file): files over :data:`FILE_MAX_BYTES`, and what would push the
archive's input past :data:`TOTAL_MAX_BYTES`, are left out and named in the archive's
``kit/packing-<name>.txt``. The kit re-packs after every step; each pack replaces the
archive only once it is complete."""

from __future__ import annotations

import io
import os
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

FILE_MAX_BYTES = 8 * 2**20
TOTAL_MAX_BYTES = 15 * 2**20  # uncompressed, so the .tar.gz stays under 16 MiB


def archive_name(tag: str, parts: Sequence[str]) -> str:
    """``gpu-<tag>-<parts>.tar.gz``: one name per part, so archives from separate device
    calls do not overwrite each other."""
    return f"gpu-{tag}-{'+'.join(parts) if len(parts) < 3 else 'all'}.tar.gz"


def pack(results: Path, out: Path, name: str) -> tuple[Path, list[str]]:
    """Write ``out/name`` holding ``results`` as ``<results.name>/...`` (extract it in
    ``benchmarks/results``). Returns the archive and the files left out, with why."""
    out.mkdir(parents=True, exist_ok=True)
    # Smallest first: when the archive fills up, what is left out is the bulkiest.
    files = sorted((p for p in results.rglob("*") if p.is_file()),
                   key=lambda p: (p.stat().st_size, p))
    skipped: list[str] = []
    total = 0
    archive = out / name
    partial = out / f"{name}.partial"  # renamed when complete: a call cut off mid-write
    with tarfile.open(partial, "w:gz") as tar:  # still returns the previous archive whole
        for path in files:
            size = path.stat().st_size
            rel = path.relative_to(results).as_posix()
            if size > FILE_MAX_BYTES:
                skipped.append(f"{rel} ({size / 2**20:.1f} MiB: over {FILE_MAX_BYTES >> 20} "
                               "MiB)")
                continue
            if total + size > TOTAL_MAX_BYTES:
                skipped.append(f"{rel} ({size / 2**20:.1f} MiB: the archive is full)")
                continue
            total += size
            tar.add(path, arcname=f"{results.name}/{rel}")
        note = ("left out of this archive:\n" + "\n".join(skipped) + "\n") if skipped else (
            "every file of the results directory is in this archive\n")
        data = note.encode()
        stem = name.removesuffix(".tar.gz")
        info = tarfile.TarInfo(f"{results.name}/kit/packing-{stem}.txt")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    os.replace(partial, archive)
    return archive, skipped
