// The ceilings of the GPU engine's path between hosts on this machine, each alone (common/gpu_remote.h has the path):
//   (a) kernels storing records into pinned, mapped host memory, as they fill the proxy's rings (14 KiB payloads,
//       a system fence and a stamp per record, or none);
//   (b) kernels loading from pinned, mapped host memory, as they read the far copies;
//   (c) one CPU thread (or T) copying records from a small, cache-warm source (an inbox) into a large, cold
//       destination (a far copy): memcpy against streamCopy (common/stream_copy.h);
//   (d) the copy engine's pinned D2H / H2D rate, for reference;
//   (e) records reserved as the kernels do it (an atomic add per record, the ring-room read of host memory or not);
//   (f) kernels loading from mapped host memory while other blocks poll one word of it, as waiters on a flag that a
//       rank of another host raises do.
// Virtual hosts on one machine put the net transport's socket copies on the same memory; these say what is left.
//
//   host-path-probe [--mb 512] [--blocks 32]
#include <cuda_runtime.h>

#include <cstdint>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/stream_copy.h"
#include "cuda_check.h"

namespace {

constexpr size_t kRecord = 14 * 1024 + 32;

// Every warp writes whole records (payload from device memory, 16-byte stores) into the host ring, then, with
// fence, a system fence and the stamp, as remoteCommitWarp does.
__global__ void storeRecords(uint4* ring, const uint4* src, size_t records, bool fence) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;
  const size_t words = kRecord / 16;
  for (size_t r = warp; r < records; r += nwarps) {
    uint4* d = ring + r * words;
    const uint4* s = src + (r % 64) * words;
    for (size_t i = 2 + lane; i < words; i += 32) d[i] = s[i];
    if (fence) {
      __threadfence_system();
      __syncwarp();
      if (lane == 0) *reinterpret_cast<volatile unsigned long long*>(d) = r + 1;
    }
  }
}

// As the kernels reserve records (remote.cuh remoteReserve / ringRoom / remoteCommitWarp): lane 0 takes the record's
// place with an atomic add on the ring's counter (device memory) and, with room_read 1, reads the proxy's consumed
// count (host memory) per record, as ringRoom did past the ring's first lap until s31 (there the writes waited for
// the read; here only the fence does, so this is an upper bound of that path); with 2, as it does since: the
// largest count read so far (device memory) first, host memory only where that is too low, which here is never
// after the first launch (the count never moves): the case of a ring with room, not of kernels a lap ahead of the
// proxy, where every waiting warp reads host memory again. The warp writes the payload; a system fence and the
// stamp.
__global__ void reserveRecords(uint8_t* ring, size_t ring_bytes, unsigned long long* reserved,
                               const volatile unsigned long long* consumed, const uint4* src, size_t records,
                               uint32_t payload, int room_read, unsigned long long* seen, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;
  const uint32_t need = 32 + payload;
  unsigned sum = 0;
  for (size_t r = warp; r < records; r += nwarps) {
    unsigned long long pos = 0;
    if (lane == 0) {
      pos = atomicAdd(reserved, need);
      if (room_read == 1) sum += static_cast<unsigned>(*consumed);
      if (room_read == 2 && *reinterpret_cast<volatile unsigned long long*>(seen) < 1) atomicMax(seen, *consumed);
    }
    pos = __shfl_sync(0xffffffffu, pos, 0) % (ring_bytes - need);
    uint4* d = reinterpret_cast<uint4*>(ring + (pos & ~31ull));
    const uint4* s = src + (r % 64) * (kRecord / 16);
    for (uint32_t i = 2 + lane; i < need / 16; i += 32) d[i] = s[i];
    __threadfence_system();
    __syncwarp();
    if (lane == 0) *reinterpret_cast<volatile unsigned long long*>(d) = pos + 1;
  }
  if (sum == 0x12345678u) atomicAdd(sink, 1);
}

