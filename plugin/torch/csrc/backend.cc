#include "backend.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <numeric>

#include "store_allgather.h"
#include "tensor_args.h"
#include "work.h"

namespace epcomm_torch {
namespace {

bool isCuda(const at::Device& d) { return d.type() == c10::DeviceType::CUDA; }

// Element counts and the dtype that moves them: the tensor's own when the C API has it, else its bytes.
struct Units {
  epDataType_t dtype;
  int64_t per_element;  // units per tensor element
};
Units unitsOf(const at::Tensor& t) {
  if (auto dt = toEpDtype(t.scalar_type())) return {*dt, 1};
  return {epUint8, static_cast<int64_t>(t.element_size())};
}

std::vector<int64_t> splitsOrEqual(const std::vector<int64_t>& splits, int64_t rows, int size, const char* which) {
  if (!splits.empty()) {
    TORCH_CHECK(static_cast<int>(splits.size()) == size, "epcomm all_to_all_single: ", which, " has ",
                splits.size(), " entries, the group has ", size, " ranks");
    int64_t sum = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    TORCH_CHECK(sum == rows, "epcomm all_to_all_single: ", which, " sum to ", sum, " but the tensor has ", rows,
                " rows");
    return splits;
  }
  TORCH_CHECK(rows % size == 0, "epcomm all_to_all_single: ", rows, " rows do not split evenly over ", size,
              " ranks (pass split sizes)");
  return std::vector<int64_t>(static_cast<size_t>(size), rows / size);
}

void checkSameDevice(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device() == b.device(), "epcomm ", op, ": tensors on ", a.device(), " and ", b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "epcomm ", op, ": dtypes ", a.scalar_type(), " and ",
              b.scalar_type(), " differ");
}

}  // namespace

EpcommBackend::EpcommBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                             c10::intrusive_ptr<c10d::Backend> cpu_inner,
                             c10::intrusive_ptr<c10d::Backend> cuda_inner)
    : c10d::Backend(rank, size),
      store_(std::move(store)),
      cpu_inner_(std::move(cpu_inner)),
      cuda_inner_(std::move(cuda_inner)) {
  TORCH_CHECK(cpu_inner_, "epcomm: the backend needs an inner backend for CPU tensors");
}

EpcommBackend::~EpcommBackend() {
  try {
    shutdown();
  } catch (...) {  // a destructor must not throw; shutdown reports through the logs of the C library
  }
}

void EpcommBackend::fail(const char* op, epResult_t rc, epComm_t comm) {
  std::string msg = c10::str("epcomm ", op, " failed: ", epGetErrorString(rc), ": ", epGetLastError(comm));
  if (rc == epTimeout || rc == epRemoteError || rc == epAborted) {
    C10_THROW_ERROR(DistBackendError, msg);  // torch.distributed.DistBackendError, as NCCL's failures are
  }
  TORCH_CHECK(false, msg);
}

epComm_t EpcommBackend::comm(const at::Device& device) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!closed_, "epcomm: the process group was shut down or aborted");
  std::string key = isCuda(device) ? c10::str("cuda:", static_cast<int>(device.index())) : std::string("cpu");
  auto it = comms_.find(key);
  if (it != comms_.end()) return it->second;
  TORCH_CHECK(device.type() == c10::DeviceType::CPU || isCuda(device), "epcomm: tensors on ", device,
              " are not supported (cpu and cuda are)");
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = isCuda(device) ? EP_ENGINE_GPU : EP_ENGINE_HOST;
  cfg.cuda_device = isCuda(device) ? device.index() : -1;
  // The Store prefix names the device type, never the index: with a GPU per rank every rank's index differs
  // (cuda:0 on rank 0, cuda:1 on rank 1), and they must meet under one key. Every rank creates communicators in
  // the same order (collective rule), so the creation count tells them apart.
  StoreAllgather ag{store_, c10::str("epcomm/", isCuda(device) ? "cuda" : "cpu", "/", creations_++), rank_, size_, 0,
                    {}};
  epComm_t c = nullptr;
  epResult_t rc = epCommInitRankWithAllgather(&c, size_, rank_, storeAllgather, &ag, &cfg);
  if (rc != epSuccess) {
    std::string msg = c10::str("epcomm: creating the communicator for ", key, " failed: ", epGetErrorString(rc),
                               ": ", epGetLastError(nullptr));
    if (!ag.error.empty()) msg += c10::str(" (store all-gather: ", ag.error, ")");
    C10_THROW_ERROR(DistBackendError, msg);
  }
  comms_[key] = c;
  created_.push_back(key);
  return c;
}

