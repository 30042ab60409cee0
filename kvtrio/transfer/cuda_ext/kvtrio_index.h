/*
 * kvtrio_index.h: which byte of which engine block of which layer goes where in a canonical
 * L1 chunk. Compiled twice: by nvcc into the gather/scatter kernels (kvtrio_kernels.cu), and by
 * g++ into a host-only library (kvtrio_host.cpp) that the tests call and compare byte for byte
 * against the numpy reference of the CPU path. Nothing here allocates, launches or synchronises.
 *
 * The engine side. Every layer is one tensor; whatever its kind (flash_attn, flash_infer, mla,
 * and the CPU layouts too), a layer is described by the byte strides of a five-axis view
 * (kv, block, token, head, dim) of it: the *geometry*, an array of KVT_G_FIELDS int64 built by
 * kvtrio/transfer/_geometry.py from the tensor's own strides. Layers of one registration share
 * a geometry and differ only in their base address (one pointer per layer).
 *
 * The chunk side. Per layer, a canonical chunk of n blocks is the C-contiguous array
 * (kv, n, block_size, heads, head_dim) of elements: block i of the chunk is engine block
 * ids[i]; layers follow each other.
 *
 * The copy. A *run* is the longest byte range that is contiguous in both (one element, one
 * head, one token's heads, or one whole block of K or V, depending on the strides). Each layer's
 * chunk bytes are cut into *vectors* of `vec` bytes (16, 8, 4, 2 or 1: the largest power of two
 * that divides every run, stride and base address involved), so a vector never straddles a run
 * and every load and store is aligned. Vector v of a layer is chunk byte v * vec; kvt_move copies
 * it. The kernel runs kvt_move for every (layer, vector) in one launch; the host library runs
 * the same function in a loop.
 *
 * Block ids are int64. Id -1 names no engine block: a scatter leaves that block alone (the
 * engine already has it, or computes it), so its bytes of the chunk are skipped; a gather writes
 * zeros for its bytes of the chunk (the tail of a prompt's partial chunk: its blocks first, then
 * zeros, whatever the chunk's memory held before). Any other negative id is refused
 * (kvt_check_ids).
 */
#ifndef KVTRIO_INDEX_H
#define KVTRIO_INDEX_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KVT_HD __host__ __device__ __forceinline__
#define KVT_HOST __host__ inline
#else
#define KVT_HD inline
#define KVT_HOST inline
#endif

/* The geometry array, as Python builds it. Sizes are counts; strides are bytes. */
enum {
    KVT_G_KV = 0,        /* 2 (K and V) or 1 (mla) */
    KVT_G_BLOCK_SIZE,    /* tokens per engine block */
    KVT_G_HEADS,         /* KV heads (1 for mla) */
    KVT_G_HEAD_DIM,      /* elements per head */
    KVT_G_ELEMENT,       /* bytes per element: 1, 2, 4 or 8 */
    KVT_G_NUM_BLOCKS,    /* engine blocks per layer */
    KVT_G_S_KV,          /* byte strides of the (kv, block, token, head, dim) view */
    KVT_G_S_BLOCK,
    KVT_G_S_TOKEN,
    KVT_G_S_HEAD,
    KVT_G_S_DIM,
    KVT_G_FIELDS
};

/* Error codes shared by both builds (messages in kvt_error_message). */
enum {
    KVT_OK = 0,
    KVT_E_GEOMETRY = 1,  /* a size is not positive, kv is not 1 or 2, a bad element size */
    KVT_E_STRIDE = 2,    /* a negative stride */
    KVT_E_BLOCK_ID = 3,  /* a block id outside [0, num_blocks) and not -1 */
    KVT_E_NO_BLOCKS = 4, /* an empty block id list */
    KVT_E_CUDA = 5,      /* a CUDA call failed (launchers only) */
    KVT_E_SEGMENT = 6    /* a segment outside its chunk, or ids outside the operation's */
};

