// Matrix products for a few activation rows (decoding) on the CPU: float32 weights, and weight-only int8 / int4:
//
//   tinyformer::f32_linear(x, w, b)      y_mo = sum_i x_mi w_oi (+ b_o)
//   tinyformer::int8_linear(x, q, s)     y_mo = sum_g s_og sum_{i in g} x_mi q_oi
//   tinyformer::int4_linear(x, q, s, z)  y_mo = sum_g sum_{i in g} x_mi (s_og u_oi + z_og - 8 s_og)
//
// x (M, K) float, q int8 (N, K) or uint8 (N, K/2) (column 2j in the low nibble, 2j+1 in the high one),
// w float32 (N, K), nn.Linear's own layout; s and z float32 (N, K/G): the portable layout of tinyformer.components.quantized, read in place.
// y (M, N) has x's dtype. Each weight is read once per call and widened to float32 in registers (never
// written back as a float matrix): decoding is bound by the bytes of weights read.
//
// AVX-512 (F, BW, VL) when the CPU has it, else AVX2 + FMA, checked at run time; a plain C++ loop otherwise
// (each op's `path` argument can force one). Output rows are split across threads with at::parallel_for
// (torch's thread count).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TF_X86 1
#endif

namespace {

constexpr int64_t kRowBlock = 4;  // output rows sharing each loaded activation chunk
// Bytes ahead of each row's loads that are prefetched: decoding streams every weight from memory once,
// and the hardware prefetcher alone left the int8 kernel reading slower than float32's sgemv.
constexpr int64_t kPrefetch = 4096;
constexpr int64_t kMaxBatch = 2;  // activation rows sharing each widened weight chunk (registers: 2 x 4 x 2)

// ------------------------------------------------------------------ plain C++ (any CPU)

void int8_rows_plain(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s, int64_t G,
                     float* y, int64_t N, int64_t o0, int64_t o1) {
  const int64_t ng = K / G;
  for (int64_t o = o0; o < o1; ++o) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        float p = 0.f;
        for (int64_t i = g * G; i < (g + 1) * G; ++i) p += x[m * K + i] * static_cast<float>(q[o * K + i]);
        acc += s[o * ng + g] * p;
      }
      y[m * N + o] = acc;
    }
  }
}

// float32 weights: M activation rows against each weight row in turn (sequential sums: row-independent too)
void f32_rows_plain(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t o0,
                    int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t i = 0; i < K; ++i) acc += x[m * K + i] * w[o * K + i];
      y[m * N + o] = acc;
    }
}

void int4_rows_plain(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s, const float* z,
                     int64_t G, float* y, int64_t N, int64_t o0, int64_t o1) {
  const int64_t ng = K / G;
  for (int64_t o = o0; o < o1; ++o) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        float p = 0.f, xs = 0.f;
        for (int64_t i = g * G; i < (g + 1) * G; ++i) {
          const uint8_t b = q[o * (K / 2) + i / 2];
          const int u = (i & 1) ? (b >> 4) : (b & 15);
          p += x[m * K + i] * static_cast<float>(u - 8);
          xs += x[m * K + i];
        }
        acc += s[o * ng + g] * p + z[o * ng + g] * xs;
      }
      y[m * N + o] = acc;
    }
  }
}

