"""Fetch the pinned llama.cpp tree into vendor/llama.cpp (run by CMake at configure time).

Nothing of upstream is committed. The pin below names the PyPI source distribution that
carries the tree; this script downloads it with pip, checks its sha256, unpacks only its
``vendor/llama.cpp/`` and applies our patches from ``vendor/patches/`` (in name order).

Usage: python vendor/fetch_llama_cpp.py [DEST]   (DEST defaults to vendor/llama.cpp)

Set ``LLAMA_CPP_DIR`` to build against a llama.cpp checkout of your own instead; set
``LLAMA_CPP_ARCHIVE`` to a local copy of the archive to skip the download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# -- the pin -------------------------------------------------------------------------
PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
UPSTREAM_COMMIT = "0c1e570"  # llama.cpp commit carried by that archive (2026-10-01)
# -------------------------------------------------------------------------------------

HERE = Path(__file__).resolve().parent
PATCHES = HERE / "patches"
CACHE = HERE / ".cache"
STAMP = ".engine-pin"


class FetchError(RuntimeError):
    """The pinned tree could not be obtained."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _archive() -> Path:
    """Return a verified local copy of the pinned archive, downloading it if needed."""
    candidates = [Path(p) for p in [os.environ.get("LLAMA_CPP_ARCHIVE", "")] if p]
    candidates.append(CACHE / ARCHIVE)
    for path in candidates:
        if path.is_file() and _sha256(path) == SHA256:
            return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            ":all:",
            f"{PACKAGE}=={VERSION}",
            "-d",
            tmp,
        ]
        print("fetch_llama_cpp:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / ARCHIVE
        if not got.is_file():
            # pip may fail after downloading (preparing metadata); the archive is what counts.
            raise FetchError(f"pip download failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        actual = _sha256(got)
        if actual != SHA256:
            raise FetchError(f"{ARCHIVE}: sha256 {actual} does not match the pin {SHA256}")
        shutil.move(str(got), CACHE / ARCHIVE)
    return CACHE / ARCHIVE


def _unpack(archive: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
                m.name = m.name[len(prefix) :]
                if m.name:
                    members.append(m)
        tar.extractall(staging, members=members, filter="data")
    # fresh mtimes: a re-fetched tree (other pin or patch set) must rebuild, not reuse
    # objects of files the archive dates in the past
    for path in staging.rglob("*"):
        os.utime(path, follow_symlinks=False)
    for patch in sorted(PATCHES.glob("*.patch")):
        subprocess.run(
            ["patch", "-p1", "--forward", "--quiet", "-d", str(staging), "-i", str(patch)], check=True
        )
    (staging / STAMP).write_text(
        f"{PACKAGE}=={VERSION} {SHA256} {UPSTREAM_COMMIT} "
        f"patches={','.join(p.name for p in sorted(PATCHES.glob('*.patch')))}\n"
    )
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


def expected_stamp() -> str:
    """The stamp a correctly fetched and patched tree carries."""
    patches = ",".join(p.name for p in sorted(PATCHES.glob("*.patch")))
    return f"{PACKAGE}=={VERSION} {SHA256} {UPSTREAM_COMMIT} patches={patches}\n"


def ensure(dest: Path = HERE / "llama.cpp") -> Path:
    """Make sure ``dest`` holds the pinned, patched tree; return it."""
    stamp = dest / STAMP
    if stamp.is_file() and stamp.read_text() == expected_stamp():
        return dest
    _unpack(_archive(), dest)
    return dest


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "llama.cpp"
    try:
        print(ensure(dest))
    except (FetchError, OSError, subprocess.CalledProcessError, tarfile.TarError) as exc:
        print(
            f"fetch_llama_cpp: could not obtain {PACKAGE}=={VERSION} ({exc}).\n"
            "Set LLAMA_CPP_DIR to a llama.cpp checkout (upstream commit "
            f"{UPSTREAM_COMMIT}) or LLAMA_CPP_ARCHIVE to a local copy of {ARCHIVE}.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
