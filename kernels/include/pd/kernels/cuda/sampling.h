// CUDA twin of pd::kernels::cpu::sampleRows (pd/kernels/sampling.h, which defines what is
// computed): temperature, min-p, top-k, top-p, the caller's uniform draw, raw logprobs.
// For the same logits and params it returns the same ids as the CPU twin (masses are exact
// integers and the weights are computed with the same IEEE operations), and a rerun returns
// the same ids (no float atomics).
//
// All pointers are DEVICE pointers. The function only enqueues one kernel on `stream` (no
// allocation, no synchronisation, safe inside CUDA graph capture) and returns
// cudaGetLastError() after the launch. It needs no global scratch: one block per row keeps
// its histograms in shared memory and re-reads the row (an L2-resident 0.5 MiB at a 128k
// vocabulary) once per pass.
// Launch: grid = rows blocks of 1024 threads. Passes over a row: max, masses, then for top-k
// and for top-p a radix selection on the 64-bit (logit, id) key (8-bit digits, stopping as
// soon as the selected set is known: usually 2-4 passes), the draw, and a selection for the
// top-N logprobs when topN > 0.
// Thread-safety: any host thread, any stream; outputs must not be written concurrently.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pd/kernels/sampling.h"

namespace pd::kernels::cuda {

// logits: [rows][logitsStride] f32 (vocab used per row), params: [rows],
// ids: [rows] (written), logprobs: [rows] (written, raw logprob of ids[r]),
// topIds, topLogprobs: [rows][topN] (written when topN > 0; may be null when topN == 0).
// Preconditions as the CPU twin's; additionally rows >= 1 and vocab >= 1 are checked
// (cudaErrorInvalidValue).
cudaError_t sampleRows(const float* logits, int logitsStride, int rows, int vocab, const SampleRowParams* params,
                       int topN, int32_t* ids, float* logprobs, int32_t* topIds, float* topLogprobs,
                       cudaStream_t stream);

}  // namespace pd::kernels::cuda
