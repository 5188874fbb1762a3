/* promptlang's CPU kernels (x86-64, AVX2 + FMA, float32; the linear layers' dot tiles, the
 * Q4_1/Q8_0 dequantizing and the attention's QK/PV tiles also on 512-bit vectors where the CPU
 * has AVX-512F: `wide_tiles`, pl_wide, chosen at run time), built on first use by
 * runtime/fast/native.py and called through ctypes; every caller falls back to PyTorch when they
 * are unavailable.
 *
 * pl_attend: attention of a handful of query rows (the new tokens of a cached request, grouped
 *   query heads packed as rows of their KV head) over keys/values in several places at once
 *   (the request buffer, stored units read in place, the new tokens themselves), in one pass
 *   with an online softmax: no Q x K mask, no copies, no log-sum-exp merge in Python.
 * pl_linear: y = x W^T (+ b) for a few rows of x against nn.Linear's row-major weight, each
 *   weight row read once and reused for every x row while it is in cache.
 * pl_decoder: every decoder layer of a Llama-family model for a few new tokens in one parallel
 *   region (runtime/fast/fused.py): RMSNorm, projections, RoPE, pl_attend's attention (past pieces
 *   in float32, bfloat16 or float16), SiLU-gated MLP, residuals; linear weights in float32 or
 *   as a GGUF's blocks (Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K: the same values, 4-7x fewer bytes).
 *
 * Threads come from the caller (torch's count); the OpenMP runtime is the one torch loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

/* ---- helpers ---------------------------------------------------------------------------- */

/* the four horizontal sums of a, b, c, d */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define LOG2E 1.44269504088896341f
#define LN2 0.69314718055994531f

/* Cephes' exp2f polynomial for 2^f, |f| <= 1/2, highest power first */
static const float EXP2_P[7] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                9.618437357674640e-3f, 5.550332471162809e-2f,
                                2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

/* 2^x for x <= 0 (Cephes' exp2f polynomial). Below -126, -inf included, it gives 2^-126
 * (~1e-38) instead of less: next to a softmax row's largest term (exactly 1), or inside
 * silu, that is far below float precision. */
static inline __m256 exp2_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_P[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_P[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* ---- dot-product tiles: out[i][j] = <a_i, b_j> over k (k % 8 == 0) ---------------------- */

/* 3 rows of a x 4 rows of b; results to c (row stride ldc) */
static inline void dot3x4(const float* a, long lda, const float* b, long ldb, long k,
                          float* c, long ldc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda;
    const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb, *b3 = b + 3 * ldb;
    for (long i = 0; i < k; i += 8) {
        __m256 x0 = _mm256_loadu_ps(a0 + i), x1 = _mm256_loadu_ps(a1 + i),
               x2 = _mm256_loadu_ps(a2 + i);
        __m256 y = _mm256_loadu_ps(b0 + i);
        c00 = _mm256_fmadd_ps(x0, y, c00); c10 = _mm256_fmadd_ps(x1, y, c10);
        c20 = _mm256_fmadd_ps(x2, y, c20);
        y = _mm256_loadu_ps(b1 + i);
        c01 = _mm256_fmadd_ps(x0, y, c01); c11 = _mm256_fmadd_ps(x1, y, c11);
        c21 = _mm256_fmadd_ps(x2, y, c21);
        y = _mm256_loadu_ps(b2 + i);
        c02 = _mm256_fmadd_ps(x0, y, c02); c12 = _mm256_fmadd_ps(x1, y, c12);
        c22 = _mm256_fmadd_ps(x2, y, c22);
        y = _mm256_loadu_ps(b3 + i);
        c03 = _mm256_fmadd_ps(x0, y, c03); c13 = _mm256_fmadd_ps(x1, y, c13);
        c23 = _mm256_fmadd_ps(x2, y, c23);
    }
    _mm_storeu_ps(c, hsum4(c00, c01, c02, c03));
    _mm_storeu_ps(c + ldc, hsum4(c10, c11, c12, c13));
    _mm_storeu_ps(c + 2 * ldc, hsum4(c20, c21, c22, c23));
}

/* 2 rows of a x 4 rows of b */
static inline void dot2x4(const float* a, long lda, const float* b, long ldb, long k,
                          float* c, long ldc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    const float *a0 = a, *a1 = a + lda;
    const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb, *b3 = b + 3 * ldb;
    for (long i = 0; i < k; i += 8) {
        __m256 x0 = _mm256_loadu_ps(a0 + i), x1 = _mm256_loadu_ps(a1 + i);
        __m256 y = _mm256_loadu_ps(b0 + i);
        c00 = _mm256_fmadd_ps(x0, y, c00); c10 = _mm256_fmadd_ps(x1, y, c10);
        y = _mm256_loadu_ps(b1 + i);
        c01 = _mm256_fmadd_ps(x0, y, c01); c11 = _mm256_fmadd_ps(x1, y, c11);
        y = _mm256_loadu_ps(b2 + i);
        c02 = _mm256_fmadd_ps(x0, y, c02); c12 = _mm256_fmadd_ps(x1, y, c12);
        y = _mm256_loadu_ps(b3 + i);
        c03 = _mm256_fmadd_ps(x0, y, c03); c13 = _mm256_fmadd_ps(x1, y, c13);
    }
    _mm_storeu_ps(c, hsum4(c00, c01, c02, c03));
    _mm_storeu_ps(c + ldc, hsum4(c10, c11, c12, c13));
}

/* 1 row of a x 4 rows of b */
static inline void dot1x4(const float* a, const float* b, long ldb, long k, float* c) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (long i = 0; i < k; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        c0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + i), c0);
        c1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + ldb + i), c1);
        c2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 2 * ldb + i), c2);
        c3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 3 * ldb + i), c3);
    }
    _mm_storeu_ps(c, hsum4(c0, c1, c2, c3));
}

static inline float dot1(const float* a, const float* b, long k) {
    __m256 c = _mm256_setzero_ps();
    for (long i = 0; i < k; i += 8)
        c = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c);
    return hsum(c);
}

/* c[m][n] (row stride ldc) = a[m][k] . b[n][k]^T: a, b rows contiguous with strides lda, ldb.
 * Each group of 4 rows of b is read from memory once and then served from L1 to every tile
 * of a; while a group's tiles compute, the group PREFETCH_GROUPS ahead (not past b_end) is
 * pulled into L2 a slice per tile, so the weight stream overlaps the arithmetic (19 rows:
 * 46 -> 37 ms for the default model's 210 linears, docs/BENCHMARKS.md). Into L2, not L1,
 * and 8 groups ahead (74 KB at k = 576): with 16 rows of a (37 KB) L1 cannot hold a
 * prefetched group until its turn; 16 x 576 x 50000: ~100 -> ~115 GFLOP/s, 4 rows ~+60%. */
#define PREFETCH_GROUPS 8

/* ---- the same tiles on 512-bit vectors (AVX-512F; chosen at run time, pl_wide) -------------- *
 * 16-lane accumulators along k, reduced to 8 lanes (low half + high half) and then as hsum4:
 * every (row, column) is summed in one fixed order whatever tile computes it, so a row's
 * results do not depend on how many rows a pass has (a request alone and in a batch get the
 * same numbers). Rows of a in tiles of 6 (24 accumulators: ~1.8x the 256-bit tiles' GFLOP/s
 * at 32-64 rows, ~1.5x at 16, the same at 1-3 where the weight stream bounds it). Taken for
 * k % 16 == 0 only, so the choice depends on the layer, never on the pass. */
#define WIDE __attribute__((target("avx512f")))
#define AIW static inline __attribute__((always_inline, target("avx512f")))

static int wide_tiles = 0;     /* pl_wide: the 512-bit tiles are on */

AIW __m256 half_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* R rows of a x 4 rows of b (R constant at each call: the accumulators stay in registers) */
AIW void tile_w(const int R, const float* a, long lda, const float* b, long ldb, long k,
                float* c, long ldc) {
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long i = 0; i < k; i += 16) {
        __m512 x[6];
        for (int r = 0; r < R; r++) x[r] = _mm512_loadu_ps(a + r * lda + i);
        for (int j = 0; j < 4; j++) {
            __m512 y = _mm512_loadu_ps(b + j * ldb + i);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(x[r], y, acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(c + r * ldc, hsum4(half_sum(acc[r][0]), half_sum(acc[r][1]),
                                         half_sum(acc[r][2]), half_sum(acc[r][3])));
}

WIDE static float dot1_w(const float* a, const float* b, long k) {
    __m512 c = _mm512_setzero_ps();
    for (long i = 0; i < k; i += 16)
        c = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c);
    return hsum(half_sum(c));
}

/* each tile size a function of its own: inlined into one loop with several sizes, GCC
 * spilled the 6-row tile's 24 accumulators to the stack in one of group_w's clones (the
 * quantized weights' path ran at 56 against 129 GFLOP/s) */
#define TILE_W(R) __attribute__((noinline, target("avx512f"))) \
    static void tile##R##_w(const float* a, long lda, const float* b, long ldb, long k, \
                            float* c, long ldc) { tile_w(R, a, lda, b, ldb, k, c, ldc); }
TILE_W(1) TILE_W(2) TILE_W(3) TILE_W(4) TILE_W(6)
#undef TILE_W

/* every row of a against one group of 4 rows of b; while the tiles compute, `ahead` (NULL:
 * nothing) is pulled into L2 a `slice` per tile, not past `end` (as dots) */
WIDE static void group_w(const float* a, long lda, long m, const float* b, long ldb, long k,
                         float* c, long ldc, const char* ahead, long slice, const char* end) {
    for (long i = 0; i < m; ) {
        if (ahead) {
            for (long o = 0; o < slice && ahead + o < end; o += 64)
                _mm_prefetch(ahead + o, _MM_HINT_T1);
            ahead += slice;
        }
        long left = m - i;
        if (left >= 6) { tile6_w(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc); i += 6; }
        else if (left >= 4) { tile4_w(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc); i += 4; }
        else if (left == 3) { tile3_w(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc); i += 3; }
        else if (left == 2) { tile2_w(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc); i += 2; }
        else { tile1_w(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc); i += 1; }
    }
}

WIDE static void dots_w(const float* a, long lda, long m, const float* b, long ldb, long n,
                        long k, float* c, long ldc, const float* b_end) {
    long tiles = (m + 5) / 6;
    long slice = (4 * ldb * (long)sizeof(float) / tiles + 63) & ~63L;
    long j = 0;
    for (; j + 4 <= n; j += 4)
        group_w(a, lda, m, b + j * ldb, ldb, k, c + j, ldc,
                (const char*)(b + (j + 4 * PREFETCH_GROUPS) * ldb), slice, (const char*)b_end);
    for (; j < n; j++)
        for (long i = 0; i < m; i++)
            c[i * ldc + j] = dot1_w(a + i * lda, b + j * ldb, k);
}

/* 1: the 512-bit tiles where the CPU (and its OS) has AVX-512F, 0: the 256-bit ones, -1: no
 * change; returns whether they are on */
int pl_wide(int on) {
    if (on >= 0)
        wide_tiles = on && __builtin_cpu_supports("avx512f");
    return wide_tiles;
}

static inline int use_wide(long k) { return wide_tiles && k % 16 == 0; }

static int group_shared = 1;   /* pl_group: rows of several requests over one stored unit, one task */
static long group_runs = 0;    /* attend_part calls attend_group made (pl_group_runs) */

/* 1: a batch's query rows over a unit that several of its requests read in place are computed
 * as one task (attend_group), 0: one task per request (the same numbers), -1: no change;
 * returns whether grouping is on */
int pl_group(int on) {
    if (on >= 0)
        group_shared = on != 0;
    return group_shared;
}

/* how many grouped attend_part calls have run in this process (for tests) */
long pl_group_runs(void) { return __atomic_load_n(&group_runs, __ATOMIC_RELAXED); }

static void dots(const float* a, long lda, long m, const float* b, long ldb, long n, long k,
                 float* c, long ldc, const float* b_end) {
    if (use_wide(k)) {
        dots_w(a, lda, m, b, ldb, n, k, c, ldc, b_end);
        return;
    }
    long tiles = (m + 2) / 3;
    long slice = (4 * ldb * (long)sizeof(float) / tiles + 63) & ~63L;
    const char* end = (const char*)b_end;
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        const char* ahead = (const char*)(b + (j + 4 * PREFETCH_GROUPS) * ldb);
        long i = 0, threes = m % 3 == 1 && m >= 4 ? m - 4 : m;   /* 3-row tiles, then 2s */
        for (; i < m; ahead += slice) {
            for (long o = 0; o < slice && ahead + o < end; o += 64)
                _mm_prefetch(ahead + o, _MM_HINT_T1);
            if (i + 3 <= threes) {
                dot3x4(a + i * lda, lda, b + j * ldb, ldb, k, c + i * ldc + j, ldc);
                i += 3;
            } else if (i + 2 <= m) {
                dot2x4(a + i * lda, lda, b + j * ldb, ldb, k, c + i * ldc + j, ldc);
                i += 2;
            } else {
                dot1x4(a + i * lda, b + j * ldb, ldb, k, c + i * ldc + j);
                i += 1;
            }
        }
    }
    for (; j < n; j++)
        for (long i = 0; i < m; i++)
            c[i * ldc + j] = dot1(a + i * lda, b + j * ldb, k);
}

#define LIN_BLOCK 16      /* weight rows per task: 16 x k floats stay hot while every x row uses them */

/* ---- Q4_1 weights, read as the GGUF stores them --------------------------------------------- *
 * A row of k weights is k / 32 blocks of 20 bytes: d and m (float16), then 16 bytes whose low
 * nibbles are the block's weights 0-15 and high nibbles 16-31; weight = d * q + m. The dot
 * tiles read each group of 4 weight rows dequantized into a float buffer in L1 (passes of 1-3
 * rows: made in registers, q4_tile_w), computed as gguf's dequantizer computes them (float32
 * multiply, then add: not fused), so the values are the float32 weights a converted model
 * holds, bit for bit, and a pass gives the float path's results exactly, reading ~6.4x fewer
 * weight bytes. */
#define Q4_BYTES 20           /* bytes per block of 32 */
#define Q4_MAX_K 8192
#define Q4_MAX_ROWS 3         /* passes of more rows take the float weights: for them the
                                 dequantizing costs more than the bytes it saves (measured:
                                 1-3 rows 1.3-1.7x faster a pass, 4-64 rows 0.92-1.0x) */
#define Q4_MAX_ROWS_WIDE 64   /* ... with the 512-bit tiles (dots_w; each tile size its own
                                 function), every pass up to 64 rows: the dequantizing then
                                 costs less than the weight bytes it saves (16 decode steps
                                 of the default model over ~1.3k-token contexts: 83.7 ->
                                 73.0 ms a step against the limit of 8; a 6.4k document's
                                 question pass 100 -> 90 ms) */

static __thread float q4_buf[4 * Q4_MAX_K];     /* one group of rows, per thread */

__attribute__((optimize("fp-contract=off")))
static void q4_row(const uint8_t* row, long k, float* dst) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (long b = 0; b < k / 32; b++, row += Q4_BYTES, dst += 32) {
        uint16_t hd, hm;
        memcpy(&hd, row, 2);
        memcpy(&hm, row + 2, 2);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(hd)), m = _mm256_set1_ps(_cvtsh_ss(hm));
        __m128i qs = _mm_loadu_si128((const __m128i*)(row + 4));
        __m128i lo = _mm_and_si128(qs, low), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_mul_ps(d, q0), m));
        _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_mul_ps(d, q1), m));
        _mm256_storeu_ps(dst + 16, _mm256_add_ps(_mm256_mul_ps(d, q2), m));
        _mm256_storeu_ps(dst + 24, _mm256_add_ps(_mm256_mul_ps(d, q3), m));
    }
}

/* Q8_0 (the default model's tied embedding and LM head): 34 bytes per block of 32, d
 * (float16) then 32 int8; weight = d * q (one float32 multiply: exact) */
#define Q8_BYTES 34

/* ---- K-quants and Q5_0, read as a GGUF stores them ------------------------------------------ *
 * Their row functions (kq_row8 and kq_row_w below) make the float32 weights of one row
 * exactly as gguf's reference dequantizer (gguf-py quants.py) computes them: the same
 * products in the same order, never fused (fp-contract=off), so a converted model's float
 * weights and these are the same bits. Kinds are ggml's type numbers: Q5_0 6, Q4_K 12, Q5_K
 * 13, Q6_K 14. */
#define Q5_0_BYTES 22         /* d (float16), 32 high bits, 16 bytes of low nibbles; 32 weights */
#define QK_K 256              /* weights per K-quant super-block */
#define Q4_K_BYTES 144        /* d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of nibbles */
#define Q5_K_BYTES 176        /* ... then 32 bytes of fifth bits before the nibbles */
#define Q6_K_BYTES 210        /* 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d */
#define KIND_Q5_0 6
#define KIND_Q4_K 12
#define KIND_Q5_K 13
#define KIND_Q6_K 14

