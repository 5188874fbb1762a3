"""The module store: encoded units' KV, kept in tiers and looked up by content key.

Tiers, fastest first:

    device  tensors on the compute device, ready for the assembler          memory.py
    host    CPU memory; on CUDA pinned, copied to the device asynchronously  memory.py
    disk    one safetensors file per key and store dtype under `disk_dir`;   disk.py
            survives restarts, checked on load                    (kvfile.py, folder.py)

`ModuleStore` (module_store.py) composes them: the device and host tiers are exclusive (an
entry lives in at most one of them); the disk tier is written through on `put`. Each tier has
a byte budget (None = unlimited, 0 = tier off; `disk_budget_bytes=0` turns the disk tier off
entirely) and evicts least-recently-used entries past it: device -> host -> dropped (still on
disk); policy.py holds these rules. The key (key.py) names its content: two puts of one key
carry the same tensors. tier.py says what a tier is, for adding one (e.g. a remote tier).

On a CPU device the device and host tiers would be the same memory, so there is one memory
tier, reported as "device", governed by `device_budget_bytes`; `host_budget_bytes` is
ignored. `host_tier=True` keeps a separate host tier anyway (entries move between the two by
reference, never copied): a two-level LRU, used by the tests to exercise demotion.

Store dtype: `dtype=torch.bfloat16` (or float16) stores keys and values at that precision in
every tier (halving their bytes; budgets count stored bytes). `get` converts them back to
`compute_dtype` if given, else to the dtype they were put with; that conversion is a copy per
get. Without a store dtype, `get` returns the stored tensors themselves.

Nothing that failed a check is ever served: a bad file is a miss, and the unit is encoded
again (disk.py says how each kind of bad file is reported and treated).
"""

from promptlang.runtime.store.folder import MARKER, clear_disk, list_disk_entries
from promptlang.runtime.store.module_store import TIERS, ModuleStore, StoreEntry, StoreStats
from promptlang.runtime.store.tier import CacheWarning

__all__ = ["CacheWarning", "ModuleStore", "StoreEntry", "StoreStats", "TIERS", "MARKER",
           "clear_disk", "list_disk_entries"]
