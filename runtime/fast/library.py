"""The CPU kernels' shared library: compiled from kernels.c, checked, loaded, declared.

The library is compiled once per source version (and compiler flags) into
`<promptlang home>/native/`. Loading a library runs its code, so a stored one is loaded only
when `untrusted_reason` finds nothing wrong with it (ours, not writable by others, in a
private folder of ours) and its bytes match the SHA-256 recorded privately next to it at
build time; else it is rebuilt (in a private temporary folder, then renamed into place).
Whatever stops that raises `Unavailable` with a sentence; native.py decides whether that
is a warning or an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from promptlang.home import native_dir, private_dir, untrusted_reason, write_private

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
WIDE_ENV = "PROMPTLANG_AVX512"     # "0": the linear layers' dot tiles stay on 256-bit vectors
_P = ctypes.c_void_p
_L = ctypes.c_long
_I = ctypes.c_int
_F = ctypes.c_float


class Unavailable(Exception):
    """Why the kernels cannot be had on this machine now (a sentence); caught by native.py."""


def source_digest() -> str:
    """What the library is built from (kernels.c and the flags), as 16 hex digits: the
    library's name, and the version of the kernels' numbers."""
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]


def trusted_library() -> Path:
    """The built library for this kernels.c, checked before it is loaded: rebuilt if untrusted."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unavailable("no C compiler found (install one, or name it in $CC)")
    digest = source_digest()
    try:
        folder = private_dir(native_dir())
    except OSError as exc:
        raise Unavailable(f"cannot create {native_dir()} ({exc.strerror})") from None
    target = folder / f"kernels-{digest}.so"
    stale = _distrust(target)
    if stale is None:
        return target
    if target.exists() or target.is_symlink():
        warnings.warn(f"promptlang: not loading {target}: {stale}; rebuilding it",
                      RuntimeWarning, stacklevel=5)
    _build(compiler, target)
    stale = _distrust(target)
    if stale is not None:
        raise Unavailable(f"the freshly built {target} cannot be loaded safely: {stale}")
    return target


def _record(library: Path) -> Path:
    """The file that holds the SHA-256 of `library`'s bytes as it was built."""
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _distrust(library: Path) -> str | None:
    """Why the stored `library` must not be loaded, or None when it may be."""
    reason = untrusted_reason(library)
    if reason is not None:
        return reason
    record = _record(library)
    if untrusted_reason(record) is not None:
        return "its build record is missing or untrusted"
    try:
        if record.read_text().strip() != _sha256(library):
            return "its bytes differ from the digest recorded when it was built"
    except (OSError, UnicodeDecodeError) as exc:
        return f"it cannot be checked ({exc})"
    return None


def _build(compiler: str, target: Path) -> None:
    """Compile kernels.c into a private temporary folder beside `target`, record the
    result's digest (0600), then rename it into place (atomic: concurrent builders agree)."""
    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:  # 0700
            built = Path(tmp) / target.name
            subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
            built.chmod(0o600)                       # the linker makes it 0755
            write_private(_record(target), (_sha256(built) + "\n").encode())
            os.replace(built, target)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip()[:300]
        raise Unavailable(f"could not build the CPU kernels ({compiler} exited with "
                           f"{exc.returncode}: {detail})") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"could not build the CPU kernels ({exc})") from None


def bind(library: Path) -> ctypes.CDLL:
    """Load `library` and declare its kernels' signatures."""
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        raise Unavailable(f"could not load {library} ({exc})") from None
    signatures = {
        "pl_linear": ([_P, _L, _L, _P, _L, _P, _P, _I], None),
        "pl_attend": ([_P, _L, _L, _L, _F, _L, _P, _P, _P, _P, _P, _P, _L, _P, _P, _I, _I], _I),
        "pl_decoder": ([_P, _L, _P, _F, _F, _P, _P, _P, _L, _P, _P, _P, _P, _P, _P, _P, _L, _P,
                        _L, _P, _P, _L, _P, _P, _P, _F, _F, _P, _I, _P, _P, _I, _I, _I], _I),
        "pl_q_dequant": ([_P, _L, _L, _I, _P], _I), "pl_wide": ([_I], _I),
        "pl_linear_q": ([_P, _L, _L, _P, _L, _P, _I, _I], _I),
        "pl_linear_q8": ([_P, _L, _L, _P, _L, _P, _I], None), "pl_group": ([_I], _I),
        "pl_linear_i8": ([_P, _L, _L, _P, _L, _P], _I), "pl_group_runs": ([], _L),
        "pl_products": ([_I], _I), "pl_few": ([_I], _I), "pl_vnni": ([], _I),
        "pl_causal": ([_P, _L, _L, _L, _P, _L, _P, _L, _L, _L, _F, _P, _I, _I], _I)}
    try:
        for name, (arguments, result) in signatures.items():
            kernel = getattr(lib, name)
            kernel.argtypes = arguments
            kernel.restype = result
    except AttributeError as exc:                 # "...: undefined symbol: pl_attend"
        raise Unavailable(f"{library} lacks a kernel ({exc})") from None
    lib.pl_wide(int(os.environ.get(WIDE_ENV, "1").strip().lower() not in ("0", "false", "no",
                                                                            "off")))
    return lib
