"""kvferry: move the KV cache of LLM inference.

Two jobs, one library (C++ core, this package binds it):

* **Tiering inside one instance** — :class:`TransferManager` copies blocks between a primary pool
  (GPU memory) and a host pool on its own streams; :class:`BlockManager` reuses cached prefixes,
  offloads evicted blocks and onboards them back.
* **Disaggregated serving** — every context (prefill) rank has a :class:`ContextSide`; its
  ``mark_ready`` returns a handle (``bytes``) that the router passes to the generation (decode)
  ranks, whose :class:`GenerationSide` ``fetch`` the cache into their own pools, whatever the TP/PP
  split on each side.

Objects own their C++ resources and release them on ``close()`` or at the end of a ``with``
block; using a closed object raises :class:`ClosedError`. Failures raise subclasses of
:class:`Error` (``.code``, ``.message``). Calls that wait release the GIL.
"""

from __future__ import annotations

try:
    # The UCX 1.22 the extension links comes from the libucx-cu13 wheel (a dependency): load its
    # libraries first, as RAPIDS packages do, so the extension's libucp.so.0 is that one wherever
    # the wheel lies (its RUNPATH also names site-packages/libucx/lib).
    import libucx as _libucx

    _libucx.load_library()
except ImportError:
    pass

from . import errors, metrics
from ._kvferry import (
    BlockManager,
    ContextSide,
    Device,
    Event,
    GenerationSide,
    InProcFabric,
    KvShape,
    ParallelConfig,
    Pool,
    RankSlice,
    Rendezvous,
    RendezvousServer,
    SlabStore,
    Stream,
    Tier,
    TransferBatch,
    TransferManager,
    TransferState,
    TransferStatus,
    build_features,
    get_knob,
    knobs,
    list_devices,
    random_key,
    reset_knob,
    set_knob,
    slice_of,
    transports,
    version,
)
from .errors import (
    CancelledError,
    ClosedError,
    DataLossError,
    DeadlineExceededError,
    Error,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)

__version__ = version()

__all__ = [
    "BlockManager", "CancelledError", "ClosedError", "ContextSide", "DataLossError",
    "DeadlineExceededError", "Device", "Error", "Event", "GenerationSide", "InProcFabric",
    "InternalError", "InvalidArgumentError", "KvShape", "NotFoundError", "ParallelConfig", "Pool",
    "RankSlice", "Rendezvous", "RendezvousServer", "ResourceExhaustedError", "SlabStore", "Stream", "Tier", "TransferBatch", "TransferManager",
    "TransferState", "TransferStatus", "UnavailableError", "build_features", "errors", "get_knob",
    "knobs", "list_devices", "metrics", "random_key", "reset_knob", "set_knob", "slice_of", "transports", "version",
]
