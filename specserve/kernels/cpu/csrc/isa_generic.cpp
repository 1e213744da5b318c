// Portable scalar kernels: the fallback on CPUs without AVX2+FMA, and the readable statement of
// what the SIMD files compute (same tile layouts, same integer sums, the same float steps per
// output; bit equality with them is not promised, batch invariance is).
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace specserve {
namespace {

inline float silu(float g) { return g / (1.f + std::exp(-g)); }
inline float gelu(float g) { return g / (1.f + std::exp(g * (kGeluC1 + kGeluC3 * g * g))); }
inline float gate_act(int epi, float g) { return epi == EPI_GELU_MUL ? gelu(g) : silu(g); }

// Weight (row j, column k) of a block-format tile-block, as the integer the format stores
// (Q4: 0..15, Q8_0: -127..127).
inline int block_weight(int fmt, const uint8_t* tb, int j, int k) {
  if (fmt == Q8_0) return (int8_t)tb[64 * (k / 4) + 4 * j + k % 4];
  const uint8_t byte = tb[64 * ((k % 16) / 4) + 4 * j + k % 4];
  return k < 16 ? byte & 0x0f : byte >> 4;
}

void gemm_block(const GemmArgs& a, int tile, float acc[NR], int m) {
  const int nb = a.K / QK, tbb = tile_block_bytes(a.fmt), L = a.act.levels;
  for (int j = 0; j < NR; ++j) acc[j] = 0.f;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* tb = a.w + block_offset(tile, b, nb, a.tiles, tbb);
    const uint8_t* sc = tb + (a.fmt == Q8_0 ? 512 : 256);
    const float s = a.act.scale[(int64_t)m * nb + b];
    const int32_t* sums = a.act.sums + (int64_t)m * L * nb + b;
    for (int j = 0; j < NR; ++j) {
      // digits combined exactly in int32 (Horner, see isa_avx512.cpp); Q8_0: first digit apart
      int32_t hi = 0, lo = 0;
      for (int l = 0; l < L; ++l) {
        const int8_t* al = a.act.q + ((int64_t)m * L + l) * a.K + b * QK;
        int32_t dot = 0;
        for (int k = 0; k < QK; ++k) dot += block_weight(a.fmt, tb, j, k) * al[k];
        if (a.fmt != Q8_0) hi = hi * 128 + dot;
        else if (l == 0) hi = dot;
        else lo = lo * 128 + dot;
      }
      float f;
      if (a.fmt == Q8_0) {
        f = L > 1 ? std::fma((float)hi, (float)(1 << (7 * (L - 1))), (float)lo) : (float)hi;
      } else {
        if (a.fmt == Q4_0) {
          int32_t sa = 0;
          for (int l = 0; l < L; ++l) sa = sa * 128 + sums[l * nb];
          hi -= 8 * sa;
        }
        f = (float)hi;
      }
      const float d = half_to_float(load_u16(sc + 2 * j));
      acc[j] = std::fma(d * s, f, acc[j]);
      if (a.fmt == Q4_1) {
        acc[j] = std::fma(half_to_float(load_u16(sc + 32 + 2 * j)),
                          a.act.fsum[(int64_t)m * nb + b], acc[j]);
      }
    }
  }
}

// The exact integer sum over weights [k0, k1) of (q - off) x X, X the activation's digits as one
// integer (Horner: a_0 128^(L-1) + ... + a_(L-1)).
inline int64_t sub_block_dot(const GemmArgs& a, int fmt, const uint8_t* sb, int j, int m, int b,
                             int k0, int k1, int off) {
  const int L = a.act.levels;
  int64_t dot = 0;
  for (int k = k0; k < k1; ++k) {
    int64_t x = 0;
    for (int l = 0; l < L; ++l) x = x * 128 + a.act.q[((int64_t)m * L + l) * a.K + b * QK + k];
    dot += (int64_t)(sub_block_weight(fmt, sb, j, k) - off) * x;
  }
  return dot;
}

// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: per 32-weight sub-block b, per output row, the exact integer
// dot rounded once to float (f), then acc = fma(D s, f, acc) with D the sub-block's scale and s
// the activation block's, and for formats with a min acc = fma(m, fsum, acc) (Q5_1) or
// fma(-M, fsum, acc) (Q4_K, Q5_K); Q6_K does the first step per 16-weight half, each with its
// own scale. The SIMD tables compute the same integers and run these float steps in this order,
// so every table gives these bits.
void gemm_sub_blocks(const GemmArgs& a, int tile, float acc[NR], int m) {
  const int fmt = a.fmt, nb = a.K / QK, bw = block_weights(fmt), tbb = tile_block_bytes(fmt);
  for (int j = 0; j < NR; ++j) acc[j] = 0.f;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* tb = a.w + block_offset(tile, b * QK / bw, a.K / bw, a.tiles, tbb);
    const int s = b % (bw / QK);  // the sub-block within a K-quant tile-block
    const uint8_t* sb = tb + s * sub_block_bytes(fmt);
    const float sc = a.act.scale[(int64_t)m * nb + b], fs = a.act.fsum[(int64_t)m * nb + b];
    for (int j = 0; j < NR; ++j) {
      float D[2], M = 0.f;
      if (is_kquant(fmt)) {
        kquant_scale(fmt, tb, s, j, D, &M);
      } else {
        D[0] = half_to_float(load_u16(sb + sub_block_bytes(fmt) + 2 * j));
        if (fmt == Q5_1) M = -half_to_float(load_u16(sb + sub_block_bytes(fmt) + 32 + 2 * j));
      }
      if (fmt == Q6_K) {
        for (int h = 0; h < 2; ++h) {
          const float f = (float)sub_block_dot(a, fmt, sb, j, m, b, 16 * h, 16 * h + 16, 32);
          acc[j] = std::fma(D[h] * sc, f, acc[j]);
        }
        continue;
      }
      const float f = (float)sub_block_dot(a, fmt, sb, j, m, b, 0, QK, fmt == Q5_0 ? 16 : 0);
      acc[j] = std::fma(D[0] * sc, f, acc[j]);
      if (fmt != Q5_0) acc[j] = std::fma(-M, fs, acc[j]);
    }
  }
}

