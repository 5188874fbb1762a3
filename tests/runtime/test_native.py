"""The CPU kernels (runtime/fast/kernels.c) against PyTorch, and the runtime's use of them.

Skipped where the kernels cannot be built (no AVX2/FMA, no C compiler, PROMPTLANG_NATIVE=0);
the oracle tests then cover the PyTorch paths instead. Under PROMPTLANG_REQUIRE_NATIVE=1 (CI)
kernels that cannot be built are an error, so this file fails to collect instead of skipping.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from promptlang.errors import NativeKernelsError
from promptlang.runtime import model as model_mod
from promptlang.runtime.fast import fused, native
from promptlang.runtime.fast import library as library_mod
from promptlang.runtime.model import adapt
from .tiny import tiny_llama

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")


@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 7, False), (2, 576, 576, True), (4, 64, 33, True),
                                        (19, 576, 1536, False), (19, 1536, 576, True),
                                        (64, 128, 130, False), (3, 8, 1, True)])
def test_linear_equals_f_linear(m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = native.linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_linear_keeps_leading_dims():
    x = torch.randn(1, 5, 64)
    w = torch.randn(24, 64)
    torch.testing.assert_close(native.linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_linear_fits_only_small_float32_inputs():
    w = torch.randn(16, 64)
    assert native.linear_fits(torch.randn(19, 64), w, 64)
    assert not native.linear_fits(torch.randn(65, 64), w, 64)              # too many rows
    assert not native.linear_fits(torch.randn(4, 64, dtype=torch.float64), w.double(), 64)
    assert not native.linear_fits(torch.randn(4, 60), torch.randn(16, 60), 64)   # k % 8
    assert not native.linear_fits(torch.randn(4, 64), torch.randn(64, 16).t(), 64)
    with torch.enable_grad():
        assert not native.linear_fits(torch.randn(4, 64), w, 64)     # autograd needs F.linear


def _reference(rows, pieces, new_tokens, scale):
    """The same attention as one masked softmax over the concatenated keys."""
    keys = torch.cat([p[0] for p in pieces], 1)
    values = torch.cat([p[1] for p in pieces], 1)
    r = rows.shape[1]
    allowed = torch.ones(r, keys.shape[1], dtype=torch.bool)
    at = 0
    token = torch.arange(r) % new_tokens
    for k, _, causal in pieces:
        n = k.shape[1]
        if causal:
            allowed[:, at:at + n] = torch.arange(n)[None, :] <= token[:, None]
        at += n
    scores = (rows @ keys.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("heads,groups,new,d,lengths", [
    (3, 3, 19, 64, [200, 300, 7]),        # the default model's shape, three past pieces
    (2, 2, 1, 16, [1000]),                # a decode step
    (1, 1, 5, 8, []),                     # no past at all
    (2, 4, 20, 32, [129, 1, 64]),         # 80 rows per head: two row blocks
    (1, 2, 3, 128, [130]),                # wide heads; key blocks with remainders
])
def test_attend_equals_masked_softmax(heads, groups, new, d, lengths):
    g = torch.Generator().manual_seed(new * 7 + d)
    rows = torch.randn(heads, groups * new, d, generator=g)
    buffer_k = torch.randn(heads, sum(lengths) + new + 3, d, generator=g)
    buffer_v = torch.randn(heads, sum(lengths) + new + 3, d, generator=g)
    pieces, at = [], 0
    for i, n in enumerate(lengths):
        if i % 2:       # a stored unit's own tensor, read in place
            pieces.append((torch.randn(heads, n, d, generator=g),
                           torch.randn(heads, n, d, generator=g), False))
        else:           # a slice of the buffer (head stride > n * d)
            pieces.append((buffer_k[:, at:at + n], buffer_v[:, at:at + n], False))
            at += n
    pieces.append((buffer_k[:, at:at + new], buffer_v[:, at:at + new], True))
    scale = d ** -0.5 * 2.0                       # peaked scores: a wrong key shows
    assert native.attend_fits(rows, pieces)
    out, lse = native.attend(rows, pieces, new, scale, with_lse=True)
    want_out, want_lse = _reference(rows, pieces, new, scale)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-5)


def test_attend_fits_rejects_what_it_cannot_read():
    rows = torch.randn(2, 6, 16)
    ok = (torch.randn(2, 10, 16), torch.randn(2, 10, 16), False)
    assert native.attend_fits(rows, [ok])
    assert not native.attend_fits(rows, [(ok[0].half(), ok[1], False)])
    assert not native.attend_fits(rows, [(ok[0][:, :, :8], ok[1][:, :, :8], False)])
    strided = torch.randn(2, 16, 10).transpose(1, 2)            # rows of keys not contiguous
    assert not native.attend_fits(rows, [(strided, ok[1], False)])
    assert not native.attend_fits(torch.randn(2, 6, 12), [(torch.randn(2, 4, 12),) * 2 + (False,)])


@pytest.fixture
def unfused():
    with fused.disabled():
        yield


def test_adapter_passes_take_the_kernels_and_match_pytorch(monkeypatch, unfused):
    """A cached pass (past + causal new tokens) through the adapter's transformers layers
    takes pl_attend and pl_linear, and its logits and new KV equal the same pass on
    PyTorch's kernels."""
    hf = tiny_llama(0, 97, max_positions=256)
    adapter = adapt(hf)
    calls = {"attend": 0, "linear": 0}
    real_attend, real_linear = native.attend, native.linear

    def attend(*a, **kw):
        calls["attend"] += 1
        return real_attend(*a, **kw)

    def linear(*a, **kw):
        calls["linear"] += 1
        return real_linear(*a, **kw)

    monkeypatch.setattr(native, "attend", attend)
    monkeypatch.setattr(native, "linear", linear)
    past_ids = torch.randint(0, 97, (40,))
    new_ids = torch.randint(0, 97, (6,))
    keys, values = adapter.empty_kv(64)
    adapter.forward(past_ids, torch.arange(40), model_mod.Past(keys, values, torch.arange(0)),
                    None)
    past = model_mod.Past(keys, values, torch.arange(40))
    calls.update(attend=0, linear=0)
    step = adapter.forward(new_ids, torch.arange(40, 46), past, None,
                           logits_rows=torch.arange(6))
    assert calls["attend"] == 2 and calls["linear"] > 0      # one attention per layer
    fast = (step.logits.clone(), step.keys.clone(), step.values.clone())

    calls.update(attend=0, linear=0)
    with native.disabled():                                    # every kernel back to PyTorch
        step = adapter.forward(new_ids, torch.arange(40, 46), past, None,
                               logits_rows=torch.arange(6))
    assert calls == {"attend": 0, "linear": 0}
    torch.testing.assert_close(fast[0], step.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast[1], step.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[2], step.values, rtol=1e-5, atol=1e-5)


