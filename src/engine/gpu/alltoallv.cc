// GPU engine, alltoallv with host counts and with device counts: launches of kernels/alltoallv.cu, which
// exchange the counts on the device and stream the bytes through the HT queues (no host round trip, so the
// device-count variant is capturable).
#include "common/checks.h"
#include "engine/gpu/gpu_engine.h"
#include "kernels/alltoallv.h"

namespace epcomm {

epResult_t GpuEngine::alltoallv(const void* sendbuf, const size_t* send_counts, const size_t* send_displs,
                                void* recvbuf, const size_t* recv_counts, const size_t* recv_displs, size_t es,
                                epResult_t local, epStream_t stream) {
  EPCHECK(local);
  A2aParams p{};
  p.ht = baseParams(epOpAlltoallv);
  for (int r = 0; r < comm_->nranks; ++r) {
    p.send_bytes[r] = send_counts[r] * es;
    p.send_off[r] = send_displs[r] * es;
    p.recv_bytes[r] = recv_counts[r] * es;
    p.recv_off[r] = recv_displs[r] * es;
  }
  p.sendbuf = static_cast<const uint8_t*>(sendbuf);
  p.recvbuf = static_cast<uint8_t*>(recvbuf);
  p.elem = es;
  return checkLaunch(launchAlltoallv(p, streamOf(stream)), "the alltoallv kernels");
}

epResult_t GpuEngine::alltoallvDevice(const void* sendbuf, const int64_t* send_counts, void* recvbuf,
                                      size_t recv_capacity, int64_t* recv_counts, int64_t* num_dropped, size_t es,
                                      epResult_t local, epStream_t stream) {
  EPCHECK(local);
  A2aParams p{};
  p.ht = baseParams(epOpAlltoallvDevice);
  p.sendbuf = static_cast<const uint8_t*>(sendbuf);
  p.recvbuf = static_cast<uint8_t*>(recvbuf);
  p.dev_send_counts = send_counts;
  p.dev_recv_counts = recv_counts;
  p.dev_dropped = num_dropped;
  p.capacity_bytes = recv_capacity * es;
  p.elem = es;
  return checkLaunch(launchAlltoallv(p, streamOf(stream)), "the alltoallv kernels");
}

}  // namespace epcomm