typedef struct kvt_plan {
    int64_t kv, block_size, heads, head_dim, elem, num_blocks;
    int64_t s_kv, s_block, s_token, s_head, s_dim;
    int64_t run_elems;      /* elements per run */
    int64_t run;            /* bytes per run */
    int64_t runs_per_block; /* runs per (kv, block) */
    int64_t vec;            /* bytes per vector move */
} kvt_plan;

#if defined(__CUDACC__)
typedef uint4 kvt_v16;
typedef uint2 kvt_v8;
#else
struct alignas(16) kvt_v16 { uint32_t x, y, z, w; };
struct alignas(8) kvt_v8 { uint32_t x, y; };
#endif

KVT_HOST const char* kvt_error_message(int code) {
    switch (code) {
        case KVT_OK: return "ok";
        case KVT_E_GEOMETRY: return "invalid geometry (sizes must be positive, kv 1 or 2, element size 1, 2, 4 or 8)";
        case KVT_E_STRIDE: return "invalid geometry (strides must not be negative)";
        case KVT_E_BLOCK_ID: return "a block id is out of range";
        case KVT_E_NO_BLOCKS: return "no block ids";
        case KVT_E_CUDA: return "a CUDA call failed";
        case KVT_E_SEGMENT: return "a segment lies outside its chunk or its block ids";
        default: return "unknown error";
    }
}

/* Lowest set bit of x, capped at 16 (x > 0). */
KVT_HOST int64_t kvt_vector_bytes(uint64_t bits) {
    int64_t vec = 1;
    while (vec < 16 && (bits & (uint64_t)vec) == 0) vec <<= 1;
    return vec;
}

/*
 * Build the plan of a geometry. `pointer_bits` is the bitwise OR of every base address the copy
 * will touch (all layer bases and the chunk's), so that `vec` divides each of them.
 */
KVT_HOST int kvt_make_plan(const int64_t* g, uint64_t pointer_bits, kvt_plan* p) {
    p->kv = g[KVT_G_KV];
    p->block_size = g[KVT_G_BLOCK_SIZE];
    p->heads = g[KVT_G_HEADS];
    p->head_dim = g[KVT_G_HEAD_DIM];
    p->elem = g[KVT_G_ELEMENT];
    p->num_blocks = g[KVT_G_NUM_BLOCKS];
    p->s_kv = g[KVT_G_S_KV];
    p->s_block = g[KVT_G_S_BLOCK];
    p->s_token = g[KVT_G_S_TOKEN];
    p->s_head = g[KVT_G_S_HEAD];
    p->s_dim = g[KVT_G_S_DIM];
    if ((p->kv != 1 && p->kv != 2) || p->block_size < 1 || p->heads < 1 || p->head_dim < 1 ||
        p->num_blocks < 1 || (p->elem != 1 && p->elem != 2 && p->elem != 4 && p->elem != 8))
        return KVT_E_GEOMETRY;
    if (p->s_kv < 0 || p->s_block < 0 || p->s_token < 0 || p->s_head < 0 || p->s_dim < 0)
        return KVT_E_STRIDE;

    /* Grow the run outward from one element while the engine keeps the next axis contiguous. */
    const int64_t row = p->heads * p->head_dim;
    int64_t run_elems = 1;
    if (p->head_dim == 1 || p->s_dim == p->elem) {
        run_elems = p->head_dim;
        if (p->heads == 1 || p->s_head == p->head_dim * p->elem) {
            run_elems = row;
            if (p->block_size == 1 || p->s_token == row * p->elem) run_elems = p->block_size * row;
        }
    }
    p->run_elems = run_elems;
    p->run = run_elems * p->elem;
    p->runs_per_block = p->block_size * row / run_elems;

    /* Every stride that is multiplied by a varying index must keep vectors aligned. */
    uint64_t bits = pointer_bits | (uint64_t)p->run | (uint64_t)p->s_block;
    if (p->kv > 1) bits |= (uint64_t)p->s_kv;
    if (p->block_size > 1 && run_elems < p->block_size * row) bits |= (uint64_t)p->s_token;
    if (p->heads > 1 && run_elems < row) bits |= (uint64_t)p->s_head;
    if (p->head_dim > 1 && run_elems < p->head_dim) bits |= (uint64_t)p->s_dim;
    p->vec = kvt_vector_bytes(bits);
    return KVT_OK;
}

