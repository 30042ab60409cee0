/* kvtrio's optional CPU copy helper: row copies, and the vllm_cpu layout's blocked transpose.
 *
 * vLLM's CPU engine keeps, per block and head, K transposed ([head_dim, block_size]) and then V
 * ([block_size, head_dim]). kvtrio's canonical chunk is token-major ([kv, token, head, dim]), so
 * every K element changes place; numpy can only do that element by element (~0.5 of memcpy).
 * Here each head's K goes through register-tile transposes into a small stage in L1 and leaves
 * it as rows of head_dim elements, like V (see kvt_cpu_vllm_cpu_copy). The other layouts are
 * row copies (kvt_cpu_rows). Built lazily by kvtrio/transfer/_cpu_native.py with the C compiler
 * if there is one; kvtrio/transfer/_cpu.py falls back to numpy otherwise.
 *
 * The tiles use SSE2 (every x86-64) or, where the CPU has it (checked at run time, so the
 * library stays portable), AVX2; other CPUs copy element by element.
 *
 * The caller (Python) has validated every argument: pointers, ids and strides are trusted.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__SSE2__)
#define KVT_X86 1
#include <immintrin.h>
#define KVT_AVX2 __attribute__((target("avx2")))
#endif

#define KVT_CPU_ABI 6

int kvt_cpu_abi(void) { return KVT_CPU_ABI; }

/* ------------------------------------------------------------------------ instruction sets */

/* 0: scalar, 1: SSE2, 2: AVX2. */
static int isa_limit = 2;

static int isa_supported(void) {
#if defined(KVT_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    return 0;
#endif
}

/* The instruction set the copies use: the best the CPU has, at most `limit` if limit >= 0
 * (which stays in effect: tests and benches compare the paths). */
int kvt_cpu_isa(int limit) {
    if (limit >= 0) __atomic_store_n(&isa_limit, limit, __ATOMIC_RELAXED);
    int supported = isa_supported(), wanted = __atomic_load_n(&isa_limit, __ATOMIC_RELAXED);
    return supported < wanted ? supported : wanted;
}

/* ------------------------------------------------------------------------ prefetches */

/* Where the copies' software prefetches bring lines: 0 into L1 (prefetcht0), 1 into L2 only
 * (prefetcht2). On the AMD EPYC machines measured here, prefetches into L1 wait for its few
 * miss buffers, so the core stalls on them as on the loads they announce, and the copies ran
 * as if moving and shuffling the bytes took turns: vllm_cpu gathers at 0.70 of memcpy and
 * scatters at 0.56 (smollm2 shape, fp32), flash_attn rows at 0.80 / 0.91. Into L2, which tracks
 * many more misses, they overlap: 0.95 / 0.77 (fp16: 0.94 / 0.88), flash_attn 1.04 / 1.03
 * (docs/bench.md, "CPU copies"). Intel CPUs keep L1, with which every layout measured
 * 0.87-1.28 of memcpy there. -1: not decided yet. */
static int prefetch_level = -1;

/* The prefetch level: `level` (0 or 1) if level >= 0, which stays in effect (tests and benches
 * compare the two); with -1 the one in effect, the CPU's default at first; with -2 the CPU's
 * default again. */
int kvt_cpu_prefetch(int level) {
    if (level == -1) level = __atomic_load_n(&prefetch_level, __ATOMIC_RELAXED);
    if (level < 0) {
#if defined(KVT_X86)
        __builtin_cpu_init();
        level = __builtin_cpu_is("amd") ? 1 : 0;
#else
        level = 0;
#endif
    }
    level = level > 0;
    __atomic_store_n(&prefetch_level, level, __ATOMIC_RELAXED);
    return level;
}

/* ------------------------------------------------------------------------ plain copies */

/* memcpy for the copies of this file. glibc's memcpy uses `rep movsb` from 2 KiB up, which on
 * the AMD EPYC machines measured here runs 10-20x slower when source and destination are
 * misaligned to each other in some ways (a page-aligned arena slot into a numpy array at
 * 16 mod 64: 0.6 GB/s instead of 11). Plain vector moves have no such cliff. */
static void copy_bytes(uint8_t *dst, const uint8_t *src, int64_t n) {
    int64_t i = 0;
#if defined(KVT_X86)
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_storeu_si128((__m128i *)(dst + i), a);
        _mm_storeu_si128((__m128i *)(dst + i + 16), b);
        _mm_storeu_si128((__m128i *)(dst + i + 32), c);
        _mm_storeu_si128((__m128i *)(dst + i + 48), d);
    }
#endif
    if (i < n) memcpy(dst + i, src + i, (size_t)(n - i));
}