/* the 6-bit scale and min of sub-block j (0-7) of a Q4_K/Q5_K super-block */
static inline void k_scale_min(const uint8_t* s, int j, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 0x3F);
        *mn = (float)(s[j + 4] & 0x3F);
    } else {
        *sc = (float)((s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
    }
}

/* d * scale and dmin * min of the 8 sub-blocks of a Q4_K or Q5_K super-block (its first 16
 * bytes: d, dmin, the packed scales and mins) */
static void k_sub_scales(const uint8_t* block, float* dj, float* mj) {
    uint16_t hd, hm;
    memcpy(&hd, block, 2);
    memcpy(&hm, block + 2, 2);
    float d = _cvtsh_ss(hd), dmin = _cvtsh_ss(hm);
    for (int j = 0; j < 8; j++) {
        float sc, mn;
        k_scale_min(block + 4, j, &sc, &mn);
        dj[j] = d * sc;
        mj[j] = dmin * mn;
    }
}

typedef void (*RowFn)(const uint8_t*, long, float*);

/* q4_row on 512-bit vectors (16 weights an instruction; the same operations, so the same
 * values bit for bit; Q8_0's is kq_row_w): the dequantizing bounds a 1-3 row pass, ~2x fewer
 * instructions than the 256-bit ones */
__attribute__((optimize("fp-contract=off"), target("avx512f")))
static void q4_row_w(const uint8_t* row, long k, float* dst) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (long b = 0; b < k / 32; b++, row += Q4_BYTES, dst += 32) {
        uint16_t hd, hm;
        memcpy(&hd, row, 2);
        memcpy(&hm, row + 2, 2);
        __m512 d = _mm512_set1_ps(_cvtsh_ss(hd)), m = _mm512_set1_ps(_cvtsh_ss(hm));
        __m128i qs = _mm_loadu_si128((const __m128i*)(row + 4));
        __m128i lo = _mm_and_si128(qs, low), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(d, q0), m));
        _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_mul_ps(d, q1), m));
    }
}

/* R rows of a x 4 Q4_1 rows of b (row stride `stride` bytes), each weight made in a register
 * and multiplied in where tile_w over q4_row_w's buffer multiplies it: the same bits, without
 * the buffer (a decode step's 1-3 rows: the dequantizing bounds them). A block's 32 weights
 * take 16 values, d * q + m for q = 0..15: one FMA makes them all (d * q is exact in float32 --
 * 11 bits times 4 -- so it rounds once, as q4_row_w's multiply-then-add does), and each
 * weight is the lane its nibble picks (vpermps reads an index's low 4 bits: the low nibble
 * as loaded, the high one after a shift). */
static inline __attribute__((always_inline, target("avx512f")))
void q4_tile_w(const int R, const float* a, long lda, const uint8_t* b, long stride, long k,
               float* c, long ldc) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long blk = 0; blk < k / 32; blk++) {
        __m512 x0[3], x1[3];
        for (int r = 0; r < R; r++) {
            x0[r] = _mm512_loadu_ps(a + r * lda + 32 * blk);
            x1[r] = _mm512_loadu_ps(a + r * lda + 32 * blk + 16);
        }
        for (int j = 0; j < 4; j++) {
            const uint8_t* q = b + j * stride + blk * Q4_BYTES;
            int halves;
            memcpy(&halves, q, 4);
            __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));             /* d, m */
            __m512 values = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), iota,
                                            _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
            __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 4)));
            __m512 w0 = _mm512_permutexvar_ps(e, values);
            __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), values);
            for (int r = 0; r < R; r++) {
                acc[r][j] = _mm512_fmadd_ps(x0[r], w0, acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(x1[r], w1, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(c + r * ldc, hsum4(half_sum(acc[r][0]), half_sum(acc[r][1]),
                                         half_sum(acc[r][2]), half_sum(acc[r][3])));
}

#define Q4_TILE_W(R) __attribute__((noinline, target("avx512f"))) \
    static void q4tile##R##_w(const float* a, long lda, const uint8_t* b, long stride, long k, \
                              float* c, long ldc) { q4_tile_w(R, a, lda, b, stride, k, c, ldc); }
Q4_TILE_W(1) Q4_TILE_W(2) Q4_TILE_W(3)
#undef Q4_TILE_W
#define Q4_FUSED_ROWS 3        /* passes of up to 3 rows take q4_tile_w */
static int q4_fused = 1;       /* pl_q4_fused(0): the buffer instead (to measure one against the other) */

int pl_q4_fused(int on) {
    if (on >= 0) q4_fused = on;
    return q4_fused;
}

/* ---- Q8_0, Q5_0 and K-quant tiles on 512-bit vectors ---------------------------------------- *
 * As q4_tile_w: each weight made in a register, 16 at a time in the row's order, and
 * multiplied in where tile_w over the float weights multiplies it, so a pass from the blocks
 * gives the float path's bits. Each value is the row function's:
 * - Q4_K, Q5_K: a table of a sub-block's 16 or 32 values, dj * q - mj for every q, made by one
 *   FMA (dj * q is exact in float32: an 11-bit d, a 6-bit scale and a 5-bit q, so the FMA
 *   rounds once, as the row's subtraction does), and each weight the lane its bits pick
 *   (vpermps reads an index's low 4 bits, vpermt2ps its low 5);
 * - Q5_0: the same with the table d * (q - 16), q = 0..31 (one multiply each, as the row);
 * - Q6_K: its 6-bit values put together 32 at a time with byte operations first, then
 *   converted and multiplied as the row does; Q8_0: converted and multiplied.
 * kq_row_w stores the same registers into a row (passes of more rows: the buffer and group_w).
 *
 * kq_prepare reads a block once (dj: d times each sub-block's scale; mj: dmin times its min;
 * vals: Q6_K's values, minus 32); kq_chunk makes weights [16 c, 16 c + 16) of the block. */
typedef struct {
    float dj[16], mj[8];
    uint32_t qh;
    int8_t vals[QK_K];
} KqBlock;

/* (256-bit operations only: the 256-bit tiles below take it too) */
static inline __attribute__((always_inline))
void kq_prepare(const int kind, const uint8_t* q, KqBlock* kb) {
    uint16_t hd;
    if (kind == KIND_Q4_K) {
        k_sub_scales(q, kb->dj, kb->mj);
    } else if (kind == KIND_Q5_K) {
        k_sub_scales(q, kb->dj, kb->mj);
        const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
        __m256i h = _mm256_loadu_si256((const __m256i*)(q + 16));
        for (int pair = 0; pair < 4; pair++) {
            __m256i l = _mm256_loadu_si256((const __m256i*)(q + 48 + 32 * pair));
            int s = 2 * pair;                  /* bits s and s + 1 of h -> bit 4 */
            __m256i h0 = s <= 4 ? _mm256_slli_epi16(h, 4 - s) : _mm256_srli_epi16(h, s - 4);
            __m256i h1 = s + 1 <= 4 ? _mm256_slli_epi16(h, 3 - s) : _mm256_srli_epi16(h, s - 3);
            _mm256_storeu_si256((__m256i*)(kb->vals + 64 * pair),
                                _mm256_or_si256(_mm256_and_si256(l, m4),
                                                _mm256_and_si256(h0, m10)));
            _mm256_storeu_si256((__m256i*)(kb->vals + 64 * pair + 32),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                                _mm256_and_si256(h1, m10)));
        }
    } else if (kind == KIND_Q6_K) {
        const int8_t* scales = (const int8_t*)(q + 192);
        memcpy(&hd, q + 208, 2);
        float d = _cvtsh_ss(hd);
        for (int c = 0; c < 16; c++)
            kb->dj[c] = d * (float)scales[c];
        const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30),
                      off = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i*)(q + 64 * half));
            __m256i l1 = _mm256_loadu_si256((const __m256i*)(q + 64 * half + 32));
            __m256i h = _mm256_loadu_si256((const __m256i*)(q + 128 + 32 * half));
            __m256i v[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_and_si256(h, m30));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
            for (int s = 0; s < 4; s++)
                _mm256_storeu_si256((__m256i*)(kb->vals + 128 * half + 32 * s),
                                    _mm256_sub_epi8(v[s], off));
        }
    } else {                                   /* Q8_0, Q5_0, Q4_1: d first */
        memcpy(&hd, q, 2);
        kb->dj[0] = _cvtsh_ss(hd);
        if (kind == KIND_Q5_0)
            memcpy(&kb->qh, q + 2, 4);
        if (kind == 4) {                       /* Q4_1: then m */
            memcpy(&hd, q + 2, 2);
            kb->mj[0] = _cvtsh_ss(hd);
        }
    }
}

AIW __m512 kq_chunk(const int kind, const uint8_t* q, const int c, const KqBlock* kb) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (kind == 8) {
        __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 2 + 16 * c)));
        return _mm512_mul_ps(_mm512_set1_ps(kb->dj[0]), _mm512_cvtepi32_ps(v));
    }
    if (kind == KIND_Q6_K) {
        __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(kb->vals + 16 * c)));
        return _mm512_mul_ps(_mm512_set1_ps(kb->dj[c]), _mm512_cvtepi32_ps(v));
    }
    if (kind == KIND_Q5_0) {
        __m512 d = _mm512_set1_ps(kb->dj[0]);
        __m512 low = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f)));
        __m512 high = _mm512_mul_ps(d, iota);
        __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 6)));
        e = c ? _mm512_srli_epi32(e, 4) : _mm512_and_si512(e, _mm512_set1_epi32(0x0F));
        __mmask16 fifth = (__mmask16)(kb->qh >> (16 * c));
        e = _mm512_mask_or_epi32(e, fifth, e, _mm512_set1_epi32(16));
        return _mm512_permutex2var_ps(low, e, high);
    }
    const int s = c >> 1;                             /* Q4_K, Q5_K: sub-block s */
    __m512 dj = _mm512_set1_ps(kb->dj[s]), mj = _mm512_set1_ps(kb->mj[s]);
    __m512 low = _mm512_fmsub_ps(dj, iota, mj);
    if (kind == KIND_Q5_K) {
        __m512 high = _mm512_fmsub_ps(dj, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), mj);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(kb->vals + 16 * c)));
        return _mm512_permutex2var_ps(low, v, high);
    }
    const uint8_t* qs = q + 16 + 32 * (s >> 1) + 16 * (c & 1);
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    if (s & 1)
        e = _mm512_srli_epi32(e, 4);
    return _mm512_permutexvar_ps(e, low);
}

/* weights per block and bytes per block of a kq kind */
static inline long kq_per(int kind) {
    return kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K ? QK_K : 32;
}

static inline long kq_bytes(int kind) {
    switch (kind) {
    case 4: return Q4_BYTES;
    case 8: return Q8_BYTES;
    case KIND_Q5_0: return Q5_0_BYTES;
    case KIND_Q4_K: return Q4_K_BYTES;
    case KIND_Q5_K: return Q5_K_BYTES;
    default: return Q6_K_BYTES;
    }
}

/* R rows of a x 4 rows of b (blocks of `kind`, row stride `stride` bytes), as q4_tile_w */
AIW void kq_tile_w(const int R, const int kind, const float* a, long lda, const uint8_t* b,
                   long stride, long k, float* c, long ldc) {
    const long per = kq_per(kind), bytes = kq_bytes(kind);
    __m512 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    KqBlock kb[4];
    for (long blk = 0; blk < k / per; blk++) {
        for (int j = 0; j < 4; j++)
            kq_prepare(kind, b + j * stride + blk * bytes, &kb[j]);
        for (int ch = 0; ch < per / 16; ch++) {          /* the 4 rows' sums side by side */
            __m512 x[3];
            for (int r = 0; r < R; r++)
                x[r] = _mm512_loadu_ps(a + r * lda + blk * per + 16 * ch);
            for (int j = 0; j < 4; j++) {
                __m512 w = kq_chunk(kind, b + j * stride + blk * bytes, ch, &kb[j]);
                for (int r = 0; r < R; r++)
                    acc[r][j] = _mm512_fmadd_ps(x[r], w, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(c + r * ldc, hsum4(half_sum(acc[r][0]), half_sum(acc[r][1]),
                                         half_sum(acc[r][2]), half_sum(acc[r][3])));
}

/* one row of k weights of `kind` into dst, from the same registers */
AIW void kq_row_w(const int kind, const uint8_t* row, long k, float* dst) {
    const long per = kq_per(kind), bytes = kq_bytes(kind);
    for (long blk = 0; blk < k / per; blk++, row += bytes, dst += per) {
        KqBlock kb;
        kq_prepare(kind, row, &kb);
        for (int ch = 0; ch < per / 16; ch++)
            _mm512_storeu_ps(dst + 16 * ch, kq_chunk(kind, row, ch, &kb));
    }
}

/* one kind's tile functions of 1, 2 and 3 rows, NAME_tileR##SUFFIX, each TILE(R, KIND, ...)
 * compiled with ATTR (both widths below) */
#define KQ_TILE_SET(ATTR, TILE, SUFFIX, KIND, NAME) \
    ATTR static void NAME##_tile1##SUFFIX(const float* a, long lda, const uint8_t* b, \
                                          long stride, long k, float* c, long ldc) { \
        TILE(1, KIND, a, lda, b, stride, k, c, ldc); \
    } \
    ATTR static void NAME##_tile2##SUFFIX(const float* a, long lda, const uint8_t* b, \
                                          long stride, long k, float* c, long ldc) { \
        TILE(2, KIND, a, lda, b, stride, k, c, ldc); \
    } \
    ATTR static void NAME##_tile3##SUFFIX(const float* a, long lda, const uint8_t* b, \
                                          long stride, long k, float* c, long ldc) { \
        TILE(3, KIND, a, lda, b, stride, k, c, ldc); \
    }
#define KQ_FN __attribute__((noinline, optimize("fp-contract=off"), target("avx512f")))
#define KQ_TILES(KIND, NAME) \
    KQ_TILE_SET(KQ_FN, kq_tile_w, _w, KIND, NAME) \
    KQ_FN static void NAME##_row_w(const uint8_t* row, long k, float* dst) { \
        kq_row_w(KIND, row, k, dst); \
    }
__attribute__((noinline, target("avx512f")))
static void q8_row_w(const uint8_t* row, long k, float* dst) { kq_row_w(8, row, k, dst); }
KQ_TILES(KIND_Q5_0, q5_0) KQ_TILES(KIND_Q4_K, q4k) KQ_TILES(KIND_Q5_K, q5k)
KQ_TILES(KIND_Q6_K, q6k)
#undef KQ_TILES
#undef KQ_FN

typedef void (*TileFn)(const float*, long, const uint8_t*, long, long, float*, long);

/* the 512-bit row function of a kind and its tiles of 1, 2 and 3 rows (tiles[0..2], NULL where
 * the kind takes the buffer: Q8_0's few multiplies made the tiles no faster than the buffer
 * and group_w); 0 for a kind without them (Q4_1 has q4_tile_w's) */
static int kq_wide(int kind, TileFn* tiles, RowFn* row) {
    switch (kind) {
    case 8: tiles[0] = NULL; *row = q8_row_w; return 1;
#define KQ_CASE(KIND, NAME) case KIND: tiles[0] = NAME##_tile1_w; tiles[1] = NAME##_tile2_w; \
        tiles[2] = NAME##_tile3_w; *row = NAME##_row_w; return 1;
    KQ_CASE(KIND_Q5_0, q5_0) KQ_CASE(KIND_Q4_K, q4k) KQ_CASE(KIND_Q5_K, q5k)
    KQ_CASE(KIND_Q6_K, q6k)
#undef KQ_CASE
    default: return 0;
    }
}

/* ---- Q4_1, Q8_0, Q5_0 and K-quant tiles on 256-bit vectors (every CPU the kernels run on) -- *
 * As the 512-bit ones, 8 weights at a time in the row's order, each multiplied in where the
 * 256-bit dot tiles (dot1x4, dot2x4, dot3x4) multiply the float weight: the same lanes, the
 * same order along k, so a pass from the blocks gives the float path's bits. Each weight is
 * computed as the reference dequantizer computes it, with no table: Q4_1 d * q + m, Q4_K and
 * Q5_K dj * q - mj (d * q and dj * q are exact in float32, so the addition rounds once, fused
 * or not), Q5_0 d * (q - 16) (q - 16 put together as bytes first, q5_0_values), Q6_K dj * q
 * (kq_prepare's values), Q8_0 d * q. kq_row8 stores the same registers into a row: the row
 * functions of these kinds but Q4_1 (q4_row; the buffer of a pass of more rows,
 * pl_q_dequant). */
/* Q5_0's 32 values q - 16 as int8 into kb->vals (byte operations, as kq_prepare's Q5_K):
 * weight e takes the low (e < 16) or high nibble of qs[e % 16] and bit e of qh */
static inline __attribute__((always_inline))
void q5_0_values(const uint8_t* q, KqBlock* kb) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i qs = _mm_loadu_si128((const __m128i*)(q + 6));
    __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4),
                                       _mm_and_si128(qs, m4));
    /* byte e gets byte e / 8 of qh, then keeps bit e % 8 of it as 0x10 */
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)kb->qh),
                                         _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0,
                                                          1, 1, 1, 1, 1, 1, 1, 1,
                                                          2, 2, 2, 2, 2, 2, 2, 2,
                                                          3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                     _mm256_set1_epi8(0x10));
    _mm256_storeu_si256((__m256i*)kb->vals,
                        _mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), _mm256_set1_epi8(16)));
}

static inline __attribute__((always_inline))
__m256 kq_chunk8(const int kind, const uint8_t* q, const int c, const KqBlock* kb) {
    if (kind == 8) {
        __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 2 + 8 * c)));
        return _mm256_mul_ps(_mm256_set1_ps(kb->dj[0]), _mm256_cvtepi32_ps(v));
    }
    if (kind == KIND_Q6_K || kind == KIND_Q5_0) {    /* the prepared values */
        __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(kb->vals + 8 * c)));
        return _mm256_mul_ps(_mm256_set1_ps(kb->dj[kind == KIND_Q6_K ? c >> 1 : 0]),
                             _mm256_cvtepi32_ps(v));
    }
    if (kind == 4) {                           /* Q4_1: d * q + m (d * q exact) */
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 4 + 8 * (c & 1))));
        v = c >= 2 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
        return _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(kb->dj[0]), _mm256_cvtepi32_ps(v)),
                             _mm256_set1_ps(kb->mj[0]));
    }
    const int s = c >> 2;                     /* Q4_K, Q5_K: sub-block s (32 weights) */
    __m256i v;
    if (kind == KIND_Q5_K) {
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(kb->vals + 8 * c)));
    } else {
        const uint8_t* qs = q + 16 + 32 * (s >> 1) + 8 * (c & 3);
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
        v = s & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
    }
    return _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(kb->dj[s]), _mm256_cvtepi32_ps(v)),
                         _mm256_set1_ps(kb->mj[s]));
}