uintptr_t EpcommBackend::commHandle(const at::Device& device) { return reinterpret_cast<uintptr_t>(comm(device)); }

namespace {
at::Device deviceOfKey(const std::string& key) {
  if (key == "cpu") return at::Device(c10::DeviceType::CPU);
  return at::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(std::stoi(key.substr(5))));
}

// The stream a call on the communicator of `key` runs on: the device's current one (none on the CPU).
epStream_t streamOfKey(const std::string& key) {
  const at::Device device = deviceOfKey(key);
  return isCuda(device) ? nativeStream(currentStream(device)) : nullptr;
}
}  // namespace

std::vector<std::pair<std::string, epComm_t>> EpcommBackend::createdComms() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!closed_, "epcomm: the process group was shut down or aborted");
  std::vector<std::pair<std::string, epComm_t>> comms;
  // Creation order, which every rank shares (device indices may differ between ranks, so key order may not).
  for (const std::string& key : created_) comms.emplace_back(key, comms_.at(key));
  return comms;
}

void EpcommBackend::setActiveRanks(const std::vector<int32_t>& active) {
  TORCH_CHECK(static_cast<int>(active.size()) == size_, "epcomm set_active_ranks: the mask has ", active.size(),
              " entries, the group has ", size_, " ranks");
  for (auto& [key, c] : createdComms()) {
    epResult_t rc = epCommSetActiveRanks(c, active.data(), streamOfKey(key));
    if (rc != epSuccess) fail(c10::str("set_active_ranks (", key, ")").c_str(), rc, c);
  }
}

std::vector<int32_t> EpcommBackend::recover() {
  const auto comms = createdComms();
  std::vector<int32_t> mask;
  size_t found = comms.size();
  for (size_t i = 0; i < comms.size() && found == comms.size(); ++i) {
    std::vector<int32_t> m(static_cast<size_t>(size_), 0);
    epResult_t rc = epCommRecover(comms[i].second, m.data(), streamOfKey(comms[i].first));
    if (rc == epNotSupported) continue;  // decided by the engine alone, before any exchange: alike on every rank
    if (rc != epSuccess) fail(c10::str("recover (", comms[i].first, ")").c_str(), rc, comms[i].second);
    mask = m;
    found = i;
  }
  if (comms.empty()) return mask;
  TORCH_CHECK(found < comms.size(), "epcomm recover: none of the group's communicators (", comms.size(),
              ") runs on an engine that has epCommRecover (the host engine); call set_active_ranks with the failed "
              "ranks masked");
  for (size_t i = 0; i < comms.size(); ++i) {
    if (i == found) continue;
    epResult_t rc = epCommSetActiveRanks(comms[i].second, mask.data(), streamOfKey(comms[i].first));
    if (rc != epSuccess) fail(c10::str("recover (", comms[i].first, ")").c_str(), rc, comms[i].second);
  }
  return mask;
}

std::vector<int32_t> EpcommBackend::activeRanks() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> all(static_cast<size_t>(size_), 1), one(static_cast<size_t>(size_));
  for (auto& [key, c] : comms_) {
    epResult_t rc = epCommGetActiveRanks(c, one.data());
    if (rc != epSuccess) fail("get_active_ranks", rc, c);
    for (size_t r = 0; r < all.size(); ++r) all[r] = all[r] != 0 && one[r] != 0 ? 1 : 0;
  }
  return all;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> EpcommBackend::maskedDrops(const at::Device& device) {
  std::vector<int64_t> rows(static_cast<size_t>(size_), 0), elements(static_cast<size_t>(size_), 0);
  epComm_t c = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // "cuda" without an index: the current device, as torch reads it.
    const int index = isCuda(device) && !device.has_index()
                          ? c10::impl::VirtualGuardImpl(device.type()).getDevice().index()
                          : device.index();
    auto it = comms_.find(isCuda(device) ? c10::str("cuda:", index) : std::string("cpu"));
    if (it != comms_.end()) c = it->second;
  }
  if (c != nullptr) {
    epStream_t stream = isCuda(device) ? nativeStream(currentStream(device)) : nullptr;
    epResult_t rc = epCommGetMaskedDrops(c, rows.data(), elements.data(), stream);
    if (rc != epSuccess) fail("get_masked_drops", rc, c);
  }
  return {rows, elements};
}

