/* Training-mode BatchNorm + ReLU, optionally followed by 2x2 max pooling, over channels-last (NHWC) float32
 * memory, one thread (see native.py for why and when).
 *
 * Statistics are over the N * H * W pixels of each channel, variance biased, as torch's batch_norm; sums run in
 * double. Dense passes walk the memory in tiles of TILE whole pixels, so that per-channel vectors repeated TILE
 * times line up with any channel count and the loops vectorize. Pooling (stride 2, floor mode) scans each window in
 * row-major order and keeps the first maximum, a NaN winning over numbers and a later NaN over an earlier one, as
 * torch's CPU kernel does. The backward pass reads each window's winner (its offset and its value, saved by the
 * forward pass) in output order and adds its gradient there: on this CPU, vector gathers from memory the
 * convolutions have since evicted cost more than the whole pass (benchmarks/RESULTS.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16
#define FLUSH 64 /* tiles summed in float before their sums move to double */

/* Per-channel sums of g and g * (x - m) in double, g and x given per element by G and X (macros of i, the element,
 * and j = i mod T, its place in a tile of T = TILE * C values; channel j % C) over n elements. */
#define SUMS(n, G, X)                                                                                          \
    do {                                                                                                        \
        const int64_t tiles_ = (n) / T;                                                                         \
        for (int64_t t0 = 0; t0 < tiles_; t0 += FLUSH) {                                                       \
            for (int64_t j = 0; j < T; j++) f1[j] = f2[j] = 0;                                                 \
            const int64_t t1 = t0 + FLUSH < tiles_ ? t0 + FLUSH : tiles_;                                       \
            for (int64_t t = t0; t < t1; t++) {                                                                 \
                _Pragma("omp simd") for (int64_t j = 0; j < T; j++) {                                          \
                    const int64_t i = t * T + j;                                                                \
                    const float g = (G), x = (X);                                                               \
                    f1[j] += g;                                                                                 \
                    f2[j] += g * (x - m[j]);                                                                    \
                }                                                                                               \
            }                                                                                                   \
            for (int64_t j = 0; j < T; j++) d[j] += f1[j], d[T + j] += f2[j];                                 \
        }                                                                                                       \
        for (int64_t j = 0; j < T; j++) s[j % C] += d[j], s[C + j % C] += d[T + j];                           \
        for (int64_t i = tiles_ * T; i < (n); i++) {                                                            \
            const int64_t j = i % C;                                                                            \
            const float g = (G), x = (X);                                                                       \
            s[j] += g, s[C + j] += (double)g * (x - m[j]);                                                      \
        }                                                                                                       \
    } while (0)

/* mean, var (biased) of z; scale = weight * rstd, shift = bias - mean * scale, the last two repeated n times. */
static int statistics(const float *z, int64_t P, int64_t C, const float *weight, const float *bias, double eps,
                      float *mean, float *var, float *scale, float *shift, int64_t n) {
    const int64_t T = TILE * C;
    float *row = malloc(sizeof(float) * 3 * T);
    double *s = calloc(2 * C, sizeof(double)), *d = calloc(2 * T, sizeof(double));
    if (!row || !s || !d) {
        free(row), free(s), free(d);
        return 0;
    }
    /* Sums of z - m and its square around the first pixel's values: a mean far from zero costs no precision. */
    float *m = row, *f1 = row + T, *f2 = row + 2 * T;
    for (int64_t j = 0; j < T; j++) m[j] = z[j % C];
    SUMS(P * C, z[i] - m[j], z[i]);
    for (int64_t c = 0; c < C; c++) {
        const double dm = s[c] / P, v = s[C + c] / P - dm * dm;
        mean[c] = (float)(z[c] + dm);
        var[c] = (float)(v > 0 ? v : 0);
        const double a = weight[c] / sqrt((double)var[c] + eps);
        for (int64_t k = 0; k < n; k++) {
            scale[k * C + c] = (float)a;
            shift[k * C + c] = (float)(bias[c] - mean[c] * a);
        }
    }
    free(row), free(s), free(d);
    return 1;
}

