/* The memory-bound layers of small conv nets on a CPU, float32, NCHW contiguous, one thread (see fused.py).
 *
 * bn_relu_*: training-mode BatchNorm followed by ReLU. Statistics over (B, H, W) per channel, biased variance,
 * as torch's batch_norm. The sums run over a shift (the channel's first value) so that a mean far from zero
 * costs no precision; each plane's sum is accumulated in float (vectorized), planes in double.
 * max_pool2_*: 2x2 max pooling, stride 2, floor mode. Ties and NaN pick the element torch's CPU kernel picks
 * (the first maximum in row-major order; a NaN wins over numbers, a later NaN over an earlier one), so values
 * and gradients equal torch's bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void bn_relu_forward_f32(const float *restrict x, float *restrict y, const float *restrict weight,
                         const float *restrict bias, float *restrict mean, float *restrict var, int64_t B,
                         int64_t C, int64_t HW, double eps) {
    const double n = (double)B * (double)HW;
    for (int64_t c = 0; c < C; c++) {
        const float shift = x[c * HW];
        double s1 = 0, s2 = 0;
        for (int64_t b = 0; b < B; b++) {
            const float *p = x + (b * C + c) * HW;
            float f1 = 0, f2 = 0;
#pragma omp simd reduction(+ : f1, f2)
            for (int64_t i = 0; i < HW; i++) {
                const float d = p[i] - shift;
                f1 += d;
                f2 += d * d;
            }
            s1 += f1;
            s2 += f2;
        }
        const double m = s1 / n, v = s2 / n - m * m > 0 ? s2 / n - m * m : 0;
        mean[c] = (float)(shift + m);
        var[c] = (float)v;
        const float scale = (float)(weight[c] / sqrt((double)var[c] + eps)), m0 = mean[c], b0 = bias[c];
        for (int64_t b = 0; b < B; b++) {
            const float *p = x + (b * C + c) * HW;
            float *q = y + (b * C + c) * HW;
#pragma omp simd
            for (int64_t i = 0; i < HW; i++) {
                const float t = (p[i] - m0) * scale + b0;
                q[i] = t > 0 ? t : 0;
            }
        }
    }
}

/* dx, dweight, dbias of y = relu(batch_norm(x)) given dy; mean and var as the forward pass returned them. */
void bn_relu_backward_f32(const float *restrict x, const float *restrict y, const float *restrict dy,
                          float *restrict dx, const float *restrict weight, const float *restrict mean,
                          const float *restrict var, float *restrict dweight, float *restrict dbias, int64_t B,
                          int64_t C, int64_t HW, double eps) {
    const double n = (double)B * (double)HW;
    for (int64_t c = 0; c < C; c++) {
        const float m = mean[c];
        double s = 0, sx = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t at = (b * C + c) * HW;
            float f = 0, fx = 0;
#pragma omp simd reduction(+ : f, fx)
            for (int64_t i = 0; i < HW; i++) {
                const float g = y[at + i] > 0 ? dy[at + i] : 0;
                f += g;
                fx += g * (x[at + i] - m);
            }
            s += f;
            sx += fx;
        }
        const double invstd = 1.0 / sqrt((double)var[c] + eps);
        dweight[c] = (float)(sx * invstd);
        dbias[c] = (float)s;
        const float k = (float)(weight[c] * invstd), a = (float)(s / n), r = (float)(sx * invstd * invstd / n);
        for (int64_t b = 0; b < B; b++) {
            const int64_t at = (b * C + c) * HW;
#pragma omp simd
            for (int64_t i = 0; i < HW; i++) {
                const float g = y[at + i] > 0 ? dy[at + i] : 0;
                dx[at + i] = k * (g - a - (x[at + i] - m) * r);
            }
        }
    }
}

/* x: P planes of H x W; out and which (0-3: the window's row-major position of the maximum): P x H/2 x W/2.
 * Branch-free, in chunks of a row through an int32 scratch, so that the compiler vectorizes the windows. */
void max_pool2_forward_f32(const float *restrict x, float *restrict out, uint8_t *restrict which, int64_t P,
                           int64_t H, int64_t W) {
    enum { CHUNK = 256 };
    int32_t at[CHUNK];
    const int64_t H2 = H / 2, W2 = W / 2;
    for (int64_t p = 0; p < P; p++)
        for (int64_t i = 0; i < H2; i++)
            for (int64_t j0 = 0; j0 < W2; j0 += CHUNK) {
                const float *r0 = x + (p * H + 2 * i) * W + 2 * j0, *r1 = r0 + W;
                float *o = out + (p * H2 + i) * W2 + j0;
                uint8_t *k = which + (p * H2 + i) * W2 + j0;
                const int64_t n = W2 - j0 < CHUNK ? W2 - j0 : CHUNK;
                for (int64_t j = 0; j < n; j++) {
                    float best = r0[2 * j], v;
                    int32_t t = 0, c;
                    v = r0[2 * j + 1];
                    c = (v > best) | (v != v);
                    best = c ? v : best;
                    t = c ? 1 : t;
                    v = r1[2 * j];
                    c = (v > best) | (v != v);
                    best = c ? v : best;
                    t = c ? 2 : t;
                    v = r1[2 * j + 1];
                    c = (v > best) | (v != v);
                    best = c ? v : best;
                    t = c ? 3 : t;
                    o[j] = best;
                    at[j] = t;
                }
                for (int64_t j = 0; j < n; j++)
                    k[j] = (uint8_t)at[j];
            }
}

