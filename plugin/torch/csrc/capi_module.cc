// epcomm._capi: the public C API for Python, without torch. Buffers cross as integers (data pointers, from
// tensor.data_ptr()) plus sizes, dtype codes and a stream handle (an integer cudaStream_t; ignored by the host
// engine). Every failing call raises epcomm._capi.Error whose message is epcomm's (code name: last error) and
// whose .code is the epResult_t. Calls that may wait for peers release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <epcomm/epcomm.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

py::object g_error_type;  // epcomm._capi.Error

// `active`, when given, becomes the exception's .active (epCommRecover's mask: its own entry 0 means "leave").
[[noreturn]] void raise(epResult_t rc, epComm_t comm, py::object active = py::none()) {
  std::string msg = std::string(epGetErrorString(rc)) + ": " + epGetLastError(comm);
  py::object err = g_error_type(msg);
  err.attr("code") = static_cast<int>(rc);
  if (!active.is_none()) err.attr("active") = active;
  PyErr_SetObject(g_error_type.ptr(), err.ptr());
  throw py::error_already_set();
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }
epStream_t stream(uintptr_t s) { return reinterpret_cast<epStream_t>(s); }

// Lets C call the Python all-gather (e.g. torch.distributed.all_gather_object) during creation.
struct PyAllgather {
  py::object fn;      // bytes -> every rank's bytes concatenated in rank order
  size_t nranks;
  std::string error;  // what went wrong, for the exception
};

int callPyAllgather(void* ctx, const void* sendbuf, void* recvbuf, size_t bytes_per_rank) {
  auto* self = static_cast<PyAllgather*>(ctx);
  py::gil_scoped_acquire gil;
  try {
    py::bytes mine(static_cast<const char*>(sendbuf), bytes_per_rank);
    std::string all = py::cast<std::string>(self->fn(mine));
    if (all.size() != self->nranks * bytes_per_rank) {
      self->error = "the all-gather returned " + std::to_string(all.size()) + " bytes, expected " +
                    std::to_string(self->nranks * bytes_per_rank);
      return 1;
    }
    std::memcpy(recvbuf, all.data(), all.size());
    return 0;
  } catch (py::error_already_set& e) {
    self->error = e.what();
    return 1;
  }
}

class Comm {
 public:
  Comm(int nranks, int rank, py::object allgather, int engine, int cuda_device, int timeout_ms, int num_channels,
       int num_sms, int ll_max_tokens_per_rank, int ll_max_hidden, int ll_num_experts, int ht_max_tokens_per_rank,
       int ht_max_hidden, int ll_zero_copy_dispatch) {
    epConfig_t cfg = EP_CONFIG_INIT;
    cfg.engine = engine;
    cfg.cuda_device = cuda_device;
    cfg.timeout_ms = timeout_ms;
    cfg.num_channels = num_channels;
    cfg.num_sms = num_sms;
    cfg.ll_max_tokens_per_rank = ll_max_tokens_per_rank;
    cfg.ll_max_hidden = ll_max_hidden;
    cfg.ll_num_experts = ll_num_experts;
    cfg.ht_max_tokens_per_rank = ht_max_tokens_per_rank;
    cfg.ht_max_hidden = ht_max_hidden;
    cfg.ll_zero_copy_dispatch = ll_zero_copy_dispatch;
    PyAllgather ctx{std::move(allgather), static_cast<size_t>(nranks), {}};
    epResult_t rc;
    {
      py::gil_scoped_release nogil;
      rc = epCommInitRankWithAllgather(&comm_, nranks, rank, callPyAllgather, &ctx, &cfg);
    }
    if (rc != epSuccess) {
      if (!ctx.error.empty()) {
        py::object err = g_error_type(std::string(epGetErrorString(rc)) + ": " + epGetLastError(nullptr) +
                                      " (all-gather: " + ctx.error + ")");
        err.attr("code") = static_cast<int>(rc);
        PyErr_SetObject(g_error_type.ptr(), err.ptr());
        throw py::error_already_set();
      }
      raise(rc, nullptr);
    }
  }
  ~Comm() {
    if (comm_ != nullptr) epCommDestroy(comm_);
    *alive_ = false;
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  epComm_t get() const {
    if (comm_ == nullptr) {
      PyErr_SetString(g_error_type.ptr(), "epInvalidUsage: the communicator was destroyed");
      throw py::error_already_set();
    }
    return comm_;
  }
  void check(epResult_t rc) const {
    if (rc != epSuccess) raise(rc, comm_);
  }
  void destroy() {
    if (comm_ == nullptr) return;
    epComm_t c = comm_;
    comm_ = nullptr;
    *alive_ = false;
    epResult_t rc;
    {
      py::gil_scoped_release nogil;
      rc = epCommDestroy(c);
    }
    if (rc != epSuccess) raise(rc, nullptr);
  }
  void abort() {
    if (comm_ != nullptr) check(epCommAbort(comm_));
  }
  int rank() const { int r = 0; check(epCommRank(get(), &r)); return r; }
  int size() const { int s = 0; check(epCommSize(get(), &s)); return s; }
  int engine() const { epEngine_t e; check(epCommEngine(get(), &e)); return e; }
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(get()); }
  // Shared with the HT handles made on this communicator: a handle must not be freed through a dead one.
  std::shared_ptr<bool> alive() const { return alive_; }

