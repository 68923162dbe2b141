"""A wheel re-written with only the members a GPU run loads, so fewer device calls carry it.

    python3 tests/gpu/slim_wheel.py SRC.whl DEST.whl 'nvidia/nvshmem/lib/*.so*' [GLOB ...]

Keeps the members matching a GLOB and the .dist-info folder, whose RECORD is re-written
to list exactly the kept files (pip installs what RECORD names). The tag becomes
``py3-none-any`` only in the file name the caller gives: the metadata is the source's.
Used for nvidia-nvshmem-cu13, whose 135 MB wheel is mostly device bitcode, headers
and static libraries that torch never loads (tests/gpu/bundle_torch.sh).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import sys
import zipfile


def record_row(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: str, dest: str, globs: list) -> list:
    """Write ``dest`` from ``src`` keeping ``globs`` and the dist-info; returns kept names."""
    kept, rows, record_name = [], [], None
    with zipfile.ZipFile(src) as wheel, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as out:
        for info in wheel.infolist():
            in_dist_info = ".dist-info/" in info.filename
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            if not in_dist_info and not any(fnmatch.fnmatch(info.filename, g) for g in globs):
                continue
            data = wheel.read(info)
            out.writestr(info, data)
            kept.append(info.filename)
            rows.append(record_row(info.filename, data))
        if record_name is None:
            raise SystemExit(f"{src}: no .dist-info/RECORD: not a wheel")
        if not any(".dist-info/" not in name for name in kept):
            raise SystemExit(f"{src}: nothing matches {globs}")
        out.writestr(record_name, "\n".join(rows + [f"{record_name},,"]) + "\n")
    return kept


def main(argv: list) -> int:
    if len(argv) < 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    kept = slim(argv[0], argv[1], argv[2:])
    print(f"{argv[1]}: {len(kept)} members kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