#ifdef TF_X86
// ------------------------------------------------------------------ AVX-512

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// R output rows o..o+R-1 times MB activation rows. Within a group the products x q are summed unscaled
// (p), then scaled once per group; PER_ROW (one group per row, G = K) scales once at the end.
template <int MB, int R, bool PER_ROW>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void int8_block_avx512(
    const float* x, int64_t K, const int8_t* q, const float* s, int64_t G, float* y, int64_t N, int64_t o) {
  const int64_t ng = K / G;
  __m512 acc[R][MB], p[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) p[r][m] = _mm512_setzero_ps();
    const int64_t end = (g + 1) * G;
    for (int64_t c = g * G; c < end; c += 16) {
      const __mmask16 mk = tail_mask(end - c);
      __m512 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm512_maskz_loadu_ps(mk, x + m * K + c);
      for (int r = 0; r < R; ++r) {
        if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + (o + r) * K + c) + kPrefetch, _MM_HINT_T0);
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, q + (o + r) * K + c)));
        for (int m = 0; m < MB; ++m) p[r][m] = _mm512_fmadd_ps(xv[m], w, p[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (PER_ROW) {
        for (int m = 0; m < MB; ++m) acc[r][m] = p[r][m];
      } else {
        const __m512 sc = _mm512_set1_ps(s[(o + r) * ng + g]);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(p[r][m], sc, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      const float v = _mm512_reduce_add_ps(acc[r][m]);
      y[m * N + o + r] = PER_ROW ? v * s[o + r] : v;
    }
}

// xp: x with each chunk of up to 32 columns of a group stored as its even columns, then its odd ones, so
// that a chunk's low nibbles (even columns) and high nibbles (odd columns) each meet contiguous floats.
// Each group's 16 possible weights form a table, t_u = s (u - 8) + z for u = 0..15 (the dequantized values,
// rounded as dequantize_weight rounds them), held in one register; vpermps looks each nibble up in it
// (it reads the low 4 bits of each 32-bit index), which widens, converts and scales 16 weights in one
// instruction. (Converting the nibbles with cvtdq2ps and scaling per group took twice the instructions:
// at G = 32 the per-group scaling cost as much as the products.)
template <int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void int4_block_avx512(
    const float* xp, int64_t K, const uint8_t* q, const float* s, const float* z, int64_t G, float* y,
    int64_t N, int64_t o) {
  const int64_t ng = K / G;
  const __m512 centred = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f,
                                        5.f, 6.f, 7.f);  // u - 8 for u = 0..15
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 table[R];
    for (int r = 0; r < R; ++r)
      table[r] = _mm512_add_ps(_mm512_mul_ps(centred, _mm512_set1_ps(s[(o + r) * ng + g])),
                               _mm512_set1_ps(z[(o + r) * ng + g]));
    const int64_t end = (g + 1) * G;
    for (int64_t c = g * G; c < end; c += 32) {
      const int64_t half = std::min<int64_t>(32, end - c) / 2;
      const __mmask16 mk = tail_mask(half);
      __m512 xe[MB], xo[MB];
      for (int m = 0; m < MB; ++m) {
        xe[m] = _mm512_maskz_loadu_ps(mk, xp + m * K + c);
        xo[m] = _mm512_maskz_loadu_ps(mk, xp + m * K + c + half);
      }
      for (int r = 0; r < R; ++r) {
        if ((c & 127) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(q + (o + r) * (K / 2) + c / 2) + kPrefetch, _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, q + (o + r) * (K / 2) + c / 2));
        const __m512 lo = _mm512_permutexvar_ps(v, table[r]);  // low nibble: bits 0-3 of each lane
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[r]);
        for (int m = 0; m < MB; ++m) {
          acc[r][m] = _mm512_fmadd_ps(xe[m], lo, acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(xo[m], hi, acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[m * N + o + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Horizontal sum of a ymm register's eight floats.
__attribute__((target("avx2"))) inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// ------------------------------------------------------------------ AVX2 + FMA (no AVX-512)
// Eight floats a vector. Columns past the last full vector of a group (G not a multiple of 8, or 16 for
// int4) are summed in scalars: AVX2 has no byte-masked loads, and a group's tail is a few columns at most.

// As int8_block_avx512. The register file is half as wide and half as deep (16 ymm), so a call covers at
// most 2 activation rows x 2 output rows or 1 x 4 (p and acc: 2 MB R registers).
template <int MB, int R, bool PER_ROW>
__attribute__((target("avx2,fma"))) void int8_block_avx2(const float* x, int64_t K, const int8_t* q, const float* s,
                                                        int64_t G, float* y, int64_t N, int64_t o) {
  const int64_t ng = K / G;
  __m256 acc[R][MB], p[R][MB];
  float tacc[R][MB] = {}, tp[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        p[r][m] = _mm256_setzero_ps();
        tp[r][m] = 0.f;
      }
    const int64_t end = (g + 1) * G;
    int64_t c = g * G;
    for (; c + 8 <= end; c += 8) {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + c);
      for (int r = 0; r < R; ++r) {
        const int8_t* qr = q + (o + r) * K + c;
        if ((c & 63) < 8) _mm_prefetch(reinterpret_cast<const char*>(qr) + kPrefetch, _MM_HINT_T0);
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr))));
        for (int m = 0; m < MB; ++m) p[r][m] = _mm256_fmadd_ps(xv[m], w, p[r][m]);
      }
    }
    for (; c < end; ++c)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) tp[r][m] += x[m * K + c] * static_cast<float>(q[(o + r) * K + c]);
    for (int r = 0; r < R; ++r) {
      if (PER_ROW) {
        for (int m = 0; m < MB; ++m) {
          acc[r][m] = p[r][m];
          tacc[r][m] = tp[r][m];
        }
      } else {
        const float sv = s[(o + r) * ng + g];
        for (int m = 0; m < MB; ++m) {
          acc[r][m] = _mm256_fmadd_ps(p[r][m], _mm256_set1_ps(sv), acc[r][m]);
          tacc[r][m] += sv * tp[r][m];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      const float v = hsum256(acc[r][m]) + tacc[r][m];
      y[m * N + o + r] = PER_ROW ? v * s[o + r] : v;
    }
}

// xp as for int4_block_avx512 (per chunk of up to 32 columns: its even columns, then its odd ones), so 8 bytes
// of q widen to the chunk's 8 next even columns (low nibbles) and 8 next odd ones (high nibbles). vpermps
// reaches only 8 table entries here, so the nibbles u are converted instead and the zero points move out of
// the sum: w = s (u - 8) + z, y = sum_g [ s_og sum_{i in g} x_i u_oi + (z_og - 8 s_og) xs_g ], xs (MB, K/G)
// the exact group sums of x, shared by all output rows.
template <int MB, int R>
__attribute__((target("avx2,fma"))) void int4_block_avx2(const float* xp, const float* xs, int64_t K,
                                                        const uint8_t* q, const float* s, const float* z,
                                                        int64_t G, float* y, int64_t N, int64_t o) {
  const int64_t ng = K / G;
  const __m256i low = _mm256_set1_epi32(15);
  __m256 acc[R][MB], p[R][MB];
  float tacc[R][MB] = {}, tp[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        p[r][m] = _mm256_setzero_ps();
        tp[r][m] = 0.f;
      }
    const int64_t end = (g + 1) * G;
    for (int64_t c = g * G; c < end; c += 32) {
      const int64_t half = std::min<int64_t>(32, end - c) / 2;
      int64_t j = 0;
      for (; j + 8 <= half; j += 8) {
        __m256 xe[MB], xo[MB];
        for (int m = 0; m < MB; ++m) {
          xe[m] = _mm256_loadu_ps(xp + m * K + c + j);
          xo[m] = _mm256_loadu_ps(xp + m * K + c + half + j);
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* qr = q + (o + r) * (K / 2) + c / 2 + j;
          if (((c / 2 + j) & 63) < 8) _mm_prefetch(reinterpret_cast<const char*>(qr) + kPrefetch, _MM_HINT_T0);
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          for (int m = 0; m < MB; ++m) {
            p[r][m] = _mm256_fmadd_ps(xe[m], lo, p[r][m]);
            p[r][m] = _mm256_fmadd_ps(xo[m], hi, p[r][m]);
          }
        }
      }
      for (; j < half; ++j)
        for (int r = 0; r < R; ++r) {
          const uint8_t b = q[(o + r) * (K / 2) + c / 2 + j];
          for (int m = 0; m < MB; ++m)
            tp[r][m] += xp[m * K + c + j] * static_cast<float>(b & 15) +
                        xp[m * K + c + half + j] * static_cast<float>(b >> 4);
        }
    }
    for (int r = 0; r < R; ++r) {
      const float sv = s[(o + r) * ng + g], zs = z[(o + r) * ng + g] - 8.f * sv;
      for (int m = 0; m < MB; ++m) {
        acc[r][m] = _mm256_fmadd_ps(p[r][m], _mm256_set1_ps(sv), acc[r][m]);
        tacc[r][m] += sv * tp[r][m] + zs * xs[m * ng + g];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[m * N + o + r] = hsum256(acc[r][m]) + tacc[r][m];
}

// R output rows (kRowBlock or 1) from o: one activation row 4 output rows a call, two rows 2 a call.
// float32 weights, M activation rows against weight rows o0..o1 one at a time: each thread then streams one
// contiguous run of W from memory, which the hardware prefetcher follows (8 rows interleaved and software
// prefetching both read slower here); the activation rows meet the weight row in turn while it sits in L1.
// Each row's dot product is summed the same way whatever M is (4 accumulators over K, then their sum, then
// the tail), so row m of y is bit for bit the product of row m alone: a speculative verification over K + 1
// rows then computes what K + 1 one-row decoding steps compute.
__attribute__((target("avx2,fma"))) void f32_rows_avx2(const float* x, int64_t M, int64_t K, const float* w,
                                                      float* y, int64_t N, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = w + o * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t c = 0;
      for (; c + 32 <= K; c += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(wr + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 8), _mm256_loadu_ps(wr + c + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 16), _mm256_loadu_ps(wr + c + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 24), _mm256_loadu_ps(wr + c + 24), a3);
      }
      for (; c + 8 <= K; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(wr + c), a0);
      float t = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; c < K; ++c) t += xr[c] * wr[c];
      y[m * N + o] = t;
    }
  }
}

// As f32_rows_avx2, 16 columns a step, the tail of K under a mask.
__attribute__((target("avx512f,fma"))) void f32_rows_avx512(const float* x, int64_t M, int64_t K, const float* w,
                                                           float* y, int64_t N, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = w + o * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t c = 0;
      for (; c + 64 <= K; c += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + c), _mm512_loadu_ps(wr + c), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + c + 16), _mm512_loadu_ps(wr + c + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + c + 32), _mm512_loadu_ps(wr + c + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + c + 48), _mm512_loadu_ps(wr + c + 48), a3);
      }
      for (; c < K; c += 16) {
        const __mmask16 mk = tail_mask(K - c);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xr + c), _mm512_maskz_loadu_ps(mk, wr + c), a0);
      }
      y[m * N + o] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
  }
}

template <int R>
void int8_avx2(const float* x, int mb, int64_t K, const int8_t* q, const float* s, int64_t G, float* y, int64_t N,
               int64_t o) {
  const bool per_row = G == K;
  if (mb == 1) {
    if (per_row)
      int8_block_avx2<1, R, true>(x, K, q, s, G, y, N, o);
    else
      int8_block_avx2<1, R, false>(x, K, q, s, G, y, N, o);
    return;
  }
  constexpr int R2 = R < 2 ? R : 2;
  for (int r = 0; r < R; r += R2) {
    if (per_row)
      int8_block_avx2<2, R2, true>(x, K, q, s, G, y, N, o + r);
    else
      int8_block_avx2<2, R2, false>(x, K, q, s, G, y, N, o + r);
  }
}

template <int R>
void int4_avx2(const float* xp, const float* xs, int mb, int64_t K, const uint8_t* q, const float* s, const float* z,
               int64_t G, float* y, int64_t N, int64_t o) {
  if (mb == 1) {
    int4_block_avx2<1, R>(xp, xs, K, q, s, z, G, y, N, o);
    return;
  }
  constexpr int R2 = R < 2 ? R : 2;
  for (int r = 0; r < R; r += R2) int4_block_avx2<2, R2>(xp, xs, K, q, s, z, G, y, N, o + r);
}

