#include "engine/validate.h"

#include "common/checks.h"
#include "common/dtype.h"

namespace epcomm {
namespace {

template <typename Args>
epResult_t checkHeader(const Args* a, const char* what, const char* init) {
  EP_REQUIRE(a != nullptr, epNullPointer, "%s is NULL", what);
  EP_REQUIRE(a->magic == EP_STRUCT_MAGIC && a->size >= sizeof(Args), epInvalidArgument,
             "%s was not initialised from %s (size %u, magic 0x%x)", what, init, a->size, a->magic);
  return epSuccess;
}

epResult_t checkShape(int num_tokens, int hidden, int topk, int num_experts, int nranks, bool fp8,
                      size_t row_bytes, size_t max_row_bytes) {
  EP_REQUIRE(num_tokens >= 0, epInvalidArgument, "num_tokens = %d is negative", num_tokens);
  const int align = fp8 ? EP_FP8_BLOCK : EP_HIDDEN_ALIGN;
  EP_REQUIRE(hidden > 0 && hidden % align == 0, epInvalidHidden,
             "hidden = %d must be a positive multiple of %d elements%s", hidden, align,
             fp8 ? " for fp8 (one scale per 128 columns)" : "");
  EP_REQUIRE(row_bytes <= max_row_bytes, epInvalidHidden,
             "hidden = %d gives %zu-byte rows, over the %zu bytes the queues take (raise EPCOMM_QUEUE_BYTES)",
             hidden, row_bytes, max_row_bytes);
  EP_REQUIRE(topk >= 1 && topk <= EP_MAX_TOPK, epInvalidTopk, "topk = %d is outside [1, %d]", topk, EP_MAX_TOPK);
  EP_REQUIRE(num_experts > 0 && num_experts % nranks == 0 && num_experts <= EP_MAX_EXPERTS, epInvalidNumExperts,
             "num_experts = %d must be a positive multiple of the rank count %d, at most EP_MAX_EXPERTS = %d",
             num_experts, nranks, EP_MAX_EXPERTS);
  return epSuccess;
}

epResult_t checkPtr(const void* p, bool needed, const char* name) {
  EP_REQUIRE(p != nullptr || !needed, epNullPointer, "%s is NULL", name);
  return epSuccess;
}

epResult_t checkBytes(const void* p, size_t have, size_t need, const char* name) {
  if (p == nullptr) return epSuccess;
  EP_REQUIRE(have >= need, epBufferTooSmall, "%s_bytes = %zu is smaller than the %zu bytes it must hold", name,
             have, need);
  return epSuccess;
}

bool isFloatType(int dt) { return dt == epBfloat16 || dt == epFloat16 || dt == epFloat32; }

// NULL is epNullPointer, a pointer that is not a live handle epInvalidArgument (it is not read), a live handle
// of another communicator epInvalidUsage.
epResult_t checkHandle(const epHtHandle* h, const epComm* comm) {
  EP_REQUIRE(h != nullptr, epNullPointer, "handle is NULL");
  EP_REQUIRE(isLiveHandle(h), epInvalidArgument, "handle is not a live HT handle (destroyed?)");
  EP_REQUIRE(h->comm == comm, epInvalidUsage, "handle was created by epHtHandleCreate on another communicator");
  return epSuccess;
}

// The shape fields of HT dispatch (also checked by its size helper).
epResult_t checkHtShape(const ValidateCtx& v, const epHtDispatchArgs_t* a) {
  EP_REQUIRE(a->dtype == epBfloat16 || a->dtype == epFloat16 || a->dtype == epFloat32 || a->dtype == epFloat8E4M3,
             epUnsupportedDtype, "dtype = %d (%s) is not one of bf16, fp16, fp32, fp8_e4m3 for HT dispatch",
             a->dtype, dtypeName(a->dtype));
  return checkShape(a->num_tokens, a->hidden, a->topk, a->num_experts, v.comm->nranks, a->dtype == epFloat8E4M3,
                    static_cast<size_t>(a->hidden) * dtypeSize(a->dtype), v.max_row_bytes);
}

// The shape fields of LL dispatch and combine (also checked by the LL size helper).
epResult_t checkLlShape(const ValidateCtx& v, int num_tokens, int M, int hidden, int topk, int num_experts, int dtype,
                        bool fp8, int layout) {
  const CommConfig& c = v.comm->config;
  EP_REQUIRE(c.ll_max_tokens_per_rank > 0, epInvalidUsage,
             "the communicator was created without low-latency capacity (config.ll_max_tokens_per_rank = 0)");
  EP_REQUIRE(M >= 1, epInvalidArgument, "max_tokens_per_rank = %d must be at least 1", M);
  EP_REQUIRE(M <= c.ll_max_tokens_per_rank, epCapacityExceeded,
             "max_tokens_per_rank = %d exceeds config.ll_max_tokens_per_rank = %d", M, c.ll_max_tokens_per_rank);
  EP_REQUIRE(num_tokens <= M, epCapacityExceeded, "num_tokens = %d exceeds max_tokens_per_rank = %d", num_tokens, M);
  EP_REQUIRE(isFloatType(dtype), epUnsupportedDtype, "dtype = %d (%s) is not one of bf16, fp16, fp32 for LL",
             dtype, dtypeName(dtype));
  EP_REQUIRE(hidden <= c.ll_max_hidden, epInvalidHidden, "hidden = %d exceeds config.ll_max_hidden = %d", hidden,
             c.ll_max_hidden);
  EPCHECK(checkShape(num_tokens, hidden, topk, num_experts, v.comm->nranks, fp8,
                     static_cast<size_t>(hidden) * dtypeSize(dtype), v.max_row_bytes));
  EP_REQUIRE(c.ll_num_experts == 0 || num_experts <= c.ll_num_experts, epInvalidNumExperts,
             "num_experts = %d exceeds config.ll_num_experts = %d", num_experts, c.ll_num_experts);
  EP_REQUIRE(layout == EP_LL_EXPERT_MAJOR || layout == EP_LL_RANK_MAJOR, epInvalidArgument,
             "layout = %d is neither EP_LL_EXPERT_MAJOR nor EP_LL_RANK_MAJOR", layout);
  return epSuccess;
}

// Element counts and displacements stay below this, so that no byte offset or sum of them overflows.
constexpr size_t kMaxElemBytes = size_t{1} << 56;

}  // namespace

epResult_t validateActiveRanks(const epComm* comm, const int32_t* active, std::vector<uint8_t>* mask) {
  EP_REQUIRE(active != nullptr, epNullPointer, "active is NULL");
  EP_REQUIRE(active[comm->rank] != 0, epInvalidArgument,
             "active[%d] = 0 masks the calling rank %d; a rank can mask only others (a masked rank does not call "
             "epCommSetActiveRanks)",
             comm->rank, comm->rank);
  mask->assign(comm->nranks, 0);
  for (int r = 0; r < comm->nranks; ++r) {
    if (active[r] == 0) continue;
    EP_REQUIRE(comm->active[r] != 0, epInvalidUsage,
               "active[%d] = %d keeps rank %d, but rank %d was masked earlier; a masked rank cannot rejoin this "
               "communicator",
               r, active[r], r, r);
    (*mask)[r] = 1;
  }
  return epSuccess;
}

epResult_t validateRouting(int num_tokens, int topk, int num_experts, int nranks) {
  return checkShape(num_tokens, EP_HIDDEN_ALIGN, topk, num_experts, nranks, false, 0, 1);
}

epResult_t validateTopkIdx(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, const char* name) {
  for (size_t i = 0; i < static_cast<size_t>(num_tokens) * topk; ++i) {
    int64_t e = topk_idx[i];
    if (e < -1 || e >= num_experts)
      EP_FAIL(epExpertOutOfRange, "%s[%zu, %zu] = %lld is outside [-1, num_experts = %d)", name, i / topk,
              i % topk, static_cast<long long>(e), num_experts);
  }
  return epSuccess;
}

static void htBufferSizes(const epHtDispatchArgs_t* a, int nranks, int recv_rows, epBufferSizes_t* s) {
  const size_t rows = recv_rows > 0 ? static_cast<size_t>(recv_rows) : 0;
  s->recv_x = rows * a->hidden * dtypeSize(a->dtype);
  s->recv_x_scales = a->dtype == epFloat8E4M3 ? rows * (a->hidden / EP_FP8_BLOCK) * sizeof(float) : 0;
  s->recv_topk_idx = rows * a->topk * sizeof(int64_t);
  s->recv_topk_weights = rows * a->topk * sizeof(float);
  s->recv_tokens_per_expert = (nranks > 0 ? a->num_experts / nranks : 0) * sizeof(int);
  s->recv_count = sizeof(int);
  s->recv_src_info = 0;
  s->recv_layout_range = 0;
  s->combined_x = static_cast<size_t>(a->num_tokens > 0 ? a->num_tokens : 0) * a->hidden *
                  (a->dtype == epFloat8E4M3 ? 2 : dtypeSize(a->dtype));
}

static void llBufferSizes(const epLlDispatchArgs_t* a, int R, epBufferSizes_t* s) {
  const size_t L = R > 0 ? a->num_experts / R : 0, M = a->max_tokens_per_rank > 0 ? a->max_tokens_per_rank : 0;
  const size_t H = a->hidden > 0 ? a->hidden : 0;
  const size_t row = a->use_fp8 ? H : H * dtypeSize(a->dtype);
  const size_t srow = a->use_fp8 ? (H / EP_FP8_BLOCK) * sizeof(float) : 0;
  const size_t rows = a->layout == EP_LL_RANK_MAJOR ? R * M : L * R * M;
  s->recv_x = rows * row;
  s->recv_x_scales = rows * srow;
  s->recv_count = (a->layout == EP_LL_RANK_MAJOR ? R : L) * sizeof(int);
  s->recv_src_info = a->layout == EP_LL_RANK_MAJOR ? 0 : L * R * M * sizeof(int);
  s->recv_layout_range = a->layout == EP_LL_RANK_MAJOR ? 0 : L * R * sizeof(int64_t);
  s->recv_topk_idx = a->layout == EP_LL_RANK_MAJOR ? R * M * a->topk * sizeof(int64_t) : 0;
  s->recv_topk_weights = 0;
  s->recv_tokens_per_expert = 0;
  s->combined_x = static_cast<size_t>(a->num_tokens > 0 ? a->num_tokens : 0) * H * dtypeSize(a->dtype);
}

epResult_t htDispatchSizes(const ValidateCtx& v, const epHtDispatchArgs_t* a, int recv_rows, epBufferSizes_t* sizes) {
  EPCHECK(checkHeader(a, "args", "EP_HT_DISPATCH_ARGS_INIT"));
  EPCHECK(checkHeader(sizes, "sizes", "EP_BUFFER_SIZES_INIT"));
  EPCHECK(checkHtShape(v, a));
  EP_REQUIRE(recv_rows >= 0, epInvalidArgument, "recv_rows = %d is negative", recv_rows);
  epBufferSizes_t s = *sizes;
  htBufferSizes(a, v.comm->nranks, recv_rows, &s);
  *sizes = s;
  return epSuccess;
}

epResult_t llDispatchSizes(const ValidateCtx& v, const epLlDispatchArgs_t* a, epBufferSizes_t* sizes) {
  EPCHECK(checkHeader(a, "args", "EP_LL_DISPATCH_ARGS_INIT"));
  EPCHECK(checkHeader(sizes, "sizes", "EP_BUFFER_SIZES_INIT"));
  EPCHECK(checkLlShape(v, a->num_tokens, a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype,
                       a->use_fp8 != 0, a->layout));
  epBufferSizes_t s = *sizes;
  llBufferSizes(a, v.comm->nranks, &s);
  *sizes = s;
  return epSuccess;
}

epResult_t validateHtDispatch(const ValidateCtx& v, const epHtDispatchArgs_t* a, const epHtHandle* h,
                              bool notify) {
  EPCHECK(checkHeader(a, "args", "EP_HT_DISPATCH_ARGS_INIT"));
  EPCHECK(checkHandle(h, v.comm));
  EPCHECK(checkHtShape(v, a));
  const bool fp8 = a->dtype == epFloat8E4M3;
  EP_REQUIRE(a->num_tokens <= h->max_tokens, epCapacityExceeded,
             "num_tokens = %d exceeds the handle's max_tokens = %d", a->num_tokens, h->max_tokens);
  EP_REQUIRE(a->num_worst_tokens >= 0, epInvalidArgument, "num_worst_tokens = %d is negative", a->num_worst_tokens);
  const bool use_handle = !notify && (a->num_worst_tokens == 0 || (a->flags & EP_HT_USE_HANDLE_LAYOUT));
  const bool need_idx = notify || !use_handle;
  const bool T = a->num_tokens > 0;
  EPCHECK(checkPtr(a->topk_idx, need_idx && T, "topk_idx"));
  if (!notify) {
    EPCHECK(checkPtr(a->x, T, "x"));
    EPCHECK(checkPtr(a->x_scales, fp8 && T, "x_scales"));
  }
  if (use_handle) {
    EP_REQUIRE(h->valid, epInvalidUsage,
               "the handle holds no layout: call epHtDispatchNotify (exact mode) or a dispatch without "
               "EP_HT_USE_HANDLE_LAYOUT first");
    EP_REQUIRE(h->num_tokens == a->num_tokens && h->num_experts == a->num_experts, epInvalidUsage,
               "num_tokens = %d / num_experts = %d differ from the handle's layout (%d / %d)", a->num_tokens,
               a->num_experts, h->num_tokens, h->num_experts);
  }
  if (a->topk_idx && v.host_memory) EPCHECK(validateTopkIdx(a->topk_idx, a->num_tokens, a->topk, a->num_experts, "topk_idx"));
  if (notify) return epSuccess;
  // Buffers of 0 bytes may be NULL (a rank that receives no rows).
  const int rows = a->num_worst_tokens > 0 ? a->num_worst_tokens : h->num_recv;
  EPCHECK(checkPtr(a->recv_x, rows > 0, "recv_x"));
  EPCHECK(checkPtr(a->recv_x_scales, fp8 && rows > 0, "recv_x_scales"));
  epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
  htBufferSizes(a, v.comm->nranks, rows, &s);
  EPCHECK(checkBytes(a->recv_x, a->recv_x_bytes, s.recv_x, "recv_x"));
  EPCHECK(checkBytes(a->recv_x_scales, a->recv_x_scales_bytes, s.recv_x_scales, "recv_x_scales"));
  EPCHECK(checkBytes(a->recv_topk_idx, a->recv_topk_idx_bytes, s.recv_topk_idx, "recv_topk_idx"));
  EPCHECK(checkBytes(a->recv_topk_weights, a->recv_topk_weights_bytes, s.recv_topk_weights, "recv_topk_weights"));
  return epSuccess;
}

epResult_t validateHtCombine(const ValidateCtx& v, const epHtCombineArgs_t* a, const epHtHandle* h) {
  EPCHECK(checkHeader(a, "args", "EP_HT_COMBINE_ARGS_INIT"));
  EPCHECK(checkHandle(h, v.comm));
  EP_REQUIRE(isFloatType(a->dtype), epUnsupportedDtype,
             "dtype = %d (%s) is not one of bf16, fp16, fp32 for HT combine", a->dtype, dtypeName(a->dtype));
  EP_REQUIRE(h->valid, epInvalidUsage, "the handle holds no dispatch layout: dispatch before combine");
  EP_REQUIRE(a->num_tokens == h->num_tokens, epInvalidUsage,
             "num_tokens = %d differs from the %d tokens of the handle's dispatch", a->num_tokens, h->num_tokens);
  const size_t row = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  EPCHECK(checkShape(a->num_tokens, a->hidden, 1, v.comm->nranks, v.comm->nranks, false, row, v.max_row_bytes));
  EPCHECK(checkPtr(a->x, h->recv_rows > 0, "x"));
  EPCHECK(checkPtr(a->combined_x, a->num_tokens > 0, "combined_x"));
  EPCHECK(checkBytes(a->x, a->x_bytes, h->recv_rows * row, "x"));
  EPCHECK(checkBytes(a->combined_x, a->combined_x_bytes, a->num_tokens * row, "combined_x"));
  return epSuccess;
}

static epResult_t checkLlCommon(const ValidateCtx& v, int num_tokens, int M, int hidden, int topk, int num_experts,
                                int dtype, bool fp8, int layout, unsigned phases) {
  EPCHECK(checkLlShape(v, num_tokens, M, hidden, topk, num_experts, dtype, fp8, layout));
  EP_REQUIRE(phases >= 1 && phases <= 3, epInvalidArgument, "phases = 0x%x is not a non-empty set of EP_LL_SEND | EP_LL_RECV",
             phases);
  return epSuccess;
}

epResult_t validateLlDispatch(const ValidateCtx& v, const epLlDispatchArgs_t* a) {
  EPCHECK(checkHeader(a, "args", "EP_LL_DISPATCH_ARGS_INIT"));
  EPCHECK(checkLlCommon(v, a->num_tokens, a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype,
                        a->use_fp8 != 0, a->layout, a->phases));
  const bool T = a->num_tokens > 0;
  if (a->phases & EP_LL_SEND) {
    EPCHECK(checkPtr(a->x, T, "x"));
    EPCHECK(checkPtr(a->topk_idx, T, "topk_idx"));
    if (a->topk_idx && v.host_memory)
      EPCHECK(validateTopkIdx(a->topk_idx, a->num_tokens, a->topk, a->num_experts, "topk_idx"));
  }
  if (a->phases & EP_LL_RECV) {
    const bool em = a->layout == EP_LL_EXPERT_MAJOR;
    EPCHECK(checkPtr(a->recv_x, true, "recv_x"));
    EPCHECK(checkPtr(a->recv_x_scales, a->use_fp8 != 0, "recv_x_scales"));
    EPCHECK(checkPtr(a->recv_count, true, "recv_count"));
    EPCHECK(checkPtr(a->recv_src_info, em, "recv_src_info"));
    EPCHECK(checkPtr(a->recv_layout_range, em, "recv_layout_range"));
    EPCHECK(checkPtr(a->recv_topk_idx, !em, "recv_topk_idx"));
    epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
    llBufferSizes(a, v.comm->nranks, &s);
    EPCHECK(checkBytes(a->recv_x, a->recv_x_bytes, s.recv_x, "recv_x"));
    EPCHECK(checkBytes(a->recv_x_scales, a->recv_x_scales_bytes, s.recv_x_scales, "recv_x_scales"));
    EPCHECK(checkBytes(a->recv_count, a->recv_count_bytes, s.recv_count, "recv_count"));
    if (em) {
      EPCHECK(checkBytes(a->recv_src_info, a->recv_src_info_bytes, s.recv_src_info, "recv_src_info"));
      EPCHECK(checkBytes(a->recv_layout_range, a->recv_layout_range_bytes, s.recv_layout_range, "recv_layout_range"));
    } else {
      EPCHECK(checkBytes(a->recv_topk_idx, a->recv_topk_idx_bytes, s.recv_topk_idx, "recv_topk_idx"));
    }
  }
  return epSuccess;
}

epResult_t validateLlCombine(const ValidateCtx& v, const epLlCombineArgs_t* a) {
  EPCHECK(checkHeader(a, "args", "EP_LL_COMBINE_ARGS_INIT"));
  EPCHECK(checkLlCommon(v, a->num_tokens, a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype,
                        false, a->layout, a->phases));
  const int R = v.comm->nranks, L = a->num_experts / R, M = a->max_tokens_per_rank;
  const size_t row = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  const bool em = a->layout == EP_LL_EXPERT_MAJOR;
  if (a->phases & EP_LL_SEND) {
    EPCHECK(checkPtr(a->y, true, "y"));
    EPCHECK(checkBytes(a->y, a->y_bytes, static_cast<size_t>(L) * R * M * row, "y"));
    EPCHECK(checkPtr(a->recv_count, true, "recv_count"));
    EPCHECK(checkPtr(a->recv_layout_range, em, "recv_layout_range"));
    EPCHECK(checkPtr(a->recv_topk_idx, !em, "recv_topk_idx"));
    if (v.host_memory && em) {
      for (int e = 0; e < L; ++e)
        for (int s = 0; s < R; ++s) {
          int64_t lr = a->recv_layout_range[static_cast<size_t>(e) * R + s];
          int64_t c = lr >> 32, b = lr & 0xffffffffLL;
          EP_REQUIRE(c >= 0 && c <= M && b + c <= static_cast<int64_t>(R) * M, epInvalidArgument,
                     "recv_layout_range[%d, %d] = (count %lld, begin %lld) is outside the %d rows of an expert", e, s,
                     static_cast<long long>(c), static_cast<long long>(b), R * M);
        }
    } else if (v.host_memory) {
      for (int s = 0; s < R; ++s)
        EP_REQUIRE(a->recv_count[s] >= 0 && a->recv_count[s] <= M, epInvalidArgument,
                   "recv_count[%d] = %d is outside [0, max_tokens_per_rank = %d]", s, a->recv_count[s], M);
      for (size_t i = 0; i < static_cast<size_t>(R) * M * a->topk; ++i)
        EP_REQUIRE(a->recv_topk_idx[i] >= -1 && a->recv_topk_idx[i] < L, epExpertOutOfRange,
                   "recv_topk_idx[%zu] = %lld is outside [-1, local experts = %d)", i,
                   static_cast<long long>(a->recv_topk_idx[i]), L);
    }
  }
  if (a->phases & EP_LL_RECV) {
    const bool T = a->num_tokens > 0;
    EPCHECK(checkPtr(a->topk_idx, T, "topk_idx"));
    EPCHECK(checkPtr(a->topk_weights, T, "topk_weights"));
    EPCHECK(checkPtr(a->out, T, "out"));
    EPCHECK(checkBytes(a->out, a->out_bytes, a->num_tokens * row, "out"));
    if (a->topk_idx && v.host_memory)
      EPCHECK(validateTopkIdx(a->topk_idx, a->num_tokens, a->topk, a->num_experts, "topk_idx"));
  }
  return epSuccess;
}

epResult_t validateAlltoallv(const ValidateCtx& v, const void* sendbuf, const size_t* send_counts,
                             const size_t* send_displs, const void* recvbuf, const size_t* recv_counts,
                             const size_t* recv_displs, int dtype) {
  const size_t es = dtypeSize(dtype);
  EP_REQUIRE(es > 0, epUnsupportedDtype, "dtype = %d is not an epDataType_t", dtype);
  EPCHECK(checkPtr(send_counts, true, "send_counts"));
  EPCHECK(checkPtr(send_displs, true, "send_displs"));
  EPCHECK(checkPtr(recv_counts, true, "recv_counts"));
  EPCHECK(checkPtr(recv_displs, true, "recv_displs"));
  const size_t limit = kMaxElemBytes / es;
  size_t s = 0, r = 0;
  for (int p = 0; p < v.comm->nranks; ++p) {
    EP_REQUIRE(send_counts[p] <= limit && send_displs[p] <= limit, epInvalidArgument,
               "send_counts[%d] = %zu / send_displs[%d] = %zu is over %zu elements of %zu bytes", p, send_counts[p], p,
               send_displs[p], limit, es);
    EP_REQUIRE(recv_counts[p] <= limit && recv_displs[p] <= limit, epInvalidArgument,
               "recv_counts[%d] = %zu / recv_displs[%d] = %zu is over %zu elements of %zu bytes", p, recv_counts[p], p,
               recv_displs[p], limit, es);
    s += send_counts[p];
    r += recv_counts[p];
  }
  // Sides that carry nothing may be NULL.
  EPCHECK(checkPtr(sendbuf, s > 0, "sendbuf"));
  EPCHECK(checkPtr(recvbuf, r > 0, "recvbuf"));
  return epSuccess;
}

epResult_t validateAlltoallvDevice(const ValidateCtx& v, const void* sendbuf, const int64_t* send_counts,
                                   const void* recvbuf, size_t recv_capacity, const int64_t* recv_counts, int dtype) {
  const size_t es = dtypeSize(dtype);
  EP_REQUIRE(es > 0, epUnsupportedDtype, "dtype = %d is not an epDataType_t", dtype);
  EPCHECK(checkPtr(send_counts, true, "send_counts"));
  EPCHECK(checkPtr(recv_counts, true, "recv_counts"));
  EP_REQUIRE(recv_capacity <= kMaxElemBytes / es, epInvalidArgument, "recv_capacity = %zu is over %zu elements",
             recv_capacity, kMaxElemBytes / es);
  int64_t s = 0;
  if (v.host_memory)
    for (int p = 0; p < v.comm->nranks; ++p) {
      EP_REQUIRE(send_counts[p] >= 0 && static_cast<size_t>(send_counts[p]) <= kMaxElemBytes / es, epInvalidArgument,
                 "send_counts[%d] = %lld is negative or over %zu elements", p, static_cast<long long>(send_counts[p]),
                 kMaxElemBytes / es);
      s += send_counts[p];
    }
  EPCHECK(checkPtr(sendbuf, s > 0 || !v.host_memory, "sendbuf"));
  EPCHECK(checkPtr(recvbuf, recv_capacity > 0, "recvbuf"));
  return epSuccess;
}

}  // namespace epcomm