/* R rows of a x 4 rows of b (blocks of `kind`, row stride `stride` bytes), as dotRx4 */
static inline __attribute__((always_inline))
void kq_tile8(const int R, const int kind, const float* a, long lda, const uint8_t* b,
              long stride, long k, float* c, long ldc) {
    const long per = kq_per(kind), bytes = kq_bytes(kind);
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    KqBlock kb[4];
    for (long blk = 0; blk < k / per; blk++) {
        for (int j = 0; j < 4; j++) {
            kq_prepare(kind, b + j * stride + blk * bytes, &kb[j]);
            if (kind == KIND_Q5_0)
                q5_0_values(b + j * stride + blk * bytes, &kb[j]);
        }
        for (int ch = 0; ch < per / 8; ch++) {
            __m256 x[3];
            for (int r = 0; r < R; r++)
                x[r] = _mm256_loadu_ps(a + r * lda + blk * per + 8 * ch);
            for (int j = 0; j < 4; j++) {
                __m256 w = kq_chunk8(kind, b + j * stride + blk * bytes, ch, &kb[j]);
                for (int r = 0; r < R; r++)
                    acc[r][j] = _mm256_fmadd_ps(x[r], w, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(c + r * ldc, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* one row of k weights of `kind` into dst, from the same registers */
static inline __attribute__((always_inline))
void kq_row8(const int kind, const uint8_t* row, long k, float* dst) {
    const long per = kq_per(kind), bytes = kq_bytes(kind);
    for (long blk = 0; blk < k / per; blk++, row += bytes, dst += per) {
        KqBlock kb;
        kq_prepare(kind, row, &kb);
        if (kind == KIND_Q5_0)
            q5_0_values(row, &kb);
        for (int ch = 0; ch < per / 8; ch++)
            _mm256_storeu_ps(dst + 8 * ch, kq_chunk8(kind, row, ch, &kb));
    }
}

#define KQ_FN __attribute__((noinline, optimize("fp-contract=off")))
#define KQ_TILES(KIND, NAME) KQ_TILE_SET(KQ_FN, kq_tile8, , KIND, NAME)
#define KQ_ROW(KIND, NAME) \
    KQ_FN static void NAME##_row(const uint8_t* row, long k, float* dst) { \
        kq_row8(KIND, row, k, dst); \
    }
KQ_TILES(4, q4_1) KQ_TILES(8, q8_0) KQ_TILES(KIND_Q5_0, q5_0) KQ_TILES(KIND_Q4_K, q4k)
KQ_TILES(KIND_Q5_K, q5k) KQ_TILES(KIND_Q6_K, q6k)
KQ_ROW(8, q8_0) KQ_ROW(KIND_Q5_0, q5_0) KQ_ROW(KIND_Q4_K, q4k) KQ_ROW(KIND_Q5_K, q5k)
KQ_ROW(KIND_Q6_K, q6k)         /* Q4_1's row: q4_row */
#undef KQ_ROW
#undef KQ_TILES
#undef KQ_FN
#undef KQ_TILE_SET

/* the 256-bit tiles of 1, 2 and 3 rows of a kind (tiles[0..2]); 0 for a kind without them */
static int kq_narrow(int kind, TileFn* tiles) {
    switch (kind) {
#define KQ_CASE(KIND, NAME) case KIND: tiles[0] = NAME##_tile1; tiles[1] = NAME##_tile2; \
        tiles[2] = NAME##_tile3; return 1;
    KQ_CASE(4, q4_1) KQ_CASE(8, q8_0) KQ_CASE(KIND_Q5_0, q5_0) KQ_CASE(KIND_Q4_K, q4k) KQ_CASE(KIND_Q5_K, q5k)
    KQ_CASE(KIND_Q6_K, q6k)
#undef KQ_CASE
    default: return 0;
    }
}

/* The row function of a kind (4: Q4_1, 8: Q8_0, and ggml's numbers for Q5_0 and the
 * K-quants), NULL for another; *stride: the bytes of a row of k weights, k a multiple of the
 * kind's block (32, or 256 for the K-quants). */
static RowFn kind_row(int kind, long k, long* stride) {
    switch (kind) {
    case 4: *stride = k / 32 * Q4_BYTES; return q4_row;
    case 8: *stride = k / 32 * Q8_BYTES; return q8_0_row;
    case KIND_Q5_0: *stride = k / 32 * Q5_0_BYTES; return q5_0_row;
    case KIND_Q4_K: *stride = k / QK_K * Q4_K_BYTES; return q4k_row;
    case KIND_Q5_K: *stride = k / QK_K * Q5_K_BYTES; return q5k_row;
    case KIND_Q6_K: *stride = k / QK_K * Q6_K_BYTES; return q6k_row;
    default: *stride = 0; return NULL;
    }
}

/* the weights in one block of a kind_row kind */
static long kind_block(int kind) {
    return kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K ? QK_K : 32;
}

/* out[r][0:k] = the weights of rows [0, rows) of blocks w of `kind` (kind_row): for tests and
 * checks. Returns 0, or -1 for an unknown kind. */
int pl_q_dequant(const uint8_t* w, long rows, long k, int kind, float* out) {
    long stride;
    RowFn row = kind_row(kind, k, &stride);
    if (!row)
        return -1;
    TileFn tiles[3];
    if (use_wide(k) && kind == 4)
        row = q4_row_w;                 /* the same values from 512-bit registers */
    else if (use_wide(k))
        kq_wide(kind, tiles, &row);
    #pragma omp parallel for schedule(static) if (rows * k >= (1L << 20))
    for (long r = 0; r < rows; r++)
        row(w + r * stride, k, out + r * k);
    return 0;
}

/* dots with b as quantized rows (`row` dequantizes one; row stride `stride` bytes): the same
 * tiles, in the same order, over each group of 4 rows dequantized into this thread's buffer */
static void dots_q(const float* a, long lda, long m, const uint8_t* b, long n, long k,
                   float* c, long ldc, int kind, RowFn row, long stride) {
    float* buf = q4_buf;
    int w = use_wide(k);
    TileFn tiles[3] = {NULL, NULL, NULL};
    if (w && kind == 4) {
        row = q4_row_w;
        tiles[0] = q4tile1_w;
        tiles[1] = q4tile2_w;
        tiles[2] = q4tile3_w;
    } else if (w && !kq_wide(kind, tiles, &row)) {
        tiles[0] = NULL;
    } else if (!w && !kq_narrow(kind, tiles)) {
        tiles[0] = NULL;
    }
    long j = 0;
    if (tiles[0] && q4_fused && m >= 1 && m <= Q4_FUSED_ROWS)
        for (; j + 4 <= n; j += 4) {
            if (j + 8 <= n)
                for (long o = 0; o < 4 * stride; o += 64)
                    _mm_prefetch((const char*)(b + (j + 4) * stride + o), _MM_HINT_T0);
            tiles[m - 1](a, lda, b + j * stride, stride, k, c + j, ldc);
        }
    for (; j + 4 <= n; j += 4) {
        for (long r = 0; r < 4; r++) row(b + (j + r) * stride, k, buf + r * k);
        if (j + 8 <= n)
            for (long o = 0; o < 4 * stride; o += 64)
                _mm_prefetch((const char*)(b + (j + 4) * stride + o), _MM_HINT_T0);
        if (w)
            group_w(a, lda, m, buf, k, k, c + j, ldc, NULL, 0, NULL);
        else            /* dots' tiles (written out here, they ran several times slower) */
            dots(a, lda, m, buf, k, 4, k, c + j, ldc, buf + 4 * k);
    }
    for (; j < n; j++) {
        row(b + j * stride, k, buf);
        for (long i = 0; i < m; i++)
            c[i * ldc + j] = w ? dot1_w(a + i * lda, buf, k) : dot1(a + i * lda, buf, k);
    }
}

/* y[m][n] = x[m][k] . w^T for rows w of blocks of `kind` (kind_row; k <= Q4_MAX_K): a linear
 * layer from the GGUF's own blocks, the same tiles over the same values as the float weights'.
 * Returns 0, or -1 for an unknown kind. */
int pl_linear_q(const float* x, long m, long k, const uint8_t* w, long n, float* y, int kind,
                int threads) {
    long stride;
    RowFn row = kind_row(kind, k, &stride);
    if (!row)
        return -1;
    long tasks = (n + LIN_BLOCK - 1) / LIN_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        long j0 = t * LIN_BLOCK, j1 = j0 + LIN_BLOCK < n ? j0 + LIN_BLOCK : n;
        dots_q(x, k, m, w + j0 * stride, j1 - j0, k, y + j0, n, kind, row, stride);
    }
    return 0;
}

/* y[m][n] = x[m][k] . w^T for Q8_0 rows w (k % 32 == 0, k <= Q4_MAX_K): the LM head of a
 * decode step from the GGUF's own blocks */
void pl_linear_q8(const float* x, long m, long k, const uint8_t* w, long n, float* y,
                  int threads) {
    pl_linear_q(x, m, k, w, n, y, 8, threads);
}

/* columns [j0, j1) of y (row stride ldy) = x[m][k] . w[n][k]^T (+ bias) */
static void linear_cols(const float* x, long m, long k, const float* w, long n, const float* bias,
                        long j0, long j1, float* y, long ldy) {
    dots(x, k, m, w + j0 * k, k, j1 - j0, k, y + j0, ldy, w + n * k);
    if (bias)
        for (long i = 0; i < m; i++)
            for (long j = j0; j < j1; j++) y[i * ldy + j] += bias[j];
}


void pl_linear(const float* x, long m, long k, const float* w, long n, const float* bias,
               float* y, int threads) {
    long tasks = (n + LIN_BLOCK - 1) / LIN_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        long j0 = t * LIN_BLOCK, j1 = j0 + LIN_BLOCK < n ? j0 + LIN_BLOCK : n;
        linear_cols(x, m, k, w, n, bias, j0, j1, y, n);
    }
}

/* ---- attention ----------------------------------------------------------------------------- *
 * Scores are kept in base 2 (the queries are scaled by log2(e) as well as 1/sqrt(d)), so the
 * softmax takes exp2_neg directly. */

/* ---- int8 weights x 12-bit inputs (opt-in, approximate; AVX512_VNNI or AVX2) ---------------- *
 * Kind I8_KIND weights (fused.py attach_int8, int8_rows) are one buffer per linear layer: n x k
 * int8 (each output row quantized with its own scale: w = s_w[j] * q), then s_w ([n] float).
 * The int8 values of the first n16 = n - n % 16 rows lie in panels of 16 rows, k-pairs
 * interleaved ([n16 / 16][k / 2][16][2]: a 512-bit vpdpwssd then takes 16 output columns'
 * next two weights at once, against one input pair broadcast), the other rows plain
 * ([n % 16][k]). Each
 * pass quantizes every input row t with its own scale to 12 bits (s_x[t] = max|x| / 2047,
 * q = round(x / s_x), held as int16), and vpdpwssd sums the products, 32 a cycle against
 * float32 FMAs' 16: y[t][j] = s_x[t] * s_w[j] * sum_i q_x q_w. (8-bit inputs, vpdpbusd's 64,
 * moved the default model's next-token distribution ~15x more: outlier channels take a
 * row's scale; docs/BENCHMARKS.md, *int8 linear layers*.) The sums are integers, exact in
 * any order: a row's results do not depend on the other rows of its pass (a request alone
 * and in a batch get the same numbers). k % 64 == 0 and k <= Q4_MAX_K (|sum| <= 2047 * 127 *
 * 8192 < 2^31). Without AVX512_VNNI (or with the 512-bit tiles off) the same integers come
 * from AVX2's vpmaddwd, 8 output columns a register: the same numbers, bit for bit. */
#define I8_KIND 1
#define X_MAX 2047
#define VNNI __attribute__((noinline, target("avx512f,avx512bw,avx512vnni")))
#define AIV static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vnni")))

static int vnni_ok = -1;     /* the CPU has AVX512_VNNI (and F, BW): checked once */
int pl_bf16_products(void);

/* which products the CPU can take: kind 16, bfloat16 (AVX512_BF16); kind 8, the int8 weights'
 * (every CPU the kernels run on: AVX512_VNNI's tiles, else AVX2's) */
int pl_products(int kind) {
    if (kind == 16) return pl_bf16_products();
    return kind == 8;
}

/* whether the int8 sums take the 512-bit VNNI tiles (else the 256-bit ones) */
int pl_vnni(void) {
    if (vnni_ok < 0)
        vnni_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("avx512vnni");
    return vnni_ok && wide_tiles;
}

/* u[0:k] = x[0:k] quantized to 12 bits, s = its scale (0 for a zero row); 16 lanes at a
 * time (max |x| ignores a NaN, as fmaxf does; rounding to nearest even, as nearbyintf) */
VNNI static void quantize_row_w(const float* x, long k, int16_t* u, float* s) {
    __m512 vm = _mm512_setzero_ps();
    long i = 0;
    for (; i + 16 <= k; i += 16) vm = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vm);
    float m = _mm512_reduce_max_ps(vm);
    for (long t = i; t < k; t++) m = fmaxf(m, fabsf(x[t]));
    float inv = m > 0.f ? (float)X_MAX / m : 0.f;
    *s = m / (float)X_MAX;
    __m512 vi = _mm512_set1_ps(inv);
    for (i = 0; i + 16 <= k; i += 16)
        _mm256_storeu_si256((__m256i*)(u + i), _mm512_cvtsepi32_epi16(
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vi))));
    for (; i < k; i++) u[i] = (int16_t)nearbyintf(x[i] * inv);
}

/* quantize_row_w on 256-bit vectors: the same maximum, products and rounding, so the same
 * u and s */
static void quantize_row8(const float* x, long k, int16_t* u, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vm = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= k; i += 16) {
        vm = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), vm);
        vm = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8)), vm);
    }
    float m = hmax(vm);
    for (long t = i; t < k; t++) m = fmaxf(m, fabsf(x[t]));
    float inv = m > 0.f ? (float)X_MAX / m : 0.f;
    *s = m / (float)X_MAX;
    __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 16 <= k; i += 16) {
        __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi));
        __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vi));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256((__m256i*)(u + i), packed);
    }
    for (; i < k; i++) u[i] = (int16_t)nearbyintf(x[i] * inv);
}

static void quantize_row(const float* x, long k, int16_t* u, float* s) {
    if (pl_vnni())
        quantize_row_w(x, k, u, s);
    else
        quantize_row8(x, k, u, s);
}

/* R rows of u x one panel (16 weight rows, k-pairs interleaved): the integer sums of each
 * row, 16 lanes (the panel's rows), into y (row stride ldy) scaled by s_x[r] * s_w[lane].
 * Fewer than 6 rows keep U sums each (k-pairs taken in turns, added at the end), so that
 * the products do not wait on one another (one sum: a 1-row pass 1.5x slower) */
AIV void panel_i8(const int R, const int16_t* u, long ldu, const int8_t* q, long k,
                  const float* sx, const float* sw, float* y, long ldy) {
    const int U = R < 3 ? 4 : R < 6 ? 2 : 1;           /* k % 64 == 0: k / 2 pairs % 4 == 0 */
    __m512i acc[4][12];
    for (int v = 0; v < U; v++)
        for (int r = 0; r < R; r++) acc[v][r] = _mm512_setzero_si512();
    for (long i = 0; i < k; i += 2 * U)
        for (int v = 0; v < U; v++) {
            __m512i w = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256((const __m256i*)(q + (i + 2 * v) * 16)));
            for (int r = 0; r < R; r++) {
                int32_t pair;                         /* two int16 inputs, one broadcast */
                memcpy(&pair, u + r * ldu + i + 2 * v, sizeof pair);
                acc[v][r] = _mm512_dpwssd_epi32(acc[v][r], w, _mm512_set1_epi32(pair));
            }
        }
    for (int v = 1; v < U; v++)
        for (int r = 0; r < R; r++) acc[0][r] = _mm512_add_epi32(acc[0][r], acc[v][r]);
    __m512 vs = _mm512_loadu_ps(sw);
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * ldy, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[0][r]),
                                                    _mm512_mul_ps(_mm512_set1_ps(sx[r]), vs)));
}

#define PANEL_I8(R) VNNI static void panel##R##_i8(const int16_t* u, long ldu, const int8_t* q, \
        long k, const float* sx, const float* sw, float* y, long ldy) { \
    panel_i8(R, u, ldu, q, k, sx, sw, y, ldy); }
PANEL_I8(1) PANEL_I8(2) PANEL_I8(3) PANEL_I8(4) PANEL_I8(5) PANEL_I8(6)
PANEL_I8(7) PANEL_I8(8) PANEL_I8(9) PANEL_I8(10) PANEL_I8(11) PANEL_I8(12)
#undef PANEL_I8

/* sum_i u[i] q[i] over k (k % 32 == 0): a plain int8 row (the rows after the panels) */
VNNI static int32_t dot_i8(const int16_t* u, const int8_t* q, long k) {
    __m512i acc = _mm512_setzero_si512();
    for (long i = 0; i < k; i += 32)
        acc = _mm512_dpwssd_epi32(acc, _mm512_loadu_si512((const void*)(u + i)),
                                  _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + i))));
    return _mm512_reduce_add_epi32(acc);
}

/* panel_i8 on 256-bit vectors: each 16-weight-row step in two registers (the panel's rows
 * 0-7 and 8-15), vpmaddwd then an add where vpdpwssd does both; R <= 6 rows of u */