template <int R>
void int8_avx512(const float* x, int mb, int64_t K, const int8_t* q, const float* s, int64_t G, float* y,
                 int64_t N, int64_t o) {
  const bool per_row = G == K;
#define TF_INT8_CASE(MB)                                                    \
  case MB:                                                                  \
    if (per_row)                                                            \
      int8_block_avx512<MB, R, true>(x, K, q, s, G, y, N, o);               \
    else                                                                    \
      int8_block_avx512<MB, R, false>(x, K, q, s, G, y, N, o);              \
    break;
  switch (mb) { TF_INT8_CASE(1) TF_INT8_CASE(2) }
#undef TF_INT8_CASE
}

template <int R>
void int4_avx512(const float* xp, int mb, int64_t K, const uint8_t* q, const float* s, const float* z, int64_t G,
                 float* y, int64_t N, int64_t o) {
  if (mb == 1)
    int4_block_avx512<1, R>(xp, K, q, s, z, G, y, N, o);
  else
    int4_block_avx512<2, R>(xp, K, q, s, z, G, y, N, o);
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return yes;
}

bool has_vnni() {  // the act8 kernels: AVX-512 as above plus its integer dot products
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#else
bool has_avx512() { return false; }
bool has_vnni() { return false; }
bool has_avx2() { return false; }
#endif

// The ops' `path` argument (quant_kernels.py: WEIGHT_ONLY_PATHS, GEMM_PATHS). kWide is the AVX-512 kernel of
// the op (weight-only: F/BW/VL; act8_gemm: VNNI); auto takes the widest this CPU has.
enum Path : int64_t { kAuto = 0, kWide = 1, kPlain = 2, kAvx2 = 3 };

Path resolve_path(int64_t path, bool wide_ok, const char* wide) {
  TORCH_CHECK(path >= kAuto && path <= kAvx2, "path must be 0 (auto), 1 (", wide, "), 2 (plain) or 3 (avx2), got ",
              path);
  TORCH_CHECK(path != kWide || wide_ok, "this CPU has no ", wide);
  TORCH_CHECK(path != kAvx2 || has_avx2(), "this CPU has no AVX2 + FMA");
  if (path != kAuto) return static_cast<Path>(path);
  return wide_ok ? kWide : has_avx2() ? kAvx2 : kPlain;
}

// Threads take blocks of kRowBlock output rows; each block runs over the activation rows kMaxBatch at a
// time, so its weights (a few KiB) are widened from cache after the first pass.
template <typename Block, typename Plain>
void over_rows(int64_t M, int64_t N, int64_t K, Block block, Plain plain, bool fast) {
  const int64_t n_blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, n_blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * kRowBlock;
      for (int64_t m = 0; m < M; m += kMaxBatch) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxBatch, M - m));
        if (fast) {
          block(m, mb, o, std::min<int64_t>(kRowBlock, N - o));
        } else {
          plain(m, mb, o, std::min<int64_t>(o + kRowBlock, N));
        }
      }
    }
  });
}

void check_common(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t K) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K), got ", x.sizes());
  TORCH_CHECK(q.dim() == 2 && s.dim() == 2, "q and s must be 2-D");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && s.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(s.is_floating_point() && s.size(0) == q.size(0), "s must be float (N, K / G)");
  TORCH_CHECK(s.size(1) > 0 && K % s.size(1) == 0, "the number of groups must divide K");
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t path) {
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8");
  const Path use = resolve_path(path, has_avx512(), "AVX-512");
  const int64_t K = q.size(1);
  check_common(x, q, s, K);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, q has ", K);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor qc = q.contiguous(), sc = s.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), N = qc.size(0), G = K / sc.size(1);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xd = xf.data_ptr<float>();
  const int8_t* qd = qc.data_ptr<int8_t>();
  const float* sd = sc.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  over_rows(M, N, K,
            [&](int64_t m, int mb, int64_t o, int64_t rows) {
#ifdef TF_X86
              const auto kernel = use == kWide ? int8_avx512<kRowBlock> : int8_avx2<kRowBlock>;
              const auto one = use == kWide ? int8_avx512<1> : int8_avx2<1>;
              if (rows == kRowBlock)
                kernel(xd + m * K, mb, K, qd, sd, G, yd + m * N, N, o);
              else
                for (int64_t r = 0; r < rows; ++r) one(xd + m * K, mb, K, qd, sd, G, yd + m * N, N, o + r);
#endif
            },
            [&](int64_t m, int mb, int64_t o0, int64_t o1) {
              int8_rows_plain(xd + m * K, mb, K, qd, sd, G, yd + m * N, N, o0, o1);
            },
            use != kPlain);
  return y.to(x.scalar_type());
}

// Activation rows up to which f32_linear runs its own kernels; past it at::linear's GEMM (MKL), which is
// compute-bound there. At 1 and 2 rows MKL keeps the product on one thread and reads W slower than a plain
// stream (docs/benchmarks/decode.md, "float32 products for a few rows"); at 8 rows its GEMM was still slower.
constexpr int64_t kF32MaxRows = 8;

// y (M, N) = x (M, K) W^T (+ b) for float32 W (N, K) row-major (nn.Linear's layout). Threads split the output
// rows; each meets every activation row with its rows of W, one weight row at a time.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, int64_t path) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "w must be float32 (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.size(1), "x must be float32 (M, ",
              w.size(1), "), got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  const Path use = resolve_path(path, has_avx512(), "AVX-512");
  if (x.size(0) > kF32MaxRows) return at::linear(x, w, b);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xd = xc.data_ptr<float>();
  const float* wd = wc.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(K, 1));  // >= 256 KiB of W a task
  at::parallel_for(0, N, grain, [&](int64_t o0, int64_t o1) {
#ifdef TF_X86
    if (use == kWide) return f32_rows_avx512(xd, M, K, wd, yd, N, o0, o1);
    if (use == kAvx2) return f32_rows_avx2(xd, M, K, wd, yd, N, o0, o1);
#endif
    f32_rows_plain(xd, M, K, wd, yd, N, o0, o1);
  });
  if (b.has_value() && b->defined()) y.add_(*b);
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& z,
                       int64_t path) {
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must be uint8 (two 4-bit values per byte)");
  const Path use = resolve_path(path, has_avx512(), "AVX-512");
  const int64_t K = 2 * q.size(1);
  check_common(x, q, s, K);
  TORCH_CHECK(z.is_floating_point() && z.sizes() == s.sizes(), "z must be float shaped like s");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, q holds ", K);
  const int64_t G = K / s.size(1);
  TORCH_CHECK(G % 2 == 0, "int4 groups must hold an even number of columns");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor qc = q.contiguous(), sc = s.to(at::kFloat).contiguous(), zc = z.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), N = qc.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xd = xf.data_ptr<float>();
  const uint8_t* qd = qc.data_ptr<uint8_t>();
  const float* sd = sc.data_ptr<float>();
  const float* zd = zc.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const int64_t ng = K / G;
  std::vector<float> xp, xs;
  if (use == kAvx2) {
    xs.assign(static_cast<size_t>(M * ng), 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < K; ++i) xs[m * ng + i / G] += xd[m * K + i];
  }
  if (use != kPlain) {  // evens then odds within every chunk of up to 32 columns of a group
    xp.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g0 = 0; g0 < K; g0 += G)
        for (int64_t c = g0; c < g0 + G; c += 32) {
          const int64_t half = std::min<int64_t>(32, g0 + G - c) / 2;
          for (int64_t j = 0; j < half; ++j) {
            xp[m * K + c + j] = xd[m * K + c + 2 * j];
            xp[m * K + c + half + j] = xd[m * K + c + 2 * j + 1];
          }
        }
  }
  over_rows(M, N, K,
            [&](int64_t m, int mb, int64_t o, int64_t rows) {
#ifdef TF_X86
              const float* xm = xp.data() + m * K;
              if (use == kAvx2) {
                const float* xsm = xs.data() + m * ng;
                if (rows == kRowBlock)
                  int4_avx2<kRowBlock>(xm, xsm, mb, K, qd, sd, zd, G, yd + m * N, N, o);
                else
                  for (int64_t r = 0; r < rows; ++r) int4_avx2<1>(xm, xsm, mb, K, qd, sd, zd, G, yd + m * N, N, o + r);
              } else if (rows == kRowBlock) {
                int4_avx512<kRowBlock>(xm, mb, K, qd, sd, zd, G, yd + m * N, N, o);
              } else {
                for (int64_t r = 0; r < rows; ++r) int4_avx512<1>(xm, mb, K, qd, sd, zd, G, yd + m * N, N, o + r);
              }
#endif
            },
            [&](int64_t m, int mb, int64_t o0, int64_t o1) {
              int4_rows_plain(xd + m * K, mb, K, qd, sd, zd, G, yd + m * N, N, o0, o1);
            },
            use != kPlain);
  return y.to(x.scalar_type());
}

