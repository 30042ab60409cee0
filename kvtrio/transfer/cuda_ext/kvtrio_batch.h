/*
 * kvtrio_batch.h: one operation (every chunk of a store or retrieve, every layer) as one launch.
 *
 * An operation is a list of *segments*. A segment is a byte range [start, start + length) of
 * one chunk (in the canonical chunk order of kvtrio_index.h: layers follow each other) and the
 * device address of its first byte: the page-locked L1 arena itself, mapped into the device's
 * address space (zero-copy: the kernel reads and writes host memory over the bus), or a device
 * staging buffer (the copy engine then moves it). A chunk is one segment, or two or more where
 * its L1 slot straddles two separately pinned pieces of the arena (their device addresses need
 * not be contiguous). Each segment names its chunk's block ids: `n_ids` ids from `first_id` in
 * the operation's id array (int32; -1: no engine block, see kvtrio_index.h: a scatter leaves
 * it alone, a gather writes zeros for its bytes).
 *
 * The work unit is `vec * k` bytes (kvt_unit_vectors): k vectors of one run, so a thread issues
 * k independent loads before its stores (bytes in flight is what zero-copy reads over PCIe need)
 * and pays the index arithmetic once per unit. Units are aligned in the layer's chunk bytes, so
 * a unit never straddles a run or a layer; a segment boundary may cut one, and each vector is
 * checked against its segment's bounds.
 *
 * Compiled into the kernels (kvtrio_kernels.cu) and into the host library (kvtrio_host.cpp),
 * which runs kvt_move_unit for every unit in a loop: the tests compare its bytes with the numpy
 * reference.
 */
#ifndef KVTRIO_BATCH_H
#define KVTRIO_BATCH_H

#include "kvtrio_index.h"

/* One segment: 32 bytes, the layout numpy's SEGMENT_DTYPE (kvtrio/transfer/_batch.py) writes. */
typedef struct kvt_segment {
    uint64_t address; /* device address of chunk byte `start` */
    int64_t start;    /* first chunk byte of the segment */
    int64_t length;   /* bytes */
    int32_t first_id; /* where the chunk's block ids start in the operation's ids */
    int32_t n_ids;    /* blocks in the chunk */
} kvt_segment;

/* Vectors per work unit: 4, 2 or 1, the most that divides a run. */
KVT_HD int64_t kvt_unit_vectors(const kvt_plan& p) {
    if (p.run % (4 * p.vec) == 0) return 4;
    if (p.run % (2 * p.vec) == 0) return 2;
    return 1;
}

/* Units of a segment (the first may start before it, the last end after it). */
KVT_HD int64_t kvt_segment_units(const kvt_segment& s, int64_t unit) {
    if (s.length <= 0) return 0;
    const int64_t first = s.start / unit;
    const int64_t last = (s.start + s.length - 1) / unit;
    return last - first + 1;
}

/* Check an operation's segments and ids (each id in [0, num_blocks) or -1). */
KVT_HOST int kvt_check_segments(const kvt_plan* p, int64_t n_layers, const int32_t* ids,
                                int64_t n_ids, const kvt_segment* segments, int64_t n_segments) {
    if (n_segments < 1) return KVT_E_NO_BLOCKS;
    for (int64_t i = 0; i < n_segments; ++i) {
        const kvt_segment& s = segments[i];
        if (s.n_ids < 1) return KVT_E_NO_BLOCKS;
        if (s.first_id < 0 || (int64_t)s.first_id + s.n_ids > n_ids) return KVT_E_SEGMENT;
        const int64_t chunk = n_layers * kvt_layer_bytes(*p, s.n_ids);
        if (s.start < 0 || s.length < 1 || s.start + s.length > chunk) return KVT_E_SEGMENT;
        for (int32_t j = 0; j < s.n_ids; ++j) {
            const int64_t id = ids[s.first_id + j];
            if (id == -1) continue;
            if (id < 0 || id >= p->num_blocks) return KVT_E_BLOCK_ID;
        }
    }
    return KVT_OK;
}

/* The OR of every address, start and length of the segments (for the vector width). */
KVT_HOST uint64_t kvt_segment_bits(const kvt_segment* segments, int64_t n_segments) {
    uint64_t bits = 0;
    for (int64_t i = 0; i < n_segments; ++i)
        bits |= segments[i].address | (uint64_t)segments[i].start | (uint64_t)segments[i].length;
    return bits;
}