static inline __attribute__((always_inline))
void panel_i8n(const int R, const int16_t* u, long ldu, const int8_t* q, long k,
               const float* sx, const float* sw, float* y, long ldy) {
    const int U = R < 2 ? 4 : R < 4 ? 2 : 1;            /* k % 64 == 0: k / 2 pairs % 4 == 0 */
    __m256i acc[4][6][2];
    for (int v = 0; v < U; v++)
        for (int r = 0; r < R; r++) acc[v][r][0] = acc[v][r][1] = _mm256_setzero_si256();
    for (long i = 0; i < k; i += 2 * U)
        for (int v = 0; v < U; v++) {
            const int8_t* p = q + (i + 2 * v) * 16;
            __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
            __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
            for (int r = 0; r < R; r++) {
                int32_t pair;                         /* two int16 inputs, one broadcast */
                memcpy(&pair, u + r * ldu + i + 2 * v, sizeof pair);
                __m256i x = _mm256_set1_epi32(pair);
                acc[v][r][0] = _mm256_add_epi32(acc[v][r][0], _mm256_madd_epi16(w0, x));
                acc[v][r][1] = _mm256_add_epi32(acc[v][r][1], _mm256_madd_epi16(w1, x));
            }
        }
    for (int v = 1; v < U; v++)
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                acc[0][r][h] = _mm256_add_epi32(acc[0][r][h], acc[v][r][h]);
    for (int h = 0; h < 2; h++) {
        __m256 vs = _mm256_loadu_ps(sw + 8 * h);
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + r * ldy + 8 * h,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(acc[0][r][h]),
                                           _mm256_mul_ps(_mm256_set1_ps(sx[r]), vs)));
    }
}

#define PANEL8_I8(R) __attribute__((noinline)) static void panel##R##_i8n(const int16_t* u, \
        long ldu, const int8_t* q, long k, const float* sx, const float* sw, float* y, \
        long ldy) { panel_i8n(R, u, ldu, q, k, sx, sw, y, ldy); }
PANEL8_I8(1) PANEL8_I8(2) PANEL8_I8(3) PANEL8_I8(4) PANEL8_I8(5) PANEL8_I8(6)
#undef PANEL8_I8

/* dot_i8 on 256-bit vectors */
static int32_t dot8_i8(const int16_t* u, const int8_t* q, long k) {
    __m256i acc = _mm256_setzero_si256();
    for (long i = 0; i < k; i += 16)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(
            _mm256_loadu_si256((const __m256i*)(u + i)),
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + i)))));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* columns [j0, j1) of y (row stride ldy) = the m quantized rows (u, s_x) . the I8_KIND weight
 * buffer wq of n rows of k: whole panels 12 input rows at a time, the plain rows after them
 * one sum each (the same integers: exact in any order). j0 is a multiple of 16, and j1 too
 * or n (the pass's column blocks: LIN_BLOCK), so a range never cuts a panel. */
_Static_assert(LIN_BLOCK % 16 == 0, "linear_i8 takes whole panels of 16 rows");
static void linear_i8(const int16_t* u, const float* sx, long m, long k, const uint8_t* wq,
                      long n, long j0, long j1, float* y, long ldy) {
    const int8_t* q = (const int8_t*)wq;
    const float* sw = (const float*)(wq + n * k);
    const int wide = pl_vnni();
    const long most = wide ? 12 : 6;         /* input rows a panel call takes */
    long n16 = n - n % 16, j = j0;
    for (; j < j1 && j < n16; j += 16) {
        const int8_t* panel = q + j * k;
        for (long i = 0; i < m; ) {
            long R = m - i < most ? m - i : most;
            const int16_t* ui = u + i * k;
            float* yi = y + i * ldy + j;
            if (wide) {
                switch (R) {
#define P(n_) case n_: panel##n_##_i8(ui, k, panel, k, sx + i, sw + j, yi, ldy); break;
                    P(1) P(2) P(3) P(4) P(5) P(6) P(7) P(8) P(9) P(10) P(11) P(12)
#undef P
                }
            } else {
                switch (R) {
#define P(n_) case n_: panel##n_##_i8n(ui, k, panel, k, sx + i, sw + j, yi, ldy); break;
                    P(1) P(2) P(3) P(4) P(5) P(6)
#undef P
                }
            }
            i += R;
        }
    }
    for (; j < j1; j++)                  /* the plain rows after the last whole panel */
        for (long i = 0; i < m; i++) {
            const int8_t* row = q + n16 * k + (j - n16) * k;
            int32_t sum = wide ? dot_i8(u + i * k, row, k) : dot8_i8(u + i * k, row, k);
            y[i * ldy + j] = (float)sum * (sx[i] * sw[j]);
        }
}

/* y[m][n] = x[m][k] . the I8_KIND weights wq (n rows)^T, one thread: linear_i8 alone (tests);
 * 0, -1 where the CPU or k cannot take it, -2 when out of memory */
int pl_linear_i8(const float* x, long m, long k, const uint8_t* wq, long n, float* y) {
    if (!pl_products(8) || k % 64 || k > Q4_MAX_K || m <= 0)
        return -1;
    int16_t* u = (int16_t*)malloc(sizeof(int16_t) * m * k);
    float* sx = (float*)malloc(sizeof(float) * m);
    if (!u || !sx) { free(u); free(sx); return -2; }
    for (long i = 0; i < m; i++) quantize_row(x + i * k, k, u + i * k, sx + i);
    linear_i8(u, sx, m, k, wq, n, 0, n, y, n);
    free(u); free(sx);
    return 0;
}

#define BK 128         /* keys per block */
#define MAXR 64        /* query rows per task */
#define MAXD 256
#define AI static inline __attribute__((always_inline))

/* kt[c][j] = k[j][c] for j < nk (rows of d floats), zero for nk <= j < BK; d % 8 == 0 */
static void transpose_block(const float* k, long nk, long d, float* kt) {
    long j = 0;
    for (; j + 8 <= nk; j += 8)
        for (long c = 0; c < d; c += 8) {
            __m256 r0 = _mm256_loadu_ps(k + (j + 0) * d + c), r1 = _mm256_loadu_ps(k + (j + 1) * d + c),
                   r2 = _mm256_loadu_ps(k + (j + 2) * d + c), r3 = _mm256_loadu_ps(k + (j + 3) * d + c),
                   r4 = _mm256_loadu_ps(k + (j + 4) * d + c), r5 = _mm256_loadu_ps(k + (j + 5) * d + c),
                   r6 = _mm256_loadu_ps(k + (j + 6) * d + c), r7 = _mm256_loadu_ps(k + (j + 7) * d + c);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                   t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                   t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                   t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                   u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                   u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                   u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float* o = kt + c * BK + j;
            _mm256_storeu_ps(o + 0 * BK, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * BK, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * BK, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * BK, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * BK, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * BK, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * BK, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * BK, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    for (; j < nk; j++)
        for (long c = 0; c < d; c++) kt[c * BK + j] = k[j * d + c];
    for (long c = 0; c < d; c++)
        for (long jj = nk; jj < ((nk + 15) & ~15L); jj++) kt[c * BK + jj] = 0.f;
}

/* s[r][j0:j0+16] = sum_c q[r][c] kt[c][j0:j0+16], NR rows */
AI void qk_tile(const int NR, const float* q, long d, const float* kt, float* s) {
    __m256 a[6][2];
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (long c = 0; c < d; c++) {
        __m256 k0 = _mm256_load_ps(kt + c * BK), k1 = _mm256_load_ps(kt + c * BK + 8);
        for (int r = 0; r < NR; r++) {
            __m256 b = _mm256_broadcast_ss(q + r * d + c);
            a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_store_ps(s + r * BK, a[r][0]);
        _mm256_store_ps(s + r * BK + 8, a[r][1]);
    }
}

/* acc[r][c0:c0+32] += sum_j p[r][j] v[j][c0:c0+32], NR rows */
AI void pv_tile(const int NR, const float* p, long nk, const float* v, long d, float* acc) {
    __m256 a[3][4];
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < 4; u++) a[r][u] = _mm256_loadu_ps(acc + r * d + 8 * u);
    for (long j = 0; j < nk; j++) {
        const float* vj = v + j * d;
        __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8),
               v2 = _mm256_loadu_ps(vj + 16), v3 = _mm256_loadu_ps(vj + 24);
        for (int r = 0; r < NR; r++) {
            __m256 b = _mm256_broadcast_ss(p + r * BK + j);
            a[r][0] = _mm256_fmadd_ps(b, v0, a[r][0]); a[r][1] = _mm256_fmadd_ps(b, v1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(b, v2, a[r][2]); a[r][3] = _mm256_fmadd_ps(b, v3, a[r][3]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(acc + r * d + 8 * u, a[r][u]);
}

/* The same two tiles on 512-bit vectors (pl_wide): each lane does what a 256-bit lane does
 * (the same multiply-adds in the same order), so the scores and outputs are the same bit for
 * bit; twice the keys (QK) or rows (PV) per loaded vector. Not inlined into attend_part
 * (which stays 256-bit code): one call per tile of hundreds of instructions. */
AIW void qk_tile_w(const int NR, const int C, const float* q, long d, const float* kt,
                   float* s) {
    __m512 a[6][2];
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (long c = 0; c < d; c++) {
        __m512 k0 = _mm512_loadu_ps(kt + c * BK);
        __m512 k1 = C > 1 ? _mm512_loadu_ps(kt + c * BK + 16) : k0;
        for (int r = 0; r < NR; r++) {
            __m512 b = _mm512_set1_ps(q[r * d + c]);
            a[r][0] = _mm512_fmadd_ps(b, k0, a[r][0]);
            if (C > 1) a[r][1] = _mm512_fmadd_ps(b, k1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(s + r * BK, a[r][0]);
        if (C > 1) _mm512_storeu_ps(s + r * BK + 16, a[r][1]);
    }
}

/* s[r][0:16 * cols16] for nr (<= 6) rows: qk_tile for 16 or 32 keys */
WIDE static void qk_w(long nr, int cols16, const float* q, long d, const float* kt, float* s) {
    #define QK(n) case n: if (cols16 > 1) qk_tile_w(n, 2, q, d, kt, s); \
                          else qk_tile_w(n, 1, q, d, kt, s); break;
    switch (nr) { QK(1) QK(2) QK(3) QK(4) QK(5) QK(6) }
    #undef QK
}

AIW void pv_tile_w(const int NR, const float* p, long nk, const float* v, long d, float* acc) {
    __m512 a[6][2];
    for (int r = 0; r < NR; r++) {
        a[r][0] = _mm512_loadu_ps(acc + r * d);
        a[r][1] = _mm512_loadu_ps(acc + r * d + 16);
    }
    for (long j = 0; j < nk; j++) {
        __m512 v0 = _mm512_loadu_ps(v + j * d), v1 = _mm512_loadu_ps(v + j * d + 16);
        for (int r = 0; r < NR; r++) {
            __m512 b = _mm512_set1_ps(p[r * BK + j]);
            a[r][0] = _mm512_fmadd_ps(b, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(b, v1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(acc + r * d, a[r][0]);
        _mm512_storeu_ps(acc + r * d + 16, a[r][1]);
    }
}

/* acc[r][c0:c0+32] += ... for nr (<= 6) rows over the first nk keys: pv_tile */
WIDE static void pv_w(long nr, const float* p, long nk, const float* v, long d, float* acc) {
    #define PV(n) case n: pv_tile_w(n, p, nk, v, d, acc); break;
    switch (nr) { PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) }
    #undef PV
}

/* acc[r][c0:c0+8] += ..., one row, for d % 32 != 0 */
static void pv_col8(const float* p, long nk, const float* v, long d, float* acc) {
    __m256 a = _mm256_loadu_ps(acc);
    for (long j = 0; j < nk; j++)
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * d), a);
    _mm256_storeu_ps(acc, a);
}

typedef struct {           /* memory to prefetch in equal slices, one per call of pull() */
    const char *at, *end;
    long slice;
} Ahead;

static inline Ahead ahead(const char* from, long bytes, long calls) {
    Ahead a = {from, from + (bytes > 0 ? bytes : 0), 0};
    a.slice = calls > 0 ? ((a.end - a.at) / calls + 63) & ~63L : 0;
    return a;
}

static inline void pull(Ahead* a) {
    const char* stop = a->at + a->slice < a->end ? a->at + a->slice : a->end;
    for (; a->at < stop; a->at += 64) _mm_prefetch(a->at, _MM_HINT_T0);
}

typedef struct {           /* one task's rows over its key range, before normalisation */
    float *m, *l, *acc;    /* [rows], [rows], [rows][d] */
} Partial;

/* nr rows of p: nothing seen yet */
static void partial_reset(Partial* p, long nr, long d) {
    for (long r = 0; r < nr; r++) { p->m[r] = -INFINITY; p->l[r] = 0.f; }
    memset(p->acc, 0, sizeof(float) * nr * d);
}

/* 16-bit kinds of a segment (the `half` flags; 0 is float32) */
enum { HALF_BF16 = 1, HALF_FP16 = 2 };

/* ---- a decode step's few rows (pl_few): scores straight from the key rows ---- *
 * A decode step has 1-3 query rows per KV head (the group of query heads sharing it) and
 * reads every key and value of the past once: too few rows to pay for transposing each block
 * of keys (and, for a 16-bit store, widening it into a buffer first: both measured as most of
 * the step). Here a key's values are multiplied along d with each row's (16 lanes of partial
 * sums per row and key), and 8 keys' partials are folded into 8 scores by a shuffle tree;
 * values are read the same way, straight from the store. 16-bit rows are widened in
 * registers. The sums run in another order than the transposed tiles' (a lane holds dims
 * c, c+16, ...), so a row's numbers in a step of this path differ from the same row's in a
 * pass of more rows by float rounding; a request's rows take the same path alone or in a batch. */
static int few_rows = 1;       /* pl_few(0): the transposed tiles for every row count (to measure) */

int pl_few(int on) {
    if (on >= 0) few_rows = on != 0;
    return few_rows;
}

/* 16 values from element i of 16-bit `kind` (or float32) rows, as floats */
AIW __m512 load16(const char* base, long i, int kind) {
    if (kind == HALF_FP16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i)));
    if (kind == HALF_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i))), 16));
    return _mm512_loadu_ps((const float*)base + i);
}

/* the lane sums of a[0..7], in order */
AIW __m256 fold8(const __m512* a) {
    __m512 b[4];
    for (int i = 0; i < 4; i++)     /* [a_2i, a_2i+1]: 8 partials each */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    /* 128-bit lane i: key i's 4 partials (c0), key 4 + i's (c1) */
    __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
    __m512 g = _mm512_add_ps(e, _mm512_permute_ps(e, 0x4E));   /* lane 4i: key i, 4i + 1: key 4 + i */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, g));
}

/* The lines of [at, at + bytes) STREAM_AHEAD bytes further on, pulled into L2: the few-rows
 * path reads the store from memory as one stream per thread, and the hardware's prefetcher
 * alone keeps ~24 GB/s of it in flight on this machine's two cores against ~35 with these
 * (decode-shaped attention over 6.4k float32 keys, 30 layers: 12 -> 7.7 ms; float16 7.3 ->
 * 4.4 ms; T0 hints or 16-32 KB ahead measured slower). Beyond a segment's end they touch
 * nothing (a prefetch never faults). */
#define STREAM_AHEAD 8192
AIW void ahead_l2(const char* at, long bytes) {
    for (long o = 0; o < bytes; o += 64) _mm_prefetch(at + STREAM_AHEAD + o, _MM_HINT_T1);
}

/* s[r][j0:j0+8] = q[r] . key j for NR rows, keys j0 .. j0 + jn - 1 (jn <= 8; the rest 0) */
AIW void qk_few8(const int NR, const float* q, long d, const char* k, long j0, const int jn,
                 int kind, float* s) {
    long es = kind ? 2 : 4;
    __m512 a[3][8];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();
    ahead_l2(k + j0 * d * es, jn * d * es);
    for (long c = 0; c < d; c += 16)
        for (int j = 0; j < jn; j++) {
            __m512 kv = load16(k, (j0 + j) * d + c, kind);
            for (int r = 0; r < NR; r++)
                a[r][j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + r * d + c), a[r][j]);
        }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(s + r * BK + j0, fold8(a[r]));
}

/* s[r][0:nk8] = q[r] . key j for NR rows over nk keys (rows of d values, d % 16 == 0); the
 * scores of keys nk <= j < nk8 are 0 */
AIW void qk_few_t(const int NR, const float* q, long d, const char* k, long nk, int kind, float* s) {
    long j0 = 0;
    for (; j0 + 8 <= nk; j0 += 8) qk_few8(NR, q, d, k, j0, 8, kind, s);
    if (j0 < nk) qk_few8(NR, q, d, k, j0, (int)(nk - j0), kind, s);
}

