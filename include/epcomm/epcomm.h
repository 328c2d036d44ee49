/*
 * epcomm — expert-parallel communication for Mixture-of-Experts models.
 *
 * The public, torch-free C API. Everything a program needs to dispatch tokens to the ranks that hold their
 * experts and to combine the expert outputs back is declared here; nothing else of the library is exported.
 *
 * Conventions
 * - Every function returns an epResult_t. On failure the communicator keeps a message that names the
 *   argument and the limit it broke (epGetLastError): every failed call that names a live communicator
 *   records it, queries and calls refused because the communicator is broken or aborted included; a rejected
 *   call leaves the communicator usable.
 * - Pointers: a required pointer that is NULL is epNullPointer everywhere (comm and handles included); a
 *   communicator or handle that is not live (destroyed, or never created) is epInvalidArgument and is not read;
 *   a live handle of another communicator is epInvalidUsage.
 * - Zero-size NULL rule: every pointer whose buffer needs 0 bytes may be NULL (torch hands out NULL data
 *   pointers for empty tensors): x, x_scales, topk_idx, topk_weights, combined_x and out of a rank with
 *   num_tokens == 0, HT recv buffers of 0 rows, an alltoallv side that carries nothing.
 * - A failed call writes none of its outputs (its own checks or a peer's rejected it, or it failed before data
 *   moved), with the exceptions stated where they apply: epCommInitRank* set *comm to NULL, epAlltoallvDevice's
 *   epCapacityExceeded reports what fit, and a wait that breaks the communicator may leave outputs partly
 *   written. A failed epHtDispatchNotify or uncached epHtDispatch may leave the handle without a layout.
 * - Structs that cross the ABI start with {size, magic}; always build them from their *_INIT macro and then
 *   set fields, so that a program compiled against an older header keeps working. A struct not built so (a
 *   wrong magic; for config and args structs also a size smaller than this header's) is epInvalidArgument.
 * - The stream is the last argument. It is a cudaStream_t (struct CUstream_st*), declared here without CUDA
 *   headers so that host-only programs can include this file.
 *
 * Engines: a communicator runs one of two engines, chosen at creation (epConfig_t.engine, or the
 * environment variable EPCOMM_ENGINE=host|gpu when the config says EP_ENGINE_AUTO):
 * - EP_ENGINE_HOST: every operation runs on the calling thread (plus the communicator's channel threads) on
 *   host memory. All pointers are host pointers, the stream argument is ignored, and calls return when their
 *   outputs are complete. Outputs described below as "engine memory" are host memory. Ranks may sit on
 *   several hosts: ranks with the same host identity (EPCOMM_HOSTID, else hostname + boot id) share memory,
 *   the others are reached over the net transport (EPCOMM_NET=socket|ofi) only; results are bit-identical to
 *   those of the same ranks on one host, except HT combine across hosts, which sums per host first (its exact
 *   order is stated at epHtCombine; EPCOMM_HT_HIERARCHICAL=0 restores the one-host order).
 * - EP_ENGINE_GPU: operations are enqueued on the stream; pointers are device pointers; "engine memory" is
 *   device memory. The communication buffers of the ranks of one host (one host identity, as for the host
 *   engine) are allocated once, at creation, and mapped into each other with CUDA IPC, which also works for ranks
 *   that share one GPU (MPS). Ranks on other hosts are reached through a proxy thread per rank: the kernels write
 *   what is meant for such a rank into a ring in pinned host memory, the proxy carries it over the net transport
 *   (EPCOMM_NET) and the receiving rank's proxy stores it into its buffers; the counts stay on the device and the
 *   proxy keeps no per-operation state, so what is capturable on one host is capturable across hosts too. Across
 *   hosts HT dispatch and combine push through the queues (HT combine sums in ascending rank order, as on one
 *   host: bit-identical to one host's result; with EPCOMM_GPU_HT_COMBINE_HIER=1 and the hierarchical dispatch, which
 *   needs hosts of at most 16 ranks, it sums per host first, in the order stated at epHtCombine, as the host engine
 *   does), and what needs the peers' memory mapped is refused with
 *   epNotSupported: epLlCombineBuffer, epHtCombineBuffer and epCommRegister. Every operation runs on the GPU. Argument arrays in device memory (topk_idx, alltoallv device counts, the
 *   dispatch outputs passed back to LL combine) are checked by the kernels: a bad expert id is treated as -1
 *   and counted, a worst-token overflow is not written past the capacity; both are reported by
 *   epCommGetAsyncError without breaking the communicator. worst-token and cached dispatch and combine never
 *   synchronize with the host and may be captured in CUDA graphs; epHtDispatchNotify synchronizes. A call
 *   rejected by the host-side checks launches nothing: when every rank rejects it (the usual case, the shapes
 *   being the same everywhere) nothing else happens; when only some do, the others' kernels end at the
 *   deadline and epCommGetAsyncError reports the timeout. Both LL halves, LL with both halves, and alltoallv
 *   with device counts never synchronize with the host and may be captured in CUDA graphs (each half in its own
 *   graph too). epAlltoallv (host counts) is asynchronous as well; a count one side disagrees with is reported
 *   as an epInvalidUsage violation and each side moves the smaller count.
 * - EP_ENGINE_AUTO resolves to the GPU engine when the library was built with it and a CUDA device is
 *   visible, otherwise to the host engine. Query the result with epCommEngine. It is chosen on each rank before
 *   any exchange: every rank must resolve to the same engine (a GPU machine and a CPU-only one in one
 *   communicator need an explicit choice).
 *
 * Collective rule: all ranks of a communicator issue the same sequence of operations (as with NCCL). Ranks
 * compare an operation header before moving data, so a mismatch, or bad input on one rank, makes every rank
 * return an error instead of hanging. (Host engine: where one side of a mismatch is HT dispatch or combine,
 * whose data go out with the header, that data stays in the transport: the error is epInvalidUsage on every
 * rank and the communicator needs epCommSetActiveRanks with the current mask (or, host engine, epCommRecover)
 * before its next operation. GPU
 * engine: HT dispatch (its notify) and alltoallv, which both count through one mailbox, find each other
 * (epInvalidUsage, then the same resynchronization); other mismatches are not diagnosed: every wait still ends
 * by its deadline, but what the mismatched kernels wrote is undefined.) Every wait has a deadline
 * (epConfig_t.timeout_ms / EPCOMM_TIMEOUT_MS).
 */
#ifndef EPCOMM_EPCOMM_H_
#define EPCOMM_EPCOMM_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define EPCOMM_API
#else
#define EPCOMM_API __attribute__((visibility("default")))
#endif

#define EPCOMM_VERSION_MAJOR 0
#define EPCOMM_VERSION_MINOR 1
#define EPCOMM_VERSION_PATCH 0
#define EPCOMM_VERSION_CODE (EPCOMM_VERSION_MAJOR * 10000 + EPCOMM_VERSION_MINOR * 100 + EPCOMM_VERSION_PATCH)