c10d::Backend& EpcommBackend::inner(const at::Device& device) {
  if (isCuda(device) && cuda_inner_) return *cuda_inner_;
  return *cpu_inner_;
}

c10::Stream EpcommBackend::opStream(const at::Device& device, bool async_op) {
  c10::Stream current = currentStream(device);
  if (!async_op) return current;  // synchronous calls run on the caller's stream (CUDA-graph capturable)
  c10::Stream comm_stream = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comm_streams_.find(device.index());
    if (it != comm_streams_.end()) return it->second;
    c10::impl::VirtualGuardImpl impl(device.type());
    c10::Stream s = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    comm_streams_.emplace(device.index(), s);
    return s;
  }();
  // The operation must see everything the caller enqueued before it.
  c10::Event ready(device.type());
  ready.record(current);
  ready.block(comm_stream);
  return comm_stream;
}

// Records tensors used on a side stream with the caching allocator, so that their memory is not reused
// before the operation ends.
static void recordOn(const std::vector<at::Tensor>& tensors, const c10::Stream& stream, const c10::Stream& current) {
  if (stream == current) return;
  c10::impl::VirtualGuardImpl impl(stream.device_type());
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
  }
}

c10::intrusive_ptr<c10d::Work> EpcommBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& output_splits,
                                                            std::vector<int64_t>& input_splits,
                                                            const c10d::AllToAllOptions& opts) {
  checkSameDevice(output, input, "all_to_all_single");
  TORCH_CHECK(output.is_contiguous(), "epcomm all_to_all_single: the output tensor must be contiguous");
  const at::Device device = input.device();
  int64_t in_rows = input.dim() == 0 ? 1 : input.size(0);
  int64_t out_rows = output.dim() == 0 ? 1 : output.size(0);
  auto in_splits = splitsOrEqual(input_splits, in_rows, size_, "input_split_sizes");
  auto out_splits = splitsOrEqual(output_splits, out_rows, size_, "output_split_sizes");
  Units u = unitsOf(input);
  int64_t in_row_units = in_rows == 0 ? 0 : input.numel() / in_rows * u.per_element;
  int64_t out_row_units = out_rows == 0 ? 0 : output.numel() / out_rows * u.per_element;
  std::vector<size_t> sc(size_), sd(size_), rc(size_), rd(size_);
  size_t soff = 0, roff = 0;
  for (int p = 0; p < size_; ++p) {
    sc[p] = static_cast<size_t>(in_splits[p] * in_row_units);
    rc[p] = static_cast<size_t>(out_splits[p] * out_row_units);
    sd[p] = soff;
    rd[p] = roff;
    soff += sc[p];
    roff += rc[p];
  }
  epComm_t c = comm(device);
  c10::Stream stream = isCuda(device) ? opStream(device, opts.asyncOp) : c10::Stream(c10::Stream::DEFAULT, device);
  at::Tensor in = input.contiguous();
  epResult_t res;
  {
    c10::StreamGuard guard(stream);
    res = epAlltoallv(c, dataPtr(in), sc.data(), sd.data(), dataPtr(output), rc.data(), rd.data(), u.dtype,
                      nativeStream(stream));
  }
  if (res == epNotSupported && isCuda(device) && cuda_inner_) {
    // The GPU engine of this build has no alltoallv yet; every rank sees the same answer, so all take NCCL's.
    TORCH_WARN_ONCE("epcomm: the GPU engine has no alltoallv in this build; all_to_all_single on CUDA tensors "
                    "runs on the inner NCCL backend");
    return cuda_inner_->alltoall_base(output, input, output_splits, input_splits, opts);
  }
  if (res != epSuccess) fail("all_to_all_single", res, c);
  if (isCuda(device)) {
    recordOn({in, output}, stream, currentStream(device));
    return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL_BASE, std::vector<at::Tensor>{output}, stream);
  }
  return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL_BASE, std::vector<at::Tensor>{output},
                                     std::nullopt);
}