 private:
  epComm_t comm_ = nullptr;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// Runs a C call without the GIL and raises epcomm's message on failure.
template <typename F>
void run(const Comm& c, F&& f) {
  epResult_t rc;
  {
    py::gil_scoped_release nogil;
    rc = f(c.get());
  }
  c.check(rc);
}

class HtHandle {
 public:
  HtHandle(const Comm& comm, int max_tokens) : max_tokens_(max_tokens), comm_alive_(comm.alive()) {
    comm.check(epHtHandleCreate(comm.get(), max_tokens, &h_));
  }
  ~HtHandle() {
    // epHtHandleDestroy reads the handle's communicator: after that was destroyed (Buffer.destroy() while the
    // caller still holds a dispatch handle) the handle is left to process exit rather than touch freed memory.
    if (h_ != nullptr && *comm_alive_) epHtHandleDestroy(h_);
  }
  HtHandle(const HtHandle&) = delete;
  HtHandle& operator=(const HtHandle&) = delete;
  epHtHandle_t get() const { return h_; }
  int max_tokens() const { return max_tokens_; }
  std::vector<int> recvCounts(int nranks) const {
    std::vector<int> out(static_cast<size_t>(nranks), 0);
    epResult_t rc = epHtHandleGetRecvCounts(h_, out.data());
    if (rc != epSuccess) raise(rc, nullptr);
    return out;
  }
  py::tuple counts() const {
    int t = 0, r = 0;
    epResult_t rc = epHtHandleGetCounts(h_, &t, &r);
    if (rc != epSuccess) raise(rc, nullptr);
    return py::make_tuple(t, r);
  }

 private:
  epHtHandle_t h_ = nullptr;
  int max_tokens_;
  std::shared_ptr<bool> comm_alive_;
};

// A registration (epCommRegister). deregister() is collective, like the registration. The destructor makes no
// collective call (it runs whenever this process's garbage collector gets to it): with the communicator alive it
// leaves the registration to the communicator's destruction; once that is gone it frees the handle.
class MemRegion {
 public:
  MemRegion(const Comm& comm, uintptr_t address, size_t bytes) : comm_alive_(comm.alive()) {
    run(comm, [&](epComm_t h) { return epCommRegister(h, reinterpret_cast<void*>(address), bytes, &r_); });
  }
  ~MemRegion() {
    if (r_ != nullptr && !*comm_alive_) epCommDeregister(r_);
  }
  MemRegion(const MemRegion&) = delete;
  MemRegion& operator=(const MemRegion&) = delete;
  void deregister() {
    if (r_ == nullptr) return;
    epResult_t rc;
    {
      py::gil_scoped_release nogil;
      rc = epCommDeregister(r_);
    }
    if (rc != epSuccess) raise(rc, nullptr);
    r_ = nullptr;
  }
  bool registered() const { return r_ != nullptr; }