// ------------------------------------------------------------------ the 8-bit-activation GEMM (packed weights)
//
//   tinyformer::act8_gemm(x, wp, sp, aux, N, G, int4, path)  y (M, N) ~ x dequant(W)^T
//
// Activations rounded per row and block b of 32 columns (x ~ d_b xq with d_b = max_b |x| / 127, Q8_0's
// rounding; quantize_rows), weights in a layout packed once at load (quant_kernels.py::pack_act8): output channels in
// blocks of 16 (N padded with zero rows), each block's columns in 4-byte quads, so one 64-byte vector holds
// 16 channels x 4 columns and `vpdpbusd` (unsigned bytes x signed bytes, summed in fours) multiplies it by
// one row's 4 activations broadcast. A register tile of MR rows x NR channel blocks (MR x NR x 16 outputs)
// reuses every loaded weight vector MR times and every broadcast activation NR times.
//   int8: wp (Np/16, K/4, 16, 4) int8 q; the activations enter as xq + 128 (unsigned), so each block's integer
//         sum starts from aux = -128 sum_{i in b} q_oi (int32 (Np/16, K/32, 16)); y = sum_b s_og d_b dot_b
//         (s per group, (Np/16, K/G, 16); per channel (G = K): s applied once at the end).
//   int4: wp (Np/16, K/8, 16, 4) uint8: the low nibbles are columns 8p..8p+3, the high ones 8p+4..8p+7;
//         u in [0, 15] is the unsigned operand; w = s u + (z - 8 s), so
//         y = sum_g [ s_og sum_{b in g} d_b dot_b + (z_og - 8 s_og) sum_{i in g} x_i ] (aux = z - 8 s, the
//         zero points multiplying the exact group sums of x).
namespace gemm {

#ifndef TF_GEMM_MR
#define TF_GEMM_MR 4
#define TF_GEMM_NR 3
#endif
constexpr int kMaxMR = TF_GEMM_MR;  // activation rows per register tile
constexpr int kMaxNR = TF_GEMM_NR;  // 16-channel blocks per register tile

struct Act {  // x rounded: xq (M, K) (offset: xq + 128 as unsigned, else signed), d (M, K/32), xs (M, K/G) exact sums
  std::vector<uint8_t> xq;
  std::vector<float> d, xs;
};

Act quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, bool offset) {
  const int64_t nb = K / 32, ng = K / G;
  Act a;
  a.xq.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * nb));
  a.xs.assign(static_cast<size_t>(M * ng), 0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * 32;
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < 32; ++i) {
          amax = std::max(amax, std::fabs(xb[i]));
          sum += xb[i];
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        uint8_t* out = a.xq.data() + m * K + b * 32;
        for (int i = 0; i < 32; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
          out[i] = static_cast<uint8_t>(offset ? v + 128 : v);
        }
        a.d[m * nb + b] = amax / 127.f;
        a.xs[m * ng + b * 32 / G] += sum;
      }
  });
  return a;
}

struct Args {
  const uint8_t* xq;
  const float *d, *xs;
  int64_t K, G, N;
  const uint8_t* wp;
  const float* sp;
  const void* aux;
  float* y;
};

// Plain C++ over the packed layout: the same sums in the same order of blocks (any CPU).
void tile_plain(const Args& a, bool int4, int64_t m0, int mr, int64_t ob0, int nr) {
  const int64_t K = a.K, G = a.G, nb = K / 32, ng = K / G, ob_bytes = int4 ? K * 8 : K * 16;
  const bool per_row = !int4 && G == K;
  for (int m = 0; m < mr; ++m)
    for (int n = 0; n < nr; ++n)
      for (int c = 0; c < 16; ++c) {
        const int64_t ob = ob0 + n, o = ob * 16 + c;
        if (o >= a.N) continue;
        const uint8_t* w = a.wp + ob * ob_bytes;
        const uint8_t* xr = a.xq + (m0 + m) * K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t g = b * 32 / G;
          int32_t dot = int4 ? 0 : static_cast<const int32_t*>(a.aux)[(ob * nb + b) * 16 + c];
          for (int i = 0; i < 32; ++i) {
            const int64_t k = b * 32 + i;
            if (int4) {
              const int64_t p = k / 8, j = k % 8;
              const uint8_t byte = w[(p * 16 + c) * 4 + (j & 3)];
              dot += (j < 4 ? (byte & 15) : (byte >> 4)) * static_cast<int8_t>(xr[k]);
            } else {
              dot += static_cast<int32_t>(xr[k]) * static_cast<int8_t>(w[((k / 4) * 16 + c) * 4 + (k & 3)]);
            }
          }
          const float dv = a.d[(m0 + m) * nb + b] * static_cast<float>(dot);
          acc += per_row ? dv : a.sp[(ob * ng + g) * 16 + c] * dv;
          if (int4 && (b * 32 + 32) % G == 0)
            acc += static_cast<const float*>(a.aux)[(ob * ng + g) * 16 + c] * a.xs[(m0 + m) * ng + g];
        }
        a.y[(m0 + m) * a.N + o] = per_row ? acc * a.sp[ob * 16 + c] : acc;
      }
}

