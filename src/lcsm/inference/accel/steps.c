/* Engine steps in C, loaded by native.py.

First, one step of FlashConv (lcsm/inference/engines.py) for one slot, in one call instead of a few tensor ops.

At D = 64, B = 1 a step is ~100 multiply-adds, and each tensor op costs microseconds of dispatch; this does the
same arithmetic for a few hundred nanoseconds (equal to the tensor path up to rounding: the compiler may fuse a
multiply and an add into one).
Layouts, all contiguous: A, Y (b, B, D), the current block's partial output sums and inputs; rho (b, D), lags
0 .. b-1; rows (D, B, row_len), per position p the tiles' sums for output p until p's block begins, then (once the
block is complete) the input y_p, which the tiles read; filter (D, L), the slot's filters.
The smallest tiles (sizes b up to `tiles`, after a block whose end is an odd multiple of the size) are done here
too, directly, along each row: U^2 multiply-adds, which at these sizes cost less than FFTs or a batched matmul in
torch (cold caches, four tensor ops).
*/
#ifndef _POSIX_C_SOURCE /* for clock_gettime under -std=c11 (Python.h defines a newer one) */
#define _POSIX_C_SOURCE 199309L
#endif
#include <stdint.h>
#include <string.h>
#include <time.h>

#define FLASH_STEP(NAME, T)                                                                                     \
  typedef struct {                                                                                              \
    T *A, *Y;                                                                                                   \
    const T *rho;                                                                                               \
    T *rows;                                                                                                    \
    const T *filter;                                                                                            \
    int64_t b, B, D, L, row_len;                                                                                \
    int64_t pending; /* the block was begun by prefill: the tiles' sums are added to A (and Y kept), not copied */ \
    int64_t tiles;   /* the largest tile size done here (0: none) */                                           \
  } NAME##_slot;                                                                                                \
                                                                                                                \
  void NAME(NAME##_slot *s, int64_t t, const T *y, T *z) {                                                      \
    const int64_t b = s->b, B = s->B, D = s->D, o = t & (b - 1), start = t - o, BD = B * D;                   \
    const int64_t pending = s->pending;                                                                         \
    s->pending = 0;                                                                                             \
    if (o == 0 || pending) {                                                                                    \
      for (int64_t d = 0; d < D; d++)                                                                           \
        for (int64_t j = 0; j < B; j++) {                                                                       \
          const T *src = s->rows + (d * B + j) * s->row_len + start;                                            \
          for (int64_t i = 0; i < b; i++) {                                                                     \
            T *dst = s->A + i * BD + j * D + d;                                                                 \
            *dst = pending ? *dst + src[i] : src[i];                                                            \
          }                                                                                                     \
        }                                                                                                       \
      if (!pending) memset(s->Y, 0, sizeof(T) * b * BD);                                                        \
    }                                                                                                           \
    const T *A_o = s->A + o * BD;                                                                               \
    for (int64_t j = 0; j < B; j++)                                                                             \
      for (int64_t d = 0; d < D; d++) z[j * D + d] = A_o[j * D + d] + y[j * D + d] * s->rho[d];                 \
    for (int64_t k = 1; o + k < b; k++) { /* y_o reaches the block's later outputs through lags 1 .. b-1-o */   \
      T *A_k = s->A + (o + k) * BD;                                                                             \
      const T *rho_k = s->rho + k * D;                                                                          \
      for (int64_t j = 0; j < B; j++)                                                                           \
        for (int64_t d = 0; d < D; d++) A_k[j * D + d] += y[j * D + d] * rho_k[d];                              \
    }                                                                                                           \
    memcpy(s->Y + o * BD, y, sizeof(T) * BD);                                                                   \
    if (o < b - 1 || t + 1 >= s->L) return;                                                                     \
    for (int64_t d = 0; d < D; d++) /* the block is complete: its inputs go where the tiles read them */         \
      for (int64_t j = 0; j < B; j++) {                                                                         \
        T *dst = s->rows + (d * B + j) * s->row_len + start;                                                    \
        for (int64_t i = 0; i < b; i++) dst[i] = s->Y[i * BD + j * D + d];                                      \
      }                                                                                                         \
    const int64_t U = (t + 1) & -(t + 1); /* the tile launched after this block: inputs t-U+1 .. t */          \
    if (U > s->tiles) return;                                                                                   \
    const int64_t outs = t + U < s->L ? U : s->L - 1 - t;                                                       \
    for (int64_t d = 0; d < D; d++)                                                                             \
      for (int64_t j = 0; j < B; j++) {                                                                         \
        T *row = s->rows + (d * B + j) * s->row_len;                                                            \
        const T *y_k = row + t - U + 1, *lags = s->filter + d * s->L + U; /* lags[m - k]: lag U + m - k */      \
        T *out = row + t + 1;                                                                                   \
        for (int64_t k = 0; k < U; k++) {                                                                       \
          const T y_in = y_k[k], *f = lags - k;                                                                 \
          _Pragma("omp simd") for (int64_t m = 0; m < outs; m++) out[m] += y_in * f[m];                         \
        }                                                                                                       \
      }                                                                                                         \
  }

