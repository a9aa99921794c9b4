#include "base/config_table.h"

namespace kvferry::internal {
namespace {

constexpr int64_t kMaxInt = int64_t{1} << 50;

constexpr KnobDecl kKnobs[] = {
    {"log.level", KnobType::kString, "info", "least severe log level printed to stderr", 0, 0,
     "error|warn|info|debug"},
    {"device.default", KnobType::kString, "cpu",
     "device the tools use when --device is not given: cpu, cuda or cuda:N", 0, 0, ""},
    {"cpu.pinned_alignment", KnobType::kInt, "4096",
     "alignment in bytes of CPU-device allocations (must allow O_DIRECT I/O)", 64, 1 << 21, ""},
    {"cpu.streaming_copy_min_bytes", KnobType::kInt, "1048576",
     "CPU-device copies writing at least this many bytes in all (one Copy, CopyBatch or Copy2D) "
     "use non-temporal stores: past the caches they move 2 bytes per byte copied instead of 3, "
     "but leave nothing cached; 0: never",
     0, kMaxInt, ""},
    {"cuda.copy_kernel_threshold", KnobType::kInt, "1048576",
     "fragments below this many bytes are moved by the batched gather kernel, above it by the "
     "copy engine",
     0, kMaxInt, ""},
    {"files.backend", KnobType::kString, "posix",
     "file tier I/O backend; io_uring and cufile fall back to posix (logged) where unavailable", 0,
     0, "posix|io_uring|cufile"},
    {"files.slots_per_file", KnobType::kInt, "256",
     "slots per slab file of the file tier (files are created lazily, one at a time)", 1, 1 << 20,
     ""},
    {"files.direct_io", KnobType::kBool, "true",
     "file tier uses O_DIRECT where the filesystem allows it (tmpfs: buffered, logged)", 0, 0, ""},
    {"files.max_in_flight", KnobType::kInt, "16",
     "slots one file tier batch keeps in flight (io_uring depth; staging is sized by it)", 1, 4096,
     ""},
    {"files.io_timeout_ms", KnobType::kInt, "30000",
     "deadline of one file tier read or write batch", 1, 3600 * 1000, ""},
    {"transfer.timeout_ms", KnobType::kInt, "30000",
     "deadline of one KV transfer, from first contact to the last byte", 1, 3600 * 1000, ""},
    {"transfer.chunk_bytes", KnobType::kInt, "4194304",
     "size of one staging chunk: scattered fragments are packed into chunks of at most this", 4096,
     int64_t{1} << 30, ""},
    {"transfer.staging_chunks", KnobType::kInt, "8",
     "staging chunks per rank and side; staging memory = chunks * chunk_bytes, whatever the "
     "prompt length",
     1, 4096, ""},
    {"transfer.direct_min_bytes", KnobType::kInt, "262144",
     "fragments contiguous on both sides and at least this large move pool to pool, unstaged", 1,
     kMaxInt, ""},
    {"transfer.max_inflight_per_pair", KnobType::kInt, "16",
     "transport operations in flight per (context rank, generation rank) pair and request", 1, 4096,
     ""},
    {"transfer.rma", KnobType::kBool, "true",
     "move KV by one-sided puts into the peer's registered pool and staging where both "
     "transports can (else tagged messages)",
     0, 0, ""},
    {"transfer.rma_row_min_bytes", KnobType::kInt, "65536",
     "one-sided path: fragment rows at least this long are put pool to pool; shorter ones are "
     "packed into staging, put, and unpacked",
     1, kMaxInt, ""},
    {"transfer.peer_memory", KnobType::kString, "auto",
     "one-sided path on one host: the context rank maps the generation pool and copies every "
     "piece into it with its own stream, one batched copy per step (no transport puts, no "
     "staging). auto and on: GPU pools (CUDA IPC) and CPU-device pools (shared host memory "
     "between processes of one host, or ranks of one process; a wrapped region of another "
     "process falls back to puts); on also offers pinned host pools of a GPU (refused by CUDA "
     "today); off: transport puts",
     0, 0, "auto|on|off"},
    {"transfer.wire_version", KnobType::kInt, "11",
     "control-message version this rank speaks: 11 (the current one; meets a peer of version 10 "
     "in version 10 and refuses others by name) or 10 (behaves as a version-10 build: rolling "
     "upgrades). 9, 12 and 13 only pretend a build of that version (version 11's messages under "
     "its number), to test refusals",
     9, 13, ""},
    {"transfer.spin_us", KnobType::kInt, "200",
     "a progress thread with operations in flight polls every 10 us (short sleeps; a "
     "sched_yield there gave the core away for a scheduler slice, milliseconds, whenever another "
     "thread was runnable) for this long after the last thing happened, then naps 50 us at a "
     "time (frees the cores for the ranks that copy; costs up to a nap of latency on long "
     "waits)",
     0, 10 * 1000 * 1000, ""},
    {"transfer.stream_nap_us", KnobType::kInt, "1000",
     "how long a context progress thread naps while all it waits for is peer-memory copies on "
     "its CPU-device stream (the end of each launched group of copies, a public call and this "
     "timeout wake it; a peer's control message waits for them, so peers send without waking "
     "it). Polling every 50 us instead preempted the copying thread about 10,000 times a second",
     50, 1000 * 1000, ""},
    {"transfer.peer_wait_nap_us", KnobType::kInt, "500",
     "how long a generation progress thread naps while all it waits for are the CHUNK and "
     "COMPLETE messages of peer-memory pairs (a context rank copies into its pool): with one "
     "request live such a message wakes it where the transport has a wakeup fd (ucx, inproc); "
     "with several, or without that fd, it is noticed up to this late (an armed transport costs "
     "each sender a wake-up); polling every 50 us instead took the cores from the context ranks' "
     "copying threads (TP2->TP4: four generation ranks, two copying threads, two cores)",
     50, 1000 * 1000, ""},
    {"transfer.profile", KnobType::kBool, "false",
     "progress threads time their phases with the thread CPU clock and context ranks measure how "
     "long their copy stream had work (TransceiverMetrics::profile, bench transfer's profile "
     "rows); a few clock reads per loop iteration",
     0, 0, ""},
    {"transfer.checksum", KnobType::kBool, "false",
     "each chunk carries a digest of its bytes (XXH64 per 4 KiB, computed where the bytes "
     "are: the CPU, or a kernel for GPU pools), verified on the receiver (kDataLoss on a "
     "mismatch)",
     0, 0, ""},
    {"transfer.abort_grace_ms", KnobType::kInt, "1000",
     "after a request fails, how long a context rank waits for sends a dead peer never takes "
     "before it ends the request anyway (sends only read the blocks)",
     0, 600 * 1000, ""},
    {"transfer.unknown_request_wait_ms", KnobType::kInt, "2000",
     "how long a context rank holds a fetch for a request it does not know yet (its MarkReady may "
     "come later than another rank's) before refusing it",
     0, 3600 * 1000, ""},
    {"transport.close_timeout_ms", KnobType::kInt, "2000",
     "how long destroying a transport waits for its endpoints to flush and close before it "
     "forces them",
     0, 600 * 1000, ""},
    {"ucx.tls", KnobType::kString, "",
     "UCX transports to use (UCX_TLS syntax, e.g. 'shm,tcp' or 'rc,cuda_ipc'); empty: UCX's own "
     "choice",
     0, 0, ""},
    {"ucx.error_mode", KnobType::kString, "split",
     "split: per peer a control endpoint that notices a crashed peer (error mode peer, TCP) "
     "beside a data endpoint on the fastest transports (error mode none: shared memory, CMA, "
     "cuda_ipc); peer: both in error mode peer (UCX then avoids shared memory: TCP on one "
     "host); none: both in error mode none, a crashed peer is only noticed by the caller's "
     "deadlines (an orderly shutdown is still signalled)",
     0, 0, "split|peer|none"},
    {"ucx.keepalive_ms", KnobType::kInt, "1000",
     "UCX keepalive interval: how soon a peer that died without closing is detected", 10,
     3600 * 1000, ""},
    {"ucx.progress_spin", KnobType::kInt, "1",
     "ucp_worker_progress calls per Transport::Progress() (more: less call overhead per byte)", 1,
     1000, ""},
    {"nixl.library", KnobType::kString, "",
     "NIXL's C API for --transport nixl: libnixl_capi.so, a directory holding it, or a "
     "site-packages directory holding the nixl-cu13 wheel; empty: .deps/py (scripts/setup), then "
     "the running Python's site-packages",
     0, 0, ""},
    {"nixl.check_version", KnobType::kBool, "true",
     "refuse a NIXL whose wheel does not say 1.5.x (the C API kvferry declares)", 0, 0, ""},
    {"nixl.backend", KnobType::kString, "UCX",
     "the NIXL backend plugin the nixl transport creates (UCX, LIBFABRIC, ...; `kvferry info` "
     "lists the plugins found)",
     0, 0, ""},
    {"nixl.backend_params", KnobType::kString, "",
     "parameters of that backend, KEY=VALUE,KEY=VALUE (UCX: num_workers, ucx_error_handling_mode"
     "=peer|none, device_list, ...); empty: NIXL's defaults",
     0, 0, ""},
    {"nixl.control", KnobType::kString, "notifications",
     "what carries the nixl transport's control messages and tagged data: notifications (NIXL's "
     "own) or ucx (kvferry's UCX transport beside NIXL, with a wakeup fd; NIXL keeps the "
     "one-sided data)",
     0, 0, "notifications|ucx"},
    {"nixl.keepalive_ms", KnobType::kInt, "500",
     "the nixl transport pings each peer it talks to this often", 10, 3600 * 1000, ""},
    {"nixl.peer_timeout_ms", KnobType::kInt, "5000",
     "a nixl peer that sent something before and nothing for this long is dead (its pending "
     "operations fail)",
     100, 3600 * 1000, ""},
    {"tiering.file_staging_blocks", KnobType::kInt, "32",
     "pinned staging of the file tier, in blocks; also the largest batch to or from files", 1,
     1 << 20, ""},
    {"tiering.offload_min_priority", KnobType::kInt, "0",
     "evicted primary blocks with a retention priority below this are dropped, not offloaded "
     "(101 = never offload)",
     0, 101, ""},
    {"tiering.partial_reuse", KnobType::kBool, "true",
     "reuse the leading tokens of a partially matching cached block by copying them", 0, 0, ""},
    {"tiering.io_timeout_ms", KnobType::kInt, "30000",
     "file-tier I/O of the block manager older than this is abandoned (counted and logged; its "
     "slots stay leased until it ends)",
     1, 3600 * 1000, ""},
    {"cuda.copy_engine_min_row_bytes", KnobType::kInt, "65536",
     "2-D fragments with rows narrower than this, and device-to-device 2-D fragments of any "
     "width, go to the gather kernel even when their total reaches cuda.copy_kernel_threshold "
     "(the copy engine is slow on narrow rows, and slower than the kernel between two places in "
     "GPU memory); 0: never",
     0, kMaxInt, ""},
    {"cuda.copy_engine_list_row_bytes", KnobType::kInt, "16384",
     "2-D fragments on the copy engine with rows at least this wide (and at most 256 rows) are "
     "listed row by row in the cudaMemcpyBatchAsync; narrower rows, or all with a larger value, "
     "go as one cudaMemcpy2DAsync each (the engine walks the rows)",
     1, kMaxInt, ""},
    {"cuda.copy_engine_directions", KnobType::kString, "none",
     "small fragments (below cuda.copy_kernel_threshold) in these directions go to the copy "
     "engine in one cudaMemcpyBatchAsync instead of the gather kernel",
     0, 0, "none|h2d|d2h|both"},
    {"cuda.batch_copies", KnobType::kBool, "true",
     "submit a batch's copy-engine fragments with one cudaMemcpyBatchAsync (CUDA 12.8+) instead "
     "of one cudaMemcpyAsync each",
     0, 0, ""},
    {"cuda.gather_max_blocks", KnobType::kInt, "0",
     "thread blocks of one gather-kernel launch; 0: two per SM, so kernels of two copy streams "
     "(offload and onboard) run side by side instead of one after the other",
     0, 65535, ""},
    {"tiering.device_staging", KnobType::kString, "auto",
     "primary <-> host copies of fragmented blocks go through device staging (a device-local "
     "gather or scatter, then one contiguous link copy per block): auto = on GPUs when a host "
     "block is one range in the primary's own in-block order (H200, per-layer pool into a "
     "block-major-nhd host tier: 87-90 vs 70 GB/s both ways, 0.97 vs 0.91 one way, like a "
     "block-major pool); whole-block batches only; always = "
     "whenever a primary block is fragmented (any device, any host layout)",
     0, 0, "auto|always|never"},
    {"tiering.device_staging_blocks", KnobType::kInt, "32",
     "device staging per copy stream, in blocks: two halves that alternate (the device-local leg "
     "of one beside the link copy of the other); larger batches go through it half by half",
     1, 1 << 20, ""},
    {"tiering.free_low_pct", KnobType::kInt, "5",
     "background tiering: below this percent of free blocks (primary, host), LRU victims move "
     "down a tier ahead of need",
     0, 100, ""},
    {"tiering.free_high_pct", KnobType::kInt, "10",
     "background tiering: victims move down until this percent of blocks is free (0: only on "
     "demand)",
     0, 100, ""},
    {"cuda.copy_engine_2d_directions", KnobType::kString, "none",
     "2-D fragments at or above cuda.copy_kernel_threshold with rows narrower than "
     "cuda.copy_engine_min_row_bytes go to the copy engine, not the gather kernel, in these "
     "directions (one direction on the copy engine, the other as a kernel)",
     0, 0, "none|h2d|d2h|both"},
    {"tiering.max_events", KnobType::kInt, "65536",
     "router events the block manager keeps until DrainEvents; past it the oldest are dropped "
     "and counted (events_dropped)",
     1, 1 << 30, ""},
    {"files.recover", KnobType::kString, "verify",
     "slab files found at open: verify = keep every slot whose header and payload checksum "
     "verify (reads every slot), headers = check headers only, none = forget them",
     0, 0, "verify|headers|none"},
    {"transfer.peer_batch_bytes", KnobType::kInt, "1073741824",
     "peer-memory sends: bytes of consecutive chunks one CopyBatch (one gather-kernel launch) "
     "covers at most",
     1 << 20, int64_t{1} << 40, ""},
    {"transfer.peer_merge_pairs", KnobType::kBool, "true",
     "peer-memory sends: the batches of all pairs (generation ranks and requests) found ready in "
     "one progress iteration go out as one CopyBatch (one gather-kernel launch, up to "
     "transfer.peer_batch_bytes)",
     0, 0, ""},
    {"transfer.peer_hold_launches", KnobType::kInt, "-1",
     "peer-memory sends with transfer.peer_merge_pairs: while this many launches are on the "
     "context rank's copy stream, newly ready batches wait and go out as one launch when it "
     "drains below (2 = one copying, one queued); 0 = the batches found in each progress "
     "iteration go out at once; -1 = by device: 2 on the CPU device (one pass over the source "
     "rows that several generation ranks' head slices share), 0 on CUDA (no gain measured)",
     -1, 64, ""},
    {"transfer.peer_max_mapped", KnobType::kInt, "1024",
     "peer memory: generation pool regions a context rank keeps mapped; past it the least "
     "recently used one no transfer is copying into is unmapped (those of an exporter that "
     "exited go within a second anyway)",
     1, 1 << 20, ""},
};

}  // namespace

KnobTable Knobs() { return {kKnobs, static_cast<int>(sizeof(kKnobs) / sizeof(kKnobs[0]))}; }

}  // namespace kvferry::internal
