/*
 * kvtrio_kernels.cu: gather and scatter of one chunk, every layer in one launch.
 *
 * Grid: x covers the vectors of one layer's share of the chunk (grid-stride loop, capped), y is
 * the layer. Each thread moves whole vectors (16 bytes when alignment allows: one 128-bit load
 * and store), so consecutive threads touch consecutive chunk bytes and, within a run,
 * consecutive engine bytes: both sides are coalesced. The index arithmetic is kvt_move from
 * kvtrio_index.h, the same code the host library runs in the tests.
 */
#include <cuda_runtime.h>

#include "kvtrio_index.h"
#include "kvtrio_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerLayer = 1024;

template <typename V, bool Gather>
__global__ void __launch_bounds__(kThreads)
    kvt_copy_kernel(const kvt_plan p, const uint64_t* __restrict__ bases,
                    const int64_t* __restrict__ ids, const int64_t n_ids,
                    uint8_t* __restrict__ chunk) {
    const int64_t layer = blockIdx.y;
    const int64_t layer_bytes = kvt_layer_bytes(p, n_ids);
    const int64_t vectors = layer_bytes / (int64_t)sizeof(V);
    uint8_t* base = reinterpret_cast<uint8_t*>(bases[layer]);
    uint8_t* chunk_layer = chunk + layer * layer_bytes;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += stride)
        kvt_move<V, Gather>(p, base, ids, n_ids, chunk_layer, v);
}

template <bool Gather>
cudaError_t launch(const kvt_plan& p, int64_t n_layers, const uint64_t* bases,
                   const int64_t* ids, int64_t n_ids, uint8_t* chunk, cudaStream_t stream) {
    const int64_t vectors = kvt_layer_bytes(p, n_ids) / p.vec;
    int64_t blocks = (vectors + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocksPerLayer) blocks = kMaxBlocksPerLayer;
    const dim3 grid((unsigned)blocks, (unsigned)n_layers);
    switch (p.vec) {
        case 16:
            kvt_copy_kernel<kvt_v16, Gather><<<grid, kThreads, 0, stream>>>(p, bases, ids, n_ids, chunk);
            break;
        case 8:
            kvt_copy_kernel<kvt_v8, Gather><<<grid, kThreads, 0, stream>>>(p, bases, ids, n_ids, chunk);
            break;
        case 4:
            kvt_copy_kernel<uint32_t, Gather><<<grid, kThreads, 0, stream>>>(p, bases, ids, n_ids, chunk);
            break;
        case 2:
            kvt_copy_kernel<uint16_t, Gather><<<grid, kThreads, 0, stream>>>(p, bases, ids, n_ids, chunk);
            break;
        default:
            kvt_copy_kernel<uint8_t, Gather><<<grid, kThreads, 0, stream>>>(p, bases, ids, n_ids, chunk);
            break;
    }
    return cudaGetLastError();
}

}  // namespace

int kvt_cuda_copy(const int64_t* geometry, uint64_t pointer_bits, int64_t n_layers,
                  const uint64_t* bases, const int64_t* ids, int64_t n_ids, uint8_t* chunk,
                  int gather, void* stream, int* cuda_error) {
    kvt_plan p;
    const int rc = kvt_make_plan(geometry, pointer_bits | (uint64_t)(uintptr_t)chunk, &p);
    if (rc != KVT_OK) return rc;
    if (n_ids < 1) return KVT_E_NO_BLOCKS;
    if (n_layers < 1 || n_layers > 65535) return KVT_E_GEOMETRY;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const cudaError_t err = gather ? launch<true>(p, n_layers, bases, ids, n_ids, chunk, s)
                                   : launch<false>(p, n_layers, bases, ids, n_ids, chunk, s);
    *cuda_error = (int)err;
    return err == cudaSuccess ? KVT_OK : KVT_E_CUDA;
}
