/*
 * kvtrio_kernels.h: the launchers of the gather/scatter kernels (kvtrio_kernels.cu), with a plain
 * C++ interface (raw pointers and a cudaStream_t passed as void*), so that the kernels compile
 * without torch's headers and the torch binding (kvtrio_ext.cpp) compiles without nvcc.
 */
#ifndef KVTRIO_KERNELS_H
#define KVTRIO_KERNELS_H

#include <stdint.h>

/*
 * Copy one chunk between the engine's layers and a contiguous device buffer, all layers in one
 * launch on `stream`: gather (engine -> chunk) when `gather` is non-zero, else scatter.
 *
 * geometry: KVT_G_FIELDS int64 in host memory (see kvtrio_index.h).
 * pointer_bits: OR of every layer base address and of `chunk` (for the vector width).
 * bases: n_layers layer base addresses, in device memory.
 * ids: n_ids block ids, in device memory (already checked by the caller: kvt_check_ids).
 * chunk: n_layers * kvt_layer_bytes(...) bytes of device memory.
 *
 * Returns KVT_OK, a KVT_E_* code for a bad geometry, or KVT_E_CUDA (then *cuda_error holds the
 * cudaError_t of the failed launch). Asynchronous: returns once the kernel is queued.
 */
int kvt_cuda_copy(const int64_t* geometry, uint64_t pointer_bits, int64_t n_layers,
                  const uint64_t* bases, const int64_t* ids, int64_t n_ids, uint8_t* chunk,
                  int gather, void* stream, int* cuda_error);

#endif /* KVTRIO_KERNELS_H */
