/*
 * kvtrio_host.cpp: the host-only build of kvtrio_index.h, loaded by the tests through ctypes.
 *
 * g++ compiles the header without CUDA (KVT_HD expands to `inline`), and kvt_host_copy runs the
 * kernel's body, kvt_move, for every (layer, vector) in a loop: the same index arithmetic, the
 * same vector width, on host memory; kvt_host_run runs the operation kernel's body,
 * kvt_move_unit (kvtrio_batch.h), for every (segment, unit). The tests compare their bytes
 * with the numpy reference; the simulated GPU of the tests runs kvt_host_run as its kernel.
 */
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kvtrio_batch.h"
#include "kvtrio_index.h"

namespace {

template <typename V, bool Gather>
void copy_all(const kvt_plan& p, int64_t n_layers, const uint64_t* bases, const int64_t* ids,
              int64_t n_ids, uint8_t* chunk) {
    const int64_t layer_bytes = kvt_layer_bytes(p, n_ids);
    const int64_t vectors = layer_bytes / (int64_t)sizeof(V);
    for (int64_t layer = 0; layer < n_layers; ++layer) {
        uint8_t* base = reinterpret_cast<uint8_t*>(bases[layer]);
        uint8_t* chunk_layer = chunk + layer * layer_bytes;
        for (int64_t v = 0; v < vectors; ++v)
            kvt_move<V, Gather>(p, base, ids, n_ids, chunk_layer, v);
    }
}

template <bool Gather>
void dispatch(const kvt_plan& p, int64_t n_layers, const uint64_t* bases, const int64_t* ids,
              int64_t n_ids, uint8_t* chunk) {
    switch (p.vec) {
        case 16: copy_all<kvt_v16, Gather>(p, n_layers, bases, ids, n_ids, chunk); break;
        case 8: copy_all<kvt_v8, Gather>(p, n_layers, bases, ids, n_ids, chunk); break;
        case 4: copy_all<uint32_t, Gather>(p, n_layers, bases, ids, n_ids, chunk); break;
        case 2: copy_all<uint16_t, Gather>(p, n_layers, bases, ids, n_ids, chunk); break;
        default: copy_all<uint8_t, Gather>(p, n_layers, bases, ids, n_ids, chunk); break;
    }
}

template <typename V, int K, bool Gather>
void run_all(const kvt_plan& p, const uint64_t* bases, const int32_t* ids,
             const kvt_segment* segments, int64_t n_segments) {
    for (int64_t i = 0; i < n_segments; ++i) {
        const int64_t units = kvt_segment_units(segments[i], (int64_t)sizeof(V) * K);
        for (int64_t u = 0; u < units; ++u)
            kvt_move_unit<V, K, Gather>(p, bases, ids, segments[i], u);
    }
}

template <typename V, bool Gather>
void run_k(const kvt_plan& p, const uint64_t* bases, const int32_t* ids,
           const kvt_segment* segments, int64_t n_segments) {
    switch (kvt_unit_vectors(p)) {
        case 4: run_all<V, 4, Gather>(p, bases, ids, segments, n_segments); break;
        case 2: run_all<V, 2, Gather>(p, bases, ids, segments, n_segments); break;
        default: run_all<V, 1, Gather>(p, bases, ids, segments, n_segments); break;
    }
}

template <bool Gather>
void run_dispatch(const kvt_plan& p, const uint64_t* bases, const int32_t* ids,
                  const kvt_segment* segments, int64_t n_segments) {
    switch (p.vec) {
        case 16: run_k<kvt_v16, Gather>(p, bases, ids, segments, n_segments); break;
        case 8: run_k<kvt_v8, Gather>(p, bases, ids, segments, n_segments); break;
        case 4: run_k<uint32_t, Gather>(p, bases, ids, segments, n_segments); break;
        case 2: run_k<uint16_t, Gather>(p, bases, ids, segments, n_segments); break;
        default: run_k<uint8_t, Gather>(p, bases, ids, segments, n_segments); break;
    }
}

}  // namespace