/* Limits that arguments are checked against, and the codes for breaking them:
 * - hidden not a positive multiple of EP_HIDDEN_ALIGN (fp8: EP_FP8_BLOCK), over config.ll_max_hidden (LL), or
 *   giving rows larger than the queues take (host engine: half of EPCOMM_QUEUE_BYTES): epInvalidHidden;
 * - num_experts not a positive multiple of the rank count or over EP_MAX_EXPERTS: epInvalidNumExperts;
 * - LL max_tokens_per_rank < 1: epInvalidArgument; over config.ll_max_tokens_per_rank, or num_tokens over
 *   max_tokens_per_rank (LL) or over the handle's max_tokens (HT): epCapacityExceeded; an LL call on a
 *   communicator created with ll_max_tokens_per_rank = 0: epInvalidUsage;
 * - nranks outside [1, EP_MAX_RANKS] or rank outside [0, nranks): epRankMismatch;
 * - a negative count, or an alltoallv count or displacement over 2^56 bytes: epInvalidArgument. */
#define EP_MAX_TOPK 32          /* top-k per token */
#define EP_MAX_RANKS 1024       /* ranks per communicator */
#define EP_MAX_EXPERTS 65536    /* experts per operation */
#define EP_FP8_BLOCK 128        /* columns that share one fp32 scale in fp8 data */
#define EP_HIDDEN_ALIGN 8       /* hidden sizes are multiples of this many elements (fp8: EP_FP8_BLOCK) */

/* ---------------------------------------------------------------------------------------------------------
 * Result codes. Each invalid argument class has its own code; epGetLastError names the argument and limit.
 * ------------------------------------------------------------------------------------------------------- */
typedef enum {
  epSuccess = 0,
  epInvalidArgument = 1,     /* a value out of its range that has no more specific code (negative count…) */
  epNullPointer = 2,         /* a required pointer was NULL */
  epUnsupportedDtype = 3,    /* a data type the operation does not take */
  epInvalidHidden = 4,       /* hidden size not a positive multiple of 8 elements (fp8: 128) */
  epInvalidTopk = 5,         /* top-k outside [1, EP_MAX_TOPK] */
  epInvalidNumExperts = 6,   /* number of experts not a positive multiple of the rank count, or over EP_MAX_EXPERTS */
  epExpertOutOfRange = 7,    /* an expert id in topk_idx outside [-1, num_experts) */
  epCapacityExceeded = 8,    /* more tokens than a capacity allows */
  epBufferTooSmall = 9,      /* a caller buffer smaller than the size helper says */
  epRankMismatch = 10,       /* ranks disagree on the rank count, or a rank index is out of range */
  epInvalidUsage = 11,       /* wrong call order, foreign handle, ranks issued different operations */
  epNotSupported = 12,       /* not available in this build or engine */
  epSystemError = 13,        /* an operating-system call failed */
  epCudaError = 14,          /* a CUDA call failed */
  epTimeout = 15,            /* a wait passed its deadline; see epCommGetAsyncError */
  epRemoteError = 16,        /* a peer died, closed its connection, or reported an error */
  epAborted = 17,            /* the communicator was aborted */
  epInternalError = 18,      /* a bug in epcomm */
  epInvalidUniqueId = 19,    /* a unique id that is garbled, stale, or from another version */
  epAddressInUse = 20,       /* the rendezvous address or port is taken */
  epNumResults = 21
} epResult_t;

/* ---------------------------------------------------------------------------------------------------------
 * Data types
 * ------------------------------------------------------------------------------------------------------- */
typedef enum {
  epFloat32 = 0,
  epFloat16 = 1,
  epBfloat16 = 2,
  epFloat8E4M3 = 3, /* OCP e4m3fn; always paired with per-128-column fp32 scales */
  epInt32 = 4,
  epInt64 = 5,
  epUint8 = 6,
  epNumDataTypes = 7
} epDataType_t;

typedef enum { EP_ENGINE_AUTO = 0, EP_ENGINE_HOST = 1, EP_ENGINE_GPU = 2 } epEngine_t;

/* Operations and phases, as recorded in epErrorInfo_t. */
typedef enum {
  epOpNone = 0, epOpInit, epOpLayout, epOpHtNotify, epOpHtDispatch, epOpHtCombine, epOpLlDispatch,
  epOpLlCombine, epOpAlltoallv, epOpAlltoallvDevice, epOpBarrier, epOpDestroy,
  epOpSetActiveRanks, epOpRegister, epOpRecover, epNumOps
} epOp_t;
typedef enum { epPhaseNone = 0, epPhaseHeader, epPhaseData, epPhaseBootstrap } epPhase_t;

typedef struct CUstream_st* epStream_t; /* == cudaStream_t */
typedef struct epComm* epComm_t;
typedef struct epHtHandle* epHtHandle_t;
typedef struct epMemRegion* epMemRegion_t;

#define EP_STRUCT_MAGIC 0x65706331u /* "epc1" */

/* ---------------------------------------------------------------------------------------------------------
 * Communicator configuration. Start from EP_CONFIG_INIT; zero fields mean "default".
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
  unsigned int size;           /* sizeof(epConfig_t) */
  unsigned int magic;          /* EP_STRUCT_MAGIC */
  unsigned int version;        /* EPCOMM_VERSION_CODE of the header the caller was built with */
  int engine;                  /* epEngine_t; EP_ENGINE_AUTO honours EPCOMM_ENGINE */
  int cuda_device;             /* GPU engine: device ordinal, -1 = current device */
  int timeout_ms;              /* deadline of every wait; 0 = EPCOMM_TIMEOUT_MS (default 30000) */
  int num_channels;            /* host engine: threads per rank for HT dispatch/combine; 0 = EPCOMM_HOST_CHANNELS
                                  or cores / ranks of the machine (all ranks use the smallest value asked for) */
  int num_sms;                 /* GPU engine: SM budget per operation; 0 = default */
  size_t queue_bytes;          /* bytes of each per-peer, per-channel queue; 0 = EPCOMM_QUEUE_BYTES */
  int ll_max_tokens_per_rank;  /* low-latency capacity: tokens per rank per call; 0 = LL disabled */
  int ll_max_hidden;           /* low-latency: largest hidden size; 0 = 7168 */
  int ll_num_experts;          /* low-latency: experts the LL buffers are sized for; 0 = any on the host engine,
                                  256 on the GPU engine (whose combine buffers hold one row per expert and token) */
  int ht_max_tokens_per_rank;  /* GPU engine, HT: most tokens a rank dispatches per call (sizes the combine
                                  staging, nranks rows per token, and the pull dispatch's, one row per
                                  token); 0 = 4096 */
  int ht_max_hidden;           /* GPU engine, HT: largest hidden size in bf16 rows (fp32 rows take two); 0 = 7168 */
  int ll_zero_copy_dispatch;   /* GPU engine, ranks of one host: 1 = also allocate two zero-copy LL dispatch output
                                  regions (epLlDispatchBuffer), each ll_num_experts x ll_max_tokens_per_rank rows of
                                  ll_max_hidden bf16 plus fp8 scales; 0 = none */
} epConfig_t;

