"""Work run on a thread that then ends, so that the caller's thread keeps no OpenMP pool.

torch's parallel operations (and the CPU kernels) leave an OpenMP thread pool with the thread
that ran them, for as long as that thread lives. While a process holds more OpenMP threads
than cores, libgomp stops spinning at barriers and puts waiting threads to sleep instead:
pl_decoder meets ~8 barriers per layer, so a server whose main thread loaded the model (one
pool) and whose engine thread decodes (a second) decoded ~25-30% slower, measured
(docs/SERVING.md). Work done here takes its pool with it when the helper thread ends.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_passing_thread(work: Callable[[], T], name: str = "promptlang-passing") -> T:
    """`work()` on a new thread that ends before this returns; its result, or what it raised
    (re-raised here, on the caller's thread)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as error:            # handed to the caller, raised there
            box["error"] = error

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    helper.join()
    if "error" in box:
        raise box["error"]                        # type: ignore[misc]
    return box["result"]                          # type: ignore[return-value]