static inline float relu(float t) { return t < 0 ? 0 : t; } /* keeps a NaN, as torch's relu */

/* y = relu(batch_norm(z)) (pool == 0, y of z's shape) or its 2x2 max pooling (pool == 1, y, at_out and z_out of
 * shape (N, H / 2, W / 2, C): each output's winner, its offset in z and its z). Returns 0 where scratch memory could
 * not be had. */
int bn_relu_pool_forward(const float *restrict z, float *restrict y, int32_t *restrict at_out, float *restrict z_out,
                         const float *restrict weight, const float *restrict bias, float *restrict mean,
                         float *restrict var, int64_t N, int64_t H, int64_t W, int64_t C, double eps, int pool) {
    const int64_t P = N * H * W, RW = W * C;
    const int64_t n = pool ? 2 * W : TILE; /* scratch: two image rows, or one tile */
    float *buf = malloc(sizeof(float) * 2 * n * C + sizeof(float) * 2 * RW);
    if (!buf) return 0;
    float *scale = buf, *shift = buf + n * C, *r = buf + 2 * n * C;
    if (!statistics(z, P, C, weight, bias, eps, mean, var, scale, shift, n)) {
        free(buf);
        return 0;
    }
    if (!pool) {
        const int64_t T = TILE * C, tiles = P / TILE;
        for (int64_t t = 0; t < tiles; t++) {
            const float *p = z + t * T;
            float *q = y + t * T;
#pragma omp simd
            for (int64_t j = 0; j < T; j++) q[j] = relu(p[j] * scale[j] + shift[j]);
        }
        for (int64_t i = tiles * T; i < P * C; i++) y[i] = relu(z[i] * scale[i % C] + shift[i % C]);
        free(buf);
        return 1;
    }
    const int64_t OH = H / 2, OW = W / 2, OR = OW * C;
    float *r0 = r, *r1 = r + RW;
    int32_t *at = malloc(sizeof(int32_t) * OR); /* an output's top-left input within the row pair */
    if (!at) {
        free(buf);
        return 0;
    }
    for (int64_t j = 0; j < OR; j++) at[j] = (int32_t)(2 * (j / C) * C + j % C);
    for (int64_t b = 0; b < N; b++) {
        for (int64_t oh = 0; oh < OH; oh++) {
            const float *z0 = z + ((b * H + 2 * oh) * W) * C, *z1 = z0 + RW;
#pragma omp simd
            for (int64_t j = 0; j < RW; j++) {
                r0[j] = relu(z0[j] * scale[j] + shift[j]);
                r1[j] = relu(z1[j] * scale[j] + shift[j]);
            }
            float *out = y + (b * OH + oh) * OR;
            int32_t *k = at_out + (b * OH + oh) * OR;
            float *zk = z_out + (b * OH + oh) * OR;
            const int32_t base = (int32_t)(z0 - z);
#pragma omp simd
            for (int64_t j = 0; j < OR; j++) { /* branch-free: the winners are data, not predictable */
                const int32_t s = at[j];
                float v = r0[s], q = r0[s + C];
                int w = 0, u = q > v || q != q;
                v = u ? q : v, w = u ? 1 : w;
                q = r1[s], u = q > v || q != q;
                v = u ? q : v, w = u ? 2 : w;
                q = r1[s + C], u = q > v || q != q;
                v = u ? q : v, w = u ? 3 : w;
                const int32_t at = s + (w & 1) * (int32_t)C + (w >> 1) * (int32_t)RW;
                out[j] = v;
                k[j] = base + at;
                zk[j] = z0[at];
            }
        }
    }
    free(at);
    free(buf);
    return 1;
}

