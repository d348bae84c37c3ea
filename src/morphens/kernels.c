/* The memory-bound layers of small conv nets on a CPU, float32, one thread (see fused.py): NCHW contiguous, and
 * channels-last (NHWC in memory) twins further down.
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

/* The maximum of a 2x2 window given in row-major order, by torch's rule; *at = its position (0-3). Branch-free,
 * so that the loops calling it vectorize. */
static inline float window_max(float v0, float v1, float v2, float v3, int32_t *at) {
    float best = v0;
    int32_t t = 0, c;
    c = (v1 > best) | (v1 != v1);
    best = c ? v1 : best;
    t = c ? 1 : t;
    c = (v2 > best) | (v2 != v2);
    best = c ? v2 : best;
    t = c ? 2 : t;
    c = (v3 > best) | (v3 != v3);
    best = c ? v3 : best;
    *at = c ? 3 : t;
    return best;
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
                for (int64_t j = 0; j < n; j++)
                    o[j] = window_max(r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1], &at[j]);
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
 * no bias: x (B, 1, H, W), weight (C, 1, K, K), y (B, C, H, W), or (B, H, W, C) in memory where nhwc. oneDNN's
 * kernels run at a few GFLOP/s there.
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
    int64_t H, W, K, C, Wp, n, stride; /* n: values per plane in the padded row length; stride: between planes */
    float *xp, *yp;                     /* the padded input plane; C output planes (one gradient plane) */
    int32_t *at;                        /* channels-last: where value q of a pixel row lies in the planes */
} Planes;

static int planes_open(Planes *s, int64_t H, int64_t W, int64_t K, int64_t C) {
    s->H = H, s->W = W, s->K = K, s->C = C, s->Wp = W + K - 1, s->n = H * s->Wp, s->stride = s->n + 64;
    /* Shifted reads run up to K - 1 values past the padded plane, and the forward pass's last block of 64 up to
     * 63 more (as it writes up to 63 past a plane's n): they only make pad columns' outputs, which are dropped. */
    s->xp = calloc((size_t)((H + K - 1) * s->Wp + K + 64), sizeof(float));
    s->yp = malloc(sizeof(float) * (size_t)(C * s->stride));
    s->at = malloc(sizeof(int32_t) * (size_t)(W * C));
    if (s->at)  /* an int32 table, so that the compiler vectorizes planes_store's layout change with gathers */
        for (int64_t q = 0; q < W * C; q++)
            s->at[q] = (int32_t)(q % C * s->stride + q / C);
    return s->xp && s->yp && s->at;
}

static int planes_close(Planes *s) { /* returns 0, the failure code */
    free(s->xp);
    free(s->yp);
    free(s->at);
    return 0;
}

static void planes_load(Planes *s, const float *restrict image) {
    const int64_t p = s->K / 2;
    for (int64_t h = 0; h < s->H; h++)
        memcpy(s->xp + (h + p) * s->Wp + p, image + h * s->W, sizeof(float) * (size_t)s->W);
}

/* Image b's C planes to y (channels-last: one gather per pixel row through the table), pad columns dropped. */
static void planes_store(const Planes *s, float *restrict y, int64_t b, int64_t nhwc) {
    const int64_t H = s->H, W = s->W, C = s->C;
    for (int64_t h = 0; h < H; h++) {
        const float *restrict from = s->yp + h * s->Wp;
        if (nhwc) {
            float *restrict out = y + (b * H + h) * W * C;
            for (int64_t q = 0; q < W * C; q++)
                out[q] = from[s->at[q]];
        } else
            for (int64_t c = 0; c < C; c++)
                memcpy(y + ((b * C + c) * H + h) * W, from + c * s->stride, sizeof(float) * (size_t)W);
    }
}

