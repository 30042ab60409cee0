/* kvtrio's optional CPU copy helper: row copies, and the vllm_cpu layout's blocked transpose.
 *
 * vLLM's CPU engine keeps, per block and head, K transposed ([head_dim, block_size]) and then V
 * ([block_size, head_dim]). kvtrio's canonical chunk is token-major ([kv, token, head, dim]), so
 * every K element changes place; numpy can only do that element by element (~0.5 of memcpy).
 * Here K goes through 8x8 register-tile transposes (SSE2 for 2-byte elements, scalar tiles
 * otherwise; a gather stages each block's K in the cache) and V through row copies. The other
 * layouts are row copies (kvt_cpu_rows). Built lazily by kvtrio/transfer/_cpu_native.py with
 * the C compiler if there is one; kvtrio/transfer/_cpu.py falls back to numpy otherwise.
 *
 * The caller (Python) has validated every argument: pointers, ids and strides are trusted.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define KVT_CPU_ABI 3

int kvt_cpu_abi(void) { return KVT_CPU_ABI; }

/* memcpy for the copies of this file. glibc's memcpy uses `rep movsb` from 2 KiB up, which on
 * the AMD EPYC machines measured here runs 10-20x slower when source and destination are
 * misaligned to each other in some ways (a page-aligned arena slot into a numpy array at
 * 16 mod 64: 0.6 GB/s instead of 11; bench/transfer.py --misaligned). Plain vector moves have
 * no such cliff. */
static void copy_bytes(uint8_t *dst, const uint8_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__SSE2__)
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

/* copy_bytes into memory that is not read again soon: with non-temporal stores when dst is
 * 16-byte aligned, so that the destination's lines are not first read from memory (a third
 * of the traffic; glibc's memcpy does the same for big copies, which is what the benches
 * compare with). Callers end with kvt_fence(). */
static void copy_out(uint8_t *dst, const uint8_t *src, int64_t n) {
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) == 0) {
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
        if (i < n) memcpy(dst + i, src + i, (size_t)(n - i));
        return;
    }
#endif
    copy_bytes(dst, src, n);
}

/* Orders the non-temporal stores before whatever the caller does next (a commit). */
static void kvt_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Rows of every layer to (gather) or from (scatter) the chunk: chunk row chunk_rows[j] of layer
 * l's share of the chunk is row layer_rows[j] of the layer (row_bytes each), copied in the order
 * of j, which the caller picks so that the destination is written in order. layers: num_layers
 * base addresses; the chunk holds the layers' shares (rows_per_layer rows) one after the other.
 * Arguments are trusted. */
int kvt_cpu_rows(const uint64_t *layers, int64_t num_layers, const int64_t *layer_rows,
                 const int64_t *chunk_rows, int64_t n, int64_t rows_per_layer, int64_t row_bytes,
                 uint8_t *chunk, int gather) {
    for (int64_t l = 0; l < num_layers; l++) {
        uint8_t *base = (uint8_t *)(uintptr_t)layers[l];
        uint8_t *part = chunk + l * rows_per_layer * row_bytes;
        for (int64_t j = 0; j < n; j++) {
            uint8_t *in_layer = base + layer_rows[j] * row_bytes;
            uint8_t *in_chunk = part + chunk_rows[j] * row_bytes;
            if (gather)
                copy_out(in_chunk, in_layer, row_bytes);
            else
                copy_out(in_layer, in_chunk, row_bytes);
        }
    }
    kvt_fence();
    return 0;
}

#define KVT_SCALAR_TRANSPOSE(T)                                                                 \
    static void transpose_##T(const T *src, int64_t sstride, T *dst, int64_t dstride,           \
                              int64_t rows, int64_t cols) {                                     \
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {                                              \
            int64_t r1 = r0 + 8 < rows ? r0 + 8 : rows;                                         \
            for (int64_t c0 = 0; c0 < cols; c0 += 8) {                                          \
                int64_t c1 = c0 + 8 < cols ? c0 + 8 : cols;                                     \
                for (int64_t c = c0; c < c1; c++)                                               \
                    for (int64_t r = r0; r < r1; r++) dst[c * dstride + r] = src[r * sstride + c]; \
            }                                                                                   \
        }                                                                                       \
    }

KVT_SCALAR_TRANSPOSE(uint8_t)
KVT_SCALAR_TRANSPOSE(uint32_t)

static void transpose_uint16_t(const uint16_t *src, int64_t sstride, uint16_t *dst,
                               int64_t dstride, int64_t rows, int64_t cols) {
    int64_t full_rows = rows - rows % 8, full_cols = cols - cols % 8;
#if defined(__SSE2__)
    for (int64_t r0 = 0; r0 < full_rows; r0 += 8) {
        for (int64_t c0 = 0; c0 < full_cols; c0 += 8) {
            const uint16_t *s = src + r0 * sstride + c0;
            __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * sstride));
            __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * sstride));
            __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * sstride));
            __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * sstride));
            __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * sstride));
            __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * sstride));
            __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * sstride));
            __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * sstride));
            __m128i t0 = _mm_unpacklo_epi16(a0, a1), t1 = _mm_unpackhi_epi16(a0, a1);
            __m128i t2 = _mm_unpacklo_epi16(a2, a3), t3 = _mm_unpackhi_epi16(a2, a3);
            __m128i t4 = _mm_unpacklo_epi16(a4, a5), t5 = _mm_unpackhi_epi16(a4, a5);
            __m128i t6 = _mm_unpacklo_epi16(a6, a7), t7 = _mm_unpackhi_epi16(a6, a7);
            __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
            __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
            __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
            __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
            uint16_t *d = dst + c0 * dstride + r0;
            _mm_storeu_si128((__m128i *)(d + 0 * dstride), _mm_unpacklo_epi64(u0, u4));
            _mm_storeu_si128((__m128i *)(d + 1 * dstride), _mm_unpackhi_epi64(u0, u4));
            _mm_storeu_si128((__m128i *)(d + 2 * dstride), _mm_unpacklo_epi64(u1, u5));
            _mm_storeu_si128((__m128i *)(d + 3 * dstride), _mm_unpackhi_epi64(u1, u5));
            _mm_storeu_si128((__m128i *)(d + 4 * dstride), _mm_unpacklo_epi64(u2, u6));
            _mm_storeu_si128((__m128i *)(d + 5 * dstride), _mm_unpackhi_epi64(u2, u6));
            _mm_storeu_si128((__m128i *)(d + 6 * dstride), _mm_unpacklo_epi64(u3, u7));
            _mm_storeu_si128((__m128i *)(d + 7 * dstride), _mm_unpackhi_epi64(u3, u7));
        }
    }