/* dx (P x H x W) from dout and which (P x H/2 x W/2): each window's gradient goes to its maximum, the rest is 0. */
void max_pool2_backward_f32(const float *restrict dout, const uint8_t *restrict which, float *restrict dx,
                            int64_t P, int64_t H, int64_t W) {
    const int64_t H2 = H / 2, W2 = W / 2;
    memset(dx, 0, sizeof(float) * (size_t)(P * H * W));
    for (int64_t p = 0; p < P; p++)
        for (int64_t i = 0; i < H2; i++) {
            const float *g = dout + (p * H2 + i) * W2;
            const uint8_t *k = which + (p * H2 + i) * W2;
            float *d = dx + (p * H + 2 * i) * W;
            for (int64_t j = 0; j < W2; j++)
                d[(k[j] >> 1) * W + 2 * j + (k[j] & 1)] = g[j];
        }
}

/* conv1_*: a convolution of one input channel (a grayscale net's first layer), stride 1, zero padding K/2, odd K,
 * no bias: x (B, 1, H, W), weight (C, 1, K, K), y (B, C, H, W). oneDNN's kernels run at a few GFLOP/s there.
 * Each image is copied into a zero-padded plane of row length W + K - 1; an output plane in that row length is
 * then K*K shifted multiply-adds of the whole plane (long vector loops); the pad columns are dropped at the end. */
/* GCC's and clang's vectors: 16 floats, split by the compiler where the machine's vectors are shorter. */
typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);  /* an unaligned load */
    return v;
}

typedef struct {
    int64_t H, W, K, Wp, n;  /* n: output values per plane in the padded row length */
    float *xp, *yp;
} Planes;

static int planes_open(Planes *s, int64_t H, int64_t W, int64_t K) {
    s->H = H, s->W = W, s->K = K, s->Wp = W + K - 1, s->n = H * s->Wp;
    /* Shifted reads run up to K - 1 values past the padded plane, and the forward pass's last block of 64 up to
     * 63 more (as it writes up to 63 past yp's n): they only make pad columns' outputs, which are dropped. */
    s->xp = calloc((size_t)((H + K - 1) * s->Wp + K + 64), sizeof(float));
    s->yp = malloc(sizeof(float) * (size_t)(s->n + 64));
    return s->xp && s->yp;
}

static void planes_close(Planes *s) {
    free(s->xp);
    free(s->yp);
}

static void planes_load(Planes *s, const float *restrict image) {
    const int64_t p = s->K / 2;
    for (int64_t h = 0; h < s->H; h++)
        memcpy(s->xp + (h + p) * s->Wp + p, image + h * s->W, sizeof(float) * (size_t)s->W);
}

/* Returns 0 when its scratch cannot be allocated (the caller then uses torch's convolution). */
int conv1_forward_f32(const float *restrict x, const float *restrict weight, float *restrict y, int64_t B,
                      int64_t C, int64_t H, int64_t W, int64_t K) {
    Planes s;
    if (!planes_open(&s, H, W, K)) {
        planes_close(&s);
        return 0;
    }
    for (int64_t b = 0; b < B; b++) {
        planes_load(&s, x + b * H * W);
        for (int64_t c = 0; c < C; c++) {
            const float *w = weight + c * K * K;
            /* In blocks of 64 outputs, which stay in registers over the K*K taps. */
            for (int64_t i0 = 0; i0 < s.n; i0 += 64) {
                f32x16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t t = 0; t < K * K; t++) {
                    const float *xs = s.xp + (t / K) * s.Wp + t % K + i0;
                    const float wt = w[t];
                    a0 += wt * load16(xs);
                    a1 += wt * load16(xs + 16);
                    a2 += wt * load16(xs + 32);
                    a3 += wt * load16(xs + 48);
                }
                memcpy(s.yp + i0, &a0, sizeof a0);
                memcpy(s.yp + i0 + 16, &a1, sizeof a1);
                memcpy(s.yp + i0 + 32, &a2, sizeof a2);
                memcpy(s.yp + i0 + 48, &a3, sizeof a3);
            }
            float *out = y + (b * C + c) * H * W;
            for (int64_t h = 0; h < H; h++)
                memcpy(out + h * W, s.yp + h * s.Wp, sizeof(float) * (size_t)W);
        }
    }
    planes_close(&s);
    return 1;
}

/* dweight (C, 1, K, K) of conv1_forward given dy (B, C, H, W); acc: C*K*K doubles of scratch. */
int conv1_weight_grad_f32(const float *restrict x, const float *restrict dy, float *restrict dweight,
                          double *restrict acc, int64_t B, int64_t C, int64_t H, int64_t W, int64_t K) {
    Planes s;
    if (!planes_open(&s, H, W, K)) {
        planes_close(&s);
        return 0;
    }
    memset(acc, 0, sizeof(double) * (size_t)(C * K * K));
    memset(s.yp, 0, sizeof(float) * (size_t)s.n);  /* dy in the padded row length: its pad columns stay 0 */
    for (int64_t b = 0; b < B; b++) {
        planes_load(&s, x + b * H * W);
        for (int64_t c = 0; c < C; c++) {
            const float *g = dy + (b * C + c) * H * W;
            for (int64_t h = 0; h < H; h++)
                memcpy(s.yp + h * s.Wp, g + h * W, sizeof(float) * (size_t)W);
            const float *restrict gp = s.yp;
            for (int64_t t = 0; t < K * K; t++) {
                const float *restrict xs = s.xp + (t / K) * s.Wp + t % K;
                float f = 0;
#pragma omp simd reduction(+ : f)
                for (int64_t i = 0; i < s.n; i++)
                    f += gp[i] * xs[i];
                acc[c * K * K + t] += f;
            }
        }
    }
    for (int64_t i = 0; i < C * K * K; i++)
        dweight[i] = (float)acc[i];
    planes_close(&s);
    return 1;
}
