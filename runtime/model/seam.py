"""Serving a seam adapter: the passes of the tokens after a request's last cached unit.

A request under policy `tuned` is served its units as `none` serves them (each unit's KV
encoded apart by the base model, from the store); then the tokens after its last cached
unit, and every decode step after them, run on a `SeamModel`: the same model with the seam
adapter's low-rank change folded into its attention projections (`W + scale * B A`, the
sum the tune loop's forward hooks compute; runtime/model/lora.py). Every cached unit stays
the base model's KV, so the store stays shared and every exact path stays exact.

A SeamModel stands in for the ModelAdapter in the passes it runs: `forward` swaps the
merged weights in under the model's lock, runs the transformers path (the fused layers
read their own weight table, so they are turned off for the pass), and swaps the base
weights back. `forward_batch` answers None: a batch step runs such a request on its own.
`numerics` names the adapter, so a prompt tail computed with it is never served to a
request without it. An adapter that encodes also serves as the encoder's model for the
requests under `tuned`: their units are encoded through `forward` too, and stored under
keys made from `fingerprint`, which names the adapter. An adapter with link tokens (runtime/model/lora.py) has them written
into the request's KV buffer by `place_links`, after its cached units and before its first
token computed here: every pass run through the SeamModel then attends to them as to any
buffer token. They hold the position just before that token (the one their keys are
rotated to) and, as a token id, the buffer's first token (a slot must hold some id; the
decoder's lookup drafts read the ids, and a draft is checked by the model like any).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterator

import torch

from promptlang.errors import AdapterFileError
from promptlang.home import ADAPTER_FILE, adapter_folder, untrusted_reason, write_private
from promptlang.runtime.fast import fused
from promptlang.runtime.model.adapter import ModelAdapter, Step
from promptlang.runtime.model.lora import SeamLoRA, fitted_projections

SHIPPED = Path(__file__).with_name("adapters")   # the adapters that come with promptlang


class _NoFastPaths:
    """What a SeamModel's passes have of the fast paths: none of the fused layers."""

    decoder = None
    attention = None