FLASH_STEP(flash_step_f32, float)
FLASH_STEP(flash_step_f64, double)

/* One step of LazyConv for one slot at batch 1: stores y_t, then z_t[d] = sum_{i <= t} rho[d, i] * y_i[d] over the
whole history in one pass (the tensor path multiplies into a buffer, then sums it: four passes over memory). At
B > 1 the tensor path's batched matrix-vector product is the faster and stays. Layouts: y_DL (D, L), the inputs per channel; rho_rev (D, L), each filter reversed. */
#define LAZY_STEP(NAME, T)                                                                                      \
  void NAME(T *y_DL, const T *rho_rev, int64_t D, int64_t L, int64_t t, const T *y, T *z) {                     \
    for (int64_t d = 0; d < D; d++) {                                                                           \
      T *hist = y_DL + d * L;                                                                                   \
      const T *r = rho_rev + d * L + (L - 1 - t);                                                               \
      hist[t] = y[d];                                                                                           \
      T acc = 0;                                                                                                \
      _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i <= t; i++) acc += r[i] * hist[i];           \
      z[d] = acc;                                                                                               \
    }                                                                                                           \
  }

LAZY_STEP(lazy_step_f32, float)
LAZY_STEP(lazy_step_f64, double)

/* block_exit of lcsm/inference/decode.py for one token, in one call: the last gate and out_proj of one block, its
MLP, then the next block's RMSNorm, in_proj and short conv (or the head, as a "next block" whose in_proj is the
output layer). Weights are decode.ExitBlock's: out_w (D, D), w1 (D, H), w2 (H, D), in_w (D, C) and conv_w (K, C)
with C = G D, row-major. The ring (B, K, C) holds in_proj's outputs of the last K positions, oldest first, and
moves on by one here. Equal to the tensor version up to rounding. */
#include <math.h>

/* erf in float32 as x P(x^2) / Q(x^2) on [-4, 4] (beyond it erf is +-1 to float32's precision); the coefficients
were fitted for this file by reweighted least squares. At most 3.5e-7 from the exact erf (libm's erff: 3e-8), and
unlike a call to erff it vectorizes. */
static inline float erf_f32(float x) {
  x = x < -4.f ? -4.f : (x > 4.f ? 4.f : x);
  const float s = x * x;
  const float p = 1.128378987e+00f +
                  s * (1.965912282e-01f +
                       s * (5.350906402e-02f + s * (4.016997758e-03f + s * (2.881227119e-04f + s * 1.969590585e-06f))));
  const float q = 1.f + s * (5.075555444e-01f +
                             s * (1.166144833e-01f + s * (1.547174249e-02f + s * (1.219161903e-03f + s * 3.743017078e-05f))));
  const float r = x * p / q; /* may exceed 1 by an ulp near |x| = 4 */
  return r > 1.f ? 1.f : (r < -1.f ? -1.f : r);
}

void erf_f32_array(const float *x, float *y, int64_t n) { /* for the tests */
  for (int64_t i = 0; i < n; i++) y[i] = erf_f32(x[i]);
}