extern "C" {

/* Bytes of one segment descriptor (numpy's SEGMENT_DTYPE must match). */
int64_t kvt_host_segment_bytes(void) { return (int64_t)sizeof(kvt_segment); }

/* The operation kernel's work on the host: every segment of an operation, with the launcher's
 * checks and vector width; `out` (may be NULL) receives [vec, vectors per unit]. Returns a
 * KVT_ code; nothing is copied unless it is KVT_OK. */
int kvt_host_run(const int64_t* geometry, int64_t n_layers, const uint64_t* bases,
                 const int32_t* ids, int64_t n_ids, const kvt_segment* segments,
                 int64_t n_segments, int gather, int64_t* out) {
    uint64_t bits = kvt_segment_bits(segments, n_segments);
    for (int64_t layer = 0; layer < n_layers; ++layer) bits |= bases[layer];
    kvt_plan p;
    int rc = n_layers < 1 ? KVT_E_GEOMETRY : kvt_make_plan(geometry, bits, &p);
    if (rc == KVT_OK)
        rc = kvt_check_segments(&p, n_layers, ids, n_ids, segments, n_segments);
    if (rc != KVT_OK) return rc;
    if (out) {
        out[0] = p.vec;
        out[1] = kvt_unit_vectors(p);
    }
    if (gather)
        run_dispatch<true>(p, bases, ids, segments, n_segments);
    else
        run_dispatch<false>(p, bases, ids, segments, n_segments);
    return KVT_OK;
}

/* Number of int64 a plan exports (kvt_host_plan's `out`). */
int kvt_host_plan_fields(void) { return 4; }

/* The plan of a geometry: out = [run_elems, run, runs_per_block, vec]. Returns a KVT_ code. */
int kvt_host_plan(const int64_t* geometry, uint64_t pointer_bits, int64_t* out) {
    kvt_plan p;
    const int rc = kvt_make_plan(geometry, pointer_bits, &p);
    if (rc != KVT_OK) return rc;
    out[0] = p.run_elems;
    out[1] = p.run;
    out[2] = p.runs_per_block;
    out[3] = p.vec;
    return KVT_OK;
}

/* Engine offsets (bytes from the layer base; -1 for a skipped block) of the chunk bytes
 * [first, first + count) of one layer. Returns a KVT_ code. */
int kvt_host_engine_offsets(const int64_t* geometry, const int64_t* ids, int64_t n_ids,
                            int64_t first, int64_t count, int64_t* out) {
    kvt_plan p;
    int rc = kvt_make_plan(geometry, 0, &p);
    if (rc == KVT_OK) rc = kvt_check_ids(&p, ids, n_ids);
    if (rc != KVT_OK) return rc;
    for (int64_t i = 0; i < count; ++i) out[i] = kvt_engine_offset(p, ids, n_ids, first + i);
    return KVT_OK;
}

/* Bytes of one layer's share of a chunk of n_ids blocks, or -KVT_ code. */
int64_t kvt_host_layer_bytes(const int64_t* geometry, int64_t n_ids) {
    kvt_plan p;
    const int rc = kvt_make_plan(geometry, 0, &p);
    return rc == KVT_OK ? kvt_layer_bytes(p, n_ids) : -rc;
}

/* The kernel's work on the host: copy a chunk, all layers. `vec_out` (may be NULL) receives the
 * vector width used. Returns a KVT_ code; nothing is copied unless it is KVT_OK. */
int kvt_host_copy(const int64_t* geometry, int64_t n_layers, const uint64_t* bases,
                  const int64_t* ids, int64_t n_ids, uint8_t* chunk, int gather,
                  int64_t* vec_out) {
    uint64_t bits = (uint64_t)(uintptr_t)chunk;
    for (int64_t layer = 0; layer < n_layers; ++layer) bits |= bases[layer];
    kvt_plan p;
    int rc = kvt_make_plan(geometry, bits, &p);
    if (rc == KVT_OK) rc = kvt_check_ids(&p, ids, n_ids);
    if (rc != KVT_OK) return rc;
    if (vec_out) *vec_out = p.vec;
    if (gather)
        dispatch<true>(p, n_layers, bases, ids, n_ids, chunk);
    else
        dispatch<false>(p, n_layers, bases, ids, n_ids, chunk);
    return KVT_OK;
}

/* kvt_host_run as the launcher runs it: cut into launches of at most max_segments segments and
 * max_ids ids (kvt_next_launch), each launch's segments and ids copied and rebased as into the
 * kernel's parameter. `launches` (may be NULL) receives how many. Returns a KVT_ code. */
int kvt_host_run_launches(const int64_t* geometry, int64_t n_layers, const uint64_t* bases,
                          const int32_t* ids, int64_t n_ids, const kvt_segment* segments,
                          int64_t n_segments, int gather, int64_t max_segments,
                          int64_t max_ids, int64_t* launches) {
    uint64_t bits = kvt_segment_bits(segments, n_segments);
    for (int64_t layer = 0; layer < n_layers; ++layer) bits |= bases[layer];
    kvt_plan p;
    int rc = n_layers < 1 ? KVT_E_GEOMETRY : kvt_make_plan(geometry, bits, &p);
    if (rc == KVT_OK)
        rc = kvt_check_segments(&p, n_layers, ids, n_ids, segments, n_segments);
    if (rc != KVT_OK) return rc;
    std::vector<kvt_segment> part((size_t)max_segments);
    std::vector<int32_t> part_ids((size_t)max_ids);
    int64_t count = 0;
    for (int64_t i = 0, n = 0; i < n_segments; i += n) {
        int64_t first_id, end_id;
        rc = kvt_next_launch(segments, n_segments, i, max_segments, max_ids, &n, &first_id,
                             &end_id);
        if (rc != KVT_OK) return rc;
        for (int64_t j = 0; j < n; ++j) {
            part[(size_t)j] = segments[i + j];
            part[(size_t)j].first_id = (int32_t)(segments[i + j].first_id - first_id);
        }
        memcpy(part_ids.data(), ids + first_id, (size_t)(end_id - first_id) * sizeof(int32_t));
        if (gather)
            run_dispatch<true>(p, bases, part_ids.data(), part.data(), n);
        else
            run_dispatch<false>(p, bases, part_ids.data(), part.data(), n);
        ++count;
    }
    if (launches) *launches = count;
    return KVT_OK;
}

const char* kvt_host_error_message(int code) { return kvt_error_message(code); }

}  /* extern "C" */