/* copy_bytes into memory that is not read again soon: with non-temporal stores when dst and n
 * are multiples of 16, so that the destination's lines are not first read from memory (a third
 * of the traffic; glibc's memcpy does the same for big copies). Either every store to a line is
 * non-temporal or none is: a line that gets both, or non-temporal stores to part of it and the
 * rest much later, is merged in memory (rows of 256 bytes written 768 apart at 16 mod 64 ran
 * at 1.1-1.9 GB/s that way, at 4.5 with plain stores and at 8 at 0 mod 64). So a caller either
 * copies whole lines, or adjacent rows one after the other (their stores meet in one
 * write-combining buffer), or asks for copy_bytes. Callers end with kvt_fence(). */
static void copy_out(uint8_t *dst, const uint8_t *src, int64_t n) {
#if defined(KVT_X86)
    if ((((uintptr_t)dst | (uintptr_t)n) & 15) == 0) {
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        for (; i < n; i += 16)
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        return;
    }
#endif
    copy_bytes(dst, src, n);
}

/* Orders the non-temporal stores before whatever the caller does next (a commit). */
static void kvt_fence(void) {
#if defined(KVT_X86)
    _mm_sfence();
#endif
}

/* Asks for the cache lines of bytes [begin, end) of p to be brought into the cache (a hint: it
 * neither faults nor waits for the data): into L1, or into L2 where prefetch_level is 1 (the
 * exported functions decide it first, with kvt_cpu_prefetch). */
static void prefetch(const uint8_t *p, int64_t begin, int64_t end) {
    uintptr_t line = ((uintptr_t)p + (uintptr_t)begin) & ~(uintptr_t)63;
    if (__atomic_load_n(&prefetch_level, __ATOMIC_RELAXED) > 0)
        for (; line < (uintptr_t)p + (uintptr_t)end; line += 64)
            __builtin_prefetch((const void *)line, 0, 1);
    else
        for (; line < (uintptr_t)p + (uintptr_t)end; line += 64)
            __builtin_prefetch((const void *)line);
}

/* Rows of every layer to (gather) or from (scatter) the chunk: chunk row chunk_rows[j] of layer
 * l's share of the chunk is row layer_rows[j] of the layer (row_bytes each), copied in the order
 * of j, which the caller picks so that the destination is written in order. layers: num_layers
 * base addresses; the chunk holds the layers' shares (rows_per_layer rows) one after the other.
 * While a row is copied, a piece at a time, the same piece of a row 2 KiB (16 KiB into L2) or
 * more ahead is prefetched (see kvt_cpu_vllm_cpu_copy). Arguments are trusted. */
int kvt_cpu_rows(const uint64_t *layers, int64_t num_layers, const int64_t *layer_rows,
                 const int64_t *chunk_rows, int64_t n, int64_t rows_per_layer, int64_t row_bytes,
                 uint8_t *chunk, int gather) {
    /* The prefetches run at least 2 KiB ahead, 16 KiB into L2 (AMD EPYC, cpu layout's rows of
     * 256 bytes: 2 KiB 0.82 / 0.70 of memcpy, 16 KiB 1.05 / 0.99): the next row, or as many
     * rows as that takes. */
    const int64_t far = kvt_cpu_prefetch(-1) ? 16384 : 2048, piece = 1024,
                  ahead = row_bytes < far ? (far + row_bytes - 1) / row_bytes : 1;
    for (int64_t l = 0; l < num_layers; l++) {
        uint8_t *base = (uint8_t *)(uintptr_t)layers[l];
        uint8_t *part = chunk + l * rows_per_layer * row_bytes;
        for (int64_t j = 0; j < n; j++) {
            uint8_t *in_layer = base + layer_rows[j] * row_bytes;
            uint8_t *in_chunk = part + chunk_rows[j] * row_bytes;
            uint8_t *dst = gather ? in_chunk : in_layer;
            const uint8_t *src = gather ? in_layer : in_chunk;
            const uint8_t *next = NULL; /* the source of row j + ahead */
            int64_t lp = l + (j + ahead) / n, jp = (j + ahead) % n;
            if (lp < num_layers)
                next = gather ? (const uint8_t *)(uintptr_t)layers[lp] + layer_rows[jp] * row_bytes
                              : chunk + (lp * rows_per_layer + chunk_rows[jp]) * row_bytes;
            /* whole rows decide between streaming and plain stores (see copy_out) */
            void (*const out)(uint8_t *, const uint8_t *, int64_t) =
                (((uintptr_t)dst | (uintptr_t)row_bytes) & 15) == 0 ? copy_out : copy_bytes;
            for (int64_t at = 0; at < row_bytes; at += piece) {
                int64_t len = row_bytes - at < piece ? row_bytes - at : piece;
                if (next != NULL) prefetch(next, at, at + len);
                out(dst + at, src + at, len);
            }
        }
    }
    kvt_fence();
    return 0;
}