/*
 * The launch that starts at segment i: how many segments it takes (*count: at most
 * max_segments) and which ids ([*first_id, *end_id): at most max_ids), so that an operation
 * bigger than one launch's parameter is cut into launches. Segments' ids must not go back
 * (they do not: chunks follow each other). KVT_E_SEGMENT if segment i alone needs too many ids.
 */
KVT_HOST int kvt_next_launch(const kvt_segment* segments, int64_t n_segments, int64_t i,
                             int64_t max_segments, int64_t max_ids, int64_t* count,
                             int64_t* first_id, int64_t* end_id) {
    const int64_t first = segments[i].first_id;
    int64_t n = 0, end = first;
    while (i + n < n_segments && n < max_segments) {
        const kvt_segment& s = segments[i + n];
        const int64_t stop = (int64_t)s.first_id + s.n_ids > end ? (int64_t)s.first_id + s.n_ids
                                                                  : end;
        if (s.first_id < first || stop - first > max_ids) break;
        end = stop;
        ++n;
    }
    if (n == 0) return KVT_E_SEGMENT;
    *count = n;
    *first_id = first;
    *end_id = end;
    return KVT_OK;
}

/*
 * Copy unit u of segment s: engine -> segment memory (Gather) or back. V is the vector type
 * (sizeof(V) == p.vec), K the vectors per unit (kvt_unit_vectors). `bases` are the layers'
 * addresses; `ids` the operation's block ids.
 */
template <typename V, int K, bool Gather>
KVT_HD void kvt_move_unit(const kvt_plan& p, const uint64_t* bases, const int32_t* ids,
                          const kvt_segment& s, int64_t u) {
    constexpr int64_t unit = (int64_t)sizeof(V) * K;
    const int64_t pos = (s.start / unit + u) * unit; /* chunk byte of the unit */
    const int64_t layer_bytes = kvt_layer_bytes(p, s.n_ids);
    const int64_t layer = pos / layer_bytes;
    const int64_t in_layer = pos - layer * layer_bytes;
    const int64_t r = in_layer / p.run;
    int64_t block;
    const int64_t start = kvt_run_offset(p, ids + s.first_id, (int64_t)s.n_ids, r, &block);
    uint8_t* memory = reinterpret_cast<uint8_t*>(s.address) + (pos - s.start);
    const int64_t end = s.start + s.length;
    if (block < 0) { /* no engine block: the engine keeps it (scatter), zeros (gather) */
        if constexpr (Gather) {
            for (int k = 0; k < K; ++k) {
                const int64_t at = pos + k * (int64_t)sizeof(V);
                if (at < s.start || at >= end) continue;
#if defined(__CUDA_ARCH__)
                reinterpret_cast<V*>(memory)[k] = V{};
#else
                memset(memory + k * sizeof(V), 0, sizeof(V));
#endif
            }
        }
        return;
    }
    uint8_t* engine = reinterpret_cast<uint8_t*>(bases[layer]) + start + (in_layer - r * p.run);
    if (pos >= s.start && pos + unit <= end) { /* the whole unit: K loads, then K stores */
        V values[K];
#if defined(__CUDA_ARCH__)
#pragma unroll
        for (int k = 0; k < K; ++k)
            values[k] = Gather ? reinterpret_cast<const V*>(engine)[k]
                               : reinterpret_cast<const V*>(memory)[k];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (Gather)
                reinterpret_cast<V*>(memory)[k] = values[k];
            else
                reinterpret_cast<V*>(engine)[k] = values[k];
        }
#else
        memcpy(values, Gather ? engine : memory, sizeof(values));
        memcpy(Gather ? memory : engine, values, sizeof(values));
#endif
        return;
    }
    for (int k = 0; k < K; ++k) { /* a unit cut by the segment's bounds */
        const int64_t at = pos + k * (int64_t)sizeof(V);
        if (at < s.start || at >= end) continue;
        uint8_t* e = engine + k * sizeof(V);
        uint8_t* m = memory + k * sizeof(V);
#if defined(__CUDA_ARCH__)
        if (Gather)
            *reinterpret_cast<V*>(m) = *reinterpret_cast<const V*>(e);
        else
            *reinterpret_cast<V*>(e) = *reinterpret_cast<const V*>(m);
#else
        memcpy(Gather ? m : e, Gather ? e : m, sizeof(V));
#endif
    }
}

#endif /* KVTRIO_BATCH_H */