#define BLOCK_EXIT(NAME, T, SQRT, ERF)                                                                          \
  typedef struct {                                                                                              \
    const T *out_w, *out_b, *w1, *w2, *in_w, *in_b, *conv_w, *conv_b;                                           \
    T *ring, *scratch; /* scratch: 3 D + H + C */                                                                \
    int64_t B, D, H, C, K;                                                                                      \
    T D_eps;                                                                                                    \
  } NAME##_args;                                                                                                \
                                                                                                                \
  static void NAME##_gemv(const T *x, const T *W, int64_t n, int64_t m, T *y) { /* y += x (n) @ W (n, m) */     \
    for (int64_t k = 0; k < n; k++) {                                                                           \
      const T xk = x[k], *row = W + k * m;                                                                      \
      for (int64_t j = 0; j < m; j++) y[j] += xk * row[j];                                                      \
    }                                                                                                           \
  }                                                                                                             \
                                                                                                                \
  static T NAME##_rms_scale(const T *x, int64_t n, T D_eps) {                                                   \
    T ss = 0;                                                                                                   \
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];                                                          \
    return 1 / SQRT(ss + D_eps);                                                                                \
  }                                                                                                             \
                                                                                                                \
  void NAME(const NAME##_args *s, const T *x, const T *z, const T *gate, T *out, T *u) {                        \
    const int64_t D = s->D, H = s->H, C = s->C, K = s->K;                                                       \
    T *gz = s->scratch, *h = gz + D, *o = h + D, *a = o + D, *p = a + H;                                        \
    for (int64_t b = 0; b < s->B; b++) {                                                                        \
      const T *xb = x + b * D, *zb = z + b * D, *gb = gate + b * D;                                             \
      for (int64_t d = 0; d < D; d++) gz[d] = gb[d] * zb[d], h[d] = xb[d];                                      \
      NAME##_gemv(gz, s->out_w, D, D, h);                                                                       \
      for (int64_t d = 0; d < D; d++) h[d] += s->out_b[d];                                                      \
      const T scale_h = NAME##_rms_scale(h, D, s->D_eps);                                                       \
      for (int64_t j = 0; j < H; j++) a[j] = 0;                                                                 \
      NAME##_gemv(h, s->w1, D, H, a);                                                                           \
      _Pragma("omp simd") for (int64_t j = 0; j < H; j++) a[j] *= scale_h, a[j] += a[j] * ERF(a[j]);            \
      for (int64_t d = 0; d < D; d++) o[d] = h[d];                                                              \
      NAME##_gemv(a, s->w2, H, D, o);                                                                           \
      const T scale_o = NAME##_rms_scale(o, D, s->D_eps);                                                       \
      for (int64_t d = 0; d < D; d++) out[b * D + d] = o[d], o[d] *= scale_o;                                   \
      for (int64_t c = 0; c < C; c++) p[c] = 0;                                                                 \
      NAME##_gemv(o, s->in_w, D, C, p);                                                                         \
      T *ring = s->ring + b * K * C, *ub = u + b * C;                                                           \
      memmove(ring, ring + C, sizeof(T) * (K - 1) * C);                                                         \
      for (int64_t c = 0; c < C; c++) ring[(K - 1) * C + c] = p[c] + s->in_b[c], ub[c] = s->conv_b[c];          \
      for (int64_t k = 0; k < K; k++)                                                                           \
        for (int64_t c = 0; c < C; c++) ub[c] += ring[k * C + c] * s->conv_w[k * C + c];                        \
    }                                                                                                           \
  }

BLOCK_EXIT(block_exit_f32, float, sqrtf, erf_f32)
BLOCK_EXIT(block_exit_f64, double, sqrt, erf)