/* ------------------------------------------------------------------------ transposes */

/* Every transpose writes dst[c][r] = src[r][c] for r < rows, c < cols (counted in elements of
 * E bytes; the strides ss and ds are in bytes). */
typedef void (*transpose_fn)(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds,
                             int64_t rows, int64_t cols);

/* Element by element: the edges that no tile covers, and CPUs without SSE2. */
#define KVT_EDGE(E)                                                                           \
    static void edge_##E(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds, int64_t r0, \
                         int64_t r1, int64_t c0, int64_t c1) {                                \
        for (int64_t c = c0; c < c1; c++)                                                     \
            for (int64_t r = r0; r < r1; r++)                                                 \
                memcpy(dst + c * ds + r * E, src + r * ss + c * E, E);                        \
    }                                                                                         \
    static void transpose_scalar_##E(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds, \
                                     int64_t rows, int64_t cols) {                            \
        edge_##E(src, ss, dst, ds, 0, rows, 0, cols);                                         \
    }
KVT_EDGE(1)
KVT_EDGE(2)
KVT_EDGE(4)

#if defined(KVT_X86)
/* Transposes the N x N tile of elements held in x[0..N) (one row of N elements per 16-byte
 * lane; N = 16 / E) in log2(N) rounds of N unpacks: each round interleaves rows i and i + N/2
 * into rows 2i and 2i + 1, which after log2(N) rounds leaves column c in x[c]. */
#define KVT_NETWORK(V, LO, HI, N, x)                                                          \
    do {                                                                                      \
        for (int s_ = 1; s_ < (N); s_ *= 2) {                                                 \
            V t_[N];                                                                          \
            for (int i_ = 0; i_ < (N) / 2; i_++) {                                            \
                t_[2 * i_] = LO(x[i_], x[i_ + (N) / 2]);                                      \
                t_[2 * i_ + 1] = HI(x[i_], x[i_ + (N) / 2]);                                  \
            }                                                                                 \
            for (int i_ = 0; i_ < (N); i_++) x[i_] = t_[i_];                                  \
        }                                                                                     \
    } while (0)

/* SSE2: N x N tiles (16 bytes a row), then the edges. */
#define KVT_SSE2(E, N, W)                                                                     \
    static inline void tile_sse2_##E(const uint8_t *src, int64_t ss, uint8_t *dst,            \
                                     int64_t ds) {                                            \
        __m128i x[N];                                                                         \
        for (int i = 0; i < N; i++) x[i] = _mm_loadu_si128((const __m128i *)(src + i * ss));  \
        KVT_NETWORK(__m128i, _mm_unpacklo_epi##W, _mm_unpackhi_epi##W, N, x);                 \
        for (int i = 0; i < N; i++) _mm_storeu_si128((__m128i *)(dst + i * ds), x[i]);        \
    }                                                                                         \
    static void transpose_sse2_##E(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds,  \
                                   int64_t rows, int64_t cols) {                              \
        int64_t r = 0;                                                                        \
        for (; r + N <= rows; r += N) {                                                       \
            int64_t c = 0;                                                                    \
            for (; c + N <= cols; c += N)                                                     \
                tile_sse2_##E(src + r * ss + c * E, ss, dst + c * ds + r * E, ds);           \
            edge_##E(src, ss, dst, ds, r, r + N, c, cols);                                    \
        }                                                                                     \
        edge_##E(src, ss, dst, ds, r, rows, 0, cols);                                         \
    }

/* AVX2: 2N x N tiles, rows r and N + r in the two lanes of one register, so that one in-lane
 * network transposes both halves and each result register is a whole 32-byte output row (half
 * the shuffles of SSE2 per byte); the rows left over go to SSE2. */