def test_the_environment_variable_turns_the_kernels_off():
    assert native.off_by_env({"PROMPTLANG_NATIVE": "0"})
    assert native.off_by_env({"PROMPTLANG_NATIVE": " Off "})
    assert not native.off_by_env({"PROMPTLANG_NATIVE": "1"})
    assert not native.off_by_env({})


def test_linears_are_plain_outside_the_adapter(monkeypatch):
    """transformers' own calls on a model the runtime wraps never take pl_linear."""
    hf = tiny_llama(0, 97, max_positions=256)
    adapt(hf)
    used = []
    monkeypatch.setattr(native, "linear", lambda *a: used.append(1))
    with torch.no_grad():
        hf(torch.randint(0, 97, (1, 5)))
    assert used == []


# --- building and loading the library ----------------------------------------------------------

@pytest.fixture
def home(monkeypatch, tmp_path):
    """A fresh PROMPTLANG_HOME, kernels not required (CI requires them for the real home)."""
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)
    return tmp_path / "home"


def _library(home) -> Path:
    (library,) = (home / "native").glob("kernels-*.so")
    return library


def _plant(tmp_path, library: Path, *, kernels=("pl_linear", "pl_attend", "pl_decoder")) -> Path:
    """Replace `library` by one whose constructor leaves a marker file when it is loaded;
    returns the marker's path."""
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text("#include <stdio.h>\n"
                      "__attribute__((constructor)) static void planted(void) {\n"
                      f"    FILE *f = fopen(\"{marker}\", \"w\"); if (f) fclose(f);\n}}\n"
                      + "".join(f"void {name}(void) {{}}\n" for name in kernels))
    built = tmp_path / "planted.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(built),
                    str(source)], check=True, capture_output=True)
    built.chmod(0o600)
    os.replace(built, library)      # a new file: the loaded one is mapped, never rewrite it
    return marker


def _kernels_work(lib) -> bool:
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    y = torch.empty(2, 3)
    lib.pl_linear(x.data_ptr(), 2, 8, w.data_ptr(), 3, None, y.data_ptr(), 1)
    return torch.allclose(y, x @ w.T, atol=1e-5)


