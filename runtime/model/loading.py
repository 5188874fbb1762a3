"""Loading a causal LM and its tokenizer: the default model or any transformers model.

The default model comes as a GGUF (see promptlang/default_model.py). Reading it
de-quantizes every weight (~40 s), so the first load writes a float copy next
to it and every later load reads that instead (seconds):

    <default model folder>/converted/
        model.safetensors     state dict, tied weights stored once
        config.json           without the GGUF quantization_config
        generation_config.json, tokenizer files
        promptlang-load.json  what a load computed from these files (load_record.py)

Any other GGUF file (`load("model.gguf")`) is converted the same way, once, into
`$PROMPTLANG_HOME/models/gguf/<name>-<sha256 of the file>-c<conversion>/` (its tokenizer from
the GGUF's own metadata); a changed file, or a new conversion format, is a new copy. The
file's digest is remembered by its path and stat (`.digests.json` there), so a later load
does not read the whole file to find its copy.

A converted copy is read by `_load_converted` (its weights mapped, never initialised: what
the GGUF's blocks serve is never read), and a load takes the fingerprints and the blocks'
bit check an earlier load of the same files computed from its LoadRecord.

A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf and is not
serializable"), hence safetensors' `save_model` plus the config by hand.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pickle
import shutil
import stat
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

from promptlang.errors import ModelError
from promptlang.hf_tokenizer import HFTokenizer, context_length
from promptlang.runtime.model.load_record import LoadRecord


def load_hf_model(name_or_path: str | Path | None = None, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32,
                  steps: dict[str, float] | None = None) -> tuple[Any, HFTokenizer]:
    """(model in eval mode, its HFTokenizer). None loads the default model
    (SmolLM2-135M-Instruct), converting its GGUF once; anything else is a
    transformers model id or folder, read from local files only. `steps`, where given,
    receives the seconds of each part: "file" (a GGUF's checks, hash and first conversion),
    "weights", "tokenizer"."""
    model, tokenizer, _ = load_model_files(name_or_path, device=device, dtype=dtype,
                                           steps=steps)
    return model, tokenizer


def load_model_files(name_or_path: str | Path | None = None, *,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     steps: dict[str, float] | None = None
                     ) -> tuple[Any, HFTokenizer, LoadRecord | None]:
    """load_hf_model's model and tokenizer, and the converted copy's LoadRecord where the
    model is one (the default model, a GGUF), else None. A converted copy's model is read
    by _load_converted, its tokenizer's fingerprint kept in the record."""
    began = time.perf_counter()
    if name_or_path is None:
        folder = _default_model_folder()
    elif str(name_or_path).endswith(".gguf"):
        folder = _gguf_folder(Path(name_or_path))
    else:
        folder = str(name_or_path)
    converted = name_or_path is None or str(name_or_path).endswith(".gguf")
    record = LoadRecord(folder) if converted else None
    read = time.perf_counter()
    model = _load_converted(folder, dtype) if converted else _from_pretrained(folder, dtype)
    model.to(device)
    model.eval()
    weighed = time.perf_counter()
    tokenizer = HFTokenizer.from_pretrained(folder, max_positions=context_length(model.config))
    if record is not None:
        known = record.get("tokenizer_fingerprint")
        if isinstance(known, str):
            tokenizer.adopt_fingerprint(known)
        else:
            record.put("tokenizer_fingerprint", tokenizer.fingerprint)
    if steps is not None:
        steps["file"] = read - began
        steps["weights"] = weighed - read
        steps["tokenizer"] = time.perf_counter() - weighed
    if name_or_path is None:
        from promptlang.default_model import DEFAULT_MODEL_NAME

        tokenizer.name = f"{DEFAULT_MODEL_NAME} (default)"
    return model, tokenizer, record


def gguf_source(name_or_path: str | Path | None) -> Path | None:
    """The GGUF file a model loaded from `name_or_path` was converted from (the default
    model's own, or a `.gguf` path), or None."""
    if name_or_path is None:
        from promptlang import default_model

        return Path(default_model.default_model_files()) / default_model.GGUF_FILE
    return Path(name_or_path) if str(name_or_path).endswith(".gguf") else None


# GGUF tensor names of a Llama-family layer's linear weights -> the transformers parameter
GGUF_LINEARS = {"attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
                "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
                "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight",
                "ffn_down": "mlp.down_proj.weight"}


def quantized_blocks(gguf: Path, config) -> tuple[dict[tuple[int, str], torch.Tensor],
                                                   torch.Tensor | None]:
    """A Llama-family GGUF's quantized weights as stored, mapped from the file (its pages,
    shared, not a copy: gguf_index.py). Two things:

    - its linear weights of the types the kernels read (native.KINDS: Q4_1, Q5_0, Q8_0,
      Q4_K, Q5_K, Q6_K), {(layer, parameter name): (kernel kind, [rows, row bytes] uint8)}.
      Rows are in transformers' order. llama.cpp stores a Llama's q and k projections' rows
      permuted for its rotary layout, and transformers' GGUF loader permutes them back, so
      the same permutation is applied here, to whole block rows, in a copy. Other
      architectures' rows are as stored. Other quantization types are left out: they stay
      float.
    - its LM head's Q8_0 blocks ([vocab, hidden / 32 * 34] uint8: `output.weight`, or the
      token embedding a tied head shares), or None if not Q8_0."""
    from gguf import GGMLQuantizationType

    from promptlang.runtime.fast import native
    from promptlang.runtime.model.gguf_index import read_index

    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    kinds = {GGMLQuantizationType[name].value: kind           # ggml type -> kernels.c's kind
             for kind, (name, _, _) in native.KINDS.items()}
    index = read_index(gguf)
    linears = {}
    for name, entry in index.tensors.items():
        parts = name.split(".")
        linear = len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS
        if not linear or entry.type not in kinds:
            continue
        rows = _mapped(index.rows(name))                  # [n, row bytes] uint8
        if parts[2] in ("attn_q", "attn_k") and index.arch == "llama":
            n_head = heads if parts[2] == "attn_q" else kv_heads
            half = rows.shape[0] // n_head // 2
            rows = rows.reshape(n_head, half, 2, -1).transpose(1, 2).reshape(rows.shape)
        linears[(int(parts[1]), GGUF_LINEARS[parts[2]])] = (kinds[entry.type],
                                                             rows.contiguous())
    head = index.tensors.get("output.weight") or index.tensors.get("token_embd.weight")
    if head is None or head.type != 8:
        return linears, None
    return linears, _mapped(index.rows(head.name))


def _mapped(rows) -> torch.Tensor:
    """A tensor over the read-only pages of a mapped file (the kernels only read them)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows)


def _load_converted(folder: str, dtype: torch.dtype) -> Any:
    """The model of a converted copy (`folder`, written by _convert_gguf): built without
    initialising its weights, then given the tensors of its safetensors file as they lie in
    the mapped file (a weight the runtime serves from a GGUF's blocks is then never read),
    its tied weights tied as from_pretrained ties them. transformers' from_pretrained
    initialises a tied embedding stored under the head's name with random values before
    tying it, and converts every tensor on its own. A copy that lacks a weight, holds one
    the model has not, or holds one of another shape, is a ModelError."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    again = f"delete the folder {folder!r} and load again to convert it afresh"
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        with safe_open(str(Path(folder) / "model.safetensors"), "pt") as weights:
            state = {name: weights.get_tensor(name).to(dtype) for name in weights.keys()}
    except (OSError, ValueError, SafetensorError) as err:
        raise ModelError(f"the converted model {folder!r} cannot be read ({err}): "
                         f"{again}") from None
    try:
        found = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:                  # a weight of another shape than the model's
        detail = str(err).strip().splitlines()[-1].strip()[:200]
        raise ModelError(f"the converted model {folder!r} does not fit its config "
                         f"({detail}): {again}") from None
    missing = set(found.missing_keys)
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    wrong = sorted(missing) or sorted(found.unexpected_keys)
    if wrong:
        what = "lacks" if missing else "holds weights the model has not, such as"
        raise ModelError(f"the converted model {folder!r} {what} {', '.join(wrong[:3])}: "
                         f"{again}")
    return model.eval()


def _from_pretrained(source: str, dtype: torch.dtype, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True,
                                                    **kwargs)
    except OSError as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"model {source!r} was not found locally (promptlang does not "
                         f"download from the Hugging Face hub: pass a folder that holds the "
                         f"model's files): {detail}") from None
    except ValueError as err:          # e.g. a config whose architecture has no causal LM
        raise ModelError(f"model {source!r} cannot be loaded as a causal LM: {err}") from None
    except pickle.UnpicklingError as err:    # a .bin whose pickle weights_only refuses
        raise ModelError(f"model {source!r}: its weights file holds a pickle that is not "
                         f"plain weights, refused: {str(err).splitlines()[0][:200]}") from None


def _default_model_folder() -> str:
    """The converted copy of the default model, made from the GGUF on first use."""
    from promptlang import default_model

    converted = default_model.default_converted_dir()
    if _converted_ready(converted):
        return str(converted)
    folder = default_model.default_model_files()      # fetches the GGUF if needed (own lock)
    with default_model.model_lock():
        if not _converted_ready(converted):
            _convert_default_model(folder, converted)
    return str(converted)


def _converted_ready(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def _convert_default_model(folder: Path, converted: Path) -> None:
    from promptlang import default_model

    _say("converting the default model from GGUF to float weights (once, ~40 s)...")
    _convert_gguf(folder / default_model.GGUF_FILE, converted,
                  folder / default_model.TOKENIZER_SUBDIR)


def _convert_gguf(gguf: Path, converted: Path, tokenizer_dir: Path | None = None,
                  reader=None) -> None:
    """Write the float copy of `gguf` to `converted` (through a private temporary folder
    renamed at the end); the tokenizer's files from `tokenizer_dir`, else from the GGUF.
    `reader`: the file's GGUFReader where the caller has one (else it is opened here)."""
    from gguf import GGUFReader
    from safetensors.torch import save_model

    from promptlang import default_model

    began = time.perf_counter()
    model = _from_pretrained(str(gguf.parent), torch.float32, gguf_file=gguf.name)
    reader = reader if reader is not None else GGUFReader(str(gguf))
    _keep_rope_factors(gguf, reader, model.config)
    _keep_phi3_rope(gguf, reader, model.config)
    work = default_model.partial_path(converted.parent, converted.name)
    try:
        # shared tensors (tied embeddings) are written once; from_pretrained re-ties them
        save_model(model, str(work / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config          # the copy is plain float, not GGUF
        config.dtype = torch.float32
        config.save_pretrained(str(work))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(work))
        if tokenizer_dir is not None:
            for item in tokenizer_dir.iterdir():
                if item.is_file() and item.name != "config.json":
                    shutil.copy2(item, work / item.name)
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                          local_files_only=True).save_pretrained(str(work))
        default_model.publish(work, converted)          # 0700/0600, replacing an incomplete copy
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(f"converted in {time.perf_counter() - began:.0f} s, saved to {converted}")


def _keep_rope_factors(gguf: Path, reader, config) -> None:
    """Give `config` the rotary frequency factors llama.cpp stores for a Llama 3.x model's
    rope scaling (the tensor `rope_freqs.weight`: each frequency divided by its factor),
    which transformers' GGUF loader leaves out: as transformers' "longrope" parameters with
    the same factors at every length and no attention scaling, the same frequencies.
    `reader`: the file's GGUFReader."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return
    factors = [float(v) for v in tensor.data.astype("float32").reshape(-1)]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if len(factors) != head_dim // 2:
        raise ModelError(f"{gguf}: rope_freqs.weight holds {len(factors)} factors; a head of "
                         f"{head_dim} needs {head_dim // 2}")
    theta = (config.rope_parameters or {}).get("rope_theta", 10000.0)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": theta,
                              "short_factor": factors, "long_factor": factors, "factor": 1.0,
                              "attention_factor": 1.0,
                              "original_max_position_embeddings": config.max_position_embeddings}


def _keep_phi3_rope(gguf: Path, reader, config) -> None:
    """Give a Phi-3 family `config` what transformers' GGUF loader leaves out of the file: a
    rotary dimension smaller than the head's (`phi3.rope.dimension_count`: Phi-4-mini rotates
    three quarters of each head) as `partial_rotary_factor`, and the long-context rope
    scaling llama.cpp stores as two tensors of frequency factors (`rope_factors_short`,
    `rope_factors_long`) as transformers' "longrope" parameters, with the file's original
    context length and attention factor where it gives them. `reader`: the file's
    GGUFReader.

    transformers takes the long factors for a pass that reaches past the original context
    length, so the cached passes of a longer prompt are not all computed with one set: such
    a model is served as the file intends up to that length (4k tokens for Phi-3.5-mini and
    Phi-4-mini)."""
    if getattr(config, "model_type", None) != "phi3":
        return

    def field(key: str):
        found = reader.fields.get(key)
        return None if found is None else found.parts[found.data[0]][0].item()

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dims = field("phi3.rope.dimension_count")
    parameters = dict(config.rope_parameters or {})
    if dims is not None and 0 < int(dims) < head_dim:
        parameters["partial_rotary_factor"] = int(dims) / head_dim    # transformers 5's place
    config.rope_parameters = parameters
    factors = {t.name: [float(v) for v in t.data.astype("float32").reshape(-1)]
               for t in reader.tensors
               if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
    if len(factors) != 2:
        return
    rotary = int(dims) if dims else head_dim
    for name, values in factors.items():
        if len(values) != rotary // 2:
            raise ModelError(f"{gguf}: {name} holds {len(values)} factors; a rotary "
                             f"dimension of {rotary} needs {rotary // 2}")
    original = field("phi3.rope.scaling.original_context_length")
    parameters.update({"rope_type": "longrope",
                       "short_factor": factors["rope_factors_short.weight"],
                       "long_factor": factors["rope_factors_long.weight"],
                       "original_max_position_embeddings": int(original or
                                                               config.max_position_embeddings)})
    attention = field("phi3.rope.scaling.attn_factor")
    if attention is not None:
        parameters["attention_factor"] = float(attention)
    config.rope_parameters = parameters


def _gguf_folder(gguf: Path) -> str:
    """The float copy of the GGUF file `gguf`, converted on first use (see the module doc)."""
    from promptlang.home import models_dir, private_dir

    try:
        info = os.stat(gguf)
    except OSError as err:
        raise ModelError(f"cannot read the GGUF file {str(gguf)!r}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelError(f"{str(gguf)!r} is not a regular file")
    arch = check_gguf(gguf, info.st_size)
    root = private_dir(private_dir(models_dir()) / "gguf")
    digest = _file_digest(gguf, info, root)
    converted = root / f"{gguf.stem}-{digest}-c{CONVERSIONS.get(arch, CONVERSION)}"
    if _converted_ready(converted):
        return str(converted)
    from promptlang.default_model import file_lock

    with file_lock(root / ".lock"):
        if not _converted_ready(converted):
            reader = check_gguf_fully(gguf)
            _say(f"converting {gguf.name} to float weights (once)...")
            try:
                _convert_gguf(gguf.resolve(), converted, reader=reader)
            except (ValueError, KeyError, IndexError, TypeError, RuntimeError, EOFError,
                    struct.error) as err:
                raise ModelError(f"{gguf}: cannot convert this GGUF file "
                                 f"({type(err).__name__}: {str(err)[:200]})") from None
            for older in root.glob(glob.escape(f"{gguf.stem}-{digest}") + "*"):   # earlier formats
                if older != converted and older.is_dir():
                    shutil.rmtree(older, ignore_errors=True)
    return str(converted)


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# the float copy's format, in its folder's name: 2 keeps a Llama 3.x file's rope factors; a
# Phi-3 file's is 3 (its partial rotary dimension and long-context factors kept)
CONVERSION = 2
CONVERSIONS = {"phi3": 3}
GGUF_MIN_KV_BYTES = 13        # a key's length (8), its type (4), a one-byte value
GGUF_MIN_TENSOR_BYTES = 24    # a name's length (8), dims (4), one dim (8), type (4)... at least


def check_gguf(path: Path, size: int) -> str:
    """A ModelError naming `path` and what is wrong where the file is not a GGUF promptlang
    loads: its header read by hand first (magic, version, counts that fit the file), so that
    nothing is allocated for counts a crafted file makes up, then its tensor index
    (gguf_index.py: every tensor within the file) and what it holds (check_supported).
    Returns its architecture."""
    from promptlang.runtime.model.gguf_index import read_index

    try:
        with open(path, "rb") as handle:
            head = handle.read(24)
    except OSError as err:
        raise ModelError(f"{path}: cannot read the GGUF file ({err.strerror})") from None
    if len(head) < 24:
        raise ModelError(f"{path}: not a GGUF file (its {len(head)} bytes are shorter than a "
                         f"GGUF header)")
    if head[:4] != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not "
                         f"{GGUF_MAGIC!r})")
    version, tensors, kvs = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise ModelError(f"{path}: GGUF version {version} (this reader takes versions "
                         f"{', '.join(map(str, GGUF_VERSIONS))})")
    if kvs * GGUF_MIN_KV_BYTES > size or tensors * GGUF_MIN_TENSOR_BYTES > size:
        raise ModelError(f"{path}: a GGUF header that claims {tensors:,} tensors and {kvs:,} "
                         f"metadata entries in {size:,} bytes (truncated or corrupt)")
    index = read_index(path)
    check_supported(path, index)
    return index.arch


def check_gguf_fully(path: Path):
    """check_gguf's file read by the gguf package's own parser too (every metadata value
    decoded): before a conversion, which reads them all. Returns the GGUFReader."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as err:                 # the gguf package's parser on a damaged file
        raise ModelError(f"{path}: a damaged GGUF file ({type(err).__name__}: "
                         f"{str(err)[:200]})") from None


# GGUF architectures promptlang loads (each tested with a tiny file against transformers'
# own implementation of the family: tests/runtime/test_gguf.py); a Mistral GGUF from
# llama.cpp's converter is a "llama" one
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
# tensor types read from the file as stored by the kernels (the rest become float32 weights)
GGUF_STORED_TYPES = ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def gguf_types() -> tuple[str, ...]:
    """The tensor types a GGUF may hold: float ones and those the gguf package dequantizes."""
    from gguf.quants import _type_traits

    return ("F32", "F16", "BF16") + tuple(sorted(t.name for t in _type_traits))


def check_supported(path: Path, index) -> None:
    """A ModelError naming `path`, what it holds and what is supported, where its architecture
    or one of its tensor types is not one promptlang loads (before any conversion); `index`:
    its gguf_index.GgufIndex."""
    from gguf import GGMLQuantizationType

    if not index.arch:
        raise ModelError(f"{path}: the GGUF names no architecture (general.architecture); "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    if index.arch not in GGUF_ARCHITECTURES:
        raise ModelError(f"{path}: architecture {index.arch!r} is not supported (supported "
                         f"GGUF architectures: {', '.join(GGUF_ARCHITECTURES)})")
    known = gguf_types()
    for entry in index.tensors.values():
        name = GGMLQuantizationType(entry.type).name
        if name not in known:
            raise ModelError(f"{path}: tensor {entry.name!r} is of type {name}, which "
                             f"promptlang does not read (supported: {', '.join(known)}; "
                             f"read as stored: {', '.join(GGUF_STORED_TYPES)})")


DIGESTS = ".digests.json"        # in the GGUF copies' folder: {path: {"stamp", "sha256"}}
MAX_DIGESTS = 256


def _file_digest(gguf: Path, info: os.stat_result, root: Path) -> str:
    """The first 16 hex digits of the sha256 of `gguf` (stat `info`), which names its
    converted copy: remembered in `root`/.digests.json by the file's path and stat (size,
    modification and change times, inode, device), so that a later load does not read the
    whole file again. Writing a file changes its change time, which no call can set back,
    so a file written since is hashed again."""
    from promptlang.home import write_private

    key = str(gguf.resolve())
    stamp = [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]
    memo_path = root / DIGESTS
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8")) \
            if memo_path.stat().st_size <= MAX_DIGESTS * 1024 else {}
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    entry = memo.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = _sha256(gguf)[:16]
    memo.pop(key, None)
    memo[key] = {"stamp": stamp, "sha256": digest}
    kept = dict(list(memo.items())[-MAX_DIGESTS:])       # the most recently hashed
    try:
        write_private(memo_path, json.dumps(kept).encode())
    except OSError:
        pass                                             # hashed again next time
    return digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()



def _say(message: str) -> None:
    print(f"promptlang: {message}", file=sys.stderr, flush=True)
