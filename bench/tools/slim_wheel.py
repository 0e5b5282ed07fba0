"""Rewrite a wheel without the shared libraries a target machine cannot use (bitsandbytes ships one
.so per CUDA/ROCm/XPU version: ~130 MB unpacked; the H200 image is CUDA 13, so cuda13x + cpu suffice).
RECORD is rewritten to list only what is kept, so the slim wheel installs with pip as usual.

    python3 bench/tools/slim_wheel.py WHEEL KEEP_REGEX [KEEP_REGEX ...]   (rewrites WHEEL in place)
A member is dropped when it is a .so whose name matches none of the KEEP_REGEX patterns.

    python3 bench/tools/slim_wheel.py WHEEL --drop-prefix PREFIX [PREFIX ...]
drops every member under PREFIX instead (unsloth's wheel ships its 25 MB `studio/` web app, which the
training library never imports).
"""

import re
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, keep: list[str], drop_prefixes: tuple[str, ...] = ()) -> tuple[int, int]:
    tmp = wheel.with_suffix(".slim")
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = set()
        for info in src.infolist():
            name = info.filename
            if drop_prefixes and name.startswith(drop_prefixes):
                dropped += 1
                continue
            if not drop_prefixes and name.endswith(".so") and not any(re.search(k, name) for k in keep):
                dropped += 1
                continue
            kept.add(name)
        for info in src.infolist():
            if info.filename not in kept:
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [
                    ln
                    for ln in data.decode().splitlines()
                    if ln.split(",")[0] in kept or ln.endswith("RECORD,,")
                ]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    before = wheel.stat().st_size
    tmp.replace(wheel)
    return before, dropped


if __name__ == "__main__":
    path = Path(sys.argv[1])
    args = sys.argv[2:]
    if args[:1] == ["--drop-prefix"]:
        size, n = slim(path, [], tuple(args[1:]))
    else:
        size, n = slim(path, args)
    print(
        f"{path.name}: dropped {n} members, {size / 2**20:.1f} MiB -> {path.stat().st_size / 2**20:.1f} MiB"
    )
