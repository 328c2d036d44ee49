// Host launchers of the elastic-ranks kernels (kernels/elastic.cu), used by epCommSetActiveRanks and by the
// barrier among survivors on the GPU engine: a rendezvous on the HT buffers' sync entries, and the reset of what a
// failed operation left in the protocol state.
#pragma once
#include <cuda_runtime.h>

#include "common/gpu_layout.h"

namespace epcomm {

// Publishes {mask, this rank's epochs, round} (entries of `kind`) to every rank in `publish_to`; with `wait`,
// then waits (deadline: p.timeout_ns) until every rank in `mask` published round `round` there. disagree
// (host-mapped) receives 1 + a rank whose mask differs from this one (0: none). ll_ctrl may be null (no LL buffer).
cudaError_t launchElasticSync(const HtParams& p, const LlCtrl* ll_ctrl, int kind, uint64_t mask, uint64_t publish_to,
                              uint64_t round, bool wait, int* disagree, cudaStream_t s);
// Run between two syncs of epCommSetActiveRanks, when no kernel of any survivor runs: the survivors continue from
// the largest HT and LL epochs any of them published; every HT/alltoallv queue of this rank drops what is in it
// (head := tail); LL receive halves left outstanding count as done and every active peer is told that this rank
// read all of its LL operations. The epochs are those published in sync round `round`. What was settled goes to
// `out` (host-mapped). ll may be null (no LL buffer).
cudaError_t launchElasticResync(const HtParams& p, const LlParams* ll, uint64_t mask, uint64_t round,
                                GpuResyncOut* out, cudaStream_t s);

}  // namespace epcomm