// Warp `warp` of `nwarps` reads records warp, warp + nwarps, ... whole from host memory, as the kernels read the far
// copies; what it read goes into *sink only in a case that never happens, so that the loads stay.
__device__ void readRecords(const uint4* far, size_t records, size_t warp, size_t nwarps, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const size_t words = kRecord / 16;
  unsigned acc = 0;
  for (size_t r = warp; r < records; r += nwarps) {
    const volatile uint4* s = far + r * words;
    for (size_t i = lane; i < words; i += 32) {
      const uint4 v = const_cast<const uint4&>(s[i]);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x12345678u) atomicAdd(sink, 1);
}

__global__ void loadRecords(const uint4* far, size_t records, unsigned* sink) {
  readRecords(far, records, (blockIdx.x * blockDim.x + threadIdx.x) / 32, gridDim.x * blockDim.x / 32, sink);
}

// (f): blocks [0, pollers) poll one word of host memory (lane 0 of each warp, as waitAtLeast does: a load and a
// 64 ns sleep) until the other blocks have read every record from host memory, as (b); how fast the readers go with
// the pollers beside them, and how many polls the GPU served.
__global__ void pollWhileLoading(const uint4* far, size_t records, int pollers, const volatile uint64_t* word,
                                 unsigned* done, unsigned long long* polls, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  if (static_cast<int>(blockIdx.x) < pollers) {
    unsigned long long n = 0;
    uint64_t acc = 0;
    // Bounded (about 10 s of polls), should the readers never be scheduled beside the pollers.
    for (uint32_t it = 0; *reinterpret_cast<volatile unsigned*>(done) < gridDim.x - pollers && it < (1u << 26); ++it) {
      if (lane == 0) {
        acc += *word;
        ++n;
      }
      __nanosleep(64);
    }
    if (lane == 0) atomicAdd(polls, n);
    if (acc == 0x12345678u) atomicAdd(sink, 1);
    return;
  }
  readRecords(far, records, ((blockIdx.x - pollers) * blockDim.x + threadIdx.x) / 32,
              (gridDim.x - pollers) * blockDim.x / 32, sink);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(done, 1);
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  size_t mb = 512;
  int blocks = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--mb")) mb = strtoull(argv[i + 1], nullptr, 10);
    if (!strcmp(argv[i], "--blocks")) blocks = std::max(4, atoi(argv[i + 1]));
  }
  const size_t bytes = mb << 20, records = bytes / kRecord;
  void *host = nullptr, *dev_host = nullptr, *src = nullptr;
  CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped));
  CUDA_CHECK(cudaHostGetDevicePointer(&dev_host, host, 0));
  memset(host, 1, bytes);
  CUDA_CHECK(cudaMalloc(&src, 64 * kRecord));
  CUDA_CHECK(cudaMemset(src, 7, 64 * kRecord));
  unsigned* sink = nullptr;
  CUDA_CHECK(cudaMalloc(&sink, 4));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  // The median time of a launch (5 after one warm-up), in seconds.
  auto kernelSeconds = [&](auto launch) {
    launch();
    CUDA_CHECK(cudaGetLastError());  // a launch that failed would time an empty interval
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int i = 0; i < 5; ++i) {
      CUDA_CHECK(cudaEventRecord(a));
      launch();
      CUDA_CHECK(cudaEventRecord(b));
      CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[2] * 1e-3;
  };
  const double gb = records * kRecord / 1e9;  // what (a), (b) and (f) move
  printf("host path probe: %zu MiB of %zu-byte records\n", mb, kRecord);
  for (int nb : {blocks / 4, blocks, blocks * 4})
    for (int fence = 1; fence >= 0; --fence)
      printf("(a) GPU stores into mapped host memory, %3d blocks x 8 warps, %s: %7.2f GB/s\n", nb,
             fence ? "fence+stamp per record" : "no fence             ",
             gb / kernelSeconds([&] {
               storeRecords<<<nb, 256>>>(static_cast<uint4*>(dev_host), static_cast<const uint4*>(src), records,
                                         fence);
             }));
  unsigned long long* reserved = nullptr;
  CUDA_CHECK(cudaMalloc(&reserved, 16));
  for (uint32_t payload : {2048u, 14336u})
    for (int room : {1, 2, 0}) {
      CUDA_CHECK(cudaMemset(reserved, 0, 16));
      const size_t recs = bytes / (32 + payload);
      const double sec = kernelSeconds([&] {
        reserveRecords<<<blocks, 256>>>(static_cast<uint8_t*>(dev_host), bytes, reserved,
                                        static_cast<const volatile unsigned long long*>(dev_host),
                                        static_cast<const uint4*>(src), recs, payload, room, reserved + 1, sink);
      });
      const char* how[] = {"no host read             ", "host read per record     ", "largest read, then host  "};
      printf("(e) records as the kernels reserve them, %3d blocks x 8 warps, %5u-byte payloads, %s: %7.2f GB/s, "
             "%.2f M records/s\n", blocks, payload, how[room], recs * (32 + payload) / sec / 1e9, recs / sec / 1e6);
    }
  for (int nb : {blocks / 4, blocks, blocks * 4})
    printf("(b) GPU loads from mapped host memory, %3d blocks x 8 warps: %7.2f GB/s\n", nb, gb / kernelSeconds([&] {
             loadRecords<<<nb, 256>>>(static_cast<const uint4*>(dev_host), records, sink);
           }));
  {
    unsigned* done = nullptr;
    unsigned long long* polls = nullptr;
    CUDA_CHECK(cudaMalloc(&done, 4));
    CUDA_CHECK(cudaMalloc(&polls, 8));
    for (int pollers : {0, 8, 32, 64}) {
      unsigned long long n = 0;
      const double sec = kernelSeconds([&] {
        CUDA_CHECK(cudaMemsetAsync(done, 0, 4));
        CUDA_CHECK(cudaMemsetAsync(polls, 0, 8));
        pollWhileLoading<<<pollers + blocks, 256>>>(static_cast<const uint4*>(dev_host), records, pollers,
                                                    static_cast<const volatile uint64_t*>(dev_host), done, polls,
                                                    sink);
      });
      CUDA_CHECK(cudaMemcpy(&n, polls, 8, cudaMemcpyDeviceToHost));
      printf("(f) GPU loads from mapped host memory, %3d blocks, beside %2d blocks x 8 warps polling one host word: "
             "%7.2f GB/s, %.2f M polls/s\n", blocks, pollers, gb / sec, n / sec / 1e6);
    }
  }
  // (c): T threads, each copying records from its own 8 MiB warm source ring into its share of the destination.
  for (int streaming = 0; streaming < 2; ++streaming)
    for (int T : {1, 2, 4, 8}) {
      std::vector<std::vector<uint8_t>> rings(T, std::vector<uint8_t>(8 << 20, 3));
      auto run = [&] {
        std::vector<std::thread> th;
        const double t0 = now();
        for (int t = 0; t < T; ++t)
          th.emplace_back([&, t] {
            uint8_t* d = static_cast<uint8_t*>(host) + bytes / T * t;
            const size_t n = bytes / T / kRecord;
            for (size_t r = 0; r < n; ++r) {
              const uint8_t* s = rings[t].data() + (r * kRecord) % ((8 << 20) - kRecord);
              if (streaming) epcomm::streamCopy(d + r * kRecord + 32, s + 32, kRecord - 32);
              else memcpy(d + r * kRecord + 32, s + 32, kRecord - 32);
            }
            if (streaming) epcomm::streamFence();
          });
        for (auto& x : th) x.join();
        return now() - t0;
      };
      run();
      std::vector<double> t;
      for (int i = 0; i < 3; ++i) t.push_back(run());
      std::sort(t.begin(), t.end());
      printf("(c) CPU copy warm ring -> cold host memory, %d thread(s), %s: %7.2f GB/s\n", T,
             streaming ? "streamCopy" : "memcpy    ", bytes / T / kRecord * kRecord * T / t[1] / 1e9);
    }
  void* dbuf = nullptr;
  CUDA_CHECK(cudaMalloc(&dbuf, bytes));
  for (int dir = 0; dir < 2; ++dir) {
    std::vector<float> t;
    for (int i = 0; i < 4; ++i) {
      CUDA_CHECK(cudaEventRecord(a));
      if (dir == 0) CUDA_CHECK(cudaMemcpyAsync(host, dbuf, bytes, cudaMemcpyDeviceToHost));
      else CUDA_CHECK(cudaMemcpyAsync(dbuf, host, bytes, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaEventRecord(b));
      CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      if (i) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    printf("(d) copy engine, pinned %s: %7.2f GB/s\n", dir ? "H2D" : "D2H", bytes / (t[1] * 1e-3) / 1e9);
  }
  return 0;
}
