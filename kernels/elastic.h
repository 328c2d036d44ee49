// Host launchers of the elastic-ranks kernels (kernels/elastic.cu), used by epCommSetActiveRanks on the GPU
// engine: a rendezvous of the survivors and the reset of what a failed operation left in the protocol state.
#pragma once
#include <cuda_runtime.h>

#include "common/gpu_layout.h"

namespace epcomm {

// Publishes {mask, round} to every rank in `mask` and waits (deadline: the communicator's) until each of them
// published round `round`. disagree[0] receives 1 + the first rank whose mask differs from this one (0: none).
cudaError_t launchElasticSync(const HtParams& p, uint64_t mask, uint64_t round, int* disagree, cudaStream_t s);
// Run between two syncs, when no kernel of any survivor runs: every HT/alltoallv queue of this rank drops what
// is in it (head := tail), an LL receive half left outstanding counts as done, and every active peer is told
// that this rank read all of its LL operations (acknowledgements := receive epochs). ll may be null (no LL
// buffer).
cudaError_t launchElasticResync(const HtParams& p, const LlParams* ll, cudaStream_t s);

}  // namespace epcomm
