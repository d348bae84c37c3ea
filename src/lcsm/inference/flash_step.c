/* One step of FlashConv (lcsm/inference/engines.py) for one slot, in one call instead of a few tensor ops.

At D = 64, B = 1 a step is ~100 multiply-adds, and each tensor op costs microseconds of dispatch; this does the
same arithmetic for a few hundred nanoseconds (equal to the tensor path up to rounding: the compiler may fuse a
multiply and an add into one).
Layouts, all contiguous: A, Y (b, B, D), the current block's partial output sums and inputs; rho (b, D), lags
0 .. b-1; acc (D, B, acc_len), the tiles' sums for later outputs; ys (D, B, L), the inputs kept for the tiles.
*/
#include <stdint.h>
#include <string.h>

#define FLASH_STEP(NAME, T)                                                                                     \
  typedef struct {                                                                                              \
    T *A, *Y;                                                                                                   \
    const T *rho;                                                                                               \
    const T *acc;                                                                                               \
    T *ys;                                                                                                      \
    int64_t b, B, D, L, acc_len;                                                                                \
  } NAME##_slot;                                                                                                \
                                                                                                                \
  /* pending: the block was begun by prefill, so the tiles' sums are added to A (and Y kept), not copied. */    \
  void NAME(const NAME##_slot *s, int64_t t, int32_t pending, const T *y, T *z) {                              \
    const int64_t b = s->b, B = s->B, D = s->D, o = t & (b - 1), start = t - o, BD = B * D;                   \
    if (o == 0 || pending) {                                                                                    \
      for (int64_t d = 0; d < D; d++)                                                                           \
        for (int64_t j = 0; j < B; j++) {                                                                       \
          const T *src = s->acc + (d * B + j) * s->acc_len + start;                                             \
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
    if (o == b - 1 && t + 1 < s->L) /* the block is complete: its inputs go where the tiles read them */       \
      for (int64_t d = 0; d < D; d++)                                                                           \
        for (int64_t j = 0; j < B; j++) {                                                                       \
          T *dst = s->ys + (d * B + j) * s->L + start;                                                          \
          for (int64_t i = 0; i < b; i++) dst[i] = s->Y[i * BD + j * D + d];                                    \
        }                                                                                                       \
  }

FLASH_STEP(flash_step_f32, float)
FLASH_STEP(flash_step_f64, double)