#ifdef TF_X86
template <int MR, int NR, bool INT4, bool PER_ROW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void tile_vnni(const Args& a, int64_t m0,
                                                                                    int64_t ob0, int64_t b0,
                                                                                    int64_t b1) {
  const int64_t K = a.K, G = a.G, nb = K / 32, ng = K / G, ob_bytes = INT4 ? K * 8 : K * 16;
  const uint8_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = a.xq + (m0 + m) * K;
  const uint8_t* wr[NR];
  for (int n = 0; n < NR; ++n) wr[n] = a.wp + (ob0 + n) * ob_bytes;
  const __m512i low = _mm512_set1_epi8(15);
  // Blocks b0..b1 of K: a later chunk adds to the partial sums the earlier ones stored in y (unscaled for
  // PER_ROW until the last chunk).
  __m512 facc[MR][NR];
  for (int n = 0; n < NR; ++n) {
    const __mmask16 mk = tail_mask(a.N - (ob0 + n) * 16);
    for (int m = 0; m < MR; ++m)
      facc[m][n] = b0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, a.y + (m0 + m) * a.N + (ob0 + n) * 16);
  }
  for (int64_t b = b0; b < b1; ++b) {
    __m512i iacc[MR][NR];
    for (int n = 0; n < NR; ++n) {
      const __m512i init = INT4 ? _mm512_setzero_si512()
                                : _mm512_loadu_si512(static_cast<const int32_t*>(a.aux) + ((ob0 + n) * nb + b) * 16);
      for (int m = 0; m < MR; ++m) iacc[m][n] = init;
    }
    if constexpr (INT4) {
      for (int p = 0; p < 4; ++p) {
        __m512i lo[NR], hi[NR];
        for (int n = 0; n < NR; ++n) {
          const __m512i v = _mm512_loadu_si512(wr[n] + (b * 4 + p) * 64);
          lo[n] = _mm512_and_si512(v, low);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int m = 0; m < MR; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, xr[m] + b * 32 + p * 8, 4);
          std::memcpy(&x1, xr[m] + b * 32 + p * 8 + 4, 4);
          const __m512i xv0 = _mm512_set1_epi32(x0), xv1 = _mm512_set1_epi32(x1);
          for (int n = 0; n < NR; ++n) {
            iacc[m][n] = _mm512_dpbusd_epi32(iacc[m][n], lo[n], xv0);
            iacc[m][n] = _mm512_dpbusd_epi32(iacc[m][n], hi[n], xv1);
          }
        }
      }
    } else {
      for (int qd = 0; qd < 8; ++qd) {
        __m512i w[NR];
        for (int n = 0; n < NR; ++n) w[n] = _mm512_loadu_si512(wr[n] + (b * 8 + qd) * 64);
        for (int m = 0; m < MR; ++m) {
          int32_t x0;
          std::memcpy(&x0, xr[m] + b * 32 + qd * 4, 4);
          const __m512i xv = _mm512_set1_epi32(x0);
          for (int n = 0; n < NR; ++n) iacc[m][n] = _mm512_dpbusd_epi32(iacc[m][n], xv, w[n]);
        }
      }
    }
    const int64_t g = b * 32 / G;
    for (int m = 0; m < MR; ++m) {
      const __m512 dv = _mm512_set1_ps(a.d[(m0 + m) * nb + b]);
      for (int n = 0; n < NR; ++n) {
        const __m512 sc = PER_ROW ? dv : _mm512_mul_ps(_mm512_loadu_ps(a.sp + ((ob0 + n) * ng + g) * 16), dv);
        facc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][n]), sc, facc[m][n]);
      }
    }
    if (INT4 && (b * 32 + 32) % G == 0)
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(a.xs[(m0 + m) * ng + g]);
        for (int n = 0; n < NR; ++n)
          facc[m][n] = _mm512_fmadd_ps(
              _mm512_loadu_ps(static_cast<const float*>(a.aux) + ((ob0 + n) * ng + g) * 16), xs, facc[m][n]);
      }
  }
  for (int n = 0; n < NR; ++n) {
    const int64_t o = (ob0 + n) * 16;
    const __mmask16 mk = tail_mask(a.N - o);
    const bool scale = PER_ROW && b1 == nb;
    const __m512 sc = scale ? _mm512_loadu_ps(a.sp + (ob0 + n) * 16) : _mm512_set1_ps(1.f);
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(a.y + (m0 + m) * a.N + o, mk, scale ? _mm512_mul_ps(facc[m][n], sc) : facc[m][n]);
  }
}

template <int MR, int NR>
void tile_vnni_dispatch(const Args& a, bool int4, bool per_row, int64_t m0, int64_t ob0, int64_t b0, int64_t b1) {
  if (int4)
    tile_vnni<MR, NR, true, false>(a, m0, ob0, b0, b1);
  else if (per_row)
    tile_vnni<MR, NR, false, true>(a, m0, ob0, b0, b1);
  else
    tile_vnni<MR, NR, false, false>(a, m0, ob0, b0, b1);
}

template <int MR>
void tile_vnni_nr(const Args& a, bool int4, bool per_row, int64_t m0, int64_t ob0, int nr, int64_t b0, int64_t b1) {
  switch (nr) {
    case 1: tile_vnni_dispatch<MR, 1>(a, int4, per_row, m0, ob0, b0, b1); break;
    case 2: tile_vnni_dispatch<MR, 2>(a, int4, per_row, m0, ob0, b0, b1); break;
    case 3: tile_vnni_dispatch<MR, 3>(a, int4, per_row, m0, ob0, b0, b1); break;
    default: tile_vnni_dispatch<MR, 4>(a, int4, per_row, m0, ob0, b0, b1); break;
  }
}

void tile_vnni_any(const Args& a, bool int4, bool per_row, int64_t m0, int mr, int64_t ob0, int nr, int64_t b0,
                   int64_t b1) {
  switch (mr) {
    case 1: tile_vnni_nr<1>(a, int4, per_row, m0, ob0, nr, b0, b1); break;
    case 2: tile_vnni_nr<2>(a, int4, per_row, m0, ob0, nr, b0, b1); break;
    case 3: tile_vnni_nr<3>(a, int4, per_row, m0, ob0, nr, b0, b1); break;
    default: tile_vnni_nr<4>(a, int4, per_row, m0, ob0, nr, b0, b1); break;
  }
}

// ---- AVX2 (no VNNI): the same packed layout read in halves, one 32-byte vector = 8 channels x 4 columns
// (channel block ob's half h: bytes h*32..h*32+31 of each 64-byte vector; "eighth" e = 2 ob + h below).
// vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16 with saturation, so the
// operands are chosen so that no pair can leave [-32768, 32767]:
//   int8: the activations are stored signed (xq in [-127, 127], no +128 offset, no aux correction) and each
//         product is |q| * (xq sign(q)) (vpabsb, vpsignb): |q| <= 128 (vpabsb of -128 is 0x80 = 128 as an
//         unsigned byte), |xq sign(q)| <= 127, so a pair is at most 2 x 128 x 127 = 32512; vpmaddwd by ones
//         then sums each quad's two pairs into int32.
//   int4: u in [0, 15] times xq: a pair is at most 2 x 15 x 127 = 3810, and a 32-column block's 8 such
//         products (4 vectors of low nibbles, 4 of high) add up to 30480 < 32767, so the block is summed in
//         int16 and widened to int32 once.
constexpr int kAvx2MR = 2;  // rows x 8-channel eighths of a register tile over many rows (16 ymm registers)
constexpr int kAvx2NR = 2;
constexpr int kAvx2NR1 = 4;  // one row (decoding): a wider tile for more independent sums