/* acc[r][c0:c0+16U] += sum_{j < n} p[r][j] v[j][c0:c0+16U] for NR rows */
AIW void pv_few_t(const int NR, const int U, const float* p, long n, const char* v, long d,
                  long c0, int kind, float* acc) {
    __m512 a[3][4];
    long es = kind ? 2 : 4;
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < U; u++) a[r][u] = _mm512_loadu_ps(acc + r * d + c0 + 16 * u);
    for (long j = 0; j < n; j++) {
        __m512 vv[4];
        if (c0 == 0) ahead_l2(v + j * d * es, d * es);
        for (int u = 0; u < U; u++) vv[u] = load16(v, j * d + c0 + 16 * u, kind);
        for (int r = 0; r < NR; r++) {
            __m512 b = _mm512_set1_ps(p[r * BK + j]);
            for (int u = 0; u < U; u++) a[r][u] = _mm512_fmadd_ps(b, vv[u], a[r][u]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < U; u++) _mm512_storeu_ps(acc + r * d + c0 + 16 * u, a[r][u]);
}

WIDE static void qk_few(long nr, const float* q, long d, const char* k, long nk, int kind, float* s) {
    #define QK(n) case n: if (kind == HALF_FP16) qk_few_t(n, q, d, k, nk, HALF_FP16, s); \
                          else if (kind == HALF_BF16) qk_few_t(n, q, d, k, nk, HALF_BF16, s); \
                          else qk_few_t(n, q, d, k, nk, 0, s); break;
    switch (nr) { QK(1) QK(2) QK(3) }
    #undef QK
}

AIW void pv_few_k(const int NR, const int U, const float* p, long n, const char* v, long d,
                  long c0, int kind, float* acc) {
    if (kind == HALF_FP16) pv_few_t(NR, U, p, n, v, d, c0, HALF_FP16, acc);
    else if (kind == HALF_BF16) pv_few_t(NR, U, p, n, v, d, c0, HALF_BF16, acc);
    else pv_few_t(NR, U, p, n, v, d, c0, 0, acc);
}

/* acc[r][0:d] += sum_{j < n} p[r][j] v[j] for nr (<= 3) rows, 64 columns at a time (d % 16 == 0) */
WIDE static void pv_few(long nr, const float* p, long n, const char* v, long d, int kind, float* acc) {
    for (long c0 = 0; c0 < d; c0 += 64) {
        int u = d - c0 >= 64 ? 4 : (int)(d - c0) / 16;
        #define PV(n_, u_) case 4 * n_ + u_: pv_few_k(n_, u_, p, n, v, d, c0, kind, acc); break;
        switch (4 * nr + u) {
            PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
            PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4)
        }
        #undef PV
    }
}

/* dst[i] = src[i] for n 16-bit values (n % 8 == 0): bfloat16 (a float's upper half) or
 * IEEE half precision (F16C) */
static void widen16(const uint16_t* src, long n, int kind, float* dst) {
    if (kind == HALF_FP16) {
        for (long i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
        return;
    }
    for (long i = 0; i < n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
}

/* ---- attention with bfloat16 products (pl_decoder's `bf`; AVX512_BF16, chosen per model) ---- *
 * Q.K and P.V with both sides rounded to bfloat16 (round to nearest even) and float32 sums:
 * vdpbf16ps does two products a lane an instruction, twice the float32 FMA rate on this
 * machine's cores. An approximation of the float32 attention (the error of bf16 inputs, as
 * llama.cpp's 16-bit KQ), so a model opts in (fast/fused.py `bf16_attention`). A row's
 * numbers do not depend on the rows in its tile, but P is rounded after its key range's
 * running maximum, and a batch decides the ranges: batched and alone differ at bf16
 * rounding. Pairs: a 32-bit word holds two bf16 values,
 * the unit vdpbf16ps multiplies: q pairs run along d, K blocks are transposed as 32-bit
 * words (kt[c][j] = key j's values 2c and 2c+1), V rows are interleaved in pairs of keys
 * (vt[j][c] = keys 2j and 2j+1 at column c) and p pairs run along the keys. */
#define BF __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AIB static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

static int bf16_ok = -1;       /* the CPU has AVX512_BF16 and AVX512BW (checked once) */

int pl_bf16_products(void) {
    if (bf16_ok < 0)
        bf16_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("avx512bf16");
    return bf16_ok;
}

/* dst[0:n] = src[0:n] rounded to bfloat16 (n % 32 == 0) */
BF static void to_bf16(const float* src, long n, uint16_t* dst) {
    for (long i = 0; i < n; i += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
        _mm512_storeu_si512((void*)(dst + i), (__m512i)v);
    }
}

/* vt[j][0:d] = the pairs (v[2j][c], v[2j+1][c]) for rows of d bf16 (d % 32 == 0), j <
 * (nk + 1) / 2: a zero row after an odd nk */
BF static void pair_rows(const uint16_t* v, long nk, long d, uint32_t* vt) {
    uint16_t lo[32], hi[32];
    for (int i = 0; i < 16; i++) {
        lo[2 * i] = i; lo[2 * i + 1] = 32 + i;
        hi[2 * i] = 16 + i; hi[2 * i + 1] = 48 + i;
    }
    __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
    for (long j = 0; j < nk; j += 2)
        for (long c = 0; c < d; c += 32) {
            __m512i x = _mm512_loadu_si512(v + j * d + c);
            __m512i y = j + 1 < nk ? _mm512_loadu_si512(v + (j + 1) * d + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (j / 2) * d + c, _mm512_permutex2var_epi16(x, ilo, y));
            _mm512_storeu_si512(vt + (j / 2) * d + c + 16, _mm512_permutex2var_epi16(x, ihi, y));
        }
}

/* s[r][0:16 C] = sum_c q pair . kt[c][0:16 C], NR rows (q: rows of d2 pairs) */
AIB void qk_tile_bf(const int NR, const int C, const uint32_t* q, long d2, const uint32_t* kt,
                    float* s) {
    __m512 a[6][2];
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (long c = 0; c < d2; c++) {
        __m512i k0 = _mm512_loadu_si512(kt + c * BK);
        __m512i k1 = C > 1 ? _mm512_loadu_si512(kt + c * BK + 16) : k0;
        for (int r = 0; r < NR; r++) {
            __m512i b = _mm512_set1_epi32((int)q[r * d2 + c]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)b, (__m512bh)k0);
            if (C > 1) a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)b, (__m512bh)k1);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(s + r * BK, a[r][0]);
        if (C > 1) _mm512_storeu_ps(s + r * BK + 16, a[r][1]);
    }
}

BF static void qk_bf(long nr, int cols16, const uint32_t* q, long d2, const uint32_t* kt,
                     float* s) {
    #define QK(n) case n: if (cols16 > 1) qk_tile_bf(n, 2, q, d2, kt, s); \
                          else qk_tile_bf(n, 1, q, d2, kt, s); break;
    switch (nr) { QK(1) QK(2) QK(3) QK(4) QK(5) QK(6) }
    #undef QK
}

/* acc[r][0:32] += sum_j p pair (row r: BK / 2 pairs) . vt[j][0:32] over n2 key pairs */
AIB void pv_tile_bf(const int NR, const uint32_t* p, long n2, const uint32_t* vt, long d,
                    float* acc) {
    __m512 a[6][2];
    for (int r = 0; r < NR; r++) {
        a[r][0] = _mm512_loadu_ps(acc + r * d);
        a[r][1] = _mm512_loadu_ps(acc + r * d + 16);
    }
    for (long j = 0; j < n2; j++) {
        __m512i v0 = _mm512_loadu_si512(vt + j * d), v1 = _mm512_loadu_si512(vt + j * d + 16);
        for (int r = 0; r < NR; r++) {
            __m512i b = _mm512_set1_epi32((int)p[r * (BK / 2) + j]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)b, (__m512bh)v0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)b, (__m512bh)v1);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(acc + r * d, a[r][0]);
        _mm512_storeu_ps(acc + r * d + 16, a[r][1]);
    }
}

BF static void pv_bf(long nr, const uint32_t* p, long n2, const uint32_t* vt, long d,
                     float* acc) {
    #define PV(n) case n: pv_tile_bf(n, p, n2, vt, d, acc); break;
    switch (nr) { PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) }
    #undef PV
}

/* a block's nk rows of d values (float32, or 16-bit `kind`) as bf16 rows: `src` itself where
 * it already is bf16, else converted into t16 (fp16 through `wide`) */
BF static const uint16_t* block_bf16(const char* src, long nk, long d, int kind, float* wide,
                                     uint16_t* t16) {
    if (kind == HALF_BF16) return (const uint16_t*)src;
    if (kind == HALF_FP16) {
        widen16((const uint16_t*)src, nk * d, kind, wide);
        src = (const char*)wide;
    }
    to_bf16((const float*)src, nk * d, t16);
    return t16;
}

/* Rows [r0, r1) (nr <= MAXR) of one KV head against keys [a, b) of the concatenated segments:
 * unnormalised output, running max and sum into *part. qs: the rows, pre-scaled. Segment g
 * holds float32 keys/values, or 16-bit ones where half && half[g] (HALF_BF16, HALF_FP16;
 * widened a block at a time, in cache). kpos (NULL: every key visible): the position of each
 * key of the non-causal segments, concatenated; row r then sees key j only where
 * kpos[j] <= qpos[r % qlen] (recomputed tokens among the new ones: they see the past before
 * them). A causal segment holds the qlen new tokens: row r sees its keys j <= r % qlen.
 * Blocks and 16-key tiles that no row of theirs sees are skipped.
 * ctx (NULL: none): APE's context segments (ctx[g] != 0), whose scores are multiplied by invt
 * (1 / temperature) and summed into *cpart instead of *part (recompute policy "ape"). */