/* Check block ids against the plan: each in [0, num_blocks) or -1 (no engine block). */
KVT_HOST int kvt_check_ids(const kvt_plan* p, const int64_t* ids, int64_t n_ids) {
    if (n_ids < 1) return KVT_E_NO_BLOCKS;
    for (int64_t i = 0; i < n_ids; ++i) {
        if (ids[i] == -1) continue;
        if (ids[i] < 0 || ids[i] >= p->num_blocks) return KVT_E_BLOCK_ID;
    }
    return KVT_OK;
}

/* Bytes of one layer's share of a chunk of n_ids blocks. */
KVT_HD int64_t kvt_layer_bytes(const kvt_plan& p, int64_t n_ids) {
    return p.kv * n_ids * p.runs_per_block * p.run;
}

/*
 * Where run r of a layer's chunk starts in the engine layer (bytes from the layer's base), and
 * which engine block it is in (-1: a skipped block). Runs follow the chunk's order
 * (kv, block of the chunk, token, head, dim).
 */
template <typename Id>
KVT_HD int64_t kvt_run_offset(const kvt_plan& p, const Id* ids, int64_t n_ids, int64_t r,
                              int64_t* block) {
    const int64_t per_kv = n_ids * p.runs_per_block;
    const int64_t k = r / per_kv;
    const int64_t in_kv = r - k * per_kv;
    const int64_t i = in_kv / p.runs_per_block;
    const int64_t e = (in_kv - i * p.runs_per_block) * p.run_elems; /* element in (t, h, d) */
    const int64_t row = p.heads * p.head_dim;
    const int64_t t = e / row;
    const int64_t in_row = e - t * row;
    const int64_t h = in_row / p.head_dim;
    const int64_t d = in_row - h * p.head_dim;
    *block = (int64_t)ids[i];
    return k * p.s_kv + (int64_t)ids[i] * p.s_block + t * p.s_token + h * p.s_head + d * p.s_dim;
}

/* Where byte `pos` of a layer's chunk lives in the engine layer; -1 for a skipped block. */
KVT_HD int64_t kvt_engine_offset(const kvt_plan& p, const int64_t* ids, int64_t n_ids,
                                 int64_t pos) {
    const int64_t r = pos / p.run;
    int64_t block;
    const int64_t start = kvt_run_offset(p, ids, n_ids, r, &block);
    return block < 0 ? -1 : start + (pos - r * p.run);
}

/*
 * Copy vector v of one layer: engine -> chunk (Gather) or chunk -> engine. V is a type of
 * sizeof(V) == p.vec bytes; layer_base and chunk_layer point at the layer and its chunk share.
 * A vector of block -1: a gather writes zeros, a scatter nothing.
 */
template <typename V, bool Gather>
KVT_HD void kvt_move(const kvt_plan& p, uint8_t* layer_base, const int64_t* ids, int64_t n_ids,
                     uint8_t* chunk_layer, int64_t v) {
    const int64_t pos = v * (int64_t)sizeof(V);
    const int64_t offset = kvt_engine_offset(p, ids, n_ids, pos);
    uint8_t* chunk = chunk_layer + pos;
    if (offset < 0) { /* no engine block: the engine keeps it (scatter), zeros (gather) */
        if constexpr (Gather) {
#if defined(__CUDA_ARCH__)
            *reinterpret_cast<V*>(chunk) = V{};
#else
            memset(chunk, 0, sizeof(V));
#endif
        }
        return;
    }
    uint8_t* engine = layer_base + offset;
#if defined(__CUDA_ARCH__)
    if (Gather)
        *reinterpret_cast<V*>(chunk) = *reinterpret_cast<const V*>(engine);
    else
        *reinterpret_cast<V*>(engine) = *reinterpret_cast<const V*>(chunk);
#else
    if (Gather)
        memcpy(chunk, engine, sizeof(V));
    else
        memcpy(engine, chunk, sizeof(V));
#endif
}

#endif /* KVTRIO_INDEX_H */