template <int MR, int NR, bool INT4, bool PER_ROW>
__attribute__((target("avx2,fma"))) void tile_avx2(const Args& a, int64_t m0, int64_t e0, int64_t b0, int64_t b1) {
  const int64_t K = a.K, G = a.G, nb = K / 32, ng = K / G, ob_bytes = INT4 ? K * 8 : K * 16;
  const uint8_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = a.xq + (m0 + m) * K;
  const uint8_t* wr[NR];
  int64_t col[NR];  // offset of eighth e's 8 floats in a (N/16, X, 16) array, X = 0
  __m256i mask[NR];  // the channels of the eighth below N
  for (int n = 0; n < NR; ++n) {
    const int64_t e = e0 + n;
    wr[n] = a.wp + (e / 2) * ob_bytes + (e % 2) * 32;
    col[n] = (e / 2) * 16 * (K / G) + (e % 2) * 8;
    mask[n] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(a.N - e * 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  __m256 facc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n)
      facc[m][n] = b0 == 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(a.y + (m0 + m) * a.N + (e0 + n) * 8, mask[n]);
  // the group of block b counted, not divided for: a 64-bit division costs as much as a block's products
  const int64_t bpg = G / 32;
  int64_t g = b0 / bpg, left = bpg - b0 % bpg;  // blocks of group g from b on
  for (int64_t b = b0; b < b1; ++b) {
    __m256i iacc[MR][NR];
    if constexpr (INT4) {
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) iacc[m][n] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int p = 0; p < 4; ++p) {
        __m256i x0[MR], x1[MR];
        for (int m = 0; m < MR; ++m) {
          int32_t v0, v1;
          std::memcpy(&v0, xr[m] + b * 32 + p * 8, 4);
          std::memcpy(&v1, xr[m] + b * 32 + p * 8 + 4, 4);
          x0[m] = _mm256_set1_epi32(v0);
          x1[m] = _mm256_set1_epi32(v1);
        }
        for (int n = 0; n < NR; ++n) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[n] + (b * 4 + p) * 64));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < MR; ++m)
            iacc[m][n] = _mm256_add_epi16(
                iacc[m][n], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[m]), _mm256_maddubs_epi16(hi, x1[m])));
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) iacc[m][n] = _mm256_madd_epi16(iacc[m][n], ones);
    } else {
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) iacc[m][n] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int qd = 0; qd < 8; ++qd) {
        __m256i xv[MR];
        for (int m = 0; m < MR; ++m) {
          int32_t v0;
          std::memcpy(&v0, xr[m] + b * 32 + qd * 4, 4);
          xv[m] = _mm256_set1_epi32(v0);
        }
        for (int n = 0; n < NR; ++n) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[n] + (b * 8 + qd) * 64));
          const __m256i aw = _mm256_abs_epi8(w);
          for (int m = 0; m < MR; ++m)
            iacc[m][n] = _mm256_add_epi32(
                iacc[m][n], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[m], w)), ones));
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 dv = _mm256_set1_ps(a.d[(m0 + m) * nb + b]);
      for (int n = 0; n < NR; ++n) {
        const __m256 sc = PER_ROW ? dv : _mm256_mul_ps(_mm256_loadu_ps(a.sp + col[n] + g * 16), dv);
        facc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][n]), sc, facc[m][n]);
      }
    }
    if (INT4 && left == 1)  // the group's last block: its zero points times the exact sums of x
      for (int m = 0; m < MR; ++m) {
        const __m256 xs = _mm256_set1_ps(a.xs[(m0 + m) * ng + g]);
        for (int n = 0; n < NR; ++n)
          facc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(static_cast<const float*>(a.aux) + col[n] + g * 16), xs,
                                       facc[m][n]);
      }
    if (--left == 0) {
      ++g;
      left = bpg;
    }
  }
  const bool scale = PER_ROW && b1 == nb;
  for (int n = 0; n < NR; ++n) {
    const __m256 sc = scale ? _mm256_loadu_ps(a.sp + col[n]) : _mm256_set1_ps(1.f);
    for (int m = 0; m < MR; ++m)
      _mm256_maskstore_ps(a.y + (m0 + m) * a.N + (e0 + n) * 8, mask[n], scale ? _mm256_mul_ps(facc[m][n], sc) : facc[m][n]);
  }
}

template <int MR, int NR>
void tile_avx2_dispatch(const Args& a, bool int4, bool per_row, int64_t m0, int64_t e0, int64_t b0, int64_t b1) {
  if (int4)
    tile_avx2<MR, NR, true, false>(a, m0, e0, b0, b1);
  else if (per_row)
    tile_avx2<MR, NR, false, true>(a, m0, e0, b0, b1);
  else
    tile_avx2<MR, NR, false, false>(a, m0, e0, b0, b1);
}

// Rows m0..m0+mr (mr <= kAvx2MR) times eighths e0..e0+ne (ne <= kAvx2NR1), in register tiles.
void tile_avx2_any(const Args& a, bool int4, bool per_row, int64_t m0, int mr, int64_t e0, int ne, int64_t b0,
                   int64_t b1) {
  if (mr == 1) {
    switch (ne) {
      case 1: tile_avx2_dispatch<1, 1>(a, int4, per_row, m0, e0, b0, b1); break;
      case 2: tile_avx2_dispatch<1, 2>(a, int4, per_row, m0, e0, b0, b1); break;
      case 3: tile_avx2_dispatch<1, 3>(a, int4, per_row, m0, e0, b0, b1); break;
      default: tile_avx2_dispatch<1, kAvx2NR1>(a, int4, per_row, m0, e0, b0, b1); break;
    }
    return;
  }
  if (mr < kAvx2MR) {
    for (int m = 0; m < mr; ++m) tile_avx2_any(a, int4, per_row, m0 + m, 1, e0, ne, b0, b1);
    return;
  }
  int e = 0;
  for (; e + kAvx2NR <= ne; e += kAvx2NR) tile_avx2_dispatch<kAvx2MR, kAvx2NR>(a, int4, per_row, m0, e0 + e, b0, b1);
  for (; e < ne; ++e) tile_avx2_dispatch<kAvx2MR, 1>(a, int4, per_row, m0, e0 + e, b0, b1);
}
#endif

}  // namespace gemm

// path (Path): 0 the fastest this CPU has, 1 AVX-512 VNNI, 2 plain C++, 3 AVX2 (all on the packed layout).
at::Tensor act8_gemm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sp, const at::Tensor& aux,
                     int64_t N, int64_t G, bool int4, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a (M, K) CPU tensor, got ", x.sizes());
  const int64_t K = x.size(1), nob = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0 && G > 0 && G % 32 == 0 && K % G == 0, "8-bit activations need K and G multiples of 32 ",
              "(G dividing K), got K ", K, ", G ", G);
  TORCH_CHECK(wp.scalar_type() == (int4 ? at::kByte : at::kChar) && wp.is_contiguous() &&
                  wp.numel() == nob * 16 * (int4 ? K / 2 : K),
              "wp is not a packed ", int4 ? "int4" : "int8", " weight for N ", N, ", K ", K);
  TORCH_CHECK(sp.scalar_type() == at::kFloat && sp.is_contiguous() && sp.numel() == nob * 16 * (K / G),
              "sp must hold float32 (N/16, K/G, 16) scales");
  TORCH_CHECK(aux.is_contiguous() && aux.scalar_type() == (int4 ? at::kFloat : at::kInt) &&
                  aux.numel() == nob * 16 * (int4 ? K / G : K / 32),
              "aux must be ", int4 ? "float32 (N/16, K/G, 16) z - 8 s" : "int32 (N/16, K/32, 16) corrections");
  const Path use = resolve_path(path, has_vnni(), "AVX-512 VNNI");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  const gemm::Act act = gemm::quantize_rows(xf.data_ptr<float>(), M, K, G, !int4 && use != kAvx2);
  const gemm::Args a{act.xq.data(), act.d.data(), act.xs.data(), K, G, N,
                     static_cast<const uint8_t*>(wp.data_ptr()), sp.data_ptr<float>(), aux.data_ptr(),
                     y.data_ptr<float>()};
  const bool per_row = !int4 && G == K;
  // Threads over panels of NR channel blocks; within a panel (its weights a few KiB, kept in L1/L2), the rows
  // MR at a time. One row (decoding) takes wider panels: more independent sums to hide vpdpbusd's latency.
  const int nr = gemm::kMaxNR;
  // K in chunks whose slice of a panel's weights (64 channels) stays in a 32 KiB L1 while the rows pass over it:
  // 16 KiB, 256 columns of int8 or 512 of int4 (and the partial sums go through y between chunks).
  const int64_t nb = K / 32, chunk = M <= gemm::kMaxMR ? nb : (int4 ? 16 : 8);
  const int64_t n_panels = (nob + nr - 1) / nr;
#ifdef TF_X86
  if (use == kAvx2) {  // panels of kAvx2NR1 eighths (8 channels each), the rows kAvx2MR at a time
    // a panel is 32 channels, so twice the columns of the VNNI panel's chunk fill the same 16 KiB of L1
    const int64_t ne = (N + 7) / 8, pe = gemm::kAvx2NR1, chunk2 = M <= gemm::kMaxMR ? nb : 2 * chunk;
    at::parallel_for(0, (ne + pe - 1) / pe, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int nep = static_cast<int>(std::min<int64_t>(pe, ne - p * pe));
        for (int64_t b0 = 0; b0 < nb; b0 += chunk2)
          for (int64_t m0 = 0; m0 < M; m0 += gemm::kAvx2MR)
            gemm::tile_avx2_any(a, int4, per_row, m0, static_cast<int>(std::min<int64_t>(gemm::kAvx2MR, M - m0)),
                                p * pe, nep, b0, std::min(nb, b0 + chunk2));
      }
    });
    return y.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, n_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ob0 = p * nr;
      const int nrp = static_cast<int>(std::min<int64_t>(nr, nob - ob0));
      if (use == kPlain) {
        for (int64_t m0 = 0; m0 < M; m0 += gemm::kMaxMR)
          gemm::tile_plain(a, int4, m0, static_cast<int>(std::min<int64_t>(gemm::kMaxMR, M - m0)), ob0, nrp);
        continue;
      }