void gemm_float(const GemmArgs& a, int tile, float acc[NR], int m) {
  const int eb = float_elem_bytes(a.fmt);
  const uint8_t* tw = a.w + (int64_t)tile * a.K * NR * eb;
  const float* x = a.x + (int64_t)m * a.ldx;
  float acc2[2][NR] = {};
  for (int k = 0; k < a.K; ++k) {
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = tw + ((int64_t)k * NR + j) * eb;
      float w;
      if (a.fmt == F32) std::memcpy(&w, p, 4);
      else if (a.fmt == BF16) w = bf16_to_float(load_u16(p));
      else w = half_to_float(load_u16(p));
      acc2[k & 1][j] = std::fma(w, x[k], acc2[k & 1][j]);
    }
  }
  for (int j = 0; j < NR; ++j) acc[j] = acc2[0][j] + acc2[1][j];
}

void tile_acc(const GemmArgs& a, int tile, int m, float acc[NR]) {
  if (a.fmt >= Q5_0) gemm_sub_blocks(a, tile, acc, m);
  else if (is_block_format(a.fmt)) gemm_block(a, tile, acc, m);
  else gemm_float(a, tile, acc, m);
  if (a.bias) for (int j = 0; j < NR; ++j) acc[j] += a.bias[tile * NR + j];
}

void gemm(const GemmArgs& a, int t0, int t1) {
  float acc[NR], up[NR];
  for (int t = t0; t < t1; ++t) {
    for (int m = 0; m < a.M; ++m) {
      float* y = a.y + (int64_t)m * a.ldy;
      if (gated_epilogue(a.epilogue)) {
        tile_acc(a, 2 * t, m, acc);
        tile_acc(a, 2 * t + 1, m, up);
        for (int j = 0; j < NR && t * NR + j < a.N; ++j) {
          y[t * NR + j] = gate_act(a.epilogue, acc[j]) * up[j];
        }
        continue;
      }
      tile_acc(a, t, m, acc);
      for (int j = 0; j < NR && t * NR + j < a.N; ++j) {
        if (a.epilogue == EPI_ADD) y[t * NR + j] += acc[j];
        else y[t * NR + j] = acc[j];
      }
    }
  }
}