/* One generated token in one call: decode.NativeDecodeState with a flash or lazy engine whose steps are in C. The
embedding, then per block the boundary before it (block_exit: the previous block's end and this one's entry), its
long convolutions' steps with the gates between them, and the head; the same arithmetic as the per-call path.
Tiles beyond flash's two smallest are FFTs in torch: the caller runs them after the call (they feed later positions).
Layouts:
x[i] (B, D) site i's output; u[i] (B, N_i + 1, D) block i's short conv output (the value, then its N_i gates);
flash[slot] the engine's slots, or NULL and lazy_y, lazy_rho (lazy at B = 1); embedded, z, gate scratch (B, D).
Returns 0, or -1 when a token is outside [0, vocab) (nothing is written then). */
#define DECODE_TOKEN(NAME, T, EXIT, FLASH, LAZY)                                                                \
  typedef struct {                                                                                              \
    const T *embedding;                                                                                         \
    const EXIT##_args *const *sites;                                                                            \
    T *const *x, *const *u;                                                                                     \
    const int64_t *orders;                                                                                      \
    FLASH##_slot *const *flash;                                                                                 \
    T *const *lazy_y;                                                                                           \
    const T *const *lazy_rho;                                                                                   \
    T *embedded, *v, *z, *gate;                                                                                 \
    int64_t B, D, vocab, blocks, L;                                                                             \
    int64_t timed, engine_ns; /* when timed, the nanoseconds spent in the engine's steps, summed */             \
  } NAME##_args;                                                                                                \
                                                                                                                \
  static int64_t NAME##_ns(void) {                                                                              \
    struct timespec ts;                                                                                         \
    clock_gettime(CLOCK_MONOTONIC, &ts);                                                                        \
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;                                                        \
  }                                                                                                             \
                                                                                                                \
  int32_t NAME(NAME##_args *s, int64_t t, const int64_t *tokens, T *logits) {                                   \
    const int64_t B = s->B, D = s->D;                                                                           \
    for (int64_t j = 0; j < B; j++)                                                                             \
      if (tokens[j] < 0 || tokens[j] >= s->vocab) return -1;                                                    \
    for (int64_t j = 0; j < B; j++) memcpy(s->embedded + j * D, s->embedding + tokens[j] * D, sizeof(T) * D);   \
    memset(s->z, 0, sizeof(T) * B * D); /* the embedding enters as a block output whose weights are zero */     \
    memset(s->gate, 0, sizeof(T) * B * D);                                                                      \
    const T *x = s->embedded;                                                                                   \
    int64_t slot = 0;                                                                                           \
    for (int64_t i = 0; i < s->blocks; i++) {                                                                   \
      EXIT(s->sites[i], x, s->z, s->gate, s->x[i], s->u[i]);                                                    \
      x = s->x[i];                                                                                              \
      const int64_t N = s->orders[i], G = N + 1;                                                                \
      for (int64_t j = 0; j < B; j++) memcpy(s->v + j * D, s->u[i] + j * G * D, sizeof(T) * D);                 \
      for (int64_t n = 0; n < N; n++, slot++) {                                                                 \
        const int64_t start = s->timed ? NAME##_ns() : 0;                                                       \
        if (s->flash)                                                                                           \
          FLASH(s->flash[slot], t, s->v, s->z);                                                                 \
        else                                                                                                    \
          LAZY(s->lazy_y[slot], s->lazy_rho[slot], D, s->L, t, s->v, s->z);                                     \
        if (s->timed) s->engine_ns += NAME##_ns() - start;                                                      \
        for (int64_t j = 0; j < B; j++) {                                                                       \
          const T *g = s->u[i] + (j * G + 1 + n) * D;                                                           \
          if (n < N - 1)                                                                                        \
            for (int64_t d = 0; d < D; d++) s->v[j * D + d] = g[d] * s->z[j * D + d];                           \
          else                                                                                                  \
            memcpy(s->gate + j * D, g, sizeof(T) * D);                                                          \
        }                                                                                                       \
      }                                                                                                         \
    }                                                                                                           \
    EXIT(s->sites[s->blocks], x, s->z, s->gate, s->x[s->blocks], logits);                                       \
    return 0;                                                                                                   \
  }

DECODE_TOKEN(decode_token_f32, float, block_exit_f32, flash_step_f32, lazy_step_f32)
DECODE_TOKEN(decode_token_f64, double, block_exit_f64, flash_step_f64, lazy_step_f64)