#ifdef TF_X86
      for (int64_t b0 = 0; b0 < nb; b0 += chunk)
        for (int64_t m0 = 0; m0 < M; m0 += gemm::kMaxMR)
          gemm::tile_vnni_any(a, int4, per_row, m0, static_cast<int>(std::min<int64_t>(gemm::kMaxMR, M - m0)), ob0,
                              nrp, b0, std::min(nb, b0 + chunk));
#endif
    }
  });
  return y.to(x.scalar_type());
}

// Rows o0..o1 of dequant(W) as float32 (o1 - o0, K): the weight-only prefill widens a tile of output rows and
// hands it to the BLAS. Same roundings as dequantize_weight: int8 s q; int4 (u - 8) s + z.
at::Tensor dequantize_rows(const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& z, int64_t o0,
                           int64_t o1) {
  const bool int4 = z.has_value();
  TORCH_CHECK(q.dim() == 2 && s.dim() == 2 && q.size(0) == s.size(0), "q (N, K or K/2) and s (N, K/G) expected");
  TORCH_CHECK(q.scalar_type() == (int4 ? at::kByte : at::kChar), int4 ? "q must be uint8" : "q must be int8");
  TORCH_CHECK(0 <= o0 && o0 <= o1 && o1 <= q.size(0), "rows ", o0, "..", o1, " out of range");
  const int64_t K = int4 ? 2 * q.size(1) : q.size(1), ng = s.size(1), G = K / ng;
  TORCH_CHECK(ng > 0 && K % ng == 0, "the number of groups must divide K");
  const at::Tensor qc = q.contiguous(), sc = s.to(at::kFloat).contiguous();
  const at::Tensor zc = int4 ? z->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor w = at::empty({o1 - o0, K}, sc.options());
  const float* sd = sc.data_ptr<float>();
  const float* zd = int4 ? zc.data_ptr<float>() : nullptr;
  float* wd = w.data_ptr<float>();
  at::parallel_for(o0, o1, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t o = r0; o < r1; ++o) {
      float* out = wd + (o - o0) * K;
      for (int64_t g = 0; g < ng; ++g) {
        const float sv = sd[o * ng + g];
        if (int4) {
          const uint8_t* qr = qc.data_ptr<uint8_t>() + o * (K / 2) + g * G / 2;
          const float zv = zd[o * ng + g];
          for (int64_t j = 0; j < G / 2; ++j) {
            out[g * G + 2 * j] = static_cast<float>((qr[j] & 15) - 8) * sv + zv;
            out[g * G + 2 * j + 1] = static_cast<float>((qr[j] >> 4) - 8) * sv + zv;
          }
        } else {
          const int8_t* qr = qc.data_ptr<int8_t>() + o * K + g * G;
          for (int64_t i = 0; i < G; ++i) out[g * G + i] = static_cast<float>(qr[i]) * sv;
        }
      }
    }
  });
  return w;
}

// ------------------------------------------------------------------ token rows from a packed table
//
//   tinyformer::act8_embedding(wp, sp, aux, ids, G, int4)  E[i] = dequant(row ids[i] of pack_act8's layout)
//     int8: E[i, k] = q[r, k] s[r, k/G];  int4: E[i, k] = (u[r, k] - 8) s[r, k/G] + z[r, k/G], z = aux + 8 s
//
// The token table tied to a cpp_act8 head, read from the head's bytes (quant_kernels.pack_act8): wp (Np/16,
// K/4, 16, 4) int8 or (Np/16, K/8, 16, 4) uint8, sp and aux (Np/16, K/G, 16), ids (n,) int64 -> (n, K)
// float32. One C++ pass: in a compiled graph a gather through this layout, fused with the first norm, made
// inductor sum that norm over the tokens' lanes, which rounds differently for 1 and for T tokens.
at::Tensor act8_embedding(const at::Tensor& wp, const at::Tensor& sp, const at::Tensor& aux, const at::Tensor& ids,
                          int64_t G, bool int4) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 4, "wp must be pack_act8's (Np/16, K/4|K/8, 16, 4)");
  TORCH_CHECK(wp.scalar_type() == (int4 ? at::kByte : at::kChar), "wp must be ", int4 ? "uint8" : "int8");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 (n,)");
  const int64_t K = wp.size(1) * (int4 ? 8 : 4), rows = wp.size(0) * 16;
  TORCH_CHECK(G > 0 && K % G == 0 && sp.size(1) == K / G, "G must divide K (", K, ") into sp's ", sp.size(1),
              " groups");
  const at::Tensor wc = wp.contiguous(), sc = sp.to(at::kFloat).contiguous(), ic = ids.contiguous();
  const at::Tensor ac = int4 ? aux.to(at::kFloat).contiguous() : at::Tensor();
  const int64_t n = ic.size(0), ng = K / G;
  at::Tensor out = at::empty({n, K}, sc.options());
  const int64_t* id = ic.data_ptr<int64_t>();
  const float* sd = sc.data_ptr<float>();
  const float* ad = int4 ? ac.data_ptr<float>() : nullptr;
  float* od = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "token id ", id[i], " is out of range");
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = id[i] / 16, c = id[i] % 16;
      float* row = od + i * K;
      for (int64_t k = 0; k < K; ++k) {
        const float sv = sd[(b * ng + k / G) * 16 + c];
        if (int4) {
          const uint8_t byte = wc.data_ptr<uint8_t>()[((b * (K / 8) + k / 8) * 16 + c) * 4 + k % 4];
          const float u = static_cast<float>(k % 8 < 4 ? byte & 15 : byte >> 4);
          const float z = ad[(b * ng + k / G) * 16 + c] + 8.0f * sv;
          row[k] = (u - 8.0f) * sv + z;
        } else {
          row[k] = static_cast<float>(wc.data_ptr<int8_t>()[((b * (K / 4) + k / 4) * 16 + c) * 4 + k % 4]) * sv;
        }
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------ attention of a few queries per row
//
//   tinyformer::row_attention(q, k, v, mask, scale)
//     y[b,h,t] = sum_{j: mask[b,0,t,j]} p_j v[b,h/g,j],  p_j = exp(s_j - m) / sum_{j'} exp(s_j' - m),
//     s_j = scale q[b,h,t] . k[b,h/g,j],  m = max_j s_j  (g = H / H_kv query heads share a K/V head)
//
// q (B, H, T, d), k and v (B, H_kv, S, d) float32 (rows of d contiguous), mask bool broadcastable to
// (B, 1, T, S) -> y (B, H, T, d). Every query is summed alone, key by key in slot order, over exactly the keys
// its mask allows: its output does not depend on T, on S, or on the other queries. So a speculative
// verification (T tokens a row) gives each position the bits a one-token step at that position gives, which a
// fused kernel over the T queries (SDPA, or inductor's) does not. A query that may attend no key gets zeros.

// One query's two passes over its keys, each key in slot order: the scores s_j of the allowed keys (into
// `scores`; returns their maximum m, -inf for none), then y += e_j v_j with e_j = exp(s_j - m) (returns the
// sum of the e_j). AVX2: d a multiple of 8, one vector of partial sums per dot product; plain: 8 scalars.
struct PlainAttention {
  static float scores(const float* q, const float* k, int64_t ks, const bool* allowed, int64_t S, int64_t d,
                      float scale, float* scores) {
    float m = -INFINITY;
    for (int64_t j = 0; j < S; ++j) {
      if (!allowed[j]) continue;
      const float* kj = k + j * ks;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < d; ++i) acc[i % 8] += q[i] * kj[i];
      scores[j] = (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) * scale;
      m = std::max(m, scores[j]);
    }
    return m;
  }
  static float weigh(const float* v, int64_t vs, const bool* allowed, int64_t S, int64_t d, float m,
                     float* scores, float* y) {
    float denom = 0.0f;
    for (int64_t j = 0; j < S; ++j) {
      if (!allowed[j]) continue;
      const float e = std::exp(scores[j] - m);
      denom += e;
      for (int64_t i = 0; i < d; ++i) y[i] += e * v[j * vs + i];
    }
    return denom;
  }
};