/* dz, dweight, dbias given dy (of y's shape; pooled or not, as in the forward pass), mean and var as the forward
 * pass returned them and, pooled, at_out and z_out. The ReLU's mask is recomputed from z (y > 0 where
 * z * scale + shift > 0). Unpooled: g = dy where the ReLU passed, its sums, then dz = a * g + b * z + c per channel
 * (the batch norm's backward with the statistics' gradients folded in). Pooled: the sums run over the outputs
 * (their winners' z read in order from z_out), dz = b * z + c is written densely, then a * g added at each winner. */
int bn_relu_pool_backward(const float *restrict z, const float *restrict dy, const int32_t *restrict at_out,
                          const float *restrict z_out, float *restrict dz, const float *restrict weight,
                          const float *restrict bias,
                          const float *restrict mean, const float *restrict var, float *restrict dweight,
                          float *restrict dbias, int64_t N, int64_t H, int64_t W, int64_t C, double eps, int pool) {
    const int64_t P = N * H * W, T = TILE * C, n_out = pool ? N * (H / 2) * (W / 2) * C : P * C;
    float *row = malloc(sizeof(float) * 8 * T);
    double *s = calloc(2 * C, sizeof(double)), *d = calloc(2 * T, sizeof(double));
    if (!row || !s || !d) {
        free(row), free(s), free(d);
        return 0;
    }
    float *sc = row, *sh = row + T, *m = row + 2 * T, *f1 = row + 3 * T, *f2 = row + 4 * T;
    float *a = row + 5 * T, *b = row + 6 * T, *c0 = row + 7 * T;
    for (int64_t j = 0; j < T; j++) { /* as statistics() computes them, so that the ReLU's mask is the same */
        const int64_t c = j % C;
        const double ac = weight[c] / sqrt((double)var[c] + eps);
        sc[j] = (float)ac;
        sh[j] = (float)(bias[c] - mean[c] * ac);
        m[j] = mean[c];
    }
    if (pool)
        SUMS(n_out, z_out[i] * sc[j] + sh[j] > 0 ? dy[i] : 0.0f, z_out[i]);
    else
        SUMS(n_out, z[i] * sc[j] + sh[j] > 0 ? dy[i] : 0.0f, z[i]);
    for (int64_t j = 0; j < T; j++) {
        const int64_t c = j % C;
        const double rstd = 1 / sqrt((double)var[c] + eps), ac = weight[c] * rstd;
        const double bc = -ac * rstd * (s[C + c] * rstd) / P;
        a[j] = (float)ac;
        b[j] = (float)bc;
        c0[j] = (float)(-ac * s[c] / P - bc * mean[c]);
    }
    for (int64_t c = 0; c < C; c++) {
        dbias[c] = (float)s[c];
        dweight[c] = (float)(s[C + c] / sqrt((double)var[c] + eps));
    }
    const int64_t tiles = P / TILE;
    for (int64_t t = 0; t < tiles; t++) {
        const float *p = z + t * T, *g = dy + t * T;
        float *restrict q = dz + t * T;
        if (pool) {
#pragma omp simd
            for (int64_t j = 0; j < T; j++) q[j] = p[j] * b[j] + c0[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < T; j++)
                q[j] = (p[j] * sc[j] + sh[j] > 0 ? g[j] : 0.0f) * a[j] + p[j] * b[j] + c0[j];
        }
    }
    for (int64_t i = tiles * T; i < P * C; i++) {
        const int64_t c = i % C;
        const float g = !pool && z[i] * sc[c] + sh[c] > 0 ? dy[i] : 0.0f;
        dz[i] = g * a[c] + z[i] * b[c] + c0[c];
    }
    if (pool) /* one scalar read-modify-write a window: cheaper here than a vector scatter or gather */
        for (int64_t o = 0; o < n_out; o += C)
            for (int64_t c = 0; c < C; c++) {
                dz[at_out[o + c]] += z_out[o + c] * sc[c] + sh[c] > 0 ? dy[o + c] * a[c] : 0.0f;
            }
    free(row), free(s), free(d);
    return 1;
}