#define KVT_AVX2_TILES(E, N, W)                                                               \
    KVT_AVX2 static inline void tile_avx2_##E(const uint8_t *src, int64_t ss, uint8_t *dst,   \
                                              int64_t ds) {                                   \
        __m256i x[N];                                                                         \
        for (int i = 0; i < N; i++)                                                           \
            x[i] = _mm256_inserti128_si256(                                                   \
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(src + i * ss))),     \
                _mm_loadu_si128((const __m128i *)(src + (i + N) * ss)), 1);                   \
        KVT_NETWORK(__m256i, _mm256_unpacklo_epi##W, _mm256_unpackhi_epi##W, N, x);           \
        for (int i = 0; i < N; i++) _mm256_storeu_si256((__m256i *)(dst + i * ds), x[i]);     \
    }                                                                                         \
    KVT_AVX2 static void transpose_avx2_##E(const uint8_t *src, int64_t ss, uint8_t *dst,     \
                                            int64_t ds, int64_t rows, int64_t cols) {         \
        int64_t r = 0;                                                                        \
        for (; r + 2 * N <= rows; r += 2 * N) {                                               \
            int64_t c = 0;                                                                    \
            for (; c + N <= cols; c += N)                                                     \
                tile_avx2_##E(src + r * ss + c * E, ss, dst + c * ds + r * E, ds);           \
            edge_##E(src, ss, dst, ds, r, r + 2 * N, c, cols);                                \
        }                                                                                     \
        transpose_sse2_##E(src + r * ss, ss, dst + r * E, ds, rows - r, cols);                \
    }

KVT_SSE2(1, 16, 8)
KVT_SSE2(2, 8, 16)
KVT_SSE2(4, 4, 32)
KVT_AVX2_TILES(1, 16, 8)
KVT_AVX2_TILES(2, 8, 16)
KVT_AVX2_TILES(4, 4, 32)
#endif

/* The transpose for elements of `elem` bytes (1, 2 or 4) on instruction set `isa`. */
static transpose_fn pick_transpose(int64_t elem, int isa) {
    static const transpose_fn table[3][3] = {
        {transpose_scalar_1, transpose_scalar_2, transpose_scalar_4},
#if defined(KVT_X86)
        {transpose_sse2_1, transpose_sse2_2, transpose_sse2_4},
        {transpose_avx2_1, transpose_avx2_2, transpose_avx2_4},
#else
        {transpose_scalar_1, transpose_scalar_2, transpose_scalar_4},
        {transpose_scalar_1, transpose_scalar_2, transpose_scalar_4},
#endif
    };
    return table[isa][elem == 1 ? 0 : elem == 2 ? 1 : 2];
}

/* ------------------------------------------------------------------------ vllm_cpu */

/* Copy blocks ids[0..n) of every layer to (gather) or from (scatter) blocks [0, n) of a canonical
 * chunk of span >= n blocks (the part of a bigger chunk that starts at `chunk`).
 *
 * layers: num_layers base addresses of (blocks, heads, 2, block_size, head_dim) tensors whose
 * last two axes are contiguous; block_stride, head_stride, kv_stride in bytes. The chunk: per
 * layer (2, span * block_size, heads, head_dim), contiguous. elem: 1, 2 or 4 bytes; stage: a
 * 64-byte aligned buffer of block_size * head_dim elements.
 *
 * One head of one block at a time: its K ([head_dim, block_size] in the engine) is transposed
 * through a stage of block_size x head_dim elements that stays in L1, and K and V then move as
 * rows of head_dim elements, each a contiguous run in both. A stage as wide as a chunk row (the
 * whole block's K) has a row stride that is a multiple of 2 KiB in the usual shapes, so the
 * tiles' stores fall into two L1 sets and evict each other (float32 transposes ran at 5 GB/s
 * in the cache instead of 30). Scatters transpose straight out of the chunk.
 *
 * A gather prefetches the next head (K and V) a row at a time while it writes this head's rows
 * out: blocks lie at random places, and the hardware prefetchers only start after a few misses
 * in each page. All at once, the prefetches wait for the core's few line-fill buffers, so the
 * core then waits for the next head as if it loaded it, and nothing overlaps (0.7 of memcpy on
 * an Intel Xeon with float32 blocks of 32 tokens, 1.0 spread out). A scatter reads the chunk a
 * head (a column of rows) at a time, which the hardware prefetchers follow no better; it
 * prefetches the next block's rows, spread the same way (0.75 -> 0.95 from a chunk that is not
 * in the cache; staging the block's rows with sequential copies instead did not help). */