static void attend_part(const float* qs, long r0, long nr, long d, long nseg,
                        const char* const* keys, const char* const* values, const long* lens,
                        const int* causal, const int* half, const int64_t* kpos,
                        const int64_t* qpos, long qlen, long a, long b, Partial* part,
                        const int* ctx, float invt, Partial* cpart, int bf) {
    float s[MAXR * BK] __attribute__((aligned(32)));
    float kt[MAXD * BK] __attribute__((aligned(32)));
    float wide[MAXD * BK] __attribute__((aligned(32)));
    uint16_t t16[MAXD * BK];                        /* bf: a block's rows as bf16 */
    uint32_t qh[MAXR * MAXD / 2], ph[MAXR * BK / 2];  /* bf: q and p rows as bf16 pairs */
    /* the 512-bit QK/PV tiles (the same numbers) where they pay: a decode step's few rows
     * are bound by the keys' and values' memory stream, and measured slower on them */
    bf = bf && d % 32 == 0;
    int wt = wide_tiles && nr > 6;
    int few = wide_tiles && few_rows && !bf && nr <= 3 && d % 16 == 0;
    for (long r = 0; bf && r < nr; r++)
        to_bf16(qs + r * d, d, (uint16_t*)(qh + r * (d / 2)));
    partial_reset(part, nr, d);
    if (ctx) partial_reset(cpart, nr, d);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t qp[MAXR], qmax = INT64_MIN;                      /* each row's query position */
    if (kpos)
        for (long r = 0; r < nr; r++) {
            qp[r] = qpos[(r0 + r) % qlen];
            qmax = qp[r] > qmax ? qp[r] : qmax;
        }
    long base = 0;
    for (long g = 0; g < nseg; base += lens[g], g++) {
        long lo = a > base ? a - base : 0, hi = b - base < lens[g] ? b - base : lens[g];
        long es = half && half[g] ? 2 : 4;                   /* bytes per element */
        const int64_t* kp = kpos && !causal[g] ? kpos + base : NULL;
        int context = ctx && ctx[g];                         /* APE: a context segment */
        Partial* into = context ? cpart : part;
        float *m = into->m, *l = into->l, *acc = into->acc;
        for (long j0 = lo; j0 < hi; j0 += BK) {
            long nk = hi - j0 < BK ? hi - j0 : BK;
            long nk16 = (nk + 15) & ~15L;
            int64_t tmin[BK / 16];                           /* lowest key position per tile */
            if (kp) {
                int64_t bmin = INT64_MAX;
                for (long t = 0; t < nk16 / 16; t++) {
                    int64_t lo16 = INT64_MAX;
                    for (long j = t * 16; j < t * 16 + 16 && j < nk; j++)
                        lo16 = kp[j0 + j] < lo16 ? kp[j0 + j] : lo16;
                    tmin[t] = lo16;
                    bmin = lo16 < bmin ? lo16 : bmin;
                }
                if (bmin > qmax) continue;                   /* no row sees this block */
            }
            /* the next block's keys and values, pulled into the cache a slice per tile while
             * this block computes (hides the memory stream: 94 -> 85 ms at 6.4k keys); the
             * few-rows path streams its own (ahead_l2) */
            long next = few ? 0 : hi - (j0 + BK) < BK ? hi - (j0 + BK) : BK;
            Ahead kahead = ahead(keys[g] + (j0 + BK) * d * es, next * d * es,
                                 (nk16 / 16) * ((nr + 5) / 6));
            Ahead vahead = ahead(values[g] + (j0 + BK) * d * es, next * d * es,
                                 (d / 32) * ((nr + 2) / 3));
            const float* vb = NULL;
            int kind = es == 2 ? half[g] : 0;
            if (few) {                                /* straight from the store */
                qk_few(nr, qs, d, keys[g] + j0 * d * es, nk, kind, s);
            } else if (bf)                                  /* bf16 pairs of keys */
                transpose_block((const float*)block_bf16(keys[g] + j0 * d * es, nk, d,
                                                         es == 2 ? half[g] : 0, wide, t16),
                                nk, d / 2, kt);
            else if (es == 2) {
                widen16((const uint16_t*)(keys[g] + j0 * d * es), nk * d, half[g], wide);
                transpose_block(wide, nk, d, kt);
            } else
                transpose_block((const float*)(keys[g] + j0 * d * es), nk, d, kt);
            if (few) {
            } else if (bf)                         /* bf16 pairs of value rows */
                pair_rows(block_bf16(values[g] + j0 * d * es, nk, d, es == 2 ? half[g] : 0,
                                     wide, t16), nk, d, (uint32_t*)wide);
            else if (es == 2) {
                widen16((const uint16_t*)(values[g] + j0 * d * es), nk * d, half[g], wide);
                vb = wide;
            } else
                vb = (const float*)(values[g] + j0 * d * es);
            for (long jb = 0; !few && (wt || bf) && jb < nk16; jb += 32) {   /* 512-bit: 32 keys */
                int cols16 = nk16 - jb >= 32 ? 2 : 1;
                int64_t lo32 = 0;                            /* the tile's lowest position */
                if (kp)
                    lo32 = cols16 > 1 && tmin[jb / 16 + 1] < tmin[jb / 16] ? tmin[jb / 16 + 1]
                                                                           : tmin[jb / 16];
                for (long r = 0; r < nr; r += 6) {
                    long rows = nr - r < 6 ? nr - r : 6;
                    pull(&kahead);
                    if (cols16 > 1) pull(&kahead);
                    if (kp) {              /* rows that see none of the tile's keys: skipped */
                        int n = 0;
                        for (long i = 0; i < rows; i++) n += lo32 <= qp[r + i];
                        if (n == 0) continue;               /* scores masked below, never read */
                    }
                    if (bf)                  /* bf16 pairs: kt holds d / 2 rows of pairs */
                        qk_bf(rows, cols16, qh + r * (d / 2), d / 2, (const uint32_t*)kt + jb,
                              s + r * BK + jb);
                    else
                        qk_w(rows, cols16, qs + r * d, d, kt + jb, s + r * BK + jb);
                }
            }
            for (long jb = 0; !few && !wt && !bf && jb < nk16; jb += 16) {
                long r = 0;
                for (; r + 6 <= nr; r += 6) {
                    pull(&kahead);
                    if (kp) {              /* rows that see none of the tile's keys: skipped */
                        int n = 0;
                        for (int i = 0; i < 6; i++) n += tmin[jb / 16] <= qp[r + i];
                        if (n == 0) continue;               /* scores masked below, never read */
                    }
                    qk_tile(6, qs + r * d, d, kt + jb, s + r * BK + jb);
                }
                if (r < nr) pull(&kahead);       /* a decode step's 3 rows: this pull only */
                switch (nr - r) {
                    case 1: qk_tile(1, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 2: qk_tile(2, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 3: qk_tile(3, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 4: qk_tile(4, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 5: qk_tile(5, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                }
            }
            if (context) {                 /* the contexts' temperature: scores / T */
                __m256 vt = _mm256_set1_ps(invt);
                for (long r = 0; r < nr; r++)
                    for (long j = 0; j < nk16; j += 8)
                        _mm256_store_ps(s + r * BK + j, _mm256_mul_ps(vt, _mm256_load_ps(s + r * BK + j)));
            }
            long nk8 = (nk + 7) & ~7L;
            long visr[MAXR];               /* each row's keys [0, visr) hold every one it sees */
            for (long r = 0; r < nr; r++) {
                float* sr = s + r * BK;
                long vis = nk;
                if (causal[g]) {           /* new-token block: row sees keys j <= its token */
                    long t = (r0 + r) % qlen - j0;
                    vis = t + 1 < 0 ? 0 : (t + 1 < nk ? t + 1 : nk);
                } else if (kp) {           /* keys positioned after the row's token */
                    long last = 0;
                    for (long j = 0; j < nk; j++) {
                        if (kp[j0 + j] > qp[r]) sr[j] = -INFINITY;
                        else last = j + 1;
                    }
                    vis = last;
                }
                long vis8 = (vis + 7) & ~7L;
                visr[r] = vis;
                for (long j = vis; j < vis8; j++) sr[j] = -INFINITY;
                for (long j = vis8; j < nk8; j++) sr[j] = 0.f;      /* never weighed */
                if (vis == 0) continue;
                __m256 vmx = ninf;
                for (long j = 0; j < vis8; j += 8) vmx = _mm256_max_ps(vmx, _mm256_load_ps(sr + j));
                float mx = hmax(vmx);
                float mn = mx > m[r] ? mx : m[r];
                float corr = exp2f(m[r] - mn);
                __m256 sum = _mm256_setzero_ps(), vm = _mm256_set1_ps(mn);
                for (long j = 0; j < vis8; j += 8) {
                    __m256 e = exp2_neg(_mm256_sub_ps(_mm256_load_ps(sr + j), vm));
                    _mm256_store_ps(sr + j, e);
                    sum = _mm256_add_ps(sum, e);
                }
                l[r] = l[r] * corr + hsum(sum);
                m[r] = mn;
                if (corr != 1.f) {
                    __m256 vc = _mm256_set1_ps(corr);
                    for (long c = 0; c < d; c += 8)
                        _mm256_storeu_ps(acc + r * d + c,
                                         _mm256_mul_ps(vc, _mm256_loadu_ps(acc + r * d + c)));
                }
            }
            /* values only up to the last key a tile's rows see (the rest weigh 0) */
            for (long r = 0; bf && r < nr; r++)
                to_bf16(s + r * BK, (nk + 31) & ~31L, (uint16_t*)(ph + r * (BK / 2)));
            if (few) {
                long n = 0;
                for (long r = 0; r < nr; r++) n = visr[r] > n ? visr[r] : n;
                if (n) pv_few(nr, s, n, values[g] + j0 * d * es, d, kind, acc);
            }
            for (long c = 0; bf && c < d; c += 32)
                for (long r = 0; r < nr; r += 6) {
                    long rows = nr - r < 6 ? nr - r : 6, n = 0;
                    pull(&vahead);
                    if (rows > 3) pull(&vahead);
                    for (long i = 0; i < rows; i++) n = visr[r + i] > n ? visr[r + i] : n;
                    if (n) pv_bf(rows, ph + r * (BK / 2), (n + 1) / 2, (const uint32_t*)wide + c,
                                 d, acc + r * d + c);
                }
            for (long c = 0; !few && wt && !bf && c + 32 <= d; c += 32)
                for (long r = 0; r < nr; r += 6) {
                    long rows = nr - r < 6 ? nr - r : 6, n = 0;
                    pull(&vahead);
                    if (rows > 3) pull(&vahead);
                    for (long i = 0; i < rows; i++) n = visr[r + i] > n ? visr[r + i] : n;
                    if (n) pv_w(rows, s + r * BK, n, vb + c, d, acc + r * d + c);
                }
            for (long c = 0; !few && !wt && !bf && c + 32 <= d; c += 32) {
                long r = 0;
                for (; r + 3 <= nr; r += 3) {
                    pull(&vahead);
                    long n = visr[r] > visr[r + 1] ? visr[r] : visr[r + 1];
                    n = visr[r + 2] > n ? visr[r + 2] : n;
                    if (n) pv_tile(3, s + r * BK, n, vb + c, d, acc + r * d + c);
                }
                if (nr - r == 2) {
                    long n = visr[r] > visr[r + 1] ? visr[r] : visr[r + 1];
                    if (n) pv_tile(2, s + r * BK, n, vb + c, d, acc + r * d + c);
                }
                if (nr - r == 1 && visr[r])
                    pv_tile(1, s + r * BK, visr[r], vb + c, d, acc + r * d + c);
            }
            for (long c = d & ~31L; !few && c < d; c += 8)
                for (long r = 0; r < nr; r++)
                    if (visr[r]) pv_col8(s + r * BK, visr[r], vb + c, d, acc + r * d + c);
        }
    }
}

/* How the attention of one layer is cut into tasks. The query rows of a KV head are grouped by
 * request: request i has the tokens tok[i] .. tok[i+1] (n_i of them) and groups * n_i rows,
 * head-major (its local row r is query head r / n_i of the group at token tok[i] + r % n_i),
 * and sees its own past segments seg[i] .. seg[i+1] and its own new tokens only. A unit is
 * (KV head, request, block of at most MAXR of its rows); a task is a unit over a range of its
 * request's keys, enough tasks for every thread to have two. So a request's keys are read
 * once per KV head for all of its rows, and a batch of requests never computes a score that
 * is masked out.
 *
 * Segments that several requests of a batch read in place (a stored unit: the same memory and
 * length) are tasks of their own, and the tasks of one KV head over one such segment run one
 * after another on one thread (a chain of at most CHAIN): the segment's keys and values, read
 * from memory by the first, are still in that core's cache for the others (~0.15 MB per KV
 * head and layer for a 300-token document of the default model). So the step reads each
 * shared module about once, not once per request that holds it -- the paper's batched
 * serving over shared modules. Task order within a unit stays by key range (merge_row). */
#define CHAIN 16

typedef struct {
    long heads, groups, rows, d, nreq, units, tasks, per_rows, chains;
    const long *tok, *seg;
    long *u_head, *u_req, *u_r0, *u_r1, *u_task;     /* per unit; u_task: its first task */
    long *t_unit, *t_a, *t_b;                        /* per task: unit, key range */
    long *run;                                       /* the tasks in the order threads take them */
    long *c_task;                                    /* per chain: its first place in run */
    long *c_shared;                                  /* per chain: 1 if its tasks all read one
                                                        shared segment whole (attend_group) */
    long *t_seg;                                     /* per task: its shared segment, or -1 */
    long *koff;                                      /* per request: past keys before its own */
    long *mem;
} Plan;

static void plan_free(Plan* p) { free(p->mem); p->mem = NULL; }

typedef struct { uintptr_t at; long len, g, req; } SegKey;

static int segkey_cmp(const void* x, const void* y) {
    const SegKey *a = (const SegKey*)x, *b = (const SegKey*)y;
    if (a->at != b->at) return a->at < b->at ? -1 : 1;
    if (a->len != b->len) return a->len < b->len ? -1 : 1;
    return a->g < b->g ? -1 : (a->g > b->g);
}

/* sid[g] = the number of the memory segment g reads when another request reads it too, else
 * -1 (first: NULL, or each segment's memory); returns how many such memories there are, or
 * -1 when out of memory */
static long shared_segments(long nreq, const long* seg, const long* lens, const void* const* first,
                            long* sid) {
    long nseg = seg[nreq], groups = 0;
    for (long g = 0; g < nseg; g++) sid[g] = -1;
    if (!first || nreq < 2 || nseg < 2) return 0;
    SegKey* keys = (SegKey*)malloc(sizeof(SegKey) * nseg);
    if (!keys) return -1;
    for (long i = 0; i < nreq; i++)
        for (long g = seg[i]; g < seg[i + 1]; g++)
            keys[g] = (SegKey){(uintptr_t)first[g], lens[g], g, i};
    qsort(keys, nseg, sizeof(SegKey), segkey_cmp);
    for (long a = 0, b; a < nseg; a = b) {
        int others = 0;
        for (b = a + 1; b < nseg && keys[b].at == keys[a].at && keys[b].len == keys[a].len; b++)
            others |= keys[b].req != keys[a].req;
        if (others && keys[a].len > 0) {
            for (long c = a; c < b; c++) sid[keys[c].g] = groups;
            groups++;
        }
    }
    free(keys);
    return groups;
}

/* The key ranges of request i's tasks: runs of its own segments, each shared segment alone,
 * each cut at multiples of span (a shared segment is one range, uncut, where whole); (a, b,
 * shared id or -1, segment or -1) into ra/rb/rs/rg when given. Returns how many (at least
 * one). */
static long key_ranges(long i, const long* seg, const long* lens, const long* sid, long total,
                       long span, int whole, long* ra, long* rb, long* rs, long* rg) {
    long count = 0, pos = 0, from = 0;
    for (long g = seg[i]; g <= seg[i + 1]; g++) {
        int last = g == seg[i + 1];
        if (!last && sid[g] < 0) { pos += lens[g]; continue; }
        long to = last ? total : pos;                 /* the own run before it, then it */
        for (int part = 0; part < (last ? 1 : 2); part++) {
            long a = part ? pos : from, b = part ? pos + lens[g] : to, id = part ? sid[g] : -1;
            long step = part && whole ? lens[g] : span;
            for (long x = a; x < b || (last && count == 0 && x == a); x += step, count++)
                if (ra) {
                    ra[count] = x; rb[count] = x + step < b ? x + step : b; rs[count] = id;
                    rg[count] = part ? g : -1;
                }
        }
        if (!last) { pos += lens[g]; from = pos; }
    }
    return count;
}

/* Returns the floats the tasks' Partials need (0 when out of memory: p->mem is NULL). first:
 * NULL, or each segment's memory (segments of two requests with the same memory and length
 * are read in chains, above). grouped: the pass's rows see every past key (no key positions,
 * no APE contexts), so a chain over one shared segment may run as one task (attend_group):
 * its segment is then one key range per request, uncut. */
static long attend_plan(Plan* p, long heads, long groups, long d, long nreq, const long* tok,
                        const long* seg, const long* lens, long causal_new,
                        const void* const* first, int grouped, int threads) {
    p->heads = heads; p->groups = groups; p->d = d; p->nreq = nreq; p->tok = tok; p->seg = seg;
    p->rows = groups * tok[nreq];
    p->units = p->tasks = p->chains = 0; p->per_rows = 1;
    p->mem = NULL;
    long nseg = seg[nreq], units = 0, per_rows = 1;
    for (long i = 0; i < nreq; i++) {
        long rows = groups * (tok[i + 1] - tok[i]), blocks = (rows + MAXR - 1) / MAXR;
        long per = (rows + blocks - 1) / blocks;
        units += heads * blocks;
        per_rows = per > per_rows ? per : per_rows;
    }
    long splits = (2 * threads + units - 1) / units;
    if (splits < 1) splits = 1;
    if (splits > 64) splits = 64;
    long* tmp = (long*)malloc(sizeof(long) * (3 * nreq + nseg + 1));
    if (!tmp) return 0;
    long *total = tmp, *span = total + nreq, *nranges = span + nreq, *sid = nranges + nreq;
    long nshared = shared_segments(nreq, seg, lens, first, sid);
    if (nshared < 0) { free(tmp); return 0; }
    long most = 0, koff = 0, widest = 1;
    for (long i = 0; i < nreq; i++) {
        long n = tok[i + 1] - tok[i], rows = groups * n, blocks = (rows + MAXR - 1) / MAXR;
        total[i] = causal_new ? n : 0;
        for (long g = seg[i]; g < seg[i + 1]; g++) total[i] += lens[g];
        span[i] = ((total[i] + splits - 1) / splits + BK - 1) / BK * BK;
        if (span[i] < BK) span[i] = BK;
        nranges[i] = key_ranges(i, seg, lens, sid, total[i], span[i], grouped, NULL, NULL,
                                NULL, NULL);
        widest = nranges[i] > widest ? nranges[i] : widest;
        most += heads * blocks * nranges[i];
    }
    p->mem = (long*)malloc(sizeof(long) * (nreq + 5 * units + 8 * most + 2 + 4 * widest));
    if (!p->mem) { free(tmp); return 0; }
    p->koff = p->mem; p->u_head = p->koff + nreq; p->u_req = p->u_head + units;
    p->u_r0 = p->u_req + units; p->u_r1 = p->u_r0 + units; p->u_task = p->u_r1 + units;
    p->t_unit = p->u_task + units; p->t_a = p->t_unit + most; p->t_b = p->t_a + most;
    p->run = p->t_b + most; p->c_task = p->run + most;       /* chains <= tasks, + 1 */
    p->c_shared = p->c_task + most + 1; p->t_seg = p->c_shared + most + 1;
    long *t_sid = p->t_seg + most, *ra = t_sid + most, *rb = ra + widest, *rs = rb + widest,
         *rg = rs + widest;
    for (long i = 0; i < nreq; i++) {
        p->koff[i] = koff;
        koff += total[i] - (causal_new ? tok[i + 1] - tok[i] : 0);
    }
    long u = 0, t = 0;
    for (long h = 0; h < heads; h++)
        for (long i = 0; i < nreq; i++) {
            long rows = groups * (tok[i + 1] - tok[i]);
            long blocks = (rows + MAXR - 1) / MAXR, per = (rows + blocks - 1) / blocks;
            long nr = key_ranges(i, seg, lens, sid, total[i], span[i], grouped, ra, rb, rs, rg);
            for (long r0 = 0; r0 < rows; r0 += per, u++) {
                p->u_head[u] = h; p->u_req[u] = i; p->u_r0[u] = r0;
                p->u_r1[u] = r0 + per < rows ? r0 + per : rows;
                p->u_task[u] = t;
                for (long k = 0; k < nr; k++, t++) {
                    p->t_unit[t] = u; p->t_a[t] = ra[k]; p->t_b[t] = rb[k];
                    t_sid[t] = rs[k] < 0 ? -1 : h * nshared + rs[k];
                    p->t_seg[t] = grouped ? rg[k] : -1;
                }
            }
        }
    /* the order threads take them: tasks over one shared memory of one KV head together (in
     * chains of at most CHAIN), then every other task alone */
    long c = 0, at = 0;
    if (nshared > 0) {
        long keys = heads * nshared;
        long* count = (long*)calloc(keys + 1, sizeof(long));
        if (!count) { free(tmp); plan_free(p); return 0; }
        for (long x = 0; x < t; x++) if (t_sid[x] >= 0) count[t_sid[x] + 1]++;
        for (long k = 0; k < keys; k++) count[k + 1] += count[k];
        long shared_tasks = count[keys];
        for (long x = 0; x < t; x++) if (t_sid[x] >= 0) p->run[count[t_sid[x]]++] = x;
        free(count);
        for (long run = 0; at < shared_tasks; at++, run++) {
            if (at == 0 || t_sid[p->run[at]] != t_sid[p->run[at - 1]] || run == CHAIN) {
                p->c_shared[c] = grouped;
                p->c_task[c++] = at;
                run = 0;
            }
        }
    }
    for (long x = 0; x < t; x++)
        if (t_sid[x] < 0) { p->c_shared[c] = 0; p->c_task[c++] = at; p->run[at++] = x; }
    p->c_task[c] = at;
    free(tmp);
    p->units = units; p->tasks = t; p->chains = c; p->per_rows = per_rows;
    return t * per_rows * (d + 2);
}

/* Each task's Partial (parts[t]; with APE's contexts, its contexts' one at parts[tasks + t]),
 * in `space` (attend_plan's floats, twice that with contexts). */
static void attend_partials(const Plan* p, float* space, Partial* parts, int contexts) {
    for (long t = 0; t < p->tasks * (contexts ? 2 : 1); t++) {
        float* at = space + t * p->per_rows * (p->d + 2);
        parts[t].m = at; parts[t].l = at + p->per_rows; parts[t].acc = at + 2 * p->per_rows;
    }
}

/* bf16 products for request i's rows (pl_decoder's `bf`) only when it brings at least
 * BF_MIN_TOKENS new tokens: a decode step's few rows would convert and pair every key and
 * value block for 3 rows a KV head (measured: decode at 6.4k keys ~2.4x slower). The choice
 * is the request's own, never its batch's. */
#define BF_MIN_TOKENS 8

static inline int request_bf(const Plan* p, long i, int bf) {
    return bf && p->tok[i + 1] - p->tok[i] >= BF_MIN_TOKENS;
}

/* Chain c of a grouped plan (every task reads one shared segment whole, one KV head) as few
 * tasks: the rows of its requests' units, packed up to MAXR, against the segment's keys in
 * one attend_part each -- one transpose and full-width tiles for all of them, where each
 * request alone has a decode step's 3 rows. Each row's numbers are those of its own task
 * (rows are independent in attend_part, the key blocks the same). Returns 0 (nothing done)
 * where this layer's segments are not one memory after all. */
static int attend_group(const Plan* p, long c, const float* qs, const void* const* keys,
                        const long* kstride, const void* const* values, const long* vstride,
                        const long* lens, const int* half, Partial* parts, int bf) {
    long d = p->d, x0 = p->c_task[c], x1 = p->c_task[c + 1];
    long t0 = p->run[x0], g = p->t_seg[t0], h = p->u_head[p->t_unit[t0]];
    int hf = half ? half[g] : 0;
    int want = bf;
    bf = request_bf(p, p->u_req[p->t_unit[t0]], want);   /* every member's choice agrees */
    for (long x = x0; x < x1; x++) {
        long t = p->run[x], e = p->t_seg[t];
        if (request_bf(p, p->u_req[p->t_unit[t]], want) != bf)
            return 0;
        if (e < 0 || keys[e] != keys[g] || values[e] != values[g] || kstride[e] != kstride[g]
                || vstride[e] != vstride[g] || lens[e] != lens[g] || (half ? half[e] : 0) != hf
                || p->t_b[t] - p->t_a[t] != lens[g])
            return 0;
    }
    float gq[MAXR * MAXD] __attribute__((aligned(32)));
    float gm[MAXR], gl[MAXR], gacc[MAXR * MAXD];
    Partial gp = {gm, gl, gacc};
    long es = hf ? 2 : 4, ln = lens[g];
    int cz = 0;
    const char* kh = (const char*)keys[g] + h * kstride[g] * es;
    const char* vh = (const char*)values[g] + h * vstride[g] * es;
    /* units of <= 3 rows take the few-rows path (attend_part): each alone, as ungrouped (the
     * unit's keys still in this core's cache from the chain's previous task) */
    int few = wide_tiles && few_rows && !bf && d % 16 == 0;
    for (long x = x0, xe; x < x1; x = xe) {
        long t = p->run[x], u = p->t_unit[t], n = p->u_r1[u] - p->u_r0[u];
        if (few && n <= 3) {
            const float* q = qs + (h * p->rows + p->groups * p->tok[p->u_req[u]] + p->u_r0[u]) * d;
            attend_part(q, 0, n, d, 1, &kh, &vh, &ln, &cz, &hf, NULL, NULL, 1, 0, ln, &parts[t],
                        NULL, 1.f, NULL, bf);
            xe = x + 1;
            continue;
        }
        long rows = 0;
        for (xe = x; xe < x1; xe++) {          /* units hold at most MAXR rows: one always fits */
            long u = p->t_unit[p->run[xe]], n = p->u_r1[u] - p->u_r0[u];
            if (rows + n > MAXR || (few && n <= 3)) break;
            long first = h * p->rows + p->groups * p->tok[p->u_req[u]] + p->u_r0[u];
            memcpy(gq + rows * d, qs + first * d, sizeof(float) * n * d);
            rows += n;
        }
        attend_part(gq, 0, rows, d, 1, &kh, &vh, &ln, &cz, &hf, NULL, NULL, 1, 0, ln, &gp,
                    NULL, 1.f, NULL, bf);
        __atomic_fetch_add(&group_runs, 1, __ATOMIC_RELAXED);
        for (long y = x, r = 0; y < xe; y++) {
            long t = p->run[y], u = p->t_unit[t], n = p->u_r1[u] - p->u_r0[u];
            memcpy(parts[t].m, gm + r, sizeof(float) * n);
            memcpy(parts[t].l, gl + r, sizeof(float) * n);
            memcpy(parts[t].acc, gacc + r * d, sizeof(float) * n * d);
            r += n;
        }
    }
    return 1;
}

/* Every task of the plan (a worksharing loop: call from every thread of a parallel region, or
 * from outside one). qs: [heads][rows][d] pre-scaled rows, grouped by request as the plan says;
 * past segment g of head h starts at keys[g] + h * kstride[g] elements, float32 or, where
 * half && half[g], 16-bit; causal (NULL: none) marks segments that hold a request's new
 * tokens. newk/newv (NULL: none): every request's new keys/values (head h, token t at
 * + h * nstride + t * d floats), seen causally by that request's rows after its past. kpos
 * (NULL: every past key visible): the positions of the past keys, segments concatenated;
 * qpos: each token's. ctx (NULL: none): APE's context segments, see attend_part (the
 * contexts' Partials follow the others, attend_partials). Ends with a barrier. */
static void attend_tasks(const Plan* p, const float* qs, const void* const* keys,
                         const long* kstride, const void* const* values, const long* vstride,
                         const long* lens, const int* causal, const int* half, const float* newk,
                         const float* newv, long nkstride, long nvstride, const int64_t* kpos,
                         const int64_t* qpos, Partial* parts, const int* ctx, float invt,
                         int bf) {
    long d = p->d;
    #pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < p->chains; c++)
    for (long x = p->c_task[c]; x < p->c_task[c + 1]; x++) {
        if (x == p->c_task[c] && group_shared && p->c_shared[c] && !kpos && !ctx
                && attend_group(p, c, qs, keys, kstride, values, vstride, lens, half, parts, bf))
            break;
        long t = p->run[x], u = p->t_unit[t], i = p->u_req[u], h = p->u_head[u];
        int rbf = request_bf(p, i, bf);
        long t0 = p->tok[i], n = p->tok[i + 1] - t0, g0 = p->seg[i], ns = p->seg[i + 1] - g0;
        const char* kh[64]; const char* vh[64];
        long ln[64]; int cz[64], hf[64], cx[64];
        for (long k = 0; k < ns; k++) {
            long g = g0 + k, es = half && half[g] ? 2 : 4;
            kh[k] = (const char*)keys[g] + h * kstride[g] * es;
            vh[k] = (const char*)values[g] + h * vstride[g] * es;
            ln[k] = lens[g]; cz[k] = causal ? causal[g] : 0; hf[k] = half ? half[g] : 0;
            cx[k] = ctx ? ctx[g] : 0;
        }
        if (newk) {
            kh[ns] = (const char*)(newk + h * nkstride + t0 * d);
            vh[ns] = (const char*)(newv + h * nvstride + t0 * d);
            ln[ns] = n; cz[ns] = 1; hf[ns] = 0; cx[ns] = 0; ns++;
        }
        long r0 = p->u_r0[u];
        attend_part(qs + (h * p->rows + p->groups * t0 + r0) * d, r0, p->u_r1[u] - r0, d, ns,
                    kh, vh, ln, cz, hf, kpos ? kpos + p->koff[i] : NULL,
                    qpos ? qpos + t0 : NULL, n, p->t_a[t], p->t_b[t], parts + t,
                    ctx ? cx : NULL, invt, ctx ? parts + p->tasks + t : NULL, rbf);
    }
}

/* Row r of a unit's `splits` Partials merged: o = the normalised output (d floats); returns
 * the row's log-sum-exp in base 2 (-inf: no key seen, o zero). */
static float merge_row(const Partial* pu, long splits, long r, long d, float* o) {
    float mx = -INFINITY;
    for (long sp = 0; sp < splits; sp++) {
        float mm = pu[sp].m[r];
        mx = mm > mx ? mm : mx;
    }
    float lsum = 0.f, w[64];          /* splits <= 64 */
    for (long sp = 0; sp < splits; sp++) {
        w[sp] = pu[sp].l[r] > 0.f ? exp2f(pu[sp].m[r] - mx) : 0.f;
        lsum += pu[sp].l[r] * w[sp];
    }
    float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    for (long c = 0; c < d; c++) {
        float v = 0.f;
        for (long sp = 0; sp < splits; sp++) v += pu[sp].acc[r * d + c] * w[sp];
        o[c] = v * inv;
    }
    return lsum > 0.f ? mx + log2f(lsum) : -INFINITY;
}

/* Merge each row's key ranges (a worksharing loop, ends with a barrier). Local row r of a
 * request's unit on KV head h -- query head h * G + r / n, token tok + r % n -- goes to
 * out + h * hstride + (r / n) * gstride + (tok + r % n) * tstride. lse: NULL or [heads][rows]
 * (one request: row g * n + t). contexts (APE, attend_part): the row is the contexts' output
 * and the others' mixed by softmax(mixc * L_C, L_O), L the parts' log-sum-exps (lse: NULL). */
static void attend_merge(const Plan* p, const Partial* parts, float* out, long hstride,
                         long gstride, long tstride, float* lse, int contexts, float mixc) {
    long d = p->d;
    #pragma omp for schedule(static)
    for (long u = 0; u < p->units; u++) {
        long h = p->u_head[u], i = p->u_req[u], r0 = p->u_r0[u], r1 = p->u_r1[u];
        long t0 = p->tok[i], n = p->tok[i + 1] - t0, first = p->u_task[u];
        long splits = (u + 1 < p->units ? p->u_task[u + 1] : p->tasks) - first;
        for (long r = 0; r < r1 - r0; r++) {
            long row = r0 + r;
            float* o = out + h * hstride + (row / n) * gstride + (t0 + row % n) * tstride;
            float lo = merge_row(parts + first, splits, r, d, o);
            if (contexts) {
                float oc[MAXD];
                float lc = merge_row(parts + p->tasks + first, splits, r, d, oc) * mixc;
                float top = lc > lo ? lc : lo;
                float ec = lc > -INFINITY ? exp2f(lc - top) : 0.f, eo = exp2f(lo - top);
                float wc = ec / (ec + eo), wo = eo / (ec + eo);
                for (long c = 0; c < d; c++) o[c] = wc * oc[c] + wo * o[c];
            }
            if (lse) lse[h * p->rows + p->groups * t0 + row] = lo > -INFINITY ? lo * LN2 : lo;
        }
    }
}

/* Attention of `rows` packed query rows per KV head (q, out: [heads][rows][d]) over segments of
 * keys/values; segment g of head h starts at keys[g] + h * kstride[g] (rows of d floats).
 * A causal segment holds the request's qlen new tokens: row r sees its keys j <= r % qlen.
 * Every row must see at least one key. lse (optional): [heads][rows] log-sum-exp of the
 * scaled scores. threads: the team that runs it; plan_threads: the count the key ranges are
 * cut for, so the numbers depend on it alone, never on how many threads a busy machine leaves.
 * Returns 0, or -1 when the shapes are unsupported. */
int pl_attend(const float* q, long heads, long rows, long d, float scale, long nseg,
              const float* const* keys, const long* kstride, const float* const* values,
              const long* vstride, const long* lens, const int* causal, long qlen,
              float* out, float* lse, int threads, int plan_threads) {
    if (d % 8 || d > MAXD || nseg > 64 || heads <= 0 || rows <= 0 || qlen <= 0
            || rows % qlen)
        return -1;
    long tok[2] = {0, qlen}, seg[2] = {0, nseg};
    Plan plan;
    long floats = attend_plan(&plan, heads, rows / qlen, d, 1, tok, seg, lens, 0, NULL, 0,
                              plan_threads);
    Partial* parts = (Partial*)malloc(sizeof(Partial) * plan.tasks);
    float* space = (float*)malloc(sizeof(float) * (floats ? floats : 1));
    float* qs = (float*)malloc(sizeof(float) * heads * rows * d);
    if (!plan.mem || !parts || !space || !qs) {
        plan_free(&plan); free(parts); free(space); free(qs);
        return -2;
    }
    attend_partials(&plan, space, parts, 0);
    for (long i = 0; i < heads * rows * d; i++) qs[i] = q[i] * (scale * LOG2E);
    #pragma omp parallel num_threads(threads)
    {
        attend_tasks(&plan, qs, (const void* const*)keys, kstride, (const void* const*)values,
                     vstride, lens, causal, NULL, NULL, NULL, 0, 0, NULL, NULL, parts, NULL, 1.f,
                     0);
        attend_merge(&plan, parts, out, rows * d, qlen * d, d, lse, 0, 1.f);
    }
    plan_free(&plan);
    free(parts); free(space); free(qs);
    return 0;
}

/* ---- a long causal pass (pl_causal) ----------------------------------------------------- *
 * The attention of a pass over many new tokens (a module's encode, a new combination's
 * recompute, a long prefill): n new tokens at the end of nk keys, each seeing every key
 * before it and itself. A KV head's keys are transposed into blocks once for every query
 * head and chunk of tokens that reads them, and the blocks after a chunk's last token are
 * never computed. Online softmax in float32 (exp2 on 512-bit vectors). In bfloat16 (`bf`,
 * AVX512_BF16): Q.K and P.V take vdpbf16ps (the tiles of attend_part's bf path, float32
 * sums; values paired once too), P rounded to bfloat16 after its block's running maximum.
 * In float32 (the 512-bit tiles on: pl_wide): attend_part's qk_w and pv_w, values read in
 * place. */
#define CHUNK MAXR     /* query tokens per task: one query head's rows */

/* 2^x for x <= 0 on 512-bit vectors: exp2_neg's polynomial (Cephes' exp2f) for 2^f,
 * |f| <= 1/2, scaled by 2^n with vscalefps (0 far below -126, where exp2_neg gives 2^-126). */
AIW __m512 exp2_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_P[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_P[i]));
    return _mm512_scalef_ps(p, n);
}

/* Row r's raw scores s[0:vis] of one block (Q.K) -> their weights 2^(c s - m) in place,
 * zero for keys [vis, n32); updates the row's running maximum *m (of c s), sum *l and
 * rescales acc (d floats). c > 0: the scale times log2(e). */
WIDE static void causal_softmax(float* s, long vis, long n32, float c, float* m, float* l,
                                float* acc, long d) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vc = _mm512_set1_ps(c);
    __m512 vmx = ninf;
    for (long j = 0; j < vis; j += 16) {
        __mmask16 in = vis - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (vis - j)) - 1);
        vmx = _mm512_mask_max_ps(vmx, in, vmx, _mm512_loadu_ps(s + j));
    }
    float mx = _mm512_reduce_max_ps(vmx) * c;
    float mn = mx > *m ? mx : *m;
    float corr = exp2f(*m - mn);
    __m512 sum = _mm512_setzero_ps(), vm = _mm512_set1_ps(-mn);
    for (long j = 0; j < vis; j += 16) {
        __mmask16 in = vis - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (vis - j)) - 1);
        __m512 e = _mm512_maskz_mov_ps(in, exp2_neg16(_mm512_fmadd_ps(_mm512_loadu_ps(s + j),
                                                                      vc, vm)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(s + j, e);
    }
    for (long j = (vis + 15) & ~15L; j < n32; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    *m = mn;
    if (corr != 1.f) {
        __m512 vr = _mm512_set1_ps(corr);
        for (long k = 0; k < d; k += 16)
            _mm512_storeu_ps(acc + k, _mm512_mul_ps(vr, _mm512_loadu_ps(acc + k)));
    }
}

/* The keys and values of one KV head, ready for causal_chunk: per block of BK keys, kt (the
 * block transposed: d rows of BK floats, or in bf d / 2 rows of BK bf16 pairs) and, in bf,
 * vt (pairs of value rows); in float32 the value rows are read where they are. */
typedef struct { const uint32_t* kt; const uint32_t* vt; const float* v; } CausalHead;

/* nr (<= CHUNK) query rows of one head, the first at key position p0 (row r sees keys
 * 0 .. p0 + r), over a KV head's blocks; out: the normalised rows (bf16 in bf, else float32).
 * q: the rows (bf: d / 2 bf16 pairs each, else d floats); c: the scale times log2(e). */
WIDE static void causal_chunk(const void* q, long nr, long p0, CausalHead kv, long d, float c,
                              int bf, void* out) {
    float s[CHUNK * BK] __attribute__((aligned(64)));
    float acc[CHUNK * MAXD] __attribute__((aligned(64)));
    uint32_t ph[CHUNK * BK / 2];
    float m[CHUNK], l[CHUNK];
    long visr[CHUNK], d2 = d / 2, kd = bf ? d2 : d;
    for (long r = 0; r < nr; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * nr * d);
    long kend = p0 + nr;
    for (long j0 = 0; j0 < kend; j0 += BK) {
        long nkb = kend - j0 < BK ? kend - j0 : BK;
        long nk16 = (nkb + 15) & ~15L, nk32 = (nkb + 31) & ~31L;
        const uint32_t* ktb = kv.kt + (j0 / BK) * kd * BK;
        long first = j0 > p0 ? j0 - p0 : 0;          /* rows before it see none of the block */
        for (long jb = 0; jb < nk16; jb += 32) {
            int cols16 = nk16 - jb >= 32 ? 2 : 1;
            /* rows before r see none of the tile */
            for (long r = j0 + jb > p0 ? j0 + jb - p0 : 0; r < nr; r += 6) {
                long rows = nr - r < 6 ? nr - r : 6;
                if (bf)
                    qk_bf(rows, cols16, (const uint32_t*)q + r * d2, d2, ktb + jb,
                          s + r * BK + jb);
                else
                    qk_w(rows, cols16, (const float*)q + r * d, d, (const float*)ktb + jb,
                         s + r * BK + jb);
            }
        }
        for (long r = 0; r < first; r++) visr[r] = 0;
        for (long r = first; r < nr; r++) {
            long vis = p0 + r + 1 - j0;
            vis = vis < nkb ? vis : nkb;
            visr[r] = vis;
            causal_softmax(s + r * BK, vis, nk32, c, m + r, l + r, acc + r * d, d);
            if (bf) to_bf16(s + r * BK, nk32, (uint16_t*)(ph + r * (BK / 2)));
        }
        for (long cc = 0; cc < d; cc += 32)
            for (long r = first; r < nr; r += 6) {
                long rows = nr - r < 6 ? nr - r : 6, n = 0;
                for (long i = 0; i < rows; i++) n = visr[r + i] > n ? visr[r + i] : n;
                if (bf)
                    pv_bf(rows, ph + r * (BK / 2), (n + 1) / 2,
                          kv.vt + (j0 / BK) * (BK / 2) * d + cc, d, acc + r * d + cc);
                else
                    pv_w(rows, s + r * BK, n, kv.v + j0 * d + cc, d, acc + r * d + cc);
            }
    }
    for (long r = 0; r < nr; r++) {
        __m512 inv = _mm512_set1_ps(1.f / l[r]);
        float* o = bf ? acc + r * d : (float*)out + r * d;
        for (long k = 0; k < d; k += 16)
            _mm512_storeu_ps(o + k, _mm512_mul_ps(inv, _mm512_loadu_ps(acc + r * d + k)));
        if (bf) to_bf16(o, d, (uint16_t*)out + r * d);
    }
}

/* out[h][t] = causal attention of query head h's token t (q: [heads][n][d], the n new
 * tokens last among nk keys) over its KV head h / (heads / kv_heads)'s keys and values (rows
 * of d; head g's row j at k + g * kstride + j * d, the same for v), scaled by `scale`; q, k,
 * v and out in bfloat16 where bf (AVX512_BF16), else float32 (the 512-bit tiles: pl_wide).
 * threads: the team.
 * Returns 0, -1 for shapes or a CPU it does not serve, -2 when out of memory. */
int pl_causal(const void* q, long heads, long n, long d, const void* k, long kstride,
              const void* v, long vstride, long kv_heads, long nk, float scale, void* out,
              int bf, int threads) {
    int able = bf ? pl_bf16_products() : wide_tiles;
    if (!able || d % 32 || d > MAXD || kv_heads <= 0 || heads % kv_heads || n <= 0 || n > nk)
        return -1;
    long nb = (nk + BK - 1) / BK, d2 = d / 2, es = bf ? 2 : 4;
    size_t kt_per = (size_t)nb * (bf ? d2 : d) * BK, vt_per = bf ? (size_t)nb * (BK / 2) * d : 0;
    uint32_t* kt = (uint32_t*)malloc(sizeof(uint32_t) * kt_per * kv_heads);
    uint32_t* vt = bf ? (uint32_t*)malloc(sizeof(uint32_t) * vt_per * kv_heads) : NULL;
    if (!kt || (bf && !vt)) {
        free(kt); free(vt);
        return -2;
    }
    const char *kb = (const char*)k, *vb = (const char*)v;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (long g = 0; g < kv_heads; g++)
        for (long b = 0; b < nb; b++) {
            long rows = nk - b * BK < BK ? nk - b * BK : BK;
            const char* from = kb + (g * kstride + b * BK * d) * es;
            if (bf) {
                transpose_block((const float*)from, rows, d2,
                                (float*)(kt + g * kt_per + b * d2 * BK));
                pair_rows((const uint16_t*)(vb + (g * vstride + b * BK * d) * es), rows, d,
                          vt + g * vt_per + b * (BK / 2) * d);
            } else
                transpose_block((const float*)from, rows, d,
                                (float*)(kt + g * kt_per + b * d * BK));
        }
    long chunks = (n + CHUNK - 1) / CHUNK, past = nk - n, groups = heads / kv_heads;
    float c = scale * LOG2E;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long t = 0; t < heads * chunks; t++) {
        long ch = chunks - 1 - t / heads, h = t % heads, g = h / groups;   /* longest first */
        long t0 = ch * CHUNK, nr = n - t0 < CHUNK ? n - t0 : CHUNK;
        CausalHead head = {kt + g * kt_per, bf ? vt + g * vt_per : NULL,
                           bf ? NULL : (const float*)(vb + g * vstride * es)};
        causal_chunk((const char*)q + (h * n + t0) * d * es, nr, past + t0, head, d, c, bf,
                     (char*)out + (h * n + t0) * d * es);
    }
    free(kt); free(vt);
    return 0;
}

