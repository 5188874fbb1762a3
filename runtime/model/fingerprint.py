"""The model fingerprint: what determines the KV a model computes, as one stable id.

The store keys every unit's KV by it (with the unit's tokens and positions), so that KV
computed by one model is never served for another.
"""

from __future__ import annotations

import hashlib
import json

import torch

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "architectures",
                         "torch_dtype", "dtype", "_attn_implementation_autoset"}



def model_fingerprint(hf_model: torch.nn.Module) -> str:
    """Identifies what determines the KV: the config, and the name, shape, dtype and every
    byte of every weight. Each tensor's raw bytes are hashed in place (one device->CPU copy
    for tensors elsewhere), on a few threads (hashlib releases the GIL): one pass over the
    weights per load (a converted copy's is kept in its load record: load_record.py)."""
    from concurrent.futures import ThreadPoolExecutor
    from os import cpu_count

    def tensor_digest(p: torch.Tensor) -> bytes:
        flat = p.detach().to("cpu").contiguous().reshape(-1)
        if not flat.numel():
            return hashlib.sha256().digest()
        return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).digest()  # any dtype

    h = hashlib.sha256(b"promptlang-model-fingerprint-v2\0")
    config = {k: v for k, v in hf_model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    params = sorted(hf_model.named_parameters(), key=lambda kv: kv[0])
    with torch.no_grad(), ThreadPoolExecutor(max(1, min(8, cpu_count() or 1))) as pool:
        digests = pool.map(tensor_digest, [p for _, p in params])
        for (name, p), digest in zip(params, digests):
            h.update(f"\0{name}:{tuple(p.shape)}:{p.dtype}\0".encode() + digest)
    return h.hexdigest()[:32]