static void vllm_cpu_part(const uint64_t *layers, int64_t num_layers, const int64_t *ids,
                          int64_t n, int64_t span, int64_t heads, int64_t block_size,
                          int64_t head_dim, int64_t elem, int64_t block_stride,
                          int64_t head_stride, int64_t kv_stride, uint8_t *chunk, int gather,
                          transpose_fn transpose, uint8_t *stage) {
    const int64_t pitch = heads * head_dim * elem; /* bytes of a token's row in the chunk */
    const int64_t run = head_dim * elem;           /* bytes of one head of one token */
    const int64_t kblock = block_size * pitch;     /* bytes of a block's K in the chunk */
    const int64_t half = span * kblock;            /* bytes of K (or V) of one layer */
    const int64_t region = block_size * run;       /* bytes of one head's K (or V), engine */
    /* A gather writes rows of `run` bytes, `pitch` apart: non-temporal stores only if those are
     * whole cache lines (see copy_out). */
    void (*const out)(uint8_t *, const uint8_t *, int64_t) =
        (((uintptr_t)chunk | (uintptr_t)run) & 63) == 0 ? copy_out : copy_bytes;
    for (int64_t l = 0; l < num_layers; l++) {
        uint8_t *base = (uint8_t *)(uintptr_t)layers[l];
        uint8_t *ck = chunk + l * 2 * half, *cv = ck + half;
        for (int64_t i = 0; i < n; i++) {
            uint8_t *block = base + ids[i] * block_stride;
            uint8_t *kchunk = ck + i * kblock, *vchunk = cv + i * kblock;
            for (int64_t h = 0; h < heads; h++) {
                uint8_t *key = block + h * head_stride, *value = key + kv_stride;
                uint8_t *krow = kchunk + h * run, *vrow = vchunk + h * run;
                if (gather) {
                    /* the next head: the next one of this block, or the first of the next
                     * block (or of the next layer); a 1 / block_size share of it per row */
                    const uint8_t *next = NULL;
                    if (h + 1 < heads)
                        next = key + head_stride;
                    else if (i + 1 < n)
                        next = base + ids[i + 1] * block_stride;
                    else if (l + 1 < num_layers)
                        next = (const uint8_t *)(uintptr_t)layers[l + 1] + ids[0] * block_stride;
                    transpose(key, block_size * elem, stage, run, head_dim, block_size);
                    for (int64_t t = 0; t < block_size; t++) {
                        if (next != NULL) {
                            prefetch(next, t * run, (t + 1) * run);
                            prefetch(next + kv_stride, t * run, (t + 1) * run);
                        }
                        out(krow + t * pitch, stage + t * run, run);
                        out(vrow + t * pitch, value + t * run, run);
                    }
                } else {
                    /* the next block's rows in the chunk (or the next layer's first) */
                    const uint8_t *next = NULL;
                    if (i + 1 < n)
                        next = kchunk + kblock;
                    else if (l + 1 < num_layers)
                        next = ck + 2 * half;
                    transpose(krow, pitch, stage, block_size * elem, block_size, head_dim);
                    copy_out(key, stage, region);
                    for (int64_t t = 0; t < block_size; t++) {
                        if (next != NULL) { /* a 1 / (heads * block_size) share of them */
                            int64_t at = (h * block_size + t) * run;
                            prefetch(next, at, at + run);
                            prefetch(next + half, at, at + run);
                        }
                        copy_out(value + t * run, vrow + t * pitch, run);
                    }
                }
            }
        }
    }
}

/* Copy the blocks of n_chunks chunks (or parts of chunks) in one call, so that a retrieve of many
 * chunks gives the GIL back to the caller once, not once per chunk. Chunk c: counts[c] blocks,
 * the next counts[c] of ids, to or from the part of a canonical chunk of spans[c] >= counts[c]
 * blocks that starts at address chunks[c] (see vllm_cpu_part: a part that skips the first s
 * blocks of a chunk starts s * block_size * heads * head_dim * elem bytes into it). Returns 0,
 * 1 for a bad element size, 2 if the stage could not be allocated (nothing written then). */
int kvt_cpu_vllm_cpu_copy(const uint64_t *layers, int64_t num_layers, const int64_t *ids,
                          const int64_t *counts, const int64_t *spans, const uint64_t *chunks,
                          int64_t n_chunks, int64_t heads, int64_t block_size, int64_t head_dim,
                          int64_t elem, int64_t block_stride, int64_t head_stride,
                          int64_t kv_stride, int gather) {
    if (elem != 1 && elem != 2 && elem != 4) return 1;
    kvt_cpu_prefetch(-1);
    const transpose_fn transpose = pick_transpose(elem, kvt_cpu_isa(-1));
    const int64_t region = block_size * head_dim * elem;
    uint8_t *stage = aligned_alloc(64, (size_t)((region + 63) / 64 * 64));
    if (stage == NULL) return 2;
    for (int64_t c = 0; c < n_chunks; ids += counts[c], c++)
        if (counts[c] > 0)
            vllm_cpu_part(layers, num_layers, ids, counts[c], spans[c], heads, block_size,
                          head_dim, elem, block_stride, head_stride, kv_stride,
                          (uint8_t *)(uintptr_t)chunks[c], gather, transpose, stage);
    kvt_fence();
    free(stage);
    return 0;
}
