/* promptlang's CPU kernels (x86-64, AVX2 + FMA, float32), built on first use by
 * runtime/native.py and called through ctypes; every caller falls back to PyTorch when they
 * are unavailable.
 *
 * pl_attend: attention of a handful of query rows (the new tokens of a cached request, grouped
 *   query heads packed as rows of their KV head) over keys/values in several places at once
 *   (the request buffer, stored units read in place, the new tokens themselves), in one pass
 *   with an online softmax: no Q x K mask, no copies, no log-sum-exp merge in Python.
 * pl_linear: y = x W^T (+ b) for a few rows of x against nn.Linear's row-major weight, each
 *   weight row read once and reused for every x row while it is in cache.
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

/* e^x for x <= 0 (x = -inf gives 0): Cody-Waite reduction and a degree-6 polynomial */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(dead, p);
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

/* c[m][n] (row stride ldc) = a[m][k] . b[n][k]^T: a, b rows contiguous with strides lda, ldb */
static void dots(const float* a, long lda, long m, const float* b, long ldb, long n, long k,
                 float* c, long ldc) {
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        long i = 0, threes = m % 3 == 1 && m >= 4 ? m - 4 : m;   /* 3-row tiles, then 2s */
        for (; i + 3 <= threes; i += 3)
            dot3x4(a + i * lda, lda, b + j * ldb, ldb, k, c + i * ldc + j, ldc);
        for (; i + 2 <= m; i += 2)
            dot2x4(a + i * lda, lda, b + j * ldb, ldb, k, c + i * ldc + j, ldc);
        for (; i < m; i++)
            dot1x4(a + i * lda, b + j * ldb, ldb, k, c + i * ldc + j);
    }
    for (; j < n; j++)
        for (long i = 0; i < m; i++)
            c[i * ldc + j] = dot1(a + i * lda, b + j * ldb, k);
}

/* ---- linear: y[m][n] = x[m][k] . w[n][k]^T (+ bias[n]) ------------------------------------ */

void pl_linear(const float* x, long m, long k, const float* w, long n, const float* bias,
               float* y, int threads) {
    const long block = 16;                    /* weight rows per task: 16 x k floats stay hot */
    long tasks = (n + block - 1) / block;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        long j0 = t * block, j1 = j0 + block < n ? j0 + block : n;
        dots(x, k, m, w + j0 * k, k, j1 - j0, k, y + j0, n);
        if (bias)
            for (long i = 0; i < m; i++)
                for (long j = j0; j < j1; j++) y[i * n + j] += bias[j];
    }
}

/* ---- attention ----------------------------------------------------------------------------- */

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

/* acc[r][c0:c0+8] += ..., one row, for d % 32 != 0 */
static void pv_col8(const float* p, long nk, const float* v, long d, float* acc) {
    __m256 a = _mm256_loadu_ps(acc);
    for (long j = 0; j < nk; j++)
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * d), a);
    _mm256_storeu_ps(acc, a);
}

typedef struct {           /* one task's rows over its key range, before normalisation */
    float *m, *l, *acc;    /* [rows], [rows], [rows][d] */
} Partial;

/* Rows [r0, r1) (nr <= MAXR) of one KV head against keys [a, b) of the concatenated segments:
 * unnormalised output, running max and sum into *part. qs: the rows, pre-scaled. */