#else
    full_rows = 0;
    full_cols = 0;
#endif
    /* The edges the tiles did not cover (everything, without SSE2). */
    for (int64_t r = 0; r < rows; r++) {
        int64_t c = r < full_rows ? full_cols : 0;
        for (; c < cols; c++) dst[c * dstride + r] = src[r * sstride + c];
    }
}

static void transpose(int64_t elem, const uint8_t *src, int64_t sstride, uint8_t *dst,
                      int64_t dstride, int64_t rows, int64_t cols) {
    if (elem == 2)
        transpose_uint16_t((const uint16_t *)src, sstride, (uint16_t *)dst, dstride, rows, cols);
    else if (elem == 4)
        transpose_uint32_t((const uint32_t *)src, sstride, (uint32_t *)dst, dstride, rows, cols);
    else
        transpose_uint8_t(src, sstride, dst, dstride, rows, cols);
}

/* Copy blocks ids[0..n) of every layer to (gather) or from (scatter) the canonical chunk.
 *
 * layers: num_layers base addresses of (blocks, heads, 2, block_size, head_dim) tensors whose
 * last two axes are contiguous; block_stride, head_stride, kv_stride in bytes. chunk: per layer
 * (2, n * block_size, heads, head_dim), contiguous. elem: 1, 2 or 4 bytes. Returns 0, 1 for a
 * bad element size, 2 if the stage could not be allocated (nothing written then). */
int kvt_cpu_vllm_cpu_copy(const uint64_t *layers, int64_t num_layers, const int64_t *ids,
                          int64_t n, int64_t heads, int64_t block_size, int64_t head_dim,
                          int64_t elem, int64_t block_stride, int64_t head_stride,
                          int64_t kv_stride, uint8_t *chunk, int gather) {
    if (elem != 1 && elem != 2 && elem != 4) return 1;
    const int64_t row = heads * head_dim;           /* elements per token in the chunk */
    const int64_t run = head_dim * elem;            /* bytes of one V row */
    const int64_t kblock = block_size * row * elem; /* bytes of a block's K in the chunk */
    const int64_t half = n * kblock;                /* bytes of K (or V) of one layer */
    /* Transposed K goes through a cache-resident stage and leaves it with copy_out: a gather
     * stages a block's K in chunk order, a scatter one head's K region. Transposed tiles written
     * straight out of the cache (16 bytes into each of 8 rows per tile) cost about 10% more
     * (bench/transfer.py); V rows need no stage. */
    const int64_t kregion = block_size * run; /* bytes of one head's K in the engine */
    /* A scatter first reads the block's K and V out of the chunk with two sequential copies
     * into `local` (the transposes and V rows then read across 16 rows of the chunk in the
     * cache, not in memory: 0.45 -> 0.8+ of memcpy on a quiet machine). */
    uint8_t *stage = malloc((size_t)(gather ? kblock : kregion + 2 * kblock));
    if (stage == NULL) return 2;
    uint8_t *local = gather ? NULL : stage + kregion;
    for (int64_t l = 0; l < num_layers; l++) {
        uint8_t *base = (uint8_t *)(uintptr_t)layers[l];
        uint8_t *ck = chunk + l * 2 * half, *cv = ck + half;
        for (int64_t i = 0; i < n; i++) {
            uint8_t *block = base + ids[i] * block_stride;
            uint8_t *kfrom = ck + i * kblock, *vfrom = cv + i * kblock;
            if (!gather) {
                copy_bytes(local, kfrom, kblock);
                copy_bytes(local + kblock, vfrom, kblock);
                kfrom = local;
                vfrom = local + kblock;
            }
            for (int64_t h = 0; h < heads; h++) {
                uint8_t *key = block + h * head_stride, *value = key + kv_stride;
                uint8_t *tok = kfrom + h * run;
                uint8_t *vtok = (gather ? cv + i * kblock : vfrom) + h * run;
                if (gather) {
                    transpose(elem, key, block_size, stage + h * run, row, head_dim, block_size);
                    for (int64_t t = 0; t < block_size; t++)
                        copy_out(vtok + t * row * elem, value + t * run, run);
                } else {
                    transpose(elem, tok, row, stage, block_size, block_size, head_dim);
                    copy_out(key, stage, kregion);
                    for (int64_t t = 0; t < block_size; t++)
                        copy_out(value + t * run, vtok + t * row * elem, run);
                }
            }
            if (gather) copy_out(ck + i * kblock, stage, kblock);
        }
    }
    kvt_fence();
    free(stage);
    return 0;
}