/* Returns 0 where its scratch cannot be allocated. */
int conv1_forward_f32(const float *restrict x, const float *restrict weight, float *restrict y, int64_t B,
                      int64_t C, int64_t H, int64_t W, int64_t K, int64_t nhwc) {
    Planes s;
    if (!planes_open(&s, H, W, K, C))
        return planes_close(&s);
    for (int64_t b = 0; b < B; b++) {
        planes_load(&s, x + b * H * W);
        for (int64_t c = 0; c < C; c++) {
            const float *w = weight + c * K * K;
            float *yc = s.yp + c * s.stride;
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
                memcpy(yc + i0, &a0, sizeof a0);
                memcpy(yc + i0 + 16, &a1, sizeof a1);
                memcpy(yc + i0 + 32, &a2, sizeof a2);
                memcpy(yc + i0 + 48, &a3, sizeof a3);
            }
        }
        planes_store(&s, y, b, nhwc);
    }
    planes_close(&s);
    return 1;
}

/* dweight (C, 1, K, K) of conv1_forward given dy (B, C, H, W); acc: C*K*K doubles of scratch. */
int conv1_weight_grad_f32(const float *restrict x, const float *restrict dy, float *restrict dweight,
                          double *restrict acc, int64_t B, int64_t C, int64_t H, int64_t W, int64_t K,
                          int64_t nhwc) {
    Planes s;
    if (!planes_open(&s, H, W, K, C))
        return planes_close(&s);
    memset(acc, 0, sizeof(double) * (size_t)(C * K * K));
    memset(s.yp, 0, sizeof(float) * (size_t)s.n); /* one channel's dy in the padded row length: pad columns stay 0 */
    for (int64_t b = 0; b < B; b++) {
        planes_load(&s, x + b * H * W);
        for (int64_t c = 0; c < C; c++) {  /* a channel at a time, which stays in L1 over its K*K sums */
            if (nhwc) {
                const float *g = dy + b * H * W * C + c;
                for (int64_t h = 0; h < H; h++)
                    for (int64_t w = 0; w < W; w++)
                        s.yp[h * s.Wp + w] = g[(h * W + w) * C];
            } else {
                const float *g = dy + (b * C + c) * H * W;
                for (int64_t h = 0; h < H; h++)
                    memcpy(s.yp + h * s.Wp, g + h * W, sizeof(float) * (size_t)W);
            }
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

/* The channels-last twins: x is n = B*H*W*C values in memory, value i of channel i % C. They walk it in blocks of
 * L = 16*C values (whole pixels and whole vectors) against per-channel values repeated L/C times, so that every
 * loop is a long vector loop whatever C is; the n % L values left at the end run one by one. */
typedef struct {
    int64_t C, L;
    float *f;  /* 7 arrays of L floats */
    double *d; /* 2 arrays of C doubles */
} Blocks;

static int blocks_open(Blocks *s, int64_t C) {
    s->C = C, s->L = 16 * C;
    s->f = malloc(sizeof(float) * (size_t)(7 * s->L));
    s->d = malloc(sizeof(double) * (size_t)(2 * C));
    return s->f && s->d;
}

static int blocks_close(Blocks *s) {  /* returns 0, the failure code */
    free(s->f);
    free(s->d);
    return 0;
}

static void repeat(const Blocks *s, float *restrict pattern, const float *restrict per_channel) {
    for (int64_t j = 0; j < s->L; j++)
        pattern[j] = per_channel[j % s->C];
}

/* Per-channel sums of two quantities over the n values: BODY adds value i's to fa[j] and fb[j] (j = i mod L, so
 * channel j % C); those L-float partial sums are folded into d[0..C) and d[C..2C) in doubles every 64 blocks, so
 * that no float sum grows long. */
#define CHANNEL_SUMS(s, n, fa, fb, BODY)                                                                       \
    do {                                                                                                        \
        for (int64_t c = 0; c < 2 * (s)->C; c++)                                                               \
            (s)->d[c] = 0;                                                                                      \
        const int64_t whole = (n) / (s)->L * (s)->L;                                                           \
        for (int64_t i0 = 0;; i0 += 64 * (s)->L) {                                                             \
            for (int64_t j = 0; j < (s)->L; j++)                                                               \
                fa[j] = fb[j] = 0;                                                                              \
            const int64_t i1 = i0 + 64 * (s)->L < whole ? i0 + 64 * (s)->L : whole;                           \
            for (int64_t b0 = i0; b0 < i1; b0 += (s)->L) {                                                     \
                _Pragma("omp simd") for (int64_t j = 0; j < (s)->L; j++) {                                     \
                    const int64_t i = b0 + j;                                                                   \
                    BODY                                                                                        \
                }                                                                                               \
            }                                                                                                   \
            if (i1 == whole)                                                                                    \
                for (int64_t i = whole; i < (n); i++) {                                                        \
                    const int64_t j = i - whole;                                                                \
                    BODY                                                                                        \
                }                                                                                               \
            for (int64_t j = 0; j < (s)->L; j++) {                                                             \
                (s)->d[j % (s)->C] += fa[j];                                                                    \
                (s)->d[(s)->C + j % (s)->C] += fb[j];                                                           \
            }                                                                                                   \
            if (i1 == whole)                                                                                    \
                break;                                                                                          \
        }                                                                                                       \
    } while (0)

/* BODY for each value i of the n, with j = i mod L: a vector loop over whole blocks, then the rest one by one. */
#define EACH_VALUE(n, L, BODY)                                                                                 \
    do {                                                                                                        \
        const int64_t whole = (n) / (L) * (L);                                                                 \
        for (int64_t b0 = 0; b0 < whole; b0 += (L)) {                                                          \
            _Pragma("omp simd") for (int64_t j = 0; j < (L); j++) {                                            \
                const int64_t i = b0 + j;                                                                       \
                BODY                                                                                            \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t i = whole; i < (n); i++) {                                                                \
            const int64_t j = i - whole;                                                                        \
            BODY                                                                                                \
        }                                                                                                       \
    } while (0)

int bn_relu_forward_nhwc_f32(const float *restrict x, float *restrict y, const float *restrict weight,
                             const float *restrict bias, float *restrict mean, float *restrict var, int64_t P,
                             int64_t C, double eps) {
    Blocks s;
    if (!blocks_open(&s, C))
        return blocks_close(&s);
    const int64_t n = P * C, L = s.L;
    float *shift = s.f, *f1 = s.f + L, *f2 = s.f + 2 * L, *scale = s.f + 3 * L, *mp = s.f + 4 * L,
          *bp = s.f + 5 * L, *tmp = s.f + 6 * L;
    repeat(&s, shift, x);
    CHANNEL_SUMS(&s, n, f1, f2, {
        const float d = x[i] - shift[j];
        f1[j] += d;
        f2[j] += d * d;
    });
    const double count = (double)P;
    for (int64_t c = 0; c < C; c++) {
        const double m = s.d[c] / count, v = s.d[C + c] / count - m * m > 0 ? s.d[C + c] / count - m * m : 0;
        mean[c] = (float)(x[c] + m);
        var[c] = (float)v;
        tmp[c] = (float)(weight[c] / sqrt((double)var[c] + eps));
    }
    repeat(&s, scale, tmp);
    repeat(&s, mp, mean);
    repeat(&s, bp, bias);
    EACH_VALUE(n, L, {
        const float t = (x[i] - mp[j]) * scale[j] + bp[j];
        y[i] = t > 0 ? t : 0;
    });
    blocks_close(&s);
    return 1;
}

int bn_relu_backward_nhwc_f32(const float *restrict x, const float *restrict y, const float *restrict dy,
                              float *restrict dx, const float *restrict weight, const float *restrict mean,
                              const float *restrict var, float *restrict dweight, float *restrict dbias, int64_t P,
                              int64_t C, double eps) {
    Blocks s;
    if (!blocks_open(&s, C))
        return blocks_close(&s);
    const int64_t n = P * C, L = s.L;
    float *mp = s.f, *f = s.f + L, *fx = s.f + 2 * L, *kp = s.f + 3 * L, *ap = s.f + 4 * L, *rp = s.f + 5 * L,
          *tmp = s.f + 6 * L;
    repeat(&s, mp, mean);
    CHANNEL_SUMS(&s, n, f, fx, {
        const float g = y[i] > 0 ? dy[i] : 0;
        f[j] += g;
        fx[j] += g * (x[i] - mp[j]);
    });
    const double count = (double)P;
    for (int64_t c = 0; c < C; c++) {
        const double invstd = 1.0 / sqrt((double)var[c] + eps), sum = s.d[c], sumx = s.d[C + c];
        dweight[c] = (float)(sumx * invstd);
        dbias[c] = (float)sum;
        tmp[c] = (float)(weight[c] * invstd);
        f[c] = (float)(sum / count);
        fx[c] = (float)(sumx * invstd * invstd / count);
    }
    repeat(&s, kp, tmp);
    repeat(&s, ap, f);
    repeat(&s, rp, fx);
    EACH_VALUE(n, L, {
        const float g = y[i] > 0 ? dy[i] : 0;
        dx[i] = kp[j] * (g - ap[j] - (x[i] - mp[j]) * rp[j]);
    });
    blocks_close(&s);
    return 1;
}

/* x: B x H x W x C; out and which: B x H/2 x W/2 x C (which as in max_pool2_forward_f32). A row of output values
 * reads its windows through one table of offsets (value q = j*C + c starts at input column 2j, channel c), so that
 * the compiler vectorizes across pixels and channels alike with gathers, whatever C is. Returns 0 where the table
 * cannot be allocated. */
int max_pool2_forward_nhwc_f32(const float *restrict x, float *restrict out, uint8_t *restrict which, int64_t B,
                               int64_t H, int64_t W, int64_t C) {
    const int64_t H2 = H / 2, n = W / 2 * C;
    int32_t *off = malloc(sizeof(int32_t) * (size_t)(2 * n)), *at = off + n;
    if (!off)
        return 0;
    for (int64_t q = 0; q < n; q++)
        off[q] = (int32_t)(q + q / C * C);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < H2; i++) {
            const float *r0 = x + (b * H + 2 * i) * W * C, *r1 = r0 + W * C;
            float *o = out + (b * H2 + i) * n;
            for (int64_t q = 0; q < n; q++)
                o[q] = window_max(r0[off[q]], r0[off[q] + C], r1[off[q]], r1[off[q] + C], &at[q]);
            uint8_t *k = which + (b * H2 + i) * n;
            for (int64_t q = 0; q < n; q++)
                k[q] = (uint8_t)at[q];
        }
    free(off);
    return 1;
}

/* Each input value of a window row pulls its output's gradient where it was the maximum, else 0, through tables
 * as in the forward pass: contiguous stores, no scatter. A last odd row or column gets 0. */
int max_pool2_backward_nhwc_f32(const float *restrict dout, const uint8_t *restrict which, float *restrict dx,
                                int64_t B, int64_t H, int64_t W, int64_t C) {
    const int64_t H2 = H / 2, n = W / 2 * C, row = W * C;
    int32_t *from = malloc(sizeof(int32_t) * (size_t)(5 * n)), *column = from + 2 * n, *k = column + 2 * n;
    if (!from)
        return 0;
    for (int64_t u = 0; u < 2 * n; u++) {
        from[u] = (int32_t)(u / (2 * C) * C + u % C);
        column[u] = (int32_t)(u / C % 2);
    }
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < H2; i++) {
            const float *g = dout + (b * H2 + i) * n;
            const uint8_t *w = which + (b * H2 + i) * n;
            for (int64_t q = 0; q < n; q++)
                k[q] = w[q];
            float *d0 = dx + (b * H + 2 * i) * row, *d1 = d0 + row;
            for (int64_t u = 0; u < 2 * n; u++) {
                const int32_t q = from[u], t = k[q];
                const float v = g[q];
                d0[u] = t == column[u] ? v : 0.0f;
                d1[u] = t == 2 + column[u] ? v : 0.0f;
            }
            memset(d0 + 2 * n, 0, sizeof(float) * (size_t)(row - 2 * n));
            memset(d1 + 2 * n, 0, sizeof(float) * (size_t)(row - 2 * n));
        }
        memset(dx + (b * H + 2 * H2) * row, 0, sizeof(float) * (size_t)((H - 2 * H2) * row));
    }
    free(from);
    return 1;
}
