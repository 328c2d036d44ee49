// Copies into memory this CPU will not read again soon, with non-temporal (streaming) stores where the CPU has them.
//
// The GPU proxy stores what ranks of other hosts sent into the far copies (pinned host memory as large as the HT and
// LL buffers, which the GPU reads over PCIe). A plain memcpy there first reads every destination line from DRAM
// (read-for-ownership: the far copy is far larger than the caches) and then evicts other lines to hold it; streaming
// stores write whole lines without reading them and leave the caches alone: one thread of the 16-core H100 host
// copied 14 KiB records into cold pinned memory at 14.8 GB/s this way against memcpy's 7.5 (bench/gpu/
// host_path_probe.cu (c)). Across virtual hosts that changed no end-to-end figure (s31: the copy was not the bound),
// but it halves the proxy thread's time per byte stored.
//
// Streaming stores are weakly ordered, even against later plain stores of the same thread: call streamFence()
// before a store that publishes the copied bytes (the proxy's FLAG records).
#pragma once
#include <cstddef>

namespace epcomm {

// memcpy's contract (no overlap); small copies and CPUs without streaming stores take memcpy itself.
void* streamCopy(void* dst, const void* src, size_t n);
// Orders every earlier streamCopy before the stores after it (x86: sfence; elsewhere a release fence).
void streamFence();

}  // namespace epcomm
