/*
 * kvtrio_kernels.cu: an operation's gather or scatter, every chunk and every layer in one launch.
 *
 * Grid: y is the segment (kvtrio_batch.h), x covers its work units (grid-stride loop, capped).
 * Each thread moves whole units of k vectors of 16 bytes where alignment allows (k independent
 * 128-bit loads, then the stores), so consecutive threads touch consecutive bytes on both
 * sides: coalesced on the engine side, whole PCIe packets on the mapped-host side. The index
 * arithmetic is kvt_move_unit from kvtrio_batch.h, the same code the host library runs in the
 * tests. The segments and block ids travel in the kernel's parameter (kvt_args).
 */
#include <cuda_runtime.h>
#include <string.h>

#include "kvtrio_batch.h"
#include "kvtrio_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096; /* per launch, over all segments */

struct kvt_args {
    kvt_plan plan;
    const uint64_t* bases;
    kvt_segment segments[KVT_MAX_SEGMENTS];
    int32_t ids[KVT_MAX_IDS];
};

template <typename V, int K, bool Gather>
__global__ void __launch_bounds__(kThreads) kvt_run_kernel(const __grid_constant__ kvt_args a) {
    const kvt_segment& s = a.segments[blockIdx.y];
    const int64_t units = kvt_segment_units(s, (int64_t)sizeof(V) * K);
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride)
        kvt_move_unit<V, K, Gather>(a.plan, a.bases, a.ids, s, u);
}

template <typename V, bool Gather>
void launch_k(int64_t k, dim3 grid, const kvt_args& a, cudaStream_t stream) {
    if (k == 4)
        kvt_run_kernel<V, 4, Gather><<<grid, kThreads, 0, stream>>>(a);
    else if (k == 2)
        kvt_run_kernel<V, 2, Gather><<<grid, kThreads, 0, stream>>>(a);
    else
        kvt_run_kernel<V, 1, Gather><<<grid, kThreads, 0, stream>>>(a);
}

template <bool Gather>
void launch(const kvt_args& a, int64_t n_segments, int64_t max_units, cudaStream_t stream) {
    int64_t blocks = (max_units + kThreads - 1) / kThreads;
    const int64_t cap = kMaxBlocks / n_segments > 0 ? kMaxBlocks / n_segments : 1;
    if (blocks > cap) blocks = cap;
    const dim3 grid((unsigned)blocks, (unsigned)n_segments);
    const int64_t k = kvt_unit_vectors(a.plan);
    switch (a.plan.vec) {
        case 16: launch_k<kvt_v16, Gather>(k, grid, a, stream); break;
        case 8: launch_k<kvt_v8, Gather>(k, grid, a, stream); break;
        case 4: launch_k<uint32_t, Gather>(k, grid, a, stream); break;
        case 2: launch_k<uint16_t, Gather>(k, grid, a, stream); break;
        default: launch_k<uint8_t, Gather>(k, grid, a, stream); break;
    }
}

}  // namespace

int kvt_cuda_run(const int64_t* geometry, uint64_t layer_bits, int64_t n_layers,
                 const uint64_t* bases, const int32_t* ids, int64_t n_ids,
                 const kvt_segment* segments, int64_t n_segments, int gather, void* stream,
                 int* cuda_error) {
    *cuda_error = 0;
    if (n_layers < 1) return KVT_E_GEOMETRY;
    static thread_local kvt_args a; /* ~12 KiB: not on the stack; copied at each launch */
    int rc = kvt_make_plan(geometry, layer_bits | kvt_segment_bits(segments, n_segments),
                           &a.plan);
    if (rc == KVT_OK)
        rc = kvt_check_segments(&a.plan, n_layers, ids, n_ids, segments, n_segments);
    if (rc != KVT_OK) return rc;
    a.bases = bases;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t unit = a.plan.vec * kvt_unit_vectors(a.plan);
    for (int64_t i = 0, n = 0; i < n_segments; i += n) { /* as many as a parameter holds */
        int64_t first_id, end_id, max_units = 0;
        rc = kvt_next_launch(segments, n_segments, i, KVT_MAX_SEGMENTS, KVT_MAX_IDS, &n,
                             &first_id, &end_id);
        if (rc != KVT_OK) return rc;
        for (int64_t j = 0; j < n; ++j) {
            a.segments[j] = segments[i + j];
            a.segments[j].first_id = (int32_t)(segments[i + j].first_id - first_id);
            const int64_t units = kvt_segment_units(segments[i + j], unit);
            if (units > max_units) max_units = units;
        }
        memcpy(a.ids, ids + first_id, (size_t)(end_id - first_id) * sizeof(int32_t));
        if (gather)
            launch<true>(a, n, max_units, s);
        else
            launch<false>(a, n, max_units, s);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) {
            *cuda_error = (int)err;
            return KVT_E_CUDA;
        }
    }
    return KVT_OK;
}