c10::intrusive_ptr<c10d::Work> EpcommBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "epcomm all_to_all: expected ", size_, " input and output tensors, got ", inputs.size(), " and ",
              outputs.size());
  for (int p = 0; p < size_; ++p) {
    checkSameDevice(inputs[p], inputs[0], "all_to_all");
    checkSameDevice(outputs[p], inputs[0], "all_to_all");
  }
  const at::Device device = inputs[0].device();
  Units u = unitsOf(inputs[0]);
  std::vector<size_t> sc(size_), sd(size_), rc(size_), rd(size_);
  size_t soff = 0, roff = 0;
  for (int p = 0; p < size_; ++p) {
    sc[p] = static_cast<size_t>(inputs[p].numel() * u.per_element);
    rc[p] = static_cast<size_t>(outputs[p].numel() * u.per_element);
    sd[p] = soff;
    rd[p] = roff;
    soff += sc[p];
    roff += rc[p];
  }
  epComm_t c = comm(device);
  c10::Stream stream = isCuda(device) ? opStream(device, opts.asyncOp) : c10::Stream(c10::Stream::DEFAULT, device);
  at::Tensor send, recv;
  epResult_t res;
  {
    // One packed buffer each way; the packing and unpacking copies run on the operation's stream.
    c10::StreamGuard guard(stream);
    std::vector<at::Tensor> flat;
    flat.reserve(inputs.size());
    for (auto& t : inputs) flat.push_back(t.reshape({-1}));
    send = at::cat(flat);
    recv = at::empty({static_cast<int64_t>(roff / u.per_element)}, send.options());
    res = epAlltoallv(c, dataPtr(send), sc.data(), sd.data(), dataPtr(recv), rc.data(), rd.data(), u.dtype,
                      nativeStream(stream));
    if (res == epSuccess) {
      int64_t off = 0;
      for (auto& o : outputs) {
        o.copy_(recv.narrow(0, off, o.numel()).view(o.sizes()));
        off += o.numel();
      }
    }
  }
  if (res == epNotSupported && isCuda(device) && cuda_inner_) {
    TORCH_WARN_ONCE("epcomm: the GPU engine has no alltoallv in this build; all_to_all on CUDA tensors runs on "
                    "the inner NCCL backend");
    return cuda_inner_->alltoall(outputs, inputs, opts);
  }
  if (res != epSuccess) fail("all_to_all", res, c);
  if (isCuda(device)) {
    std::vector<at::Tensor> keep = outputs;
    keep.push_back(send);
    keep.push_back(recv);
    for (auto& t : inputs) keep.push_back(t);
    recordOn(keep, stream, currentStream(device));
    return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL, outputs, stream);
  }
  return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL, outputs, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> EpcommBackend::barrier(const c10d::BarrierOptions& opts) {
  // A process barrier on the host engine. On CUDA, like NCCL's, it also waits for the caller's stream.
  if (opts.device && isCuda(*opts.device)) currentStream(*opts.device).synchronize();
  epComm_t c = comm(at::Device(c10::DeviceType::CPU));
  epResult_t res = epCommBarrier(c, nullptr);
  if (res != epSuccess) fail("barrier", res, c);
  return c10::make_intrusive<EpWork>(rank_, c10d::OpType::BARRIER, std::vector<at::Tensor>{}, std::nullopt);
}

c10::intrusive_ptr<c10d::Work> EpcommBackend::allToAllV(at::Tensor& output, const at::Tensor& input,
                                                        const at::Tensor& send_counts, at::Tensor& recv_counts,
                                                        bool async_op) {
  checkSameDevice(output, input, "all_to_all_v");
  const at::Device device = input.device();
  TORCH_CHECK(send_counts.device() == device && recv_counts.device() == device,
              "epcomm all_to_all_v: the counts must be on the data's device (", device, ")");
  TORCH_CHECK(send_counts.scalar_type() == at::kLong && recv_counts.scalar_type() == at::kLong,
              "epcomm all_to_all_v: the counts must be int64");
  TORCH_CHECK(send_counts.numel() == size_ && recv_counts.numel() == size_,
              "epcomm all_to_all_v: the counts must have ", size_, " entries (one per rank)");
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous() && recv_counts.is_contiguous(),
              "epcomm all_to_all_v: input, output and recv_counts must be contiguous");
  int64_t in_row = input.dim() <= 1 ? 1 : input.numel() / std::max<int64_t>(input.size(0), 1);
  int64_t out_row = output.dim() <= 1 ? 1 : output.numel() / std::max<int64_t>(output.size(0), 1);
  if (input.dim() > 1 && output.dim() > 1) {
    TORCH_CHECK(input.sizes().slice(1) == output.sizes().slice(1), "epcomm all_to_all_v: rows of input ",
                input.sizes(), " and output ", output.sizes(), " differ");
  }
  Units u = unitsOf(input);
  const int64_t row_units = std::max(in_row, out_row) * u.per_element;
  const size_t capacity = static_cast<size_t>(output.numel() * u.per_element);
  epComm_t c = comm(device);
  c10::Stream stream = isCuda(device) ? opStream(device, async_op) : c10::Stream(c10::Stream::DEFAULT, device);
  epResult_t res;
  at::Tensor send_units, recv_units, dropped;
  {
    c10::StreamGuard guard(stream);
    // Counts are rows for the caller and units for the C API; the conversions run on the stream.
    send_units = row_units == 1 ? send_counts.contiguous() : send_counts * row_units;
    recv_units = row_units == 1 ? recv_counts : at::empty_like(recv_counts);
    dropped = at::zeros({1}, recv_counts.options());
    res = epAlltoallvDevice(c, dataPtr(input), send_units.data_ptr<int64_t>(), dataPtr(output), capacity,
                            recv_units.data_ptr<int64_t>(), dropped.data_ptr<int64_t>(), u.dtype,
                            nativeStream(stream));
    if (res == epSuccess && row_units != 1) at::floor_divide_out(recv_counts, recv_units, row_units);
  }
  if (res != epSuccess) fail("all_to_all_v", res, c);
  if (isCuda(device)) {
    recordOn({input, output, send_units, recv_units, dropped, recv_counts}, stream, currentStream(device));
    return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL_BASE,
                                       std::vector<at::Tensor>{output, recv_counts}, stream);
  }
  return c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLTOALL_BASE, std::vector<at::Tensor>{output, recv_counts},
                                     std::nullopt);
}