class SeamModel:
    """`base` with the seam adapter `lora` folded into its attention projections for the
    passes run through it; everything else is read from `base`."""

    fast = _NoFastPaths()

    def __init__(self, base: ModelAdapter, lora: SeamLoRA, *, name: str, source: str):
        self.base = base
        self.name = name                  # the adapter file's digest
        self.source = source              # where it was loaded from, for messages
        self._lora = lora
        fitted_projections(base.model, lora, source)         # refused here if it does not fit
        # W + scale * B A per projection, in fitted_projections' order: made on the first
        # pass (a load that never serves `tuned` holds no second copy of those weights)
        self._merged: list[torch.nn.Parameter] | None = None

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    @property
    def numerics(self) -> tuple:
        return (*self.base.numerics, ("seam", self.name))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past, allowed,
                logits_rows: torch.Tensor | None = None, *, by_position: bool = False) -> Step:
        """ModelAdapter.forward with the adapter's weights (see the module docstring)."""
        with self.base.lock, fused.disabled(), self.base.float32_passes(), self._swapped():
            return self.base.forward(input_ids, positions, past, allowed, logits_rows,
                                     by_position=by_position)

    @property
    def encodes(self) -> bool:
        """Whether the adapter also encodes the modules (runtime/model/lora.py)."""
        return self._lora.shape.encodes

    @property
    def fingerprint(self) -> str:
        """The store's key for the units this model encodes: the base model's, with the
        adapter named (an adapter that encodes stores its units apart from the base's)."""
        named = f"{self.base.fingerprint}+seam-{self.name}".encode()
        return hashlib.sha256(named).hexdigest()[:32]

    @property
    def link_tokens(self) -> int:
        """The adapter's link tokens (0: none)."""
        return self._lora.shape.link_tokens

    def place_links(self, buffer, first_position: int) -> None:
        """The link tokens' KV into `buffer` after its tokens, for a pass whose first token
        is at `first_position` (see the module docstring); nothing without link tokens."""
        count = self.link_tokens
        if not count:
            return
        n = buffer.length
        if n + count > buffer.capacity:       # pooled buffers stay normal tensors
            with torch.inference_mode(False):
                buffer.reserve(n + count + 1)
        position = max(int(first_position) - 1, 0)
        with torch.inference_mode():
            keys, values = self._lora.link_kv(self.base.model, position, buffer.slot_keys.dtype)
            device = buffer.slot_keys.device
            buffer.slot_keys[:, :, n:n + count] = keys.to(device)
            buffer.slot_values[:, :, n:n + count] = values.to(device)
            first = int(buffer.token_ids[int(torch.argmin(buffer.positions[:n]))]) if n else 0
            buffer.append(torch.full((count,), first, dtype=torch.int64),
                          torch.full((count,), position, dtype=torch.int64))

    def forward_batch(self, items) -> None:
        """Never batched with other requests: the caller runs `forward` per request."""
        return None

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        """The merged weights in place of the base ones (the caller holds the model lock)."""
        # the layers are looked up at each pass: the fused decoder puts a layer whose
        # weight is kept as blocks in place of a float one, and back (fast/blocks.py)
        projections = fitted_projections(self.base.model, self._lora, self.source)
        if self._merged is None:
            self._merged = [torch.nn.Parameter(
                self._lora.merged_weight(index, target, linear.weight.detach()),
                requires_grad=False) for index, target, linear in projections]
        base = []
        try:
            for (_, _, linear), merged in zip(projections, self._merged):
                base.append((linear, linear._parameters["weight"]))
                linear._parameters["weight"] = merged
            yield
        finally:
            for linear, weight in base:
                linear._parameters["weight"] = weight


def find_seam_adapter(fingerprint: str) -> Path | None:
    """The seam adapter file for the model with `fingerprint`: the one `promptlang tune`
    wrote under the home's adapters/ (it is the user's: private files only), else the one
    shipped with promptlang, else None."""
    tuned = adapter_folder(fingerprint) / ADAPTER_FILE
    if untrusted_reason(tuned) is None:
        return tuned
    shipped = SHIPPED / fingerprint[:16] / ADAPTER_FILE
    return shipped if shipped.is_file() else None


HINT_MARKER = "no-adapter-hint-shown"


def tune_hint_once(fingerprint: str, model: str | None) -> str | None:
    """The line that tells a user how to tune a seam adapter for a model that has none, the
    first time a command loads that model (per home); None once it was shown, or where the
    home cannot be written (the hint is then left out rather than repeated). A marker file
    in the model's adapter folder remembers it."""
    marker = adapter_folder(fingerprint) / HINT_MARKER
    if marker.exists():
        return None
    try:
        write_private(marker, b"")
    except OSError:
        return None
    named = f" --model {model}" if model else ""
    return (f"promptlang: this model has no seam adapter, so a new combination of cached "
            f"modules is computed again under `exact` (the full prefill's answers, at "
            f"prefill speed); `promptlang tune{named}` learns one on this CPU with no labels "
            f"and no downloads, and `--recompute tuned` then serves it (docs/RECOMPUTE.md). "
            f"Said once per model.")


def load_seam(base: ModelAdapter, path: str | Path) -> SeamModel:
    """The seam adapter file `path` made for `base`'s model, ready to serve;
    AdapterFileError if it is not one, or was tuned for another model."""
    lora, meta = SeamLoRA.load(Path(path))
    made_for = meta.get("model_fingerprint")
    if made_for != base.weights_fingerprint:
        raise AdapterFileError(f"{path}: the adapter was tuned for model {made_for!r}, not "
                               f"this one ({base.weights_fingerprint!r})")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return SeamModel(base, lora, name=digest, source=str(path))