static void attend_part(const float* qs, long r0, long nr, long d, long nseg,
                        const float* const* keys, const float* const* values, const long* lens,
                        const int* causal, long qlen, long a, long b, Partial* part) {
    float s[MAXR * BK] __attribute__((aligned(32)));
    float kt[MAXD * BK] __attribute__((aligned(32)));
    float *m = part->m, *l = part->l, *acc = part->acc;
    for (long r = 0; r < nr; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(acc, 0, sizeof(float) * nr * d);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    long base = 0;
    for (long g = 0; g < nseg; base += lens[g], g++) {
        long lo = a > base ? a - base : 0, hi = b - base < lens[g] ? b - base : lens[g];
        for (long j0 = lo; j0 < hi; j0 += BK) {
            long nk = hi - j0 < BK ? hi - j0 : BK;
            long nk16 = (nk + 15) & ~15L;
            const float* vb = values[g] + j0 * d;
            transpose_block(keys[g] + j0 * d, nk, d, kt);
            for (long jb = 0; jb < nk16; jb += 16) {
                long r = 0;
                for (; r + 6 <= nr; r += 6) qk_tile(6, qs + r * d, d, kt + jb, s + r * BK + jb);
                switch (nr - r) {
                    case 1: qk_tile(1, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 2: qk_tile(2, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 3: qk_tile(3, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 4: qk_tile(4, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                    case 5: qk_tile(5, qs + r * d, d, kt + jb, s + r * BK + jb); break;
                }
            }
            long nk8 = (nk + 7) & ~7L;
            for (long r = 0; r < nr; r++) {
                float* sr = s + r * BK;
                long vis = nk;
                if (causal[g]) {           /* new-token block: row sees keys j <= its token */
                    long t = (r0 + r) % qlen - j0;
                    vis = t + 1 < 0 ? 0 : (t + 1 < nk ? t + 1 : nk);
                }
                for (long j = vis; j < nk8; j++) sr[j] = -INFINITY;
                if (vis == 0) { for (long j = 0; j < nk8; j++) sr[j] = 0.f; continue; }
                __m256 vmx = ninf;
                for (long j = 0; j < nk8; j += 8) vmx = _mm256_max_ps(vmx, _mm256_load_ps(sr + j));
                float mx = hmax(vmx);
                float mn = mx > m[r] ? mx : m[r];
                float corr = expf(m[r] - mn);
                __m256 sum = _mm256_setzero_ps(), vm = _mm256_set1_ps(mn);
                for (long j = 0; j < nk8; j += 8) {
                    __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(sr + j), vm));
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
            for (long c = 0; c + 32 <= d; c += 32) {
                long r = 0;
                for (; r + 3 <= nr; r += 3) pv_tile(3, s + r * BK, nk, vb + c, d, acc + r * d + c);
                if (nr - r == 2) pv_tile(2, s + r * BK, nk, vb + c, d, acc + r * d + c);
                if (nr - r == 1) pv_tile(1, s + r * BK, nk, vb + c, d, acc + r * d + c);
            }
            for (long c = d & ~31L; c < d; c += 8)
                for (long r = 0; r < nr; r++) pv_col8(s + r * BK, nk, vb + c, d, acc + r * d + c);
        }
    }
}

/* Attention of `rows` packed query rows per KV head (q, out: [heads][rows][d]) over segments of
 * keys/values; segment g of head h starts at keys[g] + h * kstride[g] (rows of d floats).
 * A causal segment holds the request's qlen new tokens: row r sees its keys j <= r % qlen.
 * Every row must see at least one key. lse (optional): [heads][rows] log-sum-exp of the
 * scaled scores. Returns 0, or -1 when the shapes are unsupported. */
int pl_attend(const float* q, long heads, long rows, long d, float scale, long nseg,
              const float* const* keys, const long* kstride, const float* const* values,
              const long* vstride, const long* lens, const int* causal, long qlen,
              float* out, float* lse, int threads) {
    if (d % 8 || d > MAXD || nseg > 64 || heads <= 0 || rows <= 0) return -1;
    long total = 0;
    for (long g = 0; g < nseg; g++) total += lens[g];
    long rblocks = (rows + MAXR - 1) / MAXR;
    long per_rows = (rows + rblocks - 1) / rblocks;
    /* key ranges per (head, row block): enough tasks for every thread, ranges of whole blocks */
    long units = heads * rblocks;
    long splits = (2 * threads + units - 1) / units;
    if (splits < 1) splits = 1;
    if (splits > 64) splits = 64;
    long span = (total + splits - 1) / splits;
    span = (span + BK - 1) / BK * BK;
    if (span < BK) span = BK;
    splits = (total + span - 1) / span;
    if (splits < 1) splits = 1;
    long tasks = units * splits;
    Partial* parts = (Partial*)malloc(sizeof(Partial) * tasks);
    float* space = (float*)malloc(sizeof(float) * tasks * per_rows * (d + 2));
    float* qs = (float*)malloc(sizeof(float) * heads * rows * d);
    if (!parts || !space || !qs) { free(parts); free(space); free(qs); return -2; }
    for (long t = 0; t < tasks; t++) {
        float* at = space + t * per_rows * (d + 2);
        parts[t].m = at; parts[t].l = at + per_rows; parts[t].acc = at + 2 * per_rows;
    }
    for (long i = 0; i < heads * rows * d; i++) qs[i] = q[i] * scale;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        long u = t / splits, sp = t % splits, h = u / rblocks, rb = u % rblocks;
        long r0 = rb * per_rows, r1 = r0 + per_rows < rows ? r0 + per_rows : rows;
        const float* kh[64]; const float* vh[64];
        for (long g = 0; g < nseg; g++) { kh[g] = keys[g] + h * kstride[g]; vh[g] = values[g] + h * vstride[g]; }
        long a = sp * span, b = a + span < total ? a + span : total;
        attend_part(qs + (h * rows + r0) * d, r0, r1 - r0, d, nseg, kh, vh, lens, causal, qlen,
                    a, b, parts + t);
    }
    /* merge the key ranges of each (head, row block) */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long u = 0; u < units; u++) {
        long h = u / rblocks, rb = u % rblocks;
        long r0 = rb * per_rows, r1 = r0 + per_rows < rows ? r0 + per_rows : rows;
        for (long r = 0; r < r1 - r0; r++) {
            float mx = -INFINITY;
            for (long sp = 0; sp < splits; sp++) {
                float mm = parts[u * splits + sp].m[r];
                mx = mm > mx ? mm : mx;
            }
            float lsum = 0.f, w[64];          /* splits <= 64 */
            for (long sp = 0; sp < splits; sp++) {
                Partial* p = parts + u * splits + sp;
                w[sp] = p->l[r] > 0.f ? expf(p->m[r] - mx) : 0.f;
                lsum += p->l[r] * w[sp];
            }
            float* o = out + (h * rows + r0 + r) * d;
            float inv = lsum > 0.f ? 1.f / lsum : 0.f;
            for (long c = 0; c < d; c++) {
                float v = 0.f;
                for (long sp = 0; sp < splits; sp++) v += parts[u * splits + sp].acc[r * d + c] * w[sp];
                o[c] = v * inv;
            }
            if (lse) lse[h * rows + r0 + r] = lsum > 0.f ? mx + logf(lsum) : -INFINITY;
        }
    }
    free(parts); free(space); free(qs);
    return 0;
}