#ifdef TF_X86
// The same arithmetic as PlainAttention's order per key and per output value, only faster: four keys' dot
// products in flight at once (each still one chain of FMAs over d, then hsum256), and y held in registers 64
// values at a time while the keys pass. Each score, e_j and y[i] is the same sequence of operations as a
// key-by-key loop, so the bits do not depend on how many keys are grouped.
struct Avx2Attention {
  __attribute__((target("avx2,fma"))) static float scores(const float* q, const float* k, int64_t ks,
                                                          const bool* allowed, int64_t S, int64_t d, float scale,
                                                          float* scores) {
    float m = -INFINITY;
    int64_t j = 0;
    for (; j + 4 <= S; j += 4) {  // the four keys' slots lie inside k: a masked one is computed, never used
      if (!(allowed[j] || allowed[j + 1] || allowed[j + 2] || allowed[j + 3])) continue;
      const float* k0 = k + j * ks;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ks + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ks + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ks + i), a3);
      }
      const __m256 acc[4] = {a0, a1, a2, a3};
      for (int u = 0; u < 4; ++u) {
        if (!allowed[j + u]) continue;
        scores[j + u] = hsum256(acc[u]) * scale;
        m = std::max(m, scores[j + u]);
      }
    }
    for (; j < S; ++j) {
      if (!allowed[j]) continue;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + j * ks + i), acc);
      scores[j] = hsum256(acc) * scale;
      m = std::max(m, scores[j]);
    }
    return m;
  }
  // scores[j] becomes e_j = exp(s_j - m); y (zeros on entry) += e_j v_j key by key, each value's sum in slot order
  __attribute__((target("avx2,fma"))) static float weigh(const float* v, int64_t vs, const bool* allowed, int64_t S,
                                                         int64_t d, float m, float* scores, float* y) {
    float denom = 0.0f;
    for (int64_t j = 0; j < S; ++j) {
      if (!allowed[j]) continue;
      scores[j] = std::exp(scores[j] - m);
      denom += scores[j];
    }
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {  // 8 vectors of y in registers
      __m256 y0 = _mm256_loadu_ps(y + c), y1 = _mm256_loadu_ps(y + c + 8), y2 = _mm256_loadu_ps(y + c + 16),
             y3 = _mm256_loadu_ps(y + c + 24), y4 = _mm256_loadu_ps(y + c + 32), y5 = _mm256_loadu_ps(y + c + 40),
             y6 = _mm256_loadu_ps(y + c + 48), y7 = _mm256_loadu_ps(y + c + 56);
      for (int64_t j = 0; j < S; ++j) {
        if (!allowed[j]) continue;
        const __m256 ev = _mm256_set1_ps(scores[j]);
        const float* vj = v + j * vs + c;
        y0 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj), y0);
        y1 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 8), y1);
        y2 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 16), y2);
        y3 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 24), y3);
        y4 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 32), y4);
        y5 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 40), y5);
        y6 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 48), y6);
        y7 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + 56), y7);
      }
      _mm256_storeu_ps(y + c, y0);
      _mm256_storeu_ps(y + c + 8, y1);
      _mm256_storeu_ps(y + c + 16, y2);
      _mm256_storeu_ps(y + c + 24, y3);
      _mm256_storeu_ps(y + c + 32, y4);
      _mm256_storeu_ps(y + c + 40, y5);
      _mm256_storeu_ps(y + c + 48, y6);
      _mm256_storeu_ps(y + c + 56, y7);
    }
    for (int64_t j = 0; j < S; ++j) {  // the last d % 64 values, through memory
      if (!allowed[j]) continue;
      const __m256 ev = _mm256_set1_ps(scores[j]);
      for (int64_t i = c; i < d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + j * vs + i), _mm256_loadu_ps(y + i)));
    }
    return denom;
  }
};
#endif

// y = softmax(scores) V for one query: zeros when it may attend no key.
template <typename Ops>
void attend_query(const float* q, const float* k, const float* v, int64_t ks, int64_t vs, const bool* allowed,
                  int64_t S, int64_t d, float scale, float* scores, float* y) {
  const float m = Ops::scores(q, k, ks, allowed, S, d, scale, scores);
  std::fill(y, y + d, 0.0f);
  if (m == -INFINITY) return;
  const float denom = Ops::weigh(v, vs, allowed, S, d, m, scores, y);
  for (int64_t i = 0; i < d; ++i) y[i] /= denom;
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale, int64_t path) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (B, H, T, d), (B, H_kv, S, d)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "q, k, v must be float32");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "mask must be bool (True = may attend)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  const int64_t H_kv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == d, "k and v must be (", B, ", H_kv, S, ", d,
              "), got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "the query heads (", H, ") must be a multiple of the K/V heads (", H_kv, ")");
  const Path use = resolve_path(path, false, "AVX-512");
  TORCH_CHECK(use != kAvx2 || d % 8 == 0, "the AVX2 path needs d a multiple of 8, got ", d);
  const at::Tensor qc = q.contiguous();
  // keys and values as given (a slice of the cache): rows of d contiguous, one stride per batch / head / slot
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  const at::Tensor mc = mask.expand({B, 1, T, S}).contiguous();
  at::Tensor y = at::empty({B, H, T, d}, qc.options());
  const float* qd = qc.data_ptr<float>();
  const float* kd = kc.data_ptr<float>();
  const float* vd = vc.data_ptr<float>();
  const bool* md = mc.data_ptr<bool>();
  float* yd = y.data_ptr<float>();
  const bool fast = use == kAvx2 || (use == kAuto && has_avx2() && d % 8 == 0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T;
      const float* kp = kd + b * kc.stride(0) + (h / (H / H_kv)) * kc.stride(1);
      const float* vp = vd + b * vc.stride(0) + (h / (H / H_kv)) * vc.stride(1);
      const bool* allowed = md + (b * T + t) * S;
#ifdef TF_X86
      if (fast) {
        attend_query<Avx2Attention>(qd + i * d, kp, vp, kc.stride(2), vc.stride(2), allowed, S, d, sc, scores.data(),
                                    yd + i * d);
        continue;
      }
#endif
      attend_query<PlainAttention>(qd + i * d, kp, vp, kc.stride(2), vc.stride(2), allowed, S, d, sc, scores.data(),
                                   yd + i * d);
    }
  });
  return y;
}

bool cpu_has_vnni() { return has_vnni(); }
bool cpu_has_avx512() { return has_avx512(); }
bool cpu_has_avx2() { return has_avx2(); }

}  // namespace

TORCH_LIBRARY(tinyformer, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? b, int path=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor s, int path=0) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor q, Tensor s, Tensor z, int path=0) -> Tensor");
  m.def("act8_gemm(Tensor x, Tensor wp, Tensor sp, Tensor aux, int N, int G, bool int4, int path) -> Tensor");
  m.def("cpu_has_vnni() -> bool", &cpu_has_vnni);
  m.def("cpu_has_avx512() -> bool", &cpu_has_avx512);
  m.def("cpu_has_avx2() -> bool", &cpu_has_avx2);
  m.def("dequantize_rows(Tensor q, Tensor s, Tensor? z, int o0, int o1) -> Tensor");
  m.def("act8_embedding(Tensor wp, Tensor sp, Tensor aux, Tensor ids, int G, bool int4) -> Tensor");
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, int path=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tinyformer, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("act8_gemm", &act8_gemm);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("row_attention", &row_attention);
  m.impl("act8_embedding", &act8_embedding);
}