 private:
  epMemRegion_t r_ = nullptr;
  std::shared_ptr<bool> comm_alive_;
};

// A DLPack capsule ("dltensor", the legacy unversioned protocol that torch.from_dlpack takes) over bytes that
// someone else owns: a 1-D uint8 tensor of nbytes at ptr on a CPU (device_type 1) or CUDA (2) device. The
// structs follow the DLPack ABI; declared here so that the binding needs no DLPack or torch header. The
// consumer's tensor aliases the memory and does not keep it alive.
struct DlDevice { int32_t device_type; int32_t device_id; };
struct DlDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DlTensor {
  void* data;
  DlDevice device;
  int32_t ndim;
  DlDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DlManagedTensor {
  DlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DlManagedTensor*);
};
struct DlView {  // the managed tensor and the shape it points to, freed together by the deleter
  DlManagedTensor managed;
  int64_t shape[1];
  PyObject* owner;  // a reference the view holds (the memory's owner), or nullptr
};
constexpr int32_t kDlCpu = 1, kDlCuda = 2;
constexpr uint8_t kDlUInt = 1;

py::capsule dlpackBytes(uintptr_t p, int64_t nbytes, int device_type, int device_id, py::object owner) {
  if (device_type != kDlCpu && device_type != kDlCuda) throw py::value_error("device_type must be 1 (CPU) or 2 (CUDA)");
  if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
  auto* v = new DlView{};
  v->shape[0] = nbytes;
  DlTensor& t = v->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(p);
  t.device = {device_type, device_type == kDlCpu ? 0 : device_id};
  t.ndim = 1;
  t.dtype = {kDlUInt, 8, 1};
  t.shape = v->shape;
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  v->managed.manager_ctx = v;
  // The consumer may free its storage on a thread without the GIL (torch does so from C++ threads too).
  v->managed.deleter = [](DlManagedTensor* m) {
    auto* view = static_cast<DlView*>(m->manager_ctx);
    if (view->owner != nullptr && Py_IsInitialized()) {
      PyGILState_STATE g = PyGILState_Ensure();
      Py_DECREF(view->owner);
      PyGILState_Release(g);
    }
    delete view;
  };
  v->owner = owner.is_none() ? nullptr : owner.release().ptr();
  // A capsule never consumed (still named "dltensor") frees its view itself; a consumed one was renamed and
  // belongs to the consumer, which calls the deleter.
  PyObject* cap = PyCapsule_New(&v->managed, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
  if (cap == nullptr) {
    v->managed.deleter(&v->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

// Pointer fields are exposed as integers.
#define EP_PTR_FIELD(cls, T, name)                                                             \
  def_property(#name, [](const T& a) { return reinterpret_cast<uintptr_t>(a.name); },          \
               [](T& a, uintptr_t p) { a.name = reinterpret_cast<decltype(a.name)>(p); })

std::vector<size_t> toSizes(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// (address, bytes) of a zero-copy region: epLlCombineBuffer and epHtCombineBuffer answer alike.
py::tuple regionOf(const Comm& c, epResult_t (*get)(epComm_t, void**, size_t*)) {
  void* region = nullptr;
  size_t bytes = 0;
  c.check(get(c.get(), &region, &bytes));
  return py::make_tuple(reinterpret_cast<uintptr_t>(region), bytes);
}

}  // namespace

PYBIND11_MODULE(_capi, m) {
  m.doc() = "epcomm's public C API (torch-free)";
  g_error_type = py::reinterpret_borrow<py::object>(
      PyErr_NewExceptionWithDoc("epcomm._capi.Error", "An epcomm call failed; .code is the epResult_t.",
                                PyExc_RuntimeError, nullptr));
  m.attr("Error") = g_error_type;

  m.def("version", [] { int v = 0; epGetVersion(&v); return v; });
  m.def("error_string", [](int rc) { return std::string(epGetErrorString(static_cast<epResult_t>(rc))); });
  m.def("dtype_size", [](int dt) { return epDataTypeSize(static_cast<epDataType_t>(dt)); });
  // torch gives empty tensors a NULL data pointer; this valid address stands in for 0-byte buffers.
  static uint64_t dummy[2] = {0, 0};
  m.def("dummy_ptr", [] { return reinterpret_cast<uintptr_t>(&dummy[0]); });
  m.def("dlpack_bytes", &dlpackBytes, py::arg("ptr"), py::arg("nbytes"), py::arg("device_type"),
        py::arg("device_id") = 0, py::arg("owner") = py::none(),
        "A DLPack capsule of a 1-D uint8 tensor over nbytes at ptr (device_type 1 = CPU, 2 = CUDA) for "
        "torch.from_dlpack; the memory stays its owner's. `owner` (any object, e.g. the Comm whose memory it is) is "
        "kept alive until the tensor's storage is freed, so that a view cannot outlive the memory by garbage "
        "collection (an explicit destroy still ends it).");

  m.attr("ENGINE_AUTO") = static_cast<int>(EP_ENGINE_AUTO);
  m.attr("ENGINE_HOST") = static_cast<int>(EP_ENGINE_HOST);
  m.attr("ENGINE_GPU") = static_cast<int>(EP_ENGINE_GPU);
  m.attr("FLOAT32") = static_cast<int>(epFloat32);
  m.attr("FLOAT16") = static_cast<int>(epFloat16);
  m.attr("BFLOAT16") = static_cast<int>(epBfloat16);
  m.attr("FLOAT8_E4M3") = static_cast<int>(epFloat8E4M3);
  m.attr("INT32") = static_cast<int>(epInt32);
  m.attr("INT64") = static_cast<int>(epInt64);
  m.attr("UINT8") = static_cast<int>(epUint8);
  m.attr("HT_USE_HANDLE_LAYOUT") = EP_HT_USE_HANDLE_LAYOUT;
  m.attr("LL_SEND") = EP_LL_SEND;
  m.attr("LL_RECV") = EP_LL_RECV;
  m.attr("LL_SEND_RECV") = EP_LL_SEND_RECV;
  m.attr("LL_EXPERT_MAJOR") = static_cast<int>(EP_LL_EXPERT_MAJOR);
  m.attr("LL_RANK_MAJOR") = static_cast<int>(EP_LL_RANK_MAJOR);
  m.attr("NOT_SUPPORTED") = static_cast<int>(epNotSupported);
  m.attr("CAPACITY_EXCEEDED") = static_cast<int>(epCapacityExceeded);
  m.attr("INVALID_USAGE") = static_cast<int>(epInvalidUsage);
  m.attr("TIMEOUT") = static_cast<int>(epTimeout);
  m.attr("REMOTE_ERROR") = static_cast<int>(epRemoteError);
  m.attr("MAX_TOPK") = EP_MAX_TOPK;

  py::class_<Comm>(m, "Comm")
      .def(py::init<int, int, py::object, int, int, int, int, int, int, int, int, int, int, int>(), py::arg("nranks"),
           py::arg("rank"), py::arg("allgather"), py::arg("engine") = 0, py::arg("cuda_device") = -1,
           py::arg("timeout_ms") = 0, py::arg("num_channels") = 0, py::arg("num_sms") = 0,
           py::arg("ll_max_tokens_per_rank") = 0, py::arg("ll_max_hidden") = 0, py::arg("ll_num_experts") = 0,
           py::arg("ht_max_tokens_per_rank") = 0, py::arg("ht_max_hidden") = 0, py::arg("ll_zero_copy_dispatch") = 0)
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("engine", &Comm::engine)
      .def_property_readonly("handle", &Comm::handle)
      .def("destroy", &Comm::destroy)
      .def("abort", &Comm::abort)
      .def("last_error", [](const Comm& c) { return std::string(epGetLastError(c.get())); })
      .def("async_error", [](const Comm& c) {
        epResult_t err = epSuccess;
        epErrorInfo_t info = EP_ERROR_INFO_INIT;
        c.check(epCommGetAsyncError(c.get(), &err, &info));
        py::dict d;
        d["result"] = static_cast<int>(err);
        d["op"] = info.op;
        d["epoch"] = info.epoch;
        d["rank"] = info.rank;
        d["peer"] = info.peer;
        d["phase"] = info.phase;
        d["violation"] = static_cast<int>(info.violation);
        d["num_violations"] = info.num_violations;
        return d;
      })
      .def("barrier", [](const Comm& c, uintptr_t s) { run(c, [&](epComm_t h) { return epCommBarrier(h, stream(s)); }); },
           py::arg("stream") = 0)
      .def("layout",
           [](const Comm& c, uintptr_t topk_idx, int num_tokens, int topk, int num_experts, uintptr_t per_rank,
              uintptr_t per_expert, uintptr_t in_rank, uintptr_t s) {
             run(c, [&](epComm_t h) {
               return epGetDispatchLayout(h, ptr<const int64_t>(topk_idx), num_tokens, topk, num_experts,
                                          ptr<int>(per_rank), ptr<int>(per_expert), ptr<uint8_t>(in_rank), stream(s));
             });
           })
      .def("alltoallv",
           [](const Comm& c, uintptr_t send, const std::vector<int64_t>& send_counts,
              const std::vector<int64_t>& send_displs, uintptr_t recv, const std::vector<int64_t>& recv_counts,
              const std::vector<int64_t>& recv_displs, int dtype, uintptr_t s) {
             auto sc = toSizes(send_counts), sd = toSizes(send_displs), rc = toSizes(recv_counts),
                  rd = toSizes(recv_displs);
             run(c, [&](epComm_t h) {
               return epAlltoallv(h, ptr<const void>(send), sc.data(), sd.data(), ptr<void>(recv), rc.data(),
                                  rd.data(), static_cast<epDataType_t>(dtype), stream(s));
             });
           })
      .def("alltoallv_device",
           [](const Comm& c, uintptr_t send, uintptr_t send_counts, uintptr_t recv, size_t capacity,
              uintptr_t recv_counts, uintptr_t num_dropped, int dtype, uintptr_t s) {
             run(c, [&](epComm_t h) {
               return epAlltoallvDevice(h, ptr<const void>(send), ptr<const int64_t>(send_counts), ptr<void>(recv),
                                        capacity, ptr<int64_t>(recv_counts), ptr<int64_t>(num_dropped),
                                        static_cast<epDataType_t>(dtype), stream(s));
             });
           })
      .def("ht_dispatch_notify",
           [](const Comm& c, const epHtDispatchArgs_t& a, const HtHandle& hd, int num_local_experts, uintptr_t s) {
             int num_recv = 0;
             std::vector<int> per_expert(static_cast<size_t>(num_local_experts), 0);
             run(c, [&](epComm_t h) { return epHtDispatchNotify(h, &a, hd.get(), &num_recv, per_expert.data(), stream(s)); });
             return py::make_tuple(num_recv, per_expert);
           })
      .def("ht_dispatch",
           [](const Comm& c, const epHtDispatchArgs_t& a, const HtHandle& hd, uintptr_t s) {
             run(c, [&](epComm_t h) { return epHtDispatch(h, &a, hd.get(), stream(s)); });
           })
      .def("ht_combine",
           [](const Comm& c, const epHtCombineArgs_t& a, const HtHandle& hd, uintptr_t s) {
             run(c, [&](epComm_t h) { return epHtCombine(h, &a, hd.get(), stream(s)); });
           })
      .def("ll_dispatch",
           [](const Comm& c, const epLlDispatchArgs_t& a, uintptr_t s) {
             run(c, [&](epComm_t h) { return epLlDispatch(h, &a, stream(s)); });
           })
      .def("ll_combine", [](const Comm& c, const epLlCombineArgs_t& a, uintptr_t s) {
        run(c, [&](epComm_t h) { return epLlCombine(h, &a, stream(s)); });
      })
      // The per-call fast paths of Buffer.low_latency_dispatch/combine: base holds what is fixed for a set of
      // outputs (shapes, receive buffers: cached per set by the Buffer), the call's own pointers come as
      // arguments, so that one call replaces a struct filled field by field from Python.
      .def("ht_combine_with",
           [](const Comm& c, const HtHandle& hd, int num_tokens, int hidden, int dtype, uintptr_t x, size_t x_bytes,
              uintptr_t out, size_t out_bytes, uintptr_t s) {
             epHtCombineArgs_t a = EP_HT_COMBINE_ARGS_INIT;
             a.num_tokens = num_tokens;
             a.hidden = hidden;
             a.dtype = dtype;
             a.x = ptr<const void>(x);
             a.x_bytes = x_bytes;
             a.combined_x = ptr<void>(out);
             a.combined_x_bytes = out_bytes;
             run(c, [&](epComm_t h) { return epHtCombine(h, &a, hd.get(), stream(s)); });
           },
           py::arg("handle"), py::arg("num_tokens"), py::arg("hidden"), py::arg("dtype"), py::arg("x"),
           py::arg("x_bytes"), py::arg("out"), py::arg("out_bytes"), py::arg("stream"),
           "epHtCombine with its arguments given one by one (no HtCombineArgs to fill)")
      .def("ll_dispatch_with",
           [](const Comm& c, const epLlDispatchArgs_t& base, int num_tokens, int topk, int dtype, uintptr_t x,
              uintptr_t topk_idx, unsigned phases, uintptr_t deepep_range, uintptr_t s) {
             epLlDispatchArgs_t a = base;
             a.num_tokens = num_tokens;
             a.topk = topk;
             a.dtype = dtype;
             a.x = ptr<const void>(x);
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.phases = phases;
             run(c, [&](epComm_t h) { return epLlDispatch(h, &a, stream(s)); });
             // Host memory only (the caller passes 0 on the GPU engine): DeepEP's layout range encoding,
             // (begin << 32) | count, from the C API's (count << 32) | begin.
             if (deepep_range != 0 && (phases & EP_LL_RECV) != 0) {
               const uint64_t* in = ptr<const uint64_t>(reinterpret_cast<uintptr_t>(a.recv_layout_range));
               uint64_t* out = ptr<uint64_t>(deepep_range);
               for (size_t i = 0; i < a.recv_layout_range_bytes / sizeof(uint64_t); ++i)
                 out[i] = (in[i] << 32) | (in[i] >> 32);
             }
           },
           py::arg("base"), py::arg("num_tokens"), py::arg("topk"), py::arg("dtype"), py::arg("x"),
           py::arg("topk_idx"), py::arg("phases"), py::arg("deepep_range"), py::arg("stream"))
      .def("ll_combine_with",
           [](const Comm& c, const epLlCombineArgs_t& base, int num_tokens, int topk, int dtype, uintptr_t y,
              size_t y_bytes, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t out, size_t out_bytes,
              unsigned phases, uintptr_t s) {
             epLlCombineArgs_t a = base;
             a.num_tokens = num_tokens;
             a.topk = topk;
             a.dtype = dtype;
             a.y = ptr<const void>(y);
             a.y_bytes = y_bytes;
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.topk_weights = ptr<const float>(topk_weights);
             a.out = ptr<void>(out);
             a.out_bytes = out_bytes;
             a.phases = phases;
             run(c, [&](epComm_t h) { return epLlCombine(h, &a, stream(s)); });
           },
           py::arg("base"), py::arg("num_tokens"), py::arg("topk"), py::arg("dtype"), py::arg("y"),
           py::arg("y_bytes"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("out"), py::arg("out_bytes"),
           py::arg("phases"), py::arg("stream"))
      .def("ll_dispatch_buffer",
           [](const Comm& c) {
             void* x = nullptr;
             float* scales = nullptr;
             size_t x_bytes = 0, scales_bytes = 0;
             c.check(epLlDispatchBuffer(c.get(), &x, &x_bytes, &scales, &scales_bytes));
             return py::make_tuple(reinterpret_cast<uintptr_t>(x), x_bytes, reinterpret_cast<uintptr_t>(scales),
                                   scales_bytes);
           },
           "epLlDispatchBuffer: (recv_x address, bytes, recv_x_scales address, bytes) of the zero-copy LL dispatch "
           "region the next dispatch would name (the library alternates two; either may be passed as recv_x). GPU "
           "engine with config.ll_zero_copy_dispatch, ranks of one host; else raises (epNotSupported, "
           "epInvalidUsage)")
      .def("ll_combine_buffer", [](const Comm& c) { return regionOf(c, epLlCombineBuffer); },
           "epLlCombineBuffer: (address, bytes) of the registered region the next zero-copy LL combine reads its y "
           "from (GPU engine; the host engine raises epNotSupported)")
      .def("ht_combine_buffer", [](const Comm& c) { return regionOf(c, epHtCombineBuffer); },
           "epHtCombineBuffer: (address, bytes) of the registered region that a zero-copy HT combine reads its x "
           "from when x is the region's start (GPU engine with the pull combine; the host engine and "
           "EPCOMM_GPU_HT_COMBINE_PULL=0 raise epNotSupported)")
      .def("set_active_ranks",
           [](const Comm& c, const std::vector<int32_t>& active, uintptr_t s) {
             int n = c.size();
             if (static_cast<int>(active.size()) != n) {
               throw py::value_error("set_active_ranks: the mask has " + std::to_string(active.size()) +
                                     " entries, the communicator has " + std::to_string(n) + " ranks");
             }
             run(c, [&](epComm_t h) { return epCommSetActiveRanks(h, active.data(), stream(s)); });
           },
           py::arg("active"), py::arg("stream") = 0,
           "epCommSetActiveRanks: active[r] nonzero keeps rank r, 0 masks it. Collective among the ranks kept; "
           "synchronous; a masked rank can never be kept again. Also resynchronizes a broken communicator.")
      .def("recover",
           [](const Comm& c, uintptr_t s) {
             std::vector<int32_t> active(static_cast<size_t>(c.size()), 0);
             epResult_t rc;
             {
               py::gil_scoped_release nogil;
               rc = epCommRecover(c.get(), active.data(), stream(s));
             }
             if (rc != epSuccess) raise(rc, c.get(), py::cast(active));
             return active;
           },
           py::arg("stream") = 0,
           "epCommRecover: after a failure, every survivor calls it; together they find the ranks to mask (dead, "
           "lost across hosts, gone, or silent for twice the deadline), agree on one mask and resynchronize with "
           "it. Returns the new mask (1 = active). Raises Error on failure, with .active the mask as far as it got: "
           ".active[rank] == 0 (REMOTE_ERROR) means this rank must leave (the others hold it out, or it reaches "
           "none of them) and destroy the communicator; otherwise the call may be retried. Host engine (the GPU "
           "engine raises NOT_SUPPORTED).")
      .def("active_ranks",
           [](const Comm& c) {
             std::vector<int32_t> active(static_cast<size_t>(c.size()), 0);
             c.check(epCommGetActiveRanks(c.get(), active.data()));
             return active;
           },
           "epCommGetActiveRanks: one entry per rank, 1 = active, 0 = masked")
      .def("masked_drops",
           [](const Comm& c, uintptr_t s) {
             std::vector<int64_t> rows(static_cast<size_t>(c.size()), 0), elements(rows.size(), 0);
             run(c, [&](epComm_t h) { return epCommGetMaskedDrops(h, rows.data(), elements.data(), stream(s)); });
             return py::make_tuple(rows, elements);
           },
           py::arg("stream") = 0,
           "epCommGetMaskedDrops: (token_rows, alltoallv_elements), cumulative per destination rank: dispatch rows "
           "and alltoallv elements not sent because the destination was masked");

  py::class_<HtHandle>(m, "HtHandle")
      .def(py::init<const Comm&, int>(), py::arg("comm"), py::arg("max_tokens"))
      .def_property_readonly("max_tokens", &HtHandle::max_tokens)
      .def("counts", &HtHandle::counts, "(num_tokens, num_recv_tokens) of the layout it holds")
      .def("recv_counts", &HtHandle::recvCounts, py::arg("nranks"),
           "epHtHandleGetRecvCounts: rows received from each of the nranks source ranks (exact mode)");

  py::class_<MemRegion>(m, "MemRegion")
      .def(py::init<const Comm&, uintptr_t, size_t>(), py::arg("comm"), py::arg("address"), py::arg("bytes"),
           "epCommRegister (collective): the peers map [address, address + bytes); an HT combine whose x lies "
           "inside it reads x in place (GPU engine; the host engine accepts and ignores it)")
      .def("deregister", &MemRegion::deregister, "epCommDeregister (collective); a second call does nothing")
      .def_property_readonly("registered", &MemRegion::registered);

  using HD = epHtDispatchArgs_t;
  py::class_<HD>(m, "HtDispatchArgs")
      .def(py::init([] { return HD EP_HT_DISPATCH_ARGS_INIT; }))
      .def_readwrite("num_tokens", &HD::num_tokens)
      .def_readwrite("hidden", &HD::hidden)
      .def_readwrite("topk", &HD::topk)
      .def_readwrite("num_experts", &HD::num_experts)
      .def_readwrite("dtype", &HD::dtype)
      .def_readwrite("flags", &HD::flags)
      .def_readwrite("num_worst_tokens", &HD::num_worst_tokens)
      .EP_PTR_FIELD(HD, HD, x)
      .EP_PTR_FIELD(HD, HD, x_scales)
      .EP_PTR_FIELD(HD, HD, topk_idx)
      .EP_PTR_FIELD(HD, HD, topk_weights)
      .EP_PTR_FIELD(HD, HD, recv_x)
      .def_readwrite("recv_x_bytes", &HD::recv_x_bytes)
      .EP_PTR_FIELD(HD, HD, recv_x_scales)
      .def_readwrite("recv_x_scales_bytes", &HD::recv_x_scales_bytes)
      .EP_PTR_FIELD(HD, HD, recv_topk_idx)
      .def_readwrite("recv_topk_idx_bytes", &HD::recv_topk_idx_bytes)
      .EP_PTR_FIELD(HD, HD, recv_topk_weights)
      .def_readwrite("recv_topk_weights_bytes", &HD::recv_topk_weights_bytes)
      .EP_PTR_FIELD(HD, HD, recv_tokens_per_expert)
      .EP_PTR_FIELD(HD, HD, num_recv_tokens);

  m.def("ht_dispatch_args",
        [](int num_tokens, int hidden, int topk, int num_experts, int dtype, unsigned flags, int num_worst_tokens,
           uintptr_t x, uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights) {
          HD a EP_HT_DISPATCH_ARGS_INIT;
          a.num_tokens = num_tokens;
          a.hidden = hidden;
          a.topk = topk;
          a.num_experts = num_experts;
          a.dtype = dtype;
          a.flags = flags;
          a.num_worst_tokens = num_worst_tokens;
          a.x = ptr<const void>(x);
          a.x_scales = ptr<const float>(x_scales);
          a.topk_idx = ptr<const int64_t>(topk_idx);
          a.topk_weights = ptr<const float>(topk_weights);
          return a;
        },
        py::arg("num_tokens"), py::arg("hidden"), py::arg("topk"), py::arg("num_experts"), py::arg("dtype"),
        py::arg("flags"), py::arg("num_worst_tokens"), py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"),
        py::arg("topk_weights"), "an HtDispatchArgs with its input fields set in one call");

  using HC = epHtCombineArgs_t;
  py::class_<HC>(m, "HtCombineArgs")
      .def(py::init([] { return HC EP_HT_COMBINE_ARGS_INIT; }))
      .def_readwrite("num_tokens", &HC::num_tokens)
      .def_readwrite("hidden", &HC::hidden)
      .def_readwrite("dtype", &HC::dtype)
      .EP_PTR_FIELD(HC, HC, x)
      .def_readwrite("x_bytes", &HC::x_bytes)
      .EP_PTR_FIELD(HC, HC, combined_x)
      .def_readwrite("combined_x_bytes", &HC::combined_x_bytes);

  using LD = epLlDispatchArgs_t;
  py::class_<LD>(m, "LlDispatchArgs")
      .def(py::init([] { return LD EP_LL_DISPATCH_ARGS_INIT; }))
      .def_readwrite("num_tokens", &LD::num_tokens)
      .def_readwrite("max_tokens_per_rank", &LD::max_tokens_per_rank)
      .def_readwrite("hidden", &LD::hidden)
      .def_readwrite("topk", &LD::topk)
      .def_readwrite("num_experts", &LD::num_experts)
      .def_readwrite("dtype", &LD::dtype)
      .def_readwrite("use_fp8", &LD::use_fp8)
      .def_readwrite("layout", &LD::layout)
      .def_readwrite("phases", &LD::phases)
      .EP_PTR_FIELD(LD, LD, x)
      .EP_PTR_FIELD(LD, LD, topk_idx)
      .EP_PTR_FIELD(LD, LD, recv_x)
      .def_readwrite("recv_x_bytes", &LD::recv_x_bytes)
      .EP_PTR_FIELD(LD, LD, recv_x_scales)
      .def_readwrite("recv_x_scales_bytes", &LD::recv_x_scales_bytes)
      .EP_PTR_FIELD(LD, LD, recv_count)
      .def_readwrite("recv_count_bytes", &LD::recv_count_bytes)
      .EP_PTR_FIELD(LD, LD, recv_src_info)
      .def_readwrite("recv_src_info_bytes", &LD::recv_src_info_bytes)
      .EP_PTR_FIELD(LD, LD, recv_layout_range)
      .def_readwrite("recv_layout_range_bytes", &LD::recv_layout_range_bytes)
      .EP_PTR_FIELD(LD, LD, recv_topk_idx)
      .def_readwrite("recv_topk_idx_bytes", &LD::recv_topk_idx_bytes);

  using LC = epLlCombineArgs_t;
  py::class_<LC>(m, "LlCombineArgs")
      .def(py::init([] { return LC EP_LL_COMBINE_ARGS_INIT; }))
      .def_readwrite("num_tokens", &LC::num_tokens)
      .def_readwrite("max_tokens_per_rank", &LC::max_tokens_per_rank)
      .def_readwrite("hidden", &LC::hidden)
      .def_readwrite("topk", &LC::topk)
      .def_readwrite("num_experts", &LC::num_experts)
      .def_readwrite("dtype", &LC::dtype)
      .def_readwrite("layout", &LC::layout)
      .def_readwrite("phases", &LC::phases)
      .EP_PTR_FIELD(LC, LC, y)
      .def_readwrite("y_bytes", &LC::y_bytes)
      .EP_PTR_FIELD(LC, LC, recv_count)
      .EP_PTR_FIELD(LC, LC, recv_src_info)
      .EP_PTR_FIELD(LC, LC, recv_layout_range)
      .EP_PTR_FIELD(LC, LC, recv_topk_idx)
      .EP_PTR_FIELD(LC, LC, topk_idx)
      .EP_PTR_FIELD(LC, LC, topk_weights)
      .EP_PTR_FIELD(LC, LC, out)
      .def_readwrite("out_bytes", &LC::out_bytes);
}