/* ---- decoder layers of the Llama family ---------------------------------------------------- */

/* Weights of one layer, in this order, in pl_decoder's table (NULL for a bias a model lacks). */
enum { W_LN1, W_Q, W_K, W_V, W_O, W_LN2, W_GATE, W_UP, W_DOWN,
       B_Q, B_K, B_V, B_O, B_GATE, B_UP, B_DOWN, W_COUNT };

/* y = w * x / sqrt(mean(x^2) + eps), one row of n floats (n % 8 == 0) */
static void rms_norm(const float* x, const float* w, long n, float eps, float* y) {
    __m256 s = _mm256_setzero_ps();
    for (long c = 0; c < n; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        s = _mm256_fmadd_ps(v, v, s);
    }
    __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(s) / (float)n + eps));
    for (long c = 0; c < n; c += 8)
        _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(w + c),
                                              _mm256_mul_ps(_mm256_loadu_ps(x + c), inv)));
}

/* x * sigmoid(x) */
static inline __m256 silu8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    __m256 e = exp2_neg(_mm256_mul_ps(_mm256_set1_ps(-LOG2E),                    /* e^-|x| */
                                      _mm256_andnot_ps(_mm256_set1_ps(-0.f), x)));
    __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));          /* sigmoid(|x|) */
    __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
    return _mm256_mul_ps(x, sig);
}