def test_a_built_library_its_record_and_its_folders_are_private(home):
    lib = native._build_and_load()
    assert lib is not None and _kernels_work(lib)
    library = _library(home)
    for folder in (home, home / "native"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in (library, library_mod._record(library)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in (home / "native").iterdir()) == [library.name,
                                                                  library.name + ".sha256"]


def test_a_group_writable_library_is_not_loaded_but_rebuilt_with_a_warning(home, tmp_path):
    native._build_and_load()
    library = _library(home)
    marker = _plant(tmp_path, library)
    library.chmod(0o620)
    with pytest.warns(RuntimeWarning, match="others can write to it; rebuilding it"):
        lib = native._build_and_load()
    assert not marker.exists()                        # its constructor never ran
    assert lib is not None and _kernels_work(lib)
    assert stat.S_IMODE(library.stat().st_mode) == 0o600
    assert library_mod._distrust(library) is None


def test_a_library_in_a_folder_others_can_write_is_not_loaded_but_rebuilt(home, tmp_path,
                                                                         monkeypatch):
    native._build_and_load()
    library = _library(home)
    marker = _plant(tmp_path, library)
    monkeypatch.setattr(library_mod, "private_dir", lambda path: path)   # a folder left loose
    (home / "native").chmod(0o777)
    with pytest.warns(RuntimeWarning, match="others can write to its folder; rebuilding it"):
        lib = native._build_and_load()
    assert not marker.exists()
    assert lib is not None and _kernels_work(lib)
    assert stat.S_IMODE((home / "native").stat().st_mode) == 0o700    # tightened on the way


def test_a_library_owned_by_another_user_is_never_loaded(home, tmp_path, monkeypatch):
    native._build_and_load()
    library = _library(home)
    marker = _plant(tmp_path, library)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(library).st_uid + 1)  # we are someone else
    with pytest.warns(RuntimeWarning) as caught:
        assert native._build_and_load() is None
    messages = " | ".join(str(w.message) for w in caught)
    assert f"not loading {library}: it is owned by uid" in messages
    assert "using PyTorch kernels" in messages
    assert not marker.exists()


def test_a_library_whose_bytes_differ_from_its_build_record_is_rebuilt(home, tmp_path):
    native._build_and_load()
    library = _library(home)
    marker = _plant(tmp_path, library)                # ours, 0600: only the digest tells
    with pytest.warns(RuntimeWarning, match="differ from the digest recorded"):
        lib = native._build_and_load()
    assert not marker.exists()
    assert lib is not None and _kernels_work(lib)


def test_a_library_lacking_a_kernel_falls_back_to_pytorch_with_a_warning(home, tmp_path,
                                                                        monkeypatch):
    source = tmp_path / "kernels.c"
    source.write_text("void pl_linear(void) {}\nvoid pl_attend(void) {}\n")
    monkeypatch.setattr(library_mod, "_SOURCE", source)
    with pytest.warns(RuntimeWarning, match="lacks a kernel .*pl_decoder.*using PyTorch"):
        assert native._build_and_load() is None


def test_a_library_that_does_not_load_falls_back_to_pytorch_with_a_warning(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)
    junk = tmp_path / "kernels-junk.so"
    junk.write_bytes(b"not an ELF file")
    monkeypatch.setattr(library_mod, "trusted_library", lambda: junk)
    with pytest.warns(RuntimeWarning, match="could not load .*using PyTorch"):
        assert native._build_and_load() is None