#define EP_CONFIG_INIT \
  { sizeof(epConfig_t), EP_STRUCT_MAGIC, EPCOMM_VERSION_CODE, EP_ENGINE_AUTO, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* What a failed wait recorded (R1 of the design): operation, its epoch, this rank, the peer, the phase. */
typedef struct {
  unsigned int size;
  unsigned int magic;
  int op;              /* epOp_t */
  uint64_t epoch;      /* per-communicator operation sequence number */
  int rank;            /* the rank that recorded the error */
  int peer;            /* the peer it was waiting for, -1 if none */
  int phase;           /* epPhase_t */
  epResult_t result;   /* epTimeout, epRemoteError, epAborted, … */
  /* GPU engine: argument violations found by kernels (they do not break the communicator): the first one's
   * code (epExpertOutOfRange, epCapacityExceeded) and how many there were since creation. */
  epResult_t violation;
  uint64_t num_violations;
} epErrorInfo_t;

#define EP_ERROR_INFO_INIT { sizeof(epErrorInfo_t), EP_STRUCT_MAGIC, 0, 0, -1, -1, 0, epSuccess, epSuccess, 0 }

/* ---------------------------------------------------------------------------------------------------------
 * Errors and version
 * ------------------------------------------------------------------------------------------------------- */
EPCOMM_API const char* epGetErrorString(epResult_t result);
/* The message of the last failed call on comm, or of the last failed call of this thread when comm is NULL
 * (use that for epGetUniqueId / epCommInitRank failures). Never NULL; "" when there is none. */
EPCOMM_API const char* epGetLastError(epComm_t comm);
EPCOMM_API epResult_t epGetVersion(int* version);
EPCOMM_API size_t epDataTypeSize(epDataType_t dtype); /* bytes per element; 0 for an unknown type */

/* ---------------------------------------------------------------------------------------------------------
 * Communicator lifecycle
 * ------------------------------------------------------------------------------------------------------- */
#define EP_UNIQUE_ID_BYTES 128
typedef struct { char internal[EP_UNIQUE_ID_BYTES]; } epUniqueId;

/* Creates a rendezvous for one communicator and describes it in *id: the address of a listener started in
 * this process (EPCOMM_SOCKET_IFNAME / EPCOMM_BOOTSTRAP_ADDR choose it) and a random secret that every
 * connection must present. Call once, on one process (usually rank 0), and share the id with all ranks.
 * The listener serves one communicator creation and then closes: the id is then stale. In the process that
 * made it, creating with a stale id returns epInvalidUniqueId at once; other processes cannot tell a closed
 * rendezvous from an unreachable one and get epTimeout (or epRemoteError) at their deadline. */
EPCOMM_API epResult_t epGetUniqueId(epUniqueId* id);

/* Creates this rank's member of an nranks communicator. Collective over all ranks; waits at most
 * timeout_ms for the others. config may be NULL for defaults. */
EPCOMM_API epResult_t epCommInitRank(epComm_t* comm, int nranks, const epUniqueId* id, int rank,
                                     const epConfig_t* config);

/* The same with the caller's own all-gather (e.g. a torch Store): fn must place every rank's bytes_per_rank
 * bytes of sendbuf at recvbuf + r * bytes_per_rank and return 0, or non-zero on failure. It is called
 * collectively, the same number of times on every rank, only during creation. */
typedef int (*epAllgatherFn_t)(void* ctx, const void* sendbuf, void* recvbuf, size_t bytes_per_rank);
EPCOMM_API epResult_t epCommInitRankWithAllgather(epComm_t* comm, int nranks, int rank, epAllgatherFn_t fn,
                                                  void* ctx, const epConfig_t* config);

/* The id as text (2 * EP_UNIQUE_ID_BYTES hex digits) for environment variables and command lines. */
#define EP_UNIQUE_ID_STRING_BYTES (2 * EP_UNIQUE_ID_BYTES + 1)
EPCOMM_API epResult_t epUniqueIdToString(const epUniqueId* id, char* buf, size_t buf_bytes);
EPCOMM_API epResult_t epUniqueIdFromString(const char* str, epUniqueId* id);

/* epCommInitRank with rank, size and id from EPCOMM_RANK, EPCOMM_WORLD_SIZE and EPCOMM_UNIQUE_ID, as
 * epcomm-run sets them. */
EPCOMM_API epResult_t epCommInitFromEnv(epComm_t* comm, const epConfig_t* config);

/* Releases this rank's member once its own work in flight has ended (GPU kernels end within their deadline).
 * Local: peers keep their mappings valid until they destroy theirs. Across hosts, what this rank's last operations
 * wrote for ranks of other hosts still goes out, and each live rank of another host is told goodbye, before the
 * connections close: a few round trips when the peers destroy too or keep running, at most timeout_ms when one is
 * stalled (a warning then names it and its connection's state). Ranks that destroy together end together. */
EPCOMM_API epResult_t epCommDestroy(epComm_t comm);
/* Local, prompt teardown even when peers are dead; in-flight waits on this communicator return epAborted. */
EPCOMM_API epResult_t epCommAbort(epComm_t comm);
/* The first asynchronous error (timeout, dead peer, abort) this communicator saw, or epSuccess.
 * info may be NULL; otherwise start it from EP_ERROR_INFO_INIT (else epInvalidArgument, nothing written). */
EPCOMM_API epResult_t epCommGetAsyncError(epComm_t comm, epResult_t* async_error, epErrorInfo_t* info);
EPCOMM_API epResult_t epCommRank(epComm_t comm, int* rank);
EPCOMM_API epResult_t epCommSize(epComm_t comm, int* size);
EPCOMM_API epResult_t epCommEngine(epComm_t comm, epEngine_t* engine);
/* A plain barrier over the communicator's own transport (not capturable). */
EPCOMM_API epResult_t epCommBarrier(epComm_t comm, epStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * Layout: per-rank and per-expert counts of one rank's routing. Local, no communication.
 *   topk_idx            [num_tokens, topk] int64, expert id or -1 (no expert)
 *   num_tokens_per_rank [nranks] int32: tokens with at least one expert on rank r
 *   num_tokens_per_expert [num_experts] int32: (token, expert) pairs per expert (duplicates count once)
 *   is_token_in_rank    [num_tokens, nranks] uint8 (0/1)
 * All in engine memory; any output may be NULL to skip it.
 * ------------------------------------------------------------------------------------------------------- */
EPCOMM_API epResult_t epGetDispatchLayout(epComm_t comm, const int64_t* topk_idx, int num_tokens, int topk,
                                          int num_experts, int* num_tokens_per_rank, int* num_tokens_per_expert,
                                          uint8_t* is_token_in_rank, epStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * High-throughput (HT) dispatch and combine.
 *
 * Dispatch sends each token once to every rank that hosts at least one of its experts. On the receiver the
 * rows are ordered by source rank, then by source token index. For each received row:
 *   recv_topk_idx[row, k]     = local expert id (expert - rank * E/R) if expert k is on this rank, else -1
 *   recv_topk_weights[row, k] = topk_weights[token, k] for local experts, else 0
 *   recv_tokens_per_expert[e] = rows that name local expert e, num_recv_tokens[0] = rows received.
 *
 * Exact mode (num_worst_tokens == 0): epHtDispatchNotify exchanges the counts, records the layout in the
 * handle and returns them host-visible; the caller sizes recv buffers from them and calls epHtDispatch with
 * the same arguments. Worst-token mode (num_worst_tokens > 0): one epHtDispatch call, static output shapes of
 * num_worst_tokens rows; rows past the received count have recv_topk_idx = -1 and weight 0 (their recv_x
 * rows are left as they were); the counts are written to engine memory only.
 * EP_HT_USE_HANDLE_LAYOUT reuses the layout the handle holds from an earlier dispatch (cached mode): the
 * routing must be the same as then; topk_idx/topk_weights may then be NULL (recv_topk_* are not written).
 * In exact mode epHtDispatch always uses the handle's layout.
 *
 * Combine: combined_x[t] = sum over the ranks r that received t, in ascending r, of x_r[row(t, r)],
 * accumulated in fp32 and rounded once (bit-identical from run to run). Tokens no rank received get 0.
 * Across hosts (ranks on more than one host) HT dispatch runs hierarchically by default in both engines (the GPU
 * engine's for hosts of up to 16 ranks): it sends each token row once to every destination host (to one forwarding
 * rank there, which passes it on to the ranks of its host that need it); every dispatch output is bit-identical to
 * one host's. The host engine's combine (and the GPU engine's with EPCOMM_GPU_HT_COMBINE_HIER=1 where its dispatch
 * is hierarchical; by default it stays flat, in the one-host order) reduces inside each host first (one rank of each
 * host sums its host's rows for a token and sends one partial back), so its order is, exactly:
 *   hosts are numbered in the order of their lowest rank; for each host h that holds token t, in ascending h,
 *     P_h = fp32 sum, starting from +0.0f, of x_r[row(t, r)] over the ranks r of h that received t, ascending r;
 *   acc = +0.0f; acc = acc + P_h for those hosts in ascending h (fp32); combined_x[t] = acc rounded once.
 * P_h crosses hosts in fp32, never rounded to the row dtype in between (where one rank of h holds t, P_h is
 * that row exactly and crosses in its dtype). On one host this is the order above (acc = +0.0f + P_0 = P_0),
 * so one-host results are unchanged; across hosts results can differ from one host's in the last bits of fp32
 * rounding (bf16/fp16 outputs mostly hide it), and they do not depend on the number of channels, the network
 * or timing: bit-identical from run to run for a given split of ranks into hosts. EPCOMM_HT_HIERARCHICAL=0
 * (the same on every rank) selects the flat path, where the token's owner receives every x_r[row(t, r)] row and
 * reduces them itself in ascending global rank order, bit-identical to one host.
 * ------------------------------------------------------------------------------------------------------- */
#define EP_HT_USE_HANDLE_LAYOUT 0x1u

/* A handle holds one rank's dispatch layout for max_tokens tokens; it is filled by notify/dispatch and read
 * by combine and cached dispatch. Create it once, reuse it for every step. */
EPCOMM_API epResult_t epHtHandleCreate(epComm_t comm, int max_tokens, epHtHandle_t* handle);
EPCOMM_API epResult_t epHtHandleDestroy(epHtHandle_t handle);
/* Host-visible counts of the layout the handle holds (exact mode; host engine always). */
EPCOMM_API epResult_t epHtHandleGetCounts(epHtHandle_t handle, int* num_tokens, int* num_recv_tokens);
/* Host-visible rows received from each source rank ([R] ints, in rank order: the received rows are ordered by
 * source rank, so source r's rows start at the sum of recv_counts[0..r-1]) of the layout the handle holds, under
 * the same condition (exact mode, after epHtDispatchNotify; host engine always). A masked source counts 0. */
EPCOMM_API epResult_t epHtHandleGetRecvCounts(epHtHandle_t handle, int* recv_counts);

typedef struct {
  unsigned int size;
  unsigned int magic;
  int num_tokens;                 /* T of this rank (may be 0) */
  int hidden;                     /* H, elements per row */
  int topk;                       /* K */
  int num_experts;                /* E, a multiple of the rank count */
  int dtype;                      /* epDataType_t of x: bf16, fp16, fp32, or fp8 e4m3 (with x_scales) */
  unsigned int flags;             /* EP_HT_USE_HANDLE_LAYOUT */
  int num_worst_tokens;           /* 0 = exact mode; > 0 = worst-token mode, rows of every recv buffer */
  const void* x;                  /* [T, H] */
  const float* x_scales;          /* [T, H/128] fp32, fp8 only */
  const int64_t* topk_idx;        /* [T, K] */
  const float* topk_weights;      /* [T, K], may be NULL */
  void* recv_x;                   /* [rows, H] dtype */
  size_t recv_x_bytes;
  float* recv_x_scales;           /* [rows, H/128], fp8 only */
  size_t recv_x_scales_bytes;
  int64_t* recv_topk_idx;         /* [rows, K], may be NULL */
  size_t recv_topk_idx_bytes;
  float* recv_topk_weights;       /* [rows, K], may be NULL */
  size_t recv_topk_weights_bytes;
  int* recv_tokens_per_expert;    /* [E/R] engine memory, may be NULL */
  int* num_recv_tokens;           /* [1] engine memory, may be NULL */
} epHtDispatchArgs_t;

#define EP_HT_DISPATCH_ARGS_INIT                                                                      \
  { sizeof(epHtDispatchArgs_t), EP_STRUCT_MAGIC, 0, 0, 0, 0, epBfloat16, 0u, 0, NULL, NULL, NULL, NULL, \
    NULL, 0, NULL, 0, NULL, 0, NULL, 0, NULL, NULL }

EPCOMM_API epResult_t epHtDispatchNotify(epComm_t comm, const epHtDispatchArgs_t* args, epHtHandle_t handle,
                                         int* num_recv_tokens_host, int* recv_tokens_per_expert_host,
                                         epStream_t stream);
EPCOMM_API epResult_t epHtDispatch(epComm_t comm, const epHtDispatchArgs_t* args, epHtHandle_t handle,
                                   epStream_t stream);

typedef struct {
  unsigned int size;
  unsigned int magic;
  int num_tokens;          /* T of this rank: must equal the handle's */
  int hidden;
  int dtype;               /* bf16, fp16 or fp32, for x and combined_x */
  const void* x;           /* [received rows of the handle, H] in dispatch receive order */
  size_t x_bytes;
  void* combined_x;        /* [T, H] */
  size_t combined_x_bytes;
} epHtCombineArgs_t;

#define EP_HT_COMBINE_ARGS_INIT { sizeof(epHtCombineArgs_t), EP_STRUCT_MAGIC, 0, 0, epBfloat16, NULL, 0, NULL, 0 }

EPCOMM_API epResult_t epHtCombine(epComm_t comm, const epHtCombineArgs_t* args, epHtHandle_t handle,
                                  epStream_t stream);

/* Zero-copy HT combine input (GPU engine). Returns a region of this rank's registered memory, *x_bytes long
 * (config.ht_max_tokens_per_rank x nranks rows of config.ht_max_hidden bf16 values), to which the expert
 * computation writes its outputs: the combine's x, [received rows, H] of the combine's dtype, row i at byte
 * i * H * dtype size from the region's start. Pass the region's start as args->x: the combine then copies
 * nothing and the token owners read the rows straight from it. Each rank chooses for itself, combine by combine.
 * The region is the same for every call (CUDA-graph safe). Lifetime: it may be written by work ordered on the
 * device after an HT dispatch of this communicator (the dispatch's stream, or an event recorded after it; the
 * dispatch waits on the device until every peer has finished reading the earlier combines' rows) and issued
 * before the combine that reads it; not after that until the next HT dispatch. A plain combine also uses the
 * region (it copies x there), so its contents do not outlive the next combine. The host engine returns
 * epNotSupported (its combine reads x in place); so does the GPU engine with EPCOMM_GPU_HT_COMBINE_PULL=0, whose
 * combine uses the memory for its own staging. An x that overlaps the region without starting at its start, or a
 * combined_x that overlaps it, is epInvalidArgument. */
EPCOMM_API epResult_t epHtCombineBuffer(epComm_t comm, void** x, size_t* x_bytes);

/* Registered combine input (GPU engine). epCommRegister maps [ptr, ptr + bytes) of this rank's device memory
 * (cudaMalloc memory: the whole allocation it lies in is shared over CUDA IPC) into every peer of the host.
 * Collective: every rank calls it, each with its own memory (sizes may differ), and every rank makes its
 * registration calls (epCommRegister, epCommDeregister) in the same order. If any rank's call is refused, every
 * rank returns an error and nothing is registered: a refusing rank returns its own code; the others return the
 * code of the lowest refusing rank, which the message names. An HT pull combine (the default,
 * EPCOMM_GPU_HT_COMBINE_PULL=1) whose x (its recv_rows rows) lies inside a region this rank registered copies
 * nothing: the token owners read the rows straight from it, as with the zero-copy region, with the plain
 * combine's lifetime rule: x may be written again, or freed, once the combine has completed on its stream (the
 * combine waits on the device until every owner has read its rows); combined_x must not overlap such an x
 * (epInvalidArgument). Each rank chooses for itself, combine by combine; other inputs take the copying path.
 * Captured graphs keep the choice made at capture: deregister a region only when no pending operation and no
 * graph to be replayed reads it. The memory must stay allocated while registered. Refused: NULL ptr or region
 * (epNullPointer); bytes 0, a range past the end of its allocation, memory of another device or of the
 * communicator's own buffers (epInvalidArgument); memory CUDA IPC cannot share, such as cuMemCreate /
 * expandable-segment or cudaMallocAsync allocations (epNotSupported); more than EP_MAX_MEM_REGIONS regions at
 * once, or a call while an LL receive half is outstanding (epInvalidUsage). The ranks agree through their
 * communication buffers; a rank missing at the deadline, or ranks in different registration calls, break the
 * communicator (epTimeout, epInvalidUsage in epCommGetAsyncError), as a failed operation does. The host engine
 * keeps nothing: it checks each rank's arguments on that rank alone and ignores the memory (its combine reads x
 * in place). epCommDeregister is collective too; it waits for this rank's device work (cudaDeviceSynchronize),
 * then for the other ranks, then unmaps (with a dead peer it waits until the deadline). A region outlives its
 * communicator only as a handle: deregistering it then just frees it; a handle deregistered twice, or made up,
 * is epInvalidArgument.
 * Without a call: on the ranks of one host, a plain HT pull combine whose x lies in a cudaMalloc allocation of
 * 2 MiB or more that starts a 2 MiB page (as PyTorch's caching-allocator segments do; CUDA packs smaller
 * allocations several to a page) offers that allocation to the peers on its own (implicit registration;
 * EPCOMM_GPU_HT_AUTO_REGISTER=0 turns it off). Nothing waits: the owners map it at their next combines, and from
 * then on combines from that allocation read x in place, with the lifetime rule above; until then, and for memory CUDA IPC cannot share, x is copied. Up to 32
 * allocations per rank stay mapped by the peers, until the communicator is destroyed or the slot, unused for 64
 * combines and no longer read, goes to another allocation; a freed allocation is recognized (CUDA gives its
 * successor another IPC handle) and never read. Captured combines copy x unless it lies in a region registered
 * with epCommRegister. */
#define EP_MAX_MEM_REGIONS 32
EPCOMM_API epResult_t epCommRegister(epComm_t comm, void* ptr, size_t bytes, epMemRegion_t* region);
EPCOMM_API epResult_t epCommDeregister(epMemRegion_t region);

/* ---------------------------------------------------------------------------------------------------------
 * Low-latency (LL) dispatch and combine, with capacity M = max_tokens_per_rank (<= ll_max_tokens_per_rank of
 * the config) and L = E/R local experts. A token that names the same expert twice is sent once to it.
 *
 * EP_LL_EXPERT_MAJOR outputs:
 *   recv_x        [L, R*M, H]  rows of local expert e packed from row 0, ordered by source rank, then token
 *   recv_x_scales [L, R*M, H/128] fp32 (use_fp8 only)
 *   recv_count    [L] int32     rows of each local expert
 *   recv_src_info [L, R*M] int32 source token index of each row
 *   recv_layout_range [L, R] int64: (count << 32) | begin of the rows that came from rank r
 * EP_LL_RANK_MAJOR outputs (one row per token and destination rank, at a fixed slot):
 *   recv_x        [R, M, H]    token t of rank r at [r, t] when it names an expert on this rank
 *   recv_x_scales [R, M, H/128] (use_fp8 only)
 *   recv_count    [R] int32     tokens sent by rank r (its num_tokens)
 *   recv_topk_idx [R, M, K] int64: local expert ids of each row, -1 elsewhere (all M rows written)
 * Unwritten recv_x rows keep their old contents.
 *
 * Combine takes expert outputs y [L, R*M, H] at the rows dispatch gave (expert-major: the packed row;
 * rank-major: row r*M + t) and computes on each source rank
 *   out[t] = sum over k = 0..K-1 with topk_idx[t,k] >= 0 of topk_weights[t,k] * y[e_k][row(t, e_k)]
 * in that order, in fp32, rounded once. The dispatch outputs that describe the rows (recv_count and
 * recv_src_info/recv_layout_range, or recv_count and recv_topk_idx) are passed back unchanged.
 *
 * phases: EP_LL_SEND issues this rank's sends and returns without waiting for peers; EP_LL_RECV completes
 * the receive (the "hook"); EP_LL_SEND_RECV does both. Call both halves with the same arguments; at most one
 * dispatch and one combine may be between their halves at a time.
 *
 * Call order, decided from local state (the same on every rank, so a refused call posts nothing): a send
 * half needs no send half of its operation outstanding; a receive half needs its operation's send half to be
 * the oldest one outstanding; a call with both halves needs none outstanding; otherwise epInvalidUsage.
 * Host engine: between a send half and its receive only LL calls may run: epCommBarrier, HT calls and
 * alltoallv return epInvalidUsage and post nothing (the GPU engine keeps separate buffers and allows them). An LL
 * half on its own on the host engine does not wait for its sends: what does not fit in the queues goes out while
 * this rank is inside its later calls, so a peer's receive may wait until this rank's next call that communicates
 * (an LL call, a barrier): a rank that stops calling for long stalls its peers' LL receives. A call with both
 * halves sends its rows straight out of x (dispatch without fp8) or y (combine) and returns only once they are
 * in the peers' queues: where a peer sits between its own halves, that may take until the peer's next call.
 * Rejected halves: a rejected EP_LL_RECV posts nothing and stays outstanding: the peers' receives complete as
 * usual and a valid retry of the receive completes this rank's. A rejected EP_LL_SEND returns at once and
 * posts an error header: every peer's receive of that operation returns epRemoteError naming this rank, and
 * this rank's own receive returns the send half's code without output; call both, to stay aligned. A rejected
 * EP_LL_SEND_RECV does both (peers: epRemoteError). A rejected call whose args cannot be read (NULL, not from
 * *_INIT, phases not in 1..3) stands for its operation's receive half when its send half is outstanding, else
 * for a send half when the other operation's receive is outstanding, else for both halves.
 *
 * GPU engine: each half is one kernel on the call's stream; the receive half may go on another stream than the
 * send half, ordered after it by the caller (an event, or stream order): sends of one kind (dispatch or combine)
 * must run in issue order, and so must receives. A rank's send half of operation n + 2 waits on the device
 * until every peer has finished receiving operation n (two operations in flight per kind, no host involvement;
 * a zero-copy dispatch's send half issues its rows first and does not complete before that).
 * Each block stages the call's routing in shared memory, at most 200 KiB: a dispatch needs 12 T K + 4 E bytes,
 * a combine 20 T K + 16 E + 4 L bytes plus ceil(T K / 32) E bytes where that is at most 32 KiB (T = num_tokens,
 * K = topk, E = num_experts, L = E / nranks); a larger call returns epCapacityExceeded (top-8, 256 experts:
 * about 2100 tokens for dispatch, 1250 for combine).
 *
 * Bit-level contract (both engines, and any reimplementation, produce the same bits):
 * - fp8 (use_fp8): per 128-column block, amax = max |x| over the block (as fp32), floored at 1e-4 (an all-zero
 *   block therefore gets scale 1e-4 / 448 and all-zero values); scale = fp32(amax / 448); each value is
 *   e4m3(fp32(x * fp32(448 / amax))), rounded to nearest even and saturated at +-448 (OCP e4m3fn, no inf).
 * - Combines accumulate in fp32 starting from +0, in the order stated above; in LL combine each term is
 *   fp32(w * y) rounded before the sum fp32(acc + term) is rounded (no fused multiply-add), and the result is
 *   rounded once to the output type (round to nearest even). HT combine adds rows without weights.
 * ------------------------------------------------------------------------------------------------------- */
typedef enum { EP_LL_EXPERT_MAJOR = 0, EP_LL_RANK_MAJOR = 1 } epLlLayout_t;
#define EP_LL_SEND 0x1u
#define EP_LL_RECV 0x2u
#define EP_LL_SEND_RECV 0x3u

typedef struct {
  unsigned int size;
  unsigned int magic;
  int num_tokens;               /* T of this rank, <= max_tokens_per_rank */
  int max_tokens_per_rank;      /* M, the same on every rank */
  int hidden;
  int topk;
  int num_experts;
  int dtype;                    /* of x: bf16, fp16, fp32 */
  int use_fp8;                  /* send as fp8 e4m3 with per-128-column fp32 scales (amax / 448) */
  int layout;                   /* epLlLayout_t */
  unsigned int phases;          /* EP_LL_SEND | EP_LL_RECV */
  const void* x;                /* [T, H] */
  const int64_t* topk_idx;      /* [T, K] */
  void* recv_x;                 /* see above; dtype, or fp8 e4m3 with use_fp8 */
  size_t recv_x_bytes;
  float* recv_x_scales;
  size_t recv_x_scales_bytes;
  int* recv_count;
  size_t recv_count_bytes;
  int* recv_src_info;           /* expert-major only */
  size_t recv_src_info_bytes;
  int64_t* recv_layout_range;   /* expert-major only */
  size_t recv_layout_range_bytes;
  int64_t* recv_topk_idx;       /* rank-major only */
  size_t recv_topk_idx_bytes;
} epLlDispatchArgs_t;

#define EP_LL_DISPATCH_ARGS_INIT                                                                      \
  { sizeof(epLlDispatchArgs_t), EP_STRUCT_MAGIC, 0, 0, 0, 0, 0, epBfloat16, 0, EP_LL_EXPERT_MAJOR,      \
    EP_LL_SEND_RECV, NULL, NULL, NULL, 0, NULL, 0, NULL, 0, NULL, 0, NULL, 0, NULL, 0 }

EPCOMM_API epResult_t epLlDispatch(epComm_t comm, const epLlDispatchArgs_t* args, epStream_t stream);

typedef struct {
  unsigned int size;
  unsigned int magic;
  int num_tokens;               /* T of this rank */
  int max_tokens_per_rank;      /* M, as in dispatch */
  int hidden;
  int topk;
  int num_experts;
  int dtype;                    /* of y and out: bf16, fp16, fp32 */
  int layout;                   /* as in dispatch */
  unsigned int phases;
  const void* y;                /* [L, R*M, H] expert outputs */
  size_t y_bytes;
  const int* recv_count;        /* from dispatch */
  const int* recv_src_info;     /* expert-major */
  const int64_t* recv_layout_range; /* expert-major */
  const int64_t* recv_topk_idx; /* rank-major */
  const int64_t* topk_idx;      /* [T, K] this rank's routing, as dispatched */
  const float* topk_weights;    /* [T, K] */
  void* out;                    /* [T, H] */
  size_t out_bytes;
} epLlCombineArgs_t;

#define EP_LL_COMBINE_ARGS_INIT                                                                       \
  { sizeof(epLlCombineArgs_t), EP_STRUCT_MAGIC, 0, 0, 0, 0, 0, epBfloat16, EP_LL_EXPERT_MAJOR,          \
    EP_LL_SEND_RECV, NULL, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0 }

EPCOMM_API epResult_t epLlCombine(epComm_t comm, const epLlCombineArgs_t* args, epStream_t stream);

/* Zero-copy LL combine input (GPU engine). Returns a region of this rank's registered memory, *y_bytes long, to
 * which the expert computation writes its outputs ([L, R*M, H] of the combine's dtype, at the rows dispatch
 * gave, exactly the y epLlCombine takes); pass it (or any y inside it) as args->y. Such a combine moves nothing
 * in its send half: each token owner reads the rows straight from the expert ranks' regions in its receive half
 * (one read per contribution instead of a copy and a read). Every rank of a combine uses a region, or none does
 * (it is part of the operation, like the layout). Two regions alternate, one per combine; the one returned is
 * the next combine's. Lifetime: a region may be written from the return of the dispatch receive half that
 * precedes its combine until that combine's send half is issued, and must not be written after that until it is
 * returned again: from then on peers may read it, and a later dispatch receive half returns only once every peer
 * has finished reading every earlier zero-copy combine's rows (a device-side wait, so captured graphs keep the
 * rule; complete a zero-copy combine's receive half before the next dispatch's receive half, or that wait
 * ends at the deadline). The host engine returns epNotSupported: its combine already reads y in place. */
EPCOMM_API epResult_t epLlCombineBuffer(epComm_t comm, void** y, size_t* y_bytes);

/* Zero-copy LL dispatch output (GPU engine, ranks of one host, expert-major; the communicator must be created with
 * config.ll_zero_copy_dispatch = 1, else epInvalidUsage). Returns an output region of this rank's registered
 * memory: *recv_x, *recv_x_bytes long, for [L, R*M, H] rows of the dispatch's row type (its dtype, or fp8), and
 * *recv_x_scales, *recv_x_scales_bytes long, for the fp8 scales [L, R*M, H/128]. Pass both as args->recv_x and
 * args->recv_x_scales (exactly these pointers; the other outputs stay in the caller's memory): the senders then
 * write every (token, expert) row once, straight into its final row there, and the receive half moves no rows.
 * Outputs, rows and bits are those of the plain dispatch. The send half of such a dispatch waits on the device
 * until every active peer has issued its own send half (from then on the peer's region is free), and for the counts
 * of the active ranks below it (its rows follow theirs). Every rank of a dispatch uses a region, or none does: in a
 * mix the ranks that use one wait for the others' started words and counts until the deadline (epTimeout, in both
 * halves), and every rank's outputs are undefined. Two regions alternate; the one returned is the next dispatch's
 * (calls in between return the same one). Lifetime: a region holds a dispatch's rows from the return of its receive
 * half until this rank issues the send half of the next dispatch that names the same region; peers write into it
 * only after that send half has started (a device-side wait), so readers ordered before that send half (stream
 * order, events) are safe, in captured graphs too. Refused: rank-major layout or ranks on other hosts
 * (epNotSupported), a call whose rows do not fit the region (epBufferTooSmall, at the dispatch). The host engine
 * returns epNotSupported. */
EPCOMM_API epResult_t epLlDispatchBuffer(epComm_t comm, void** recv_x, size_t* recv_x_bytes, float** recv_x_scales,
                                         size_t* recv_x_scales_bytes);

/* ---------------------------------------------------------------------------------------------------------
 * Size helpers: bytes each output buffer needs. recv_rows is the HT row count (num_recv_tokens in exact
 * mode, num_worst_tokens in worst-token mode); the LL helper uses the args' shape fields only. The shape fields
 * (num_tokens, hidden, topk, num_experts, dtype; LL: max_tokens_per_rank, use_fp8, layout) are checked with the
 * codes the operations use, and *sizes is written only on success.
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
  unsigned int size;
  unsigned int magic;
  size_t recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_count, recv_src_info,
      recv_layout_range, recv_tokens_per_expert, combined_x;
} epBufferSizes_t;

#define EP_BUFFER_SIZES_INIT { sizeof(epBufferSizes_t), EP_STRUCT_MAGIC, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

EPCOMM_API epResult_t epHtDispatchSizes(epComm_t comm, const epHtDispatchArgs_t* args, int recv_rows,
                                        epBufferSizes_t* sizes);
EPCOMM_API epResult_t epLlDispatchSizes(epComm_t comm, const epLlDispatchArgs_t* args, epBufferSizes_t* sizes);

/* ---------------------------------------------------------------------------------------------------------
 * alltoallv
 * Host-count variant (torch's all_to_all_single): counts and displacements in elements of dtype, on the host;
 * rank r's send_counts[p] must equal rank p's recv_counts[r]. Every rank checks every pair before any data
 * moves: the two ranks of a disagreeing pair return epInvalidUsage, every other rank epRemoteError, and no
 * buffer is read or written.
 * Device-count variant (graph-safe): send_counts [R] int64 in engine memory, send rows packed by destination
 * in rank order; received data packed by source rank into recvbuf, which holds recv_capacity elements;
 * recv_counts [R] int64 in engine memory is written with the counts each source sent, including what was
 * dropped. Data past the capacity is dropped and counted in *num_dropped (engine memory, may be NULL); the host
 * engine returns epCapacityExceeded on the receiver, the GPU engine (which cannot return a device-side count)
 * records an epCapacityExceeded violation (epCommGetAsyncError) and returns epSuccess.
 * ------------------------------------------------------------------------------------------------------- */
EPCOMM_API epResult_t epAlltoallv(epComm_t comm, const void* sendbuf, const size_t* send_counts,
                                  const size_t* send_displs, void* recvbuf, const size_t* recv_counts,
                                  const size_t* recv_displs, epDataType_t dtype, epStream_t stream);
EPCOMM_API epResult_t epAlltoallvDevice(epComm_t comm, const void* sendbuf, const int64_t* send_counts,
                                        void* recvbuf, size_t recv_capacity, int64_t* recv_counts,
                                        int64_t* num_dropped, epDataType_t dtype, epStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * Elastic ranks (DESIGN.md R4): an active-ranks mask held by the communicator. Every operation after a mask
 * change runs among the kept ("active") ranks only; masked ranks are neither sent to nor waited for and take
 * no part in any agreement. The intended use: a rank dies, every other rank gets epTimeout or epRemoteError
 * once (the communicator is then "broken": every call fails fast), every survivor calls epCommSetActiveRanks
 * with the dead rank masked, and the next operations succeed without waiting for it, on the same communicator.
 *
 * epCommSetActiveRanks(comm, active, stream): active holds nranks int32 entries in host memory; nonzero keeps
 * the rank, 0 masks it.
 * - Collective among the ranks the mask keeps: every survivor calls it with the same mask; a masked (dead)
 *   rank does not call it. Survivors compare their masks: a disagreement is an error on every survivor that
 *   sees it (epInvalidUsage), not a hang, and changes nothing. Synchronous on the host: it returns when done,
 *   is not capturable, and on the GPU engine it first synchronizes with stream.
 * - Argument errors, decided before any exchange: active NULL is epNullPointer; active[rank] == 0 (the calling
 *   rank masking itself) is epInvalidArgument; keeping a rank that an earlier call masked is epInvalidUsage (a
 *   masked rank cannot rejoin this communicator). The host engine still tells the other survivors, which then
 *   return epRemoteError at once; elsewhere they end at their deadline with epTimeout.
 * - It may be called on a broken communicator (not on an aborted one: epAborted). It resynchronizes the
 *   survivors' protocol state (whatever a failed operation left in flight is discarded, operations between an
 *   LL send half and its receive half included) and, on success, clears the asynchronous error so that the
 *   communicator is usable again. The result of the operation that failed is lost; ranks that completed it
 *   before the failure keep their outputs. On a usable communicator, a call while an LL receive half is
 *   outstanding is epInvalidUsage.
 * - A mask that masks nobody new is allowed: it is a resynchronization only. After a failure in which no rank
 *   died (a timeout, or ranks that issued different operations), every rank calling it with the current mask
 *   makes the communicator usable again. Across hosts a rank of another host that showed no sign of life for
 *   the deadline (stopped or stalled, not only dead) is lost for good: its connections are closed on both
 *   sides, so the others must mask it (and it must stop calling the communicator, like any masked rank).
 * - A failure during the call itself (a kept rank died or did not call it by the deadline) leaves the mask
 *   unchanged and the communicator broken; call it again with that rank masked too.
 *
 * Operations under a mask (both engines):
 * - Layout: entries of masked ranks read 0: num_tokens_per_rank[r], is_token_in_rank[t, r] and
 *   num_tokens_per_expert of r's experts (so that receive sizes computed from them are right).
 * - HT and LL dispatch: (token, expert) pairs whose expert lives on a masked rank are dropped, as if
 *   topk_idx held -1 there; the token rows not sent for that reason are counted per destination rank (see
 *   epCommGetMaskedDrops). On the receiver a masked source contributes no rows: HT rows and LL rows come from
 *   the active ranks only, LL rank-major recv_count[r] and expert-major recv_layout_range[e, r] of a masked r
 *   are 0 (count 0), and its recv_x rows keep their old contents.
 * - HT and LL combine: contributions of masked ranks are absent; each sum runs over the remaining terms in the
 *   order stated above (ascending rank; LL: k ascending), so results are bit-identical to a world in which
 *   every routing entry to a masked rank had been -1 and the masked rank had no tokens.
 * - An HT handle filled (notify, or uncached dispatch) before a mask change that masked someone new cannot be
 *   used for cached dispatch or combine afterwards: epInvalidUsage; dispatch again without
 *   EP_HT_USE_HANDLE_LAYOUT (a no-op mask change keeps handles valid).
 * - alltoallv: nothing is sent to or received from masked ranks, and count pairs involving them are not
 *   compared. Host counts: the receive range of a masked source is left untouched. Device counts:
 *   recv_counts[r] of a masked r is 0 and nothing of it takes receive capacity. The elements not sent for that
 *   reason are counted per destination (epCommGetMaskedDrops).
 * - epCommBarrier: among the active ranks.
 * - GPU engine: the mask lives in device memory and kernels read it when they run, so a captured graph
 *   replayed after a mask change uses the new mask without recapture. Host engine: read at operation start.
 *   A replayed graph is not checked on the host: an HT dispatch captured with EP_HT_USE_HANDLE_LAYOUT (or a
 *   combine) from before a mask change replays with that layout minus the masked ranks (nothing is sent to or
 *   received from them; the receive rows they would have filled keep their contents). Capture worst-token
 *   dispatch (its layout is recomputed on the device every replay) where masks may change.
 * - GPU engine, epCommSetActiveRanks: waits for this rank's device work (cudaDeviceSynchronize: a failed
 *   operation's kernels end at their deadline), then the survivors meet twice on the device (deadline: twice
 *   the communicator's), resetting in between the queues and LL acknowledgements a failed operation left;
 *   with ranks masked, epCommBarrier meets the same way (survivors continue from the largest HT and LL epochs
 *   any of them reached). Drop counters on the GPU engine: HT rows are added by every dispatch launch from the
 *   counts its layout's notify took (a replay of a dispatch captured with a layout from before the mask change
 *   adds nothing), LL rows by the send half, alltoallv elements by the count exchange (also when the operation
 *   then fails).
 * - A masked rank that is still alive must stop calling the communicator (destroy it): its operations would
 *   still write into the survivors' buffers.
 * ------------------------------------------------------------------------------------------------------- */
EPCOMM_API epResult_t epCommSetActiveRanks(epComm_t comm, const int32_t* active, epStream_t stream);
/* epCommRecover(comm, active, stream): epCommSetActiveRanks without knowing whom to mask. After a failure every
 * survivor calls it; together they find the ranks to mask, agree on one mask, and resynchronize with it exactly as
 * epCommSetActiveRanks does (same effects on operations, handles, drop counters; the async error is cleared).
 * active (nranks int32, host memory, may be NULL) gets the mask this rank ended with: on success the new mask, on
 * failure as far as it got, with its own entry 0 where this rank must leave (the two epRemoteError cases below).
 * - Masked: every rank masked before; every rank some survivor found dead (its process gone from that survivor's
 *   host), disconnected (its connection across hosts lost: closed, reset, or silent past the net deadline) or gone
 *   (it destroyed its communicator); and every rank that did not take part in a round for twice EPCOMM_TIMEOUT_MS
 *   (stopped, stalled, or not calling epCommRecover).
 * - How they agree: each survivor publishes the ranks it holds out and the mask it last committed (in shared
 *   memory, across hosts over its connections); each derives the same mask from all of that: a mask some rank
 *   committed is final, then, while a kept rank is held out by another kept rank, the one held out by the most
 *   (ties: the highest rank) is masked and what it held out no longer counts. They propose it in a round of
 *   epCommSetActiveRanks' resynchronization (one mask or nobody moves); a failed round teaches something (a
 *   silent rank, another survivor's view) and the next one proposes again. Each wait in a round gives a silent
 *   rank twice EPCOMM_TIMEOUT_MS; no round starts once (2 + the ranks active at the call) x twice
 *   EPCOMM_TIMEOUT_MS have passed (the call then returns the last round's error).
 * - A rank the others hold out (they gave up on it while it was stopped or stalled, and it came back) gets
 *   epRemoteError with its own entry 0; it must stop calling the communicator and destroy it, like any masked rank.
 * - A rank that reaches no other rank and lost them through timeouts or closed connections (not one whose process
 *   it saw end, or that said goodbye) gets epRemoteError, also with its own entry 0: it cannot tell whether they
 *   failed or it was cut off (the others may have gone on without it), so it must leave too.
 * - No quorum: ranks cut apart into groups that each still reach among themselves (a network partition between
 *   hosts) recover as separate groups, each masking the other. Keep the job's own liveness checks (its launcher's
 *   rendezvous) for that case.
 * - Collective among the survivors; synchronous on the host; not capturable; may be called on a broken
 *   communicator (not on an aborted one: epAborted). On a usable communicator with every rank alive it is a no-op
 *   resynchronization; a call while an LL receive half is outstanding there is epInvalidUsage (the other
 *   survivors return epRemoteError at once).
 * - Host engine. The GPU engine returns epNotSupported: call epCommSetActiveRanks there. */
EPCOMM_API epResult_t epCommRecover(epComm_t comm, int32_t* active, epStream_t stream);
/* The current mask: nranks int32 entries, 1 = active, 0 = masked (host memory). Works on a broken
 * communicator. */
EPCOMM_API epResult_t epCommGetActiveRanks(epComm_t comm, int32_t* active);
/* Cumulative counts since creation, per destination rank (nranks entries each, host memory; either may be
 * NULL): token_rows: dispatch rows (HT and LL) not sent because the destination rank was masked, one per
 * (token, destination rank) pair however many of the token's experts live there (HT notify and the layout
 * count nothing; they send no rows); alltoallv_elements: alltoallv elements (units of the call's dtype) not
 * sent for that reason. Synchronizes with stream on the GPU engine. Works on a broken communicator. */
EPCOMM_API epResult_t epCommGetMaskedDrops(epComm_t comm, int64_t* token_rows, int64_t* alltoallv_elements,
                                           epStream_t stream);

/* Bytes this rank has handed to the inter-host transport since creation (*bytes_sent, cumulative): everything
 * its operations sent to ranks of other hosts — message headers, counts, routing and token rows, as the queues
 * carry them, not the transport's own framing or flow control. Read it before and after an operation for that
 * operation's inter-host traffic (an operation has pushed all its sends when it returns, except an LL receive
 * half's later sends, see the LL section). 0 when every rank shares one host. GPU engine: the bytes of the
 * records its proxy forwarded (what the kernels wrote for ranks of other hosts, each record with its 32-byte
 * header, padded to 32 bytes); it first waits, at most EPCOMM_TIMEOUT_MS, until the proxy has taken every record
 * the kernels reserved, so read it once the operations' streams have completed. Works on a broken communicator. */
EPCOMM_API epResult_t epCommGetNetBytes(epComm_t comm, uint64_t* bytes_sent);

/* Raw throughput of the inter-host transport between this communicator's processes, to set the engine's
 * inter-host GB/s against (epcomm-bench's "net raw" row). Collective: every rank calls it, no operation in
 * flight (an outstanding LL receive half is epInvalidUsage). The ranks first meet in a barrier (every rank has
 * finished its operations); then each opens one more connection to and from every active rank of other hosts over
 * the same `net` backend (EPCOMM_NET), set up as the host engine's own (its listener, the communicator's secret),
 * posts its receives, meets the others in a second barrier, and then all ranks stream at once: bytes_per_peer to
 * every such rank in messages of msg_bytes (1 byte to 1 GiB), window (1 to 32) in flight per peer and direction,
 * one thread driving every send and receive; a third barrier, and the connections are closed. *bytes_sent: the
 * bytes this rank sent; *seconds: from the second barrier until this rank's last send and last receive completed
 * (sum the bytes and take the slowest rank's seconds for the aggregate). Both 0 when every rank shares one host
 * (then nothing is exchanged and no barrier runs). Both engines (the GPU engine's barriers are the bootstrap's,
 * of all ranks, masked ones included; its connections are its proxy's bridge's). When it fails on one rank, the
 * others fail too (at the latest when their barrier passes EPCOMM_TIMEOUT_MS, which breaks the communicator like
 * a failed operation). */
EPCOMM_API epResult_t epCommNetRawBandwidth(epComm_t comm, size_t bytes_per_peer, size_t msg_bytes, int window,
                                            uint64_t* bytes_sent, double* seconds);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EPCOMM_EPCOMM_H_ */
