/*
 * kvtrio_kernels.h: the launcher of the operation kernel (kvtrio_kernels.cu), with a plain C++
 * interface (raw pointers and a cudaStream_t passed as void*), so that the kernels compile
 * without torch's headers and the torch binding (kvtrio_ext.cpp) compiles without nvcc.
 */
#ifndef KVTRIO_KERNELS_H
#define KVTRIO_KERNELS_H

#include <stdint.h>

#include "kvtrio_batch.h"

/* What one launch carries by value (the kernel parameter, ~12 KiB: CUDA 12.1+ on sm_70+ takes
 * up to 32 KiB), so an operation needs no descriptor upload, no device buffer and no event.
 * Operations with more segments or ids are cut into several launches by the launcher. */
#define KVT_MAX_SEGMENTS 128
#define KVT_MAX_IDS 2048

/*
 * Copy every segment of an operation between the engine's layers and the segments' memory
 * (mapped host memory or device staging), on `stream`: gather (engine -> memory) when `gather`
 * is non-zero, else scatter. One launch for all of it (more only past the limits above).
 *
 * geometry: KVT_G_FIELDS int64 in host memory (see kvtrio_index.h).
 * layer_bits: OR of every layer base address (for the vector width).
 * bases: n_layers layer base addresses, in device memory (uploaded once per registration).
 * ids, segments: host memory (copied into the launch's parameter); checked here.
 *
 * Returns KVT_OK, a KVT_E_* code for a bad argument (nothing launched), or KVT_E_CUDA (then
 * *cuda_error holds the cudaError_t). Asynchronous: returns once the kernels are queued.
 */
int kvt_cuda_run(const int64_t* geometry, uint64_t layer_bits, int64_t n_layers,
                 const uint64_t* bases, const int32_t* ids, int64_t n_ids,
                 const kvt_segment* segments, int64_t n_segments, int gather, void* stream,
                 int* cuda_error);

#endif /* KVTRIO_KERNELS_H */