/* out = (x * cos + rotate_half(x) * sin) * scale, one head of d floats; rotate_half(x) is
 * (-x[d/2:], x[:d/2]) */
static void rope(const float* x, const float* cos, const float* sin, long d, float scale,
                 float* out) {
    long h = d / 2;
    for (long c = 0; c < h; c++) {
        out[c] = (x[c] * cos[c] - x[c + h] * sin[c]) * scale;
        out[c + h] = (x[c + h] * cos[c + h] + x[c] * sin[c + h]) * scale;
    }
}

/* columns [j0, j1) of y = x . w^T (+ b): from the blocks wq where given (qkind: a kind_row
 * kind, or I8_KIND), else float w */
static void linear_any(const float* x, const int16_t* xu, const float* xs, long m, long k,
                       const float* w, const uint8_t* wq, int qkind, long n, const float* b,
                       long j0, long j1, float* y, long ldy) {
    if (!wq) {
        linear_cols(x, m, k, w, n, b, j0, j1, y, ldy);
        return;
    }
    if (qkind == I8_KIND) {
        linear_i8(xu, xs, m, k, wq, n, j0, j1, y, ldy);
    } else {
        long stride;
        RowFn row = kind_row(qkind, k, &stride);
        dots_q(x, k, m, wq + j0 * stride, j1 - j0, k, y + j0, ldy, qkind, row, stride);
    }
    if (b)
        for (long i = 0; i < m; i++)
            for (long j = j0; j < j1; j++) y[i * ldy + j] += b[j];
}

/* Columns [j0, j1) of y = x . w^T + b added to the residual stream r (both [m][ld]). */
static void linear_residual(const float* x, const int16_t* xu, const float* xs, long m, long k,
                            const float* w, const uint8_t* wq, int qkind, const float* b,
                            long j0, long j1, float* tmp, float* r, long ld) {
    linear_any(x, xu, xs, m, k, w, wq, qkind, ld, b, j0, j1, tmp, ld);
    for (long i = 0; i < m; i++)
        for (long j = j0; j < j1; j++) r[i * ld + j] += tmp[i * ld + j];
}

/* Every decoder layer of a Llama-family model (RMSNorm, rotary attention with grouped KV heads,
 * SiLU-gated MLP) for q new tokens, in one parallel region.
 *
 * x: [q][hidden], the input embeddings in and the last layer's output out.
 * shape: hidden, heads, kv_heads, head_dim, intermediate, layers. w: [layers][W_COUNT].
 * cos, sin: [q][head_dim], the rotary tables at the tokens' positions.
 * The past: nseg segments per layer, segment g of layer l at keys[l * nseg + g] (head h at
 * + h * kstride[g] elements, rows of head_dim), lens[g] keys, float32 or, where half[g] (half
 * may be NULL), bfloat16 (HALF_BF16) or float16 (HALF_FP16); every key visible to every token.
 * newk[l], newv[l]: where layer l's new keys/values go (head h at + h * nkstride, token t at
 * + t * head_dim); the tokens then attend to them causally, in input order.
 * kpos (NULL: every past key visible to every token): the positions of the past keys, segments
 * concatenated; token t then sees past key j only where kpos[j] <= qpos[t] (qpos: [q],
 * increasing: causal in input order is causal by position).
 * Batched requests (nreq > 0; nreq 0 is one request): request i has the tokens tok[i] ..
 * tok[i+1] (tok[0] = 0, tok[nreq] = q) and the past segments seg[i] .. seg[i+1] (seg[0] = 0,
 * seg[nreq] = nseg; at most 63 each); its tokens see its own past and new keys only, and
 * qpos increases within a request only (the rotary embedding reads cos/sin). Requests may
 * name the same memory as a segment (a stored unit several of them read in place).
 * ctx (NULL: none): APE (Adaptive Parallel Encoding) -- the segments g with ctx[g] != 0 are
 * contexts: their scores are divided by the temperature (times invt), softmaxed apart from
 * the other keys', and the two parts mixed by softmax(mixc * L_C, L_O) (mixc: scale *
 * temperature; L the parts' log-sum-exps).
 * qw (NULL: none): blocks of the linear weights, [layers][W_COUNT] like w (NULL where a
 * weight is float only), all of kind qkind (4: Q4_1, 8: Q8_0), or each of the kind qkinds
 * gives it ([layers][W_COUNT]; NULL: qkind for all; kind_row's kinds, a GGUF's mix of
 * K-quants among them): read instead of w, giving the same values (fused.py checks them); I8_KIND: int8 rows, and the inputs of those layers
 * quantized to 12 bits per token (approximate; where the CPU has AVX512_VNNI, else float).
 * qout (NULL: none): the last token's rotated query rows of every layer, [layers][heads][d]
 * (before the softmax scale): the recompute policy query:K ranks cached tokens by them.
 * bf: the attention's products (Q.K and P.V) in bfloat16 for the rows of requests of at
 * least BF_MIN_TOKENS new tokens (only where the CPU has AVX512_BF16, pl_bf16_products, and
 * head_dim % 32 == 0), else float32.
 * threads, plan_threads: as pl_attend's.
 * Returns 0, -1 for unsupported shapes, -2 when out of memory. */
int pl_decoder(float* x, long q, const long* shape, float eps, float scale,
               const float* const* w, const float* cos, const float* sin,
               long nseg, const void* const* keys, const long* kstride,
               const void* const* values, const long* vstride, const long* lens, const int* half,
               float* const* newk, long nkstride, float* const* newv, long nvstride,
               const int64_t* kpos, const int64_t* qpos, long nreq, const long* tok,
               const long* seg, const int* ctx, float invt, float mixc,
               const uint8_t* const* qw, int qkind, const int* qkinds, float* qout, int bf,
               int threads, int plan_threads) {
    long hidden = shape[0], heads = shape[1], kvh = shape[2], d = shape[3], inter = shape[4],
         layers = shape[5];
    long tok1[2] = {0, q}, seg1[2] = {0, nseg};
    if (nreq <= 0) { nreq = 1; tok = tok1; seg = seg1; }
    bf = bf && pl_bf16_products();
    if (qw && (hidden % 32 || inter % 32 || (heads * d) % 32 || hidden > Q4_MAX_K
               || inter > Q4_MAX_K || heads * d > Q4_MAX_K
               || (!qkinds && qkind != 4 && qkind != 8 && qkind != I8_KIND)))
        return -1;
    if (qw && qkinds)                   /* each weight's kind known, its rows whole blocks */
        for (long l = 0; l < layers; l++)
            for (int slot = W_Q; slot <= W_DOWN; slot++) {
                long stride, k = slot == W_O ? heads * d : (slot == W_DOWN ? inter : hidden);
                if (slot == W_LN2 || !qw[l * W_COUNT + slot])
                    continue;
                int kind = qkinds[l * W_COUNT + slot];
                if (!kind_row(kind, k, &stride) || k % kind_block(kind))
                    return -1;
            }
    int i8 = qw && qkind == I8_KIND;
    if (i8 && (hidden % 64 || inter % 64 || (heads * d) % 64 || !pl_products(8)))
        qw = NULL, i8 = 0;
    if (!i8 && qw && q > (wide_tiles ? Q4_MAX_ROWS_WIDE : Q4_MAX_ROWS)) {
        int floats = 1;                 /* blocks kept without a float copy: read them anyway */
        for (long l = 0; l < layers; l++)
            for (int slot = W_Q; slot <= W_DOWN; slot++)
                if (slot != W_LN2 && qw[l * W_COUNT + slot] && !w[l * W_COUNT + slot])
                    floats = 0;
        if (floats)
            qw = NULL;
    }
    if (q <= 0 || d % 8 || d > MAXD || hidden % 8 || inter % 8 || (heads * d) % 8
            || kvh <= 0 || heads % kvh || tok[0] != 0 || tok[nreq] != q || seg[0] != 0
            || seg[nreq] != nseg)
        return -1;
    for (long i = 0; i < nreq; i++)
        if (tok[i + 1] <= tok[i] || seg[i + 1] < seg[i] || seg[i + 1] - seg[i] + 1 > 64)
            return -1;
    long groups = heads / kvh, nq = heads * d, nkv = kvh * d, nqkv = nq + 2 * nkv;
    long widest = hidden > inter ? hidden : inter;
    Plan plan;
    long pfloats = attend_plan(&plan, kvh, groups, d, nreq, tok, seg, lens, 1, keys,
                               kpos == NULL && ctx == NULL, plan_threads)
                   * (ctx ? 2 : 1);
    long floats = q * hidden            /* normed input */
                + q * nqkv              /* q, k, v */
                + q * nq                /* rotated, scaled query rows, packed per KV head */
                + q * nq                /* attention output */
                + 2 * q * inter         /* gate, up */
                + q * widest            /* linear output before the residual add */
                + (i8 ? q * widest / 2 + q : 0)   /* quantized inputs and their scales */
                + pfloats;
    float* space = (float*)aligned_alloc(32, sizeof(float) * ((floats + 7) & ~7L));
    Partial* parts = (Partial*)malloc(sizeof(Partial) * plan.tasks * (ctx ? 2 : 1));
    long* treq = (long*)malloc(sizeof(long) * q);               /* each token's request */
    if (!plan.mem || !space || !parts || !treq) {
        plan_free(&plan); free(space); free(parts); free(treq);
        return -2;
    }
    for (long i = 0; i < nreq; i++)
        for (long t = tok[i]; t < tok[i + 1]; t++) treq[t] = i;
    float *h = space, *qkv = h + q * hidden, *qs = qkv + q * nqkv, *att = qs + q * nq,
          *gate = att + q * nq, *up = gate + q * inter, *tmp = up + q * inter,
          *pspace = tmp + q * widest, *xs = pspace + pfloats;
    int16_t* xu = (int16_t*)(xs + q);
    attend_partials(&plan, pspace, parts, ctx != NULL);
    long qblocks = (nq + LIN_BLOCK - 1) / LIN_BLOCK, kvblocks = (nkv + LIN_BLOCK - 1) / LIN_BLOCK;
    long hblocks = (hidden + LIN_BLOCK - 1) / LIN_BLOCK, iblocks = (inter + LIN_BLOCK - 1) / LIN_BLOCK;

    #pragma omp parallel num_threads(threads)
    for (long l = 0; l < layers; l++) {
        const float* const* lw = w + l * W_COUNT;
        const uint8_t* const* lq = qw ? qw + l * W_COUNT : NULL;
        const int* lk = qkinds ? qkinds + l * W_COUNT : NULL;
#define QW(slot) (lq ? lq[slot] : NULL)
#define QK(slot) (lk ? lk[slot] : qkind)
        #pragma omp for schedule(static)
        for (long t = 0; t < q; t++) {
            rms_norm(x + t * hidden, lw[W_LN1], hidden, eps, h + t * hidden);
            if (i8) quantize_row(h + t * hidden, hidden, xu + t * hidden, xs + t);
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < qblocks + 2 * kvblocks; b++) {       /* q, k and v projections */
            int which = b < qblocks ? 0 : (b < qblocks + kvblocks ? 1 : 2);
            long j0 = (which == 0 ? b : (which == 1 ? b - qblocks : b - qblocks - kvblocks)) * LIN_BLOCK;
            long n = which == 0 ? nq : nkv, j1 = j0 + LIN_BLOCK < n ? j0 + LIN_BLOCK : n;
            long off = which == 0 ? 0 : (which == 1 ? nq : nq + nkv);
            linear_any(h, xu, xs, q, hidden, lw[W_Q + which], QW(W_Q + which),
                       QK(W_Q + which), n,
                       lw[B_Q + which], j0, j1, qkv + off, nqkv);
        }
        #pragma omp for schedule(static)
        for (long t = 0; t < q; t++) {         /* rotate; queries to packed rows, keys/values out */
            const float *row = qkv + t * nqkv, *c = cos + t * d, *s = sin + t * d;
            long t0 = tok[treq[t]], n = tok[treq[t] + 1] - t0;   /* rows grouped by request */
            for (long hq = 0; hq < heads; hq++)
                rope(row + hq * d, c, s, d, scale * LOG2E,
                     qs + ((hq / groups) * groups * q + groups * t0 + (hq % groups) * n
                           + t - t0) * d);
            if (qout && t == q - 1)
                for (long hq = 0; hq < heads; hq++)
                    rope(row + hq * d, c, s, d, 1.f, qout + (l * heads + hq) * d);
            for (long hk = 0; hk < kvh; hk++) {
                rope(row + nq + hk * d, c, s, d, 1.f, newk[l] + hk * nkstride + t * d);
                memcpy(newv[l] + hk * nvstride + t * d, row + nq + nkv + hk * d, sizeof(float) * d);
            }
        }
        attend_tasks(&plan, qs, keys + l * nseg, kstride, values + l * nseg, vstride, lens, NULL,
                     half, newk[l], newv[l], nkstride, nvstride, kpos, qpos, parts, ctx, invt,
                     bf);
        attend_merge(&plan, parts, att, groups * d, d, nq, NULL, ctx != NULL, mixc);
        if (i8) {
            #pragma omp for schedule(static)
            for (long t = 0; t < q; t++) quantize_row(att + t * nq, nq, xu + t * nq, xs + t);
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < hblocks; b++) {
            long j0 = b * LIN_BLOCK, j1 = j0 + LIN_BLOCK < hidden ? j0 + LIN_BLOCK : hidden;
            linear_residual(att, xu, xs, q, nq, lw[W_O], QW(W_O), QK(W_O), lw[B_O], j0, j1,
                            tmp, x, hidden);
        }
        #pragma omp for schedule(static)
        for (long t = 0; t < q; t++) {
            rms_norm(x + t * hidden, lw[W_LN2], hidden, eps, h + t * hidden);
            if (i8) quantize_row(h + t * hidden, hidden, xu + t * hidden, xs + t);
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < iblocks; b++) {   /* gate and up, then silu(gate) * up */
            long j0 = b * LIN_BLOCK, j1 = j0 + LIN_BLOCK < inter ? j0 + LIN_BLOCK : inter;
            linear_any(h, xu, xs, q, hidden, lw[W_GATE], QW(W_GATE), QK(W_GATE), inter,
                       lw[B_GATE], j0, j1, gate, inter);
            linear_any(h, xu, xs, q, hidden, lw[W_UP], QW(W_UP), QK(W_UP), inter, lw[B_UP],
                       j0, j1, up, inter);
            for (long t = 0; t < q; t++) {
                float *g = gate + t * inter, *u = up + t * inter;
                long j = j0;
                for (; j + 8 <= j1; j += 8)
                    _mm256_storeu_ps(g + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + j)),
                                                          _mm256_loadu_ps(u + j)));
                for (; j < j1; j++) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
            }
        }
        if (i8) {
            #pragma omp for schedule(static)
            for (long t = 0; t < q; t++)
                quantize_row(gate + t * inter, inter, xu + t * inter, xs + t);
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < hblocks; b++) {
            long j0 = b * LIN_BLOCK, j1 = j0 + LIN_BLOCK < hidden ? j0 + LIN_BLOCK : hidden;
            linear_residual(gate, xu, xs, q, inter, lw[W_DOWN], QW(W_DOWN), QK(W_DOWN),
                            lw[B_DOWN], j0, j1, tmp, x, hidden);
        }
#undef QW
#undef QK
    }
    plan_free(&plan); free(space); free(parts); free(treq);
    return 0;
}
