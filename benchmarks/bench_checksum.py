"""How long the weight check on load takes: CRC-32 (what integrity.py uses) against SHA-256 and BLAKE2b.

Writes a file of random bytes (default 500 MB) into a temporary folder and hashes it as
``integrity.file_checksum`` does (8 MiB reads into one buffer), the file in the page cache as it is
right after being written or loaded once. Each algorithm runs ``--repeats`` times, interleaved, and
the best time is kept (the machine is shared: the minimum is the least disturbed run).

    python benchmarks/bench_checksum.py
    python benchmarks/bench_checksum.py --mb 100 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hash_file(path: Path, name: str) -> str:
    h = hashlib.new(name)
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=500, help="file size in MB (default 500)")
    p.add_argument("--repeats", type=int, default=3, help="runs per algorithm; the best is reported (default 3)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from tinyformer.integrity import file_checksum

    runs = {"crc32 (zlib)": file_checksum, "sha256": lambda f: hash_file(f, "sha256"),
            "blake2b": lambda f: hash_file(f, "blake2b")}
    best = dict.fromkeys(runs, float("inf"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.bin"
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(10**6))
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn(path)
                best[name] = min(best[name], time.perf_counter() - t0)
    load = os.getloadavg()
    print(f"hashing a {args.mb} MB file from the page cache, best of {args.repeats}; load average "
          f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (a shared machine)")
    print("| algorithm | seconds | MB/s |")
    print("|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {args.mb / seconds:,.0f} |")


if __name__ == "__main__":
    main()