// --- delegated -------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> EpcommBackend::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) {
  return inner(t.at(0).device()).broadcast(t, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  return inner(t.at(0).device()).allreduce(t, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                  const c10d::AllreduceCoalescedOptions& o) {
  return inner(t.at(0).device()).allreduce_coalesced(t, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  return inner(t.at(0).device()).reduce(t, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                        std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) {
  return inner(in.at(0).device()).allgather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                              const c10d::AllgatherOptions& o) {
  return inner(in.device())._allgather_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                  std::vector<at::Tensor>& in,
                                                                  const c10d::AllgatherOptions& o) {
  return inner(in.at(0).device()).allgather_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                              std::vector<at::Tensor>& in,
                                                                              const c10d::AllgatherOptions& o) {
  return inner(in.at(0).device()).allgather_into_tensor_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::gather(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  return inner(in.at(0).device()).gather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::scatter(std::vector<at::Tensor>& out,
                                                      std::vector<std::vector<at::Tensor>>& in,
                                                      const c10d::ScatterOptions& o) {
  return inner(out.at(0).device()).scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::reduce_scatter(std::vector<at::Tensor>& out,
                                                             std::vector<std::vector<at::Tensor>>& in,
                                                             const c10d::ReduceScatterOptions& o) {
  return inner(out.at(0).device()).reduce_scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                   const c10d::ReduceScatterOptions& o) {
  return inner(in.device())._reduce_scatter_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                              std::vector<at::Tensor>& in,
                                                                              const c10d::ReduceScatterOptions& o) {
  return inner(in.at(0).device()).reduce_scatter_tensor_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::send(std::vector<at::Tensor>& t, int dst, int tag) {
  return inner(t.at(0).device()).send(t, dst, tag);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::recv(std::vector<at::Tensor>& t, int src, int tag) {
  return inner(t.at(0).device()).recv(t, src, tag);
}
c10::intrusive_ptr<c10d::Work> EpcommBackend::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  return inner(t.at(0).device()).recvAnysource(t, tag);
}
void EpcommBackend::monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) {
  cpu_inner_->monitoredBarrier(o, wait_all_ranks);
}

// --- lifecycle -------------------------------------------------------------------------------------------

void EpcommBackend::abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // epCommAbort is local and prompt; waits in flight on these communicators return epAborted.
    for (auto& [key, c] : comms_) epCommAbort(c);
    comms_.clear();
    created_.clear();
    closed_ = true;
  }
  cpu_inner_->abort();
  if (cuda_inner_) cuda_inner_->abort();
}

void EpcommBackend::shutdown() {
  std::map<std::string, epComm_t> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    comms.swap(comms_);
    created_.clear();
  }
  for (auto& [key, c] : comms) epCommDestroy(c);
  cpu_inner_->shutdown();
  if (cuda_inner_) cuda_inner_->shutdown();
}

}  // namespace epcomm_torch