def test_without_a_working_compiler_the_runtime_falls_back_with_a_warning(monkeypatch, home):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(library_mod.shutil, "which", lambda name: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native._build_and_load() is None
    monkeypatch.setenv("CC", "false")                  # a compiler that fails
    with pytest.warns(RuntimeWarning, match="could not build the CPU kernels"):
        assert native._build_and_load() is None
    assert not list((home / "native").iterdir())       # no library, no record, no temp folder


def test_required_kernels_that_cannot_be_had_are_an_error(monkeypatch, home, tmp_path):
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    monkeypatch.setenv("CC", "false")
    with pytest.raises(NativeKernelsError, match="required .*could not build"):
        native._build_and_load()
    monkeypatch.delenv("CC")
    source = tmp_path / "kernels.c"
    source.write_text("void pl_linear(void) {}\n")
    monkeypatch.setattr(library_mod, "_SOURCE", source)
    with pytest.raises(NativeKernelsError, match="lacks a kernel"):
        native._build_and_load()
    # through available(): an error on every call, never a quiet False
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    for _ in range(2):
        with pytest.raises(NativeKernelsError):
            native.available()


def test_the_require_variable_is_read_as_a_flag():
    assert native.required({native.REQUIRE_ENV: "1"})
    assert native.required({native.REQUIRE_ENV: " Yes "})
    assert not native.required({native.REQUIRE_ENV: "0"})
    assert not native.required({})


def test_required_kernels_that_cannot_be_built_fail_the_kernel_tests_instead_of_skipping(
        tmp_path):
    env = {**os.environ, native.REQUIRE_ENV: "1", "CC": "false",
           "PROMPTLANG_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    env.pop("PROMPTLANG_NATIVE", None)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/runtime/test_fused.py"], cwd=root, env=env,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode not in (0, 5), result.stdout[-2000:]
    assert "NativeKernelsError" in result.stdout
    assert "skipped" not in result.stdout


def test_kernel_threads_leave_the_cores_other_processes_hold(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    others = [0]
    monkeypatch.setattr(native, "_runnable_elsewhere", lambda: others[0])
    monkeypatch.setattr(native, "_busy", {"checked": -1.0, "others": 0})
    assert native.kernel_threads() == 4
    others[0] = 3
    assert native.kernel_threads() == 4                 # read again only after BUSY_CHECK_S
    native._busy["checked"] = -1.0
    assert native.kernel_threads() == 1
    others[0] = 9
    native._busy["checked"] = -1.0
    assert native.kernel_threads() == 1                 # never fewer than one
    monkeypatch.setattr(native, "adapt_threads", False)
    assert native.kernel_threads() == 4
    monkeypatch.setattr(native, "adapt_threads", True)
    monkeypatch.setattr(native.os, "cpu_count", lambda: 64)   # 4 of a 64-CPU machine's
    others[0] = 32                                          # 2 of them on our 4 CPUs
    native._busy["checked"] = -1.0
    assert native.kernel_threads() == 2


def test_torch_s_own_threads_follow_the_free_cores_and_come_back(monkeypatch):
    threads = [4]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(native.os, "cpu_count", lambda: 4)
    others = [0]
    monkeypatch.setattr(native, "_runnable_elsewhere", lambda: others[0])
    monkeypatch.setattr(native, "_busy", {"checked": -1.0, "others": 0})
    monkeypatch.setattr(native, "_threads", {"configured": None, "set": None})
    native.adapt_torch_threads()
    assert threads[0] == 4
    others[0] = 3
    native._busy["checked"] = -1.0
    native.adapt_torch_threads()
    assert threads[0] == 1 and native.kernel_threads() == 1
    others[0] = 1
    native._busy["checked"] = -1.0
    native.adapt_torch_threads()                 # the configured 4, less the busy core
    assert threads[0] == 3
    others[0] = 0
    native._busy["checked"] = -1.0
    native.adapt_torch_threads()
    assert threads[0] == 4
    threads[0] = 8                               # the user's own setting is the new one
    native._busy["checked"] = -1.0
    assert native.kernel_threads() == 4          # (the machine has 4 cores)
    others[0] = 3
    native._busy["checked"] = -1.0
    native.adapt_torch_threads()
    assert threads[0] == 1
    monkeypatch.setattr(native, "adapt_threads", False)
    native.adapt_torch_threads()
    assert threads[0] == 8                       # off: torch's configured count


def test_attention_numbers_do_not_depend_on_the_threads_a_busy_machine_leaves(monkeypatch):
    """The key ranges a new token's attention is cut into follow torch's thread count, not the
    team kernel_threads gives a call: one thread, or four, give the same bits."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(2, 3, 64, generator=g)
    pieces = [(torch.randn(2, 900, 64, generator=g), torch.randn(2, 900, 64, generator=g), False),
              (torch.randn(2, 1, 64, generator=g), torch.randn(2, 1, 64, generator=g), True)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    results = []
    for team in (4, 1):
        monkeypatch.setattr(native, "kernel_threads", lambda team=team: team)
        results.append(native.attend(rows, pieces, 1, 0.125, with_lse=True))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cut_for_one = native.attend(rows, pieces, 1, 0.125, with_lse=True)
    assert not torch.equal(cut_for_one[0], results[0][0])   # the cut does change the bits


def test_runnable_elsewhere_counts_a_busy_neighbour():
    """A process spinning beside this one is seen (within a bounded wait); this process's own
    running thread is not counted."""
    import time

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        seen = 0
        deadline = time.monotonic() + 5
        while seen == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = native._runnable_elsewhere()
        assert seen >= 1
    finally:
        hog.kill()
        hog.wait()