void quantize(const float* x, int64_t ldx, int r0, int r1, int K, int L, int8_t* q, float* scale,
              int32_t* sums, float* fsum) {
  const int nb = K / QK;
  for (int r = r0; r < r1; ++r) {
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + (int64_t)r * ldx + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
      const int e = block_exponent(amax);  // 2^e > amax / 127
      const float inv = pow2(-e);  // exact: a power of two
      int32_t s[3] = {0, 0, 0};
      for (int i = 0; i < QK; ++i) {
        float v = amax >= 0x1p-100f ? xb[i] * inv : 0.f;
        for (int l = 0; l < L; ++l) {
          float d = std::nearbyint(v);
          if (l == 0) d = std::fmin(127.f, std::fmax(-127.f, d));
          q[((int64_t)r * L + l) * K + b * QK + i] = (int8_t)d;
          s[l] += (int32_t)d;
          v = (v - d) * 128.f;  // the remainder, exact, scaled to the next digit
        }
      }
      int64_t total = 0;
      for (int l = 0; l < L; ++l) {
        sums[((int64_t)r * L + l) * nb + b] = s[l];
        total = total * 128 + s[l];
      }
      const float sc = pow2(e - 7 * (L - 1));
      scale[(int64_t)r * nb + b] = sc;
      fsum[(int64_t)r * nb + b] = (float)total * sc;
    }
  }
}

void rmsnorm(const float* x, int64_t ldx, const float* w, float eps, int D, float* y, int64_t ldy,
             int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + (int64_t)r * ldx;
    float ss = 0.f;
    for (int i = 0; i < D; ++i) ss = std::fma(xr[i], xr[i], ss);
    const float inv = 1.f / std::sqrt(ss / (float)D + eps);
    for (int i = 0; i < D; ++i) y[(int64_t)r * ldy + i] = xr[i] * inv * w[i];
  }
}

inline float kv_value(const float* p, int d) { return p[d]; }
inline float kv_value(const uint16_t* p, int d) { return half_to_float(p[d]); }

template <class KV>  // float or uint16_t (fp16) cache
void attention_query(const AttnArgs& a, int t, int h, const int64_t* slots, int L, float* scores) {
  const int D = a.head_dim, g = h / (a.num_heads / a.num_kv_heads);
  const float* q = a.q + (int64_t)t * a.ldq + h * D;
  float mx = -INFINITY;
  for (int j = 0; j < L; ++j) {
    const KV* k = kv_cache_k<KV>(a) + (slots[j] * a.num_kv_heads + g) * D;
    float dot = 0.f;
    for (int d = 0; d < D; ++d) dot = std::fma(q[d], kv_value(k, d), dot);
    scores[j] = dot * a.scale;
    mx = std::fmax(mx, scores[j]);
  }
  float sum = 0.f;
  for (int j = 0; j < L; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  float* o = a.out + (int64_t)t * a.ldo + h * D;
  for (int d = 0; d < D; ++d) o[d] = 0.f;
  for (int j = 0; j < L; ++j) {
    const KV* v = kv_cache_v<KV>(a) + (slots[j] * a.num_kv_heads + g) * D;
    for (int d = 0; d < D; ++d) o[d] = std::fma(scores[j], kv_value(v, d), o[d]);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < D; ++d) o[d] *= inv;
}

void attention(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  for (int item = i0; item < i1; ++item) {
    const int32_t* it = a.items + 4 * item;
    for (int t = it[0]; t < it[1]; ++t) {
      const int L = visible_keys(a, t, s.slots);
      for (int h = it[2]; h < it[3]; ++h) {
        if (a.k_half) {
          attention_query<uint16_t>(a, t, h, s.slots, L, s.scores);
        } else {
          attention_query<float>(a, t, h, s.slots, L, s.scores);
        }
      }
    }
  }
}

const IsaKernels kTable = {"generic", gemm, quantize, rmsnorm, attention, argmax_scalar,
                          logit_stats_scalar};

}  // namespace

const IsaKernels* generic_kernels() { return &kTable; }

}  // namespace specserve
