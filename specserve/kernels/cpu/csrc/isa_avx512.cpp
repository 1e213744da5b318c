// AVX-512 kernels (F, BW, VL, DQ, VNNI; F16C for fp16 scales). Chosen at run time when the CPU
// has them (engine.cpp); everything here has internal linkage but the table getter.
//
// Block formats: one 16-lane int32 vector holds 16 output rows; each vpdpbusd adds 4 weight x
// activation-digit products per row, so a tile-block (16 rows x 32 weights) is 8 vpdpbusd per
// activation digit, then one int->float conversion and one FMA per row: no horizontal add per
// output (the layout puts the 16 rows side by side). Integer sums are exact, so how they are
// chained does not matter; the float steps per output row are the same for every M.
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2,bmi,bmi2")

namespace specserve {
namespace {

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m512 exp512(__m512 x) {
  // exp(x) = 2^n exp(r), n = round(x log2 e), |r| <= ln2 / 2; Cephes' expf polynomial for
  // exp(r). Below -87.3 the result is 0 (masked), so padded -inf scores contribute nothing.
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r),
                                   _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(y, n));
}

inline __m512 silu512(__m512 g) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

// gelu_tanh (kernels.h: g / (1 + exp(g (c1 + c3 g^2)))), or silu: a gated epilogue's activation
inline __m512 gate_act512(int epi, __m512 g) {
  if (epi != EPI_GELU_MUL) return silu512(g);
  const __m512 u = _mm512_mul_ps(g, _mm512_add_ps(_mm512_set1_ps(kGeluC1),
                                                  _mm512_mul_ps(_mm512_set1_ps(kGeluC3),
                                                                _mm512_mul_ps(g, g))));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(u)));
}

// ---- block formats ----------------------------------------------------------------------------
//
// Digits are combined exactly in int32 (Horner over the digits' dots: s = (s << 7) + next digit's
// dot), so a row x tile-block costs 8 vpdpbusd per digit, then one conversion and one or two
// FMAs. For Q4 weights (0..15) the combined sum stays below 2^31 (|s| <= 32 * 15 * 127 * 2^14 +
// ... ~ 1.0e9); Q8_0 weights (stored int8, used as uint8 w + 128) would overflow, so their first
// digit keeps its own accumulator and the two meet in one float FMA.

template <int FMT>
constexpr int tbb() { return FMT == Q8_0 ? 544 : FMT == Q4_0 ? 288 : 320; }

constexpr int kPrefetchBlocks = 10;

// Sum of a row-block's digit sums combined like the digits (Horner over levels l0..L-1).
template <int L>
inline int32_t horner_sums(const int32_t* sums, int nb, int l0) {
  int32_t v = 0;
  for (int l = l0; l < L; ++l) v = v * 128 + sums[l * nb];
  return v;
}

// Tiles t[0..NT-1], rows m0..m0+MR-1, every block: acc[t][r] (16 output rows each).
template <int FMT, int L, int MR, int NT>
inline void block_tiles(const GemmArgs& a, const int* tiles, int m0, __m512 (&acc)[NT][MR]) {
  constexpr bool Q8 = FMT == Q8_0;
  constexpr int TBB = tbb<FMT>();
  constexpr int32_t OFF = Q8 ? 128 : FMT == Q4_0 ? 8 : 0;
  const int nb = a.K / QK, K = a.K;
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < MR; ++r) acc[t][r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i flip = _mm512_set1_epi8((char)0x80);  // int8 w -> uint8 w + 128
  // a tile of a memory pair (tiles 2p, 2p+1) steps over its partner's blocks (kernels.h);
  // when both are multiplied together the pair is one stream
  const uint8_t* base[NT];
  int64_t step[NT];
  for (int t = 0; t < NT; ++t) {
    base[t] = a.w + block_offset(tiles[t], 0, nb, a.tiles, TBB);
    step[t] = tiles[t] < a.tiles - a.tiles % 2 ? 2 * TBB : TBB;
  }
  const bool paired = NT == 2 && tiles[0] % 2 == 0 && tiles[1] == tiles[0] + 1 &&
                      step[0] == 2 * TBB;
  for (int b = 0; b < nb; ++b) {
    // Prefetch kPrefetchBlocks blocks ahead on the first pass over these weights (row chunk 0;
    // later chunks find them in L2): the loop computes for ~40+ cycles per block, too long
    // between loads for the hardware prefetcher alone to keep DRAM busy (1.25x measured).
    if (m0 == 0) {
      for (int t = 0; t < (paired ? 1 : NT); ++t) {
        const char* pf = (const char*)base[t] + (b + kPrefetchBlocks) * step[t];
        const int len = paired ? 2 * TBB : TBB;
        for (int off = 0; off < len; off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
      }
    }
    __m512i w[NT][8];  // group g: 16 rows x weights 4g..4g+3, unsigned bytes
    __m512 d[NT], mn[NT];
    for (int t = 0; t < NT; ++t) {
      const uint8_t* tb = base[t] + b * step[t];
      if (Q8) {
        for (int g = 0; g < 8; ++g) w[t][g] = _mm512_xor_si512(_mm512_loadu_si512(tb + 64 * g), flip);
      } else {
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(tb + 64 * c);
          w[t][c] = _mm512_and_si512(v, lo4);
          w[t][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
      }
      const uint8_t* sc = tb + (Q8 ? 512 : 256);
      d[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
      if (FMT == Q4_1) mn[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const int8_t* ab = a.act.q + m * L * K + b * QK;
      const int32_t* sums = a.act.sums + m * L * nb + b;
      // One chain per digit and tile (8 vpdpbusd each), combined after the block: Horner on the
      // digits' sums is the integer a two-chain split would build digit by digit (integer sums
      // are exact, so the bits are the same), and L independent chains of 8 hide vpdpbusd's
      // latency with fewer rows in flight than two chains of 8 L. Each digit row's pointer is
      // held apart: indexing one base by l * K ran the kernel out of general registers
      // (offsets parked in xmm, moved back per broadcast). Both: a verify forward of 8 nodes
      // -10% (python -m benchmark.profile_cpu_engine --tokens 1,8).
      __m512i dig[L][NT];
      const int8_t* al[L];
      for (int l = 0; l < L; ++l) {
        al[l] = ab + (int64_t)l * K;
        for (int t = 0; t < NT; ++t) dig[l][t] = _mm512_setzero_si512();
      }
      for (int g = 0; g < 8; ++g) {
        for (int l = 0; l < L; ++l) {
          const __m512i x = _mm512_set1_epi32(load_i32(al[l] + 4 * g));
          for (int t = 0; t < NT; ++t) dig[l][t] = _mm512_dpbusd_epi32(dig[l][t], w[t][g], x);
        }
      }
      // Q4: every digit in s; Q8_0: the first digit in s, the others in s_lo
      __m512i s[NT], s_lo[NT];
      for (int t = 0; t < NT; ++t) {
        const int l0 = Q8 ? 1 : 0;
        __m512i h = l0 < L ? dig[l0][t] : _mm512_setzero_si512();
        for (int l = l0 + 1; l < L; ++l) h = _mm512_add_epi32(_mm512_slli_epi32(h, 7), dig[l][t]);
        s[t] = Q8 ? dig[0][t] : h;
        s_lo[t] = h;
      }
      __m512 f[NT];
      if (Q8) {
        const __m512i o_hi = _mm512_set1_epi32(OFF * sums[0]);
        const __m512i o_lo = _mm512_set1_epi32(OFF * horner_sums<L>(sums, nb, 1));
        for (int t = 0; t < NT; ++t) {
          f[t] = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[t], o_hi));
          if (L > 1) {
            f[t] = _mm512_fmadd_ps(f[t], _mm512_set1_ps((float)(1 << (7 * (L - 1)))),
                                   _mm512_cvtepi32_ps(_mm512_sub_epi32(s_lo[t], o_lo)));
          }
        }
      } else {
        __m512i o = _mm512_setzero_si512();
        if (OFF) o = _mm512_set1_epi32(OFF * horner_sums<L>(sums, nb, 0));
        for (int t = 0; t < NT; ++t) {
          f[t] = _mm512_cvtepi32_ps(OFF ? _mm512_sub_epi32(s[t], o) : s[t]);
        }
      }
      const __m512 sc = _mm512_set1_ps(a.act.scale[m * nb + b]);
      for (int t = 0; t < NT; ++t) acc[t][r] = _mm512_fmadd_ps(_mm512_mul_ps(d[t], sc), f[t], acc[t][r]);
      if (FMT == Q4_1) {
        const __m512 fs = _mm512_set1_ps(a.act.fsum[m * nb + b]);
        for (int t = 0; t < NT; ++t) acc[t][r] = _mm512_fmadd_ps(mn[t], fs, acc[t][r]);
      }
    }
  }
}

// ---- 5- and 6-bit and K-quant formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) -------------------------
//
// The same scheme per 32-weight sub-block: the weights' unsigned integers q unpacked to bytes
// (nibbles, then bit 4 or bits 4-5 from their planes, kernels.h), one vpdpbusd chain per digit
// and tile (Q6_K: per 16-weight half too), Horner, the format's offset subtracted with the
// activations' digit sums, one conversion, then isa_generic.cpp's float steps in its order.

template <int FMT>
constexpr bool has_bit4() { return FMT == Q5_0 || FMT == Q5_1 || FMT == Q5_K; }

// w | (x & m), one instruction
inline __m512i or_masked(__m512i w, __m512i x, __m512i m) {
  return _mm512_ternarylogic_epi32(w, x, m, 0xF8);
}

// A sub-block's weights for 16 rows: group g (weights 4 g .. 4 g + 3) as unsigned bytes.
template <int FMT>
inline void sub_weights(const uint8_t* sb, __m512i (&w)[8]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(sb + 64 * c);
    w[c] = _mm512_and_si512(v, lo4);
    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  }
  if constexpr (has_bit4<FMT>()) {  // bit g of the plane's bytes is group g's bit 4
    const __m512i h = _mm512_loadu_si512(sb + 256), m = _mm512_set1_epi8(0x10);
    w[0] = or_masked(w[0], _mm512_slli_epi16(h, 4), m);
    w[1] = or_masked(w[1], _mm512_slli_epi16(h, 3), m);
    w[2] = or_masked(w[2], _mm512_slli_epi16(h, 2), m);
    w[3] = or_masked(w[3], _mm512_slli_epi16(h, 1), m);
    w[4] = or_masked(w[4], h, m);
    w[5] = or_masked(w[5], _mm512_srli_epi16(h, 1), m);
    w[6] = or_masked(w[6], _mm512_srli_epi16(h, 2), m);
    w[7] = or_masked(w[7], _mm512_srli_epi16(h, 3), m);
  }
  if constexpr (FMT == Q6_K) {  // plane p, bits 2 s .. 2 s + 1: group 4 p + s's bits 4-5
    const __m512i m = _mm512_set1_epi8(0x30);
    for (int p = 0; p < 2; ++p) {
      const __m512i h = _mm512_loadu_si512(sb + 256 + 64 * p);
      w[4 * p] = or_masked(w[4 * p], _mm512_slli_epi16(h, 4), m);
      w[4 * p + 1] = or_masked(w[4 * p + 1], _mm512_slli_epi16(h, 2), m);
      w[4 * p + 2] = or_masked(w[4 * p + 2], h, m);
      w[4 * p + 3] = or_masked(w[4 * p + 3], _mm512_srli_epi16(h, 2), m);
    }
  }
}

inline __m512 u8_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline __m512 i8_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// A sub-block's scales for 16 rows: D[0] (Q6_K: D[0], D[1] per half) and the min term mn
// (Q5_1: m, added; K-quants: M = dmin mn, subtracted). tb: the tile-block, s: the sub-block.
template <int FMT>
inline void sub_scales(const uint8_t* tb, int s, __m512 (&D)[2], __m512* mn) {
  if constexpr (FMT == Q5_0 || FMT == Q5_1) {
    D[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tb + 320)));
    if (FMT == Q5_1) *mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tb + 352)));
  } else {
    const uint8_t* sc = kquant_scales(FMT, tb);
    const uint8_t* dp = kquant_d(FMT, tb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dp));
    if (FMT == Q6_K) {
      D[0] = _mm512_mul_ps(d, i8_to_ps(sc + 16 * (2 * s)));
      D[1] = _mm512_mul_ps(d, i8_to_ps(sc + 16 * (2 * s + 1)));
    } else {
      D[0] = _mm512_mul_ps(d, u8_to_ps(sc + 16 * s));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dp + 32)));
      *mn = _mm512_mul_ps(dmin, u8_to_ps(sc + 128 + 16 * s));
    }
  }
}

// Prefetch for sub-block b of a pass over a tile (or tile pair: stride `step`, one stream),
// kPrefetchBlocks sub-blocks ahead: a K-quant tile-block holds 8 of them, so the slice of its
// bytes that sub-block's share of the stream covers.
template <int FMT>
inline void sub_prefetch(const uint8_t* base, int64_t step, int b) {
  constexpr int per = block_weights(FMT) / QK;
  const int at = b + kPrefetchBlocks;
  const char* p = (const char*)base + (at / per) * step + (at % per) * (step / per);
  for (int off = 0; off < step / per + 64; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Tiles t[0..NT-1], rows m0..m0+MR-1, every sub-block: acc[t][r] (block_tiles' shape).
template <int FMT, int L, int MR, int NT>
inline void sub_tiles(const GemmArgs& a, const int* tiles, int m0, __m512 (&acc)[NT][MR]) {
  constexpr int TBB = tile_block_bytes(FMT);
  constexpr int PER = block_weights(FMT) / QK, SBB = sub_block_bytes(FMT);
  constexpr int P = FMT == Q6_K ? 2 : 1;  // integer sums per sub-block: Q6_K's halves
  constexpr int32_t OFF = FMT == Q5_0 ? 16 : FMT == Q6_K ? 32 : 0;
  const int nb = a.K / QK, K = a.K, nbw = a.K / block_weights(FMT);
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < MR; ++r) acc[t][r] = _mm512_setzero_ps();
  const uint8_t* base[NT];
  int64_t step[NT];
  for (int t = 0; t < NT; ++t) {
    base[t] = a.w + block_offset(tiles[t], 0, nbw, a.tiles, TBB);
    step[t] = tiles[t] < a.tiles - a.tiles % 2 ? 2 * TBB : TBB;
  }
  const bool paired = NT == 2 && tiles[0] % 2 == 0 && tiles[1] == tiles[0] + 1 &&
                      step[0] == 2 * TBB;
  for (int b = 0; b < nb; ++b) {
    if (m0 == 0) {
      for (int t = 0; t < (paired ? 1 : NT); ++t) sub_prefetch<FMT>(base[t], step[t], b);
    }
    __m512i w[NT][8];
    __m512 D[NT][2], mn[NT];
    for (int t = 0; t < NT; ++t) {
      mn[t] = D[t][1] = _mm512_setzero_ps();
      const uint8_t* tb = base[t] + (b / PER) * step[t];
      sub_weights<FMT>(tb + (b % PER) * SBB, w[t]);
      sub_scales<FMT>(tb, b % PER, D[t], &mn[t]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const int8_t* ab = a.act.q + m * L * K + b * QK;
      __m512i dig[L][NT][P];
      const int8_t* al[L];
      for (int l = 0; l < L; ++l) {
        al[l] = ab + (int64_t)l * K;
        for (int t = 0; t < NT; ++t)
          for (int p = 0; p < P; ++p) dig[l][t][p] = _mm512_setzero_si512();
      }
      for (int g = 0; g < 8; ++g) {
        const int p = P == 2 ? g / 4 : 0;
        for (int l = 0; l < L; ++l) {
          const __m512i x = _mm512_set1_epi32(load_i32(al[l] + 4 * g));
          for (int t = 0; t < NT; ++t) {
            dig[l][t][p] = _mm512_dpbusd_epi32(dig[l][t][p], w[t][g], x);
          }
        }
      }
      // the offset's share: OFF x the digit sums (Q6_K: of each half)
      int32_t off[2] = {0, 0};
      if (OFF) {
        const int32_t* sums = a.act.sums + m * L * nb + b;
        const int64_t all = (int64_t)OFF * horner_sums<L>(sums, nb, 0);  // < 2^31, just
        if (P == 2) {
          off[0] = OFF * horner_sums<L>(a.act.hsums + m * L * nb + b, nb, 0);
          off[1] = (int32_t)(all - off[0]);
        } else {
          off[0] = (int32_t)all;
        }
      }
      const __m512 sc = _mm512_set1_ps(a.act.scale[m * nb + b]);
      const __m512 fs = _mm512_set1_ps(a.act.fsum[m * nb + b]);
      for (int t = 0; t < NT; ++t) {
        for (int p = 0; p < P; ++p) {
          __m512i h = dig[0][t][p];
          for (int l = 1; l < L; ++l) h = _mm512_add_epi32(_mm512_slli_epi32(h, 7), dig[l][t][p]);
          const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(h, _mm512_set1_epi32(off[p])));
          acc[t][r] = _mm512_fmadd_ps(_mm512_mul_ps(D[t][p], sc), f, acc[t][r]);
        }
        if (FMT == Q5_1) acc[t][r] = _mm512_fmadd_ps(mn[t], fs, acc[t][r]);
        if (FMT == Q4_K || FMT == Q5_K) acc[t][r] = _mm512_fnmadd_ps(mn[t], fs, acc[t][r]);
      }
    }
  }
}

// ---- float formats (weights [K][16] per tile) -------------------------------------------------

template <int FMT>
inline __m512 load_w16(const uint8_t* p) {
  if (FMT == F32) return _mm512_loadu_ps(p);
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  if (FMT == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16
}

template <int FMT, int MR>
inline void tile_float(const GemmArgs& a, int tile, int m0, __m512 acc[MR]) {
  constexpr int EB = FMT == F32 ? 4 : 2;
  const uint8_t* tw = a.w + (int64_t)tile * a.K * NR * EB;
  __m512 e[MR], o[MR];  // two chains per row (even / odd k), added at the end
  for (int r = 0; r < MR; ++r) e[r] = o[r] = _mm512_setzero_ps();
  const float* x = a.x + (int64_t)m0 * a.ldx;
  int k = 0;
  for (; k + 1 < a.K; k += 2) {
    const __m512 w0 = load_w16<FMT>(tw + (int64_t)k * NR * EB);
    const __m512 w1 = load_w16<FMT>(tw + (int64_t)(k + 1) * NR * EB);
    for (int r = 0; r < MR; ++r) {
      e[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * a.ldx + k]), e[r]);
      o[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * a.ldx + k + 1]), o[r]);
    }
  }
  if (k < a.K) {
    const __m512 w0 = load_w16<FMT>(tw + (int64_t)k * NR * EB);
    for (int r = 0; r < MR; ++r) e[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * a.ldx + k]), e[r]);
  }
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_add_ps(e[r], o[r]);
}

template <int FMT, int L, int MR>
inline void add_bias(const GemmArgs& a, int tile, __m512 acc[MR]) {
  if (!a.bias) return;
  const __m512 bias = _mm512_loadu_ps(a.bias + tile * NR);
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_add_ps(acc[r], bias);
}

// Accumulators of tiles ta and tb for rows m0..m0+MR-1 (float formats: one tile at a time).
template <int FMT, int L, int MR>
inline void pair_acc(const GemmArgs& a, int ta, int tb, int m0, __m512 acc_a[MR],
                     __m512 acc_b[MR]) {
  if constexpr (FMT >= Q5_0) {
    const int tiles[2] = {ta, tb};
    __m512 acc[2][MR];
    sub_tiles<FMT, L, MR, 2>(a, tiles, m0, acc);
    for (int r = 0; r < MR; ++r) acc_a[r] = acc[0][r], acc_b[r] = acc[1][r];
  } else if constexpr (FMT == Q8_0 || FMT == Q4_0 || FMT == Q4_1) {
    const int tiles[2] = {ta, tb};
    __m512 acc[2][MR];
    block_tiles<FMT, L, MR, 2>(a, tiles, m0, acc);
    for (int r = 0; r < MR; ++r) acc_a[r] = acc[0][r], acc_b[r] = acc[1][r];
  } else {
    tile_float<FMT, MR>(a, ta, m0, acc_a);
    tile_float<FMT, MR>(a, tb, m0, acc_b);
  }
  add_bias<FMT, L, MR>(a, ta, acc_a);
  add_bias<FMT, L, MR>(a, tb, acc_b);
}

template <int FMT, int L, int MR>
inline void single_acc(const GemmArgs& a, int t, int m0, __m512 acc[MR]) {
  if constexpr (FMT >= Q5_0) {
    const int tiles[1] = {t};
    __m512 one[1][MR];
    sub_tiles<FMT, L, MR, 1>(a, tiles, m0, one);
    for (int r = 0; r < MR; ++r) acc[r] = one[0][r];
  } else if constexpr (FMT == Q8_0 || FMT == Q4_0 || FMT == Q4_1) {
    const int tiles[1] = {t};
    __m512 one[1][MR];
    block_tiles<FMT, L, MR, 1>(a, tiles, m0, one);
    for (int r = 0; r < MR; ++r) acc[r] = one[0][r];
  } else {
    tile_float<FMT, MR>(a, t, m0, acc);
  }
  add_bias<FMT, L, MR>(a, t, acc);
}

// argmax (kernels.h): the maximum in one pass (NaNs noted: such a row goes the scalar way),
// then the first lane equal to it
int64_t argmax(const float* x, int64_t n, float* best) {
  if (n <= 0) return argmax_scalar(x, n, best);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 m = ninf;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
  if (i < n) {
    const __m512 v = _mm512_mask_loadu_ps(ninf, tail, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  if (nan) return argmax_scalar(x, n, best);
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 vm = _mm512_set1_ps(mx);
  *best = mx;
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz((unsigned)eq);
  }
  const __mmask16 eq = _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, x + i), vm,
                                               _CMP_EQ_OQ);
  return i + __builtin_ctz((unsigned)eq);  // the maximum is there
}

// logit_stats (kernels.h): 16 lanes of exp sums in two chains; the top-k list sees only the
// lanes above its k-th value once it is full (a few hundred candidates in a 49k row)
float logit_stats(const float* x, int64_t n, float mx, int k, float* vals, int32_t* ids,
                  int* cnt) {
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  auto top = [&](__m512 v, int64_t i, __mmask16 live) {
    if (!k) return;
    __mmask16 c = *cnt < k ? _mm512_mask_cmp_ps_mask(live, v, v, _CMP_ORD_Q)
                           : _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(vals[k - 1]),
                                                     _CMP_GT_OQ);
    for (; c; c &= c - 1) {
      const int j = __builtin_ctz((unsigned)c);
      // (lanes that a previous insert of this vector lifted the k-th above: top_insert drops)
      top_insert(x[i + j], (int32_t)(i + j), k, vals, ids, cnt);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    s0 = _mm512_add_ps(s0, exp512(_mm512_sub_ps(a, vm)));
    s1 = _mm512_add_ps(s1, exp512(_mm512_sub_ps(b, vm)));
    top(a, i, 0xffff);
    top(b, i + 16, 0xffff);
  }
  for (; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(live, x + i);
    s0 = _mm512_add_ps(s0, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(a, vm))));
    top(a, i, live);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

inline __mmask16 col_mask(const GemmArgs& a, int col) {
  const int valid = a.N - col < NR ? a.N - col : NR;
  if (valid <= 0) return 0;
  return valid == NR ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
}

template <int MR>
inline void store_rows(const GemmArgs& a, int col, int m0, __m512 acc[MR]) {
  const __mmask16 mask = col_mask(a, col);
  if (!mask) return;
  for (int r = 0; r < MR; ++r) {
    float* y = a.y + (int64_t)(m0 + r) * a.ldy + col;
    __m512 v = acc[r];
    if (a.epilogue == EPI_ADD) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
    _mm512_mask_storeu_ps(y, mask, v);
  }
}

// Tiles [t0, t1) for rows m0..m0+MR-1: in pairs, the last one alone if the count is odd.
// Gated epilogues (EPI_SILU_MUL, EPI_GELU_MUL): unit t is the (gate, up) pair of packed tiles
// 2t, 2t+1.
template <int FMT, int L, int MR>
inline void tiles_rows(const GemmArgs& a, int t0, int t1, int m0) {
  __m512 x[MR], y[MR];
  if (gated_epilogue(a.epilogue)) {
    for (int t = t0; t < t1; ++t) {
      pair_acc<FMT, L, MR>(a, 2 * t, 2 * t + 1, m0, x, y);
      const __mmask16 mask = col_mask(a, t * NR);
      for (int r = 0; r < MR; ++r) {
        float* out = a.y + (int64_t)(m0 + r) * a.ldy + t * NR;
        _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(gate_act512(a.epilogue, x[r]), y[r]));
      }
    }
    return;
  }
  int t = t0;
  for (; t + 1 < t1; t += 2) {
    pair_acc<FMT, L, MR>(a, t, t + 1, m0, x, y);
    store_rows<MR>(a, t * NR, m0, x);
    store_rows<MR>(a, (t + 1) * NR, m0, y);
  }
  if (t < t1) {
    single_acc<FMT, L, MR>(a, t, m0, x);
    store_rows<MR>(a, t * NR, m0, x);
  }
}

// Weights stream once per group of up to 32 tiles; within it, rows go up to 8 at a time (a
// call of M <= 8 rows, every verify pass of a small tree, reads and unpacks each weight block
// once), so a tile group's weights stay in L1/L2 while every row block reads them. Eight rows'
// accumulators do not all fit in registers beside the weights; the spilled ones are touched
// once per block (a forward of 8 rows -5%, a batch-8 decode step -9%, 6 rows no gain:
// python -m benchmark.profile_cpu_engine --tokens 1,6,8).
template <int FMT, int L>
void gemm_fmt(const GemmArgs& a, int t0, int t1) {
  constexpr int TG = 32;
  for (int g0 = t0; g0 < t1; g0 += TG) {
    const int g1 = g0 + TG < t1 ? g0 + TG : t1;
    for (int m = 0; m < a.M;) {
      const int mr = a.M - m < 8 ? a.M - m : 8;
      switch (mr) {
        case 8: tiles_rows<FMT, L, 8>(a, g0, g1, m); break;
        case 7: tiles_rows<FMT, L, 7>(a, g0, g1, m); break;
        case 6: tiles_rows<FMT, L, 6>(a, g0, g1, m); break;
        case 5: tiles_rows<FMT, L, 5>(a, g0, g1, m); break;
        case 4: tiles_rows<FMT, L, 4>(a, g0, g1, m); break;
        case 3: tiles_rows<FMT, L, 3>(a, g0, g1, m); break;
        case 2: tiles_rows<FMT, L, 2>(a, g0, g1, m); break;
        default: tiles_rows<FMT, L, 1>(a, g0, g1, m); break;
      }
      m += mr;
    }
  }
}

template <int FMT>
void gemm_levels(const GemmArgs& a, int t0, int t1) {
  switch (a.act.levels) {
    case 1: gemm_fmt<FMT, 1>(a, t0, t1); break;
    case 2: gemm_fmt<FMT, 2>(a, t0, t1); break;
    default: gemm_fmt<FMT, 3>(a, t0, t1); break;
  }
}

void gemm(const GemmArgs& a, int t0, int t1) {
  switch (a.fmt) {
    case Q8_0: gemm_levels<Q8_0>(a, t0, t1); break;
    case Q4_0: gemm_levels<Q4_0>(a, t0, t1); break;
    case Q4_1: gemm_levels<Q4_1>(a, t0, t1); break;
    case Q5_0: gemm_levels<Q5_0>(a, t0, t1); break;
    case Q5_1: gemm_levels<Q5_1>(a, t0, t1); break;
    case Q4_K: gemm_levels<Q4_K>(a, t0, t1); break;
    case Q5_K: gemm_levels<Q5_K>(a, t0, t1); break;
    case Q6_K: gemm_levels<Q6_K>(a, t0, t1); break;
    case F32: gemm_fmt<F32, 1>(a, t0, t1); break;
    case BF16: gemm_fmt<BF16, 1>(a, t0, t1); break;
    default: gemm_fmt<F16, 1>(a, t0, t1); break;
  }
}

// ---- activation digits (the same values as isa_generic.cpp's scalar quantize) -------------------

// Row xr's block scales, 16 blocks at a time and ahead of the digits (whose per-block work then
// no longer waits on a scalar division and exponent): inv[b] = 2^-e (0 for a block under
// 2^-100) and scale[b] = 2^(e - 7 (L - 1)), with e = block_exponent(amax) exactly (the
// quotient's bits; block_exponent itself for a lane whose quotient is not a normal float).
inline void block_scales(const float* xr, int nb, int L, float* inv, float* scale) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  alignas(64) float amax[16];
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int n = nb - b0 < 16 ? nb - b0 : 16;
    for (int i = 0; i < n; ++i) {
      const float* xb = xr + (int64_t)(b0 + i) * QK;
      amax[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(xb), absmask),
                                                   _mm512_and_ps(_mm512_loadu_ps(xb + 16), absmask)));
    }
    const __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512 a = _mm512_maskz_load_ps(m, amax);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(m, a, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
    const __m512i be = _mm512_and_si512(
        _mm512_srli_epi32(_mm512_castps_si512(_mm512_div_ps(a, _mm512_set1_ps(127.f))), 23),
        _mm512_set1_epi32(0xff));
    __m512i e = _mm512_maskz_sub_epi32(live, be, _mm512_set1_epi32(126));
    const __mmask16 odd = live & (_mm512_cmpeq_epi32_mask(be, _mm512_setzero_si512()) |
                                  _mm512_cmpeq_epi32_mask(be, _mm512_set1_epi32(0xff)));
    if (odd) {
      alignas(64) int32_t ev[16];
      _mm512_store_si512(ev, e);
      for (int i = 0; i < n; ++i) if (odd >> i & 1) ev[i] = block_exponent(amax[i]);
      e = _mm512_load_si512(ev);
    }
    const __m512i one = _mm512_set1_epi32(127);
    const __m512 iv = _mm512_maskz_mov_ps(
        live, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(one, e), 23)));
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(one, e), _mm512_set1_epi32(-7 * (L - 1))), 23));
    _mm512_mask_storeu_ps(inv + b0, m, iv);
    _mm512_mask_storeu_ps(scale + b0, m, sc);
  }
}


// Lane-wise steps of reduce16 for float and int32 vectors (the same lanes move either way).
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512i vadd(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
inline __m512 lo32(__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }
inline __m512i lo32(__m512i a, __m512i b) { return _mm512_unpacklo_epi32(a, b); }
inline __m512 hi32(__m512 a, __m512 b) { return _mm512_unpackhi_ps(a, b); }
inline __m512i hi32(__m512i a, __m512i b) { return _mm512_unpackhi_epi32(a, b); }
inline __m512 lo64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline __m512i lo64(__m512i a, __m512i b) { return _mm512_unpacklo_epi64(a, b); }
inline __m512 hi64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline __m512i hi64(__m512i a, __m512i b) { return _mm512_unpackhi_epi64(a, b); }
template <int IMM>
inline __m512 lanes128(__m512 a, __m512 b) { return _mm512_shuffle_f32x4(a, b, IMM); }
template <int IMM>
inline __m512i lanes128(__m512i a, __m512i b) { return _mm512_shuffle_i32x4(a, b, IMM); }

// r[j] = sum of the 16 lanes of p[j], for 16 vectors at once (a fixed tree of in-lane unpacks
// and 128-bit lane shuffles: ~3 instructions per vector instead of ~8 for one reduce_add); V is
// __m512 (attention scores) or __m512i (digit sums).
template <class V>
inline V reduce16(const V (&p)[16]) {
  V w[4];
  for (int g = 0; g < 4; ++g) {
    V s[2];
    for (int h = 0; h < 2; ++h) {
      const V a0 = p[4 * g + 2 * h], a1 = p[4 * g + 2 * h + 1];
      s[h] = vadd(lo32(a0, a1), hi32(a0, a1));
    }
    w[g] = vadd(lo64(s[0], s[1]), hi64(s[0], s[1]));  // lane k: 4 partials
  }
  const V y01 = vadd(lanes128<0x44>(w[0], w[1]), lanes128<0xEE>(w[0], w[1]));
  const V y23 = vadd(lanes128<0x44>(w[2], w[3]), lanes128<0xEE>(w[2], w[3]));
  return vadd(lanes128<0x88>(y01, y23), lanes128<0xDD>(y01, y23));
}

// A row's per-level digit sums, 16 blocks at a time: each block's lane sums are kept as vectors
// and reduced together (reduce16, in integers, so any order is exact),
// then Q4_1's fsum = (float)(Horner of the sums) * scale for the 16 blocks in one go. The sums
// are below 2^31 (|sum| <= 32 * 127 per level, Horner total < 2^27), so int32 holds what the
// scalar code held in int64, and the conversion rounds the same integer.
struct DigitSums {
  __m512i acc[3][16];
  // blocks [b0, b0 + n) of row r, their lane sums in acc[l][0..n)
  void flush(int L, int64_t r, int nb, int b0, int n, const float* scale, int32_t* sums,
             float* fsum) {
    const __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m512i total = _mm512_setzero_si512();
    for (int l = 0; l < L; ++l) {
      for (int i = n; i < 16; ++i) acc[l][i] = _mm512_setzero_si512();
      const __m512i sl = reduce16(acc[l]);
      _mm512_mask_storeu_epi32(sums + (r * L + l) * nb + b0, m, sl);
      total = _mm512_add_epi32(_mm512_slli_epi32(total, 7), sl);
    }
    const __m512 sc = _mm512_maskz_loadu_ps(m, scale + r * nb + b0);
    _mm512_mask_storeu_ps(fsum + r * nb + b0, m, _mm512_mul_ps(_mm512_cvtepi32_ps(total), sc));
  }
};

// Rows [r0, r1) as L levels of digits (the same values as isa_generic.cpp's scalar quantize):
// each row's scales first (block_scales), then block by block its digits, 16 at a time, handed
// to digit(r, b, l, h, di) as int32 lanes, then block(r, b) once the block's levels are done;
// the sums and Q4_1's fsum go through DigitSums.
template <class Digit, class Block>
inline void quantize_rows(const float* x, int64_t ldx, int r0, int r1, int K, int L,
                          float* scale, int32_t* sums, float* fsum, Digit&& digit,
                          Block&& block) {
  const int nb = K / QK;
  thread_local std::vector<float> invs;
  if ((int)invs.size() < nb) invs.resize(nb);
  float* const iv = invs.data();
  DigitSums ds;
  for (int r = r0; r < r1; ++r) {
    block_scales(x + (int64_t)r * ldx, nb, L, iv, scale + (int64_t)r * nb);
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + (int64_t)r * ldx + b * QK;
      const __m512 inv = _mm512_set1_ps(iv[b]);
      __m512 v[2] = {_mm512_mul_ps(_mm512_loadu_ps(xb), inv),
                     _mm512_mul_ps(_mm512_loadu_ps(xb + 16), inv)};
      for (int l = 0; l < L; ++l) {
        __m512i acc = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          __m512 d = _mm512_roundscale_ps(v[h], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          if (l == 0) d = _mm512_min_ps(_mm512_max_ps(d, _mm512_set1_ps(-127.f)),
                                        _mm512_set1_ps(127.f));
          const __m512i di = _mm512_cvtps_epi32(d);
          digit(r, b, l, h, di);
          acc = _mm512_add_epi32(acc, di);
          v[h] = _mm512_mul_ps(_mm512_sub_ps(v[h], d), _mm512_set1_ps(128.f));
        }
        ds.acc[l][b & 15] = acc;
      }
      block(r, b);
      if ((b & 15) == 15 || b == nb - 1) {
        ds.flush(L, r, nb, b & ~15, (b & 15) + 1, scale, sums, fsum);
      }
    }
  }
}

void quantize(const float* x, int64_t ldx, int r0, int r1, int K, int L, int8_t* q, float* scale,
              int32_t* sums, float* fsum) {
  if (K % QK) return generic_kernels()->quantize(x, ldx, r0, r1, K, L, q, scale, sums, fsum);
  quantize_rows(
      x, ldx, r0, r1, K, L, scale, sums, fsum,
      [&](int r, int b, int l, int h, __m512i di) {
        _mm_storeu_si128((__m128i*)(q + ((int64_t)r * L + l) * K + b * QK + 16 * h),
                         _mm512_cvtepi32_epi8(di));
      },
      [](int, int) {});
}

// ---- norms and attention --------------------------------------------------------------------

void rmsnorm(const float* x, int64_t ldx, const float* w, float eps, int D, float* y, int64_t ldy,
             int r0, int r1) {
  if (D % 16) return generic_kernels()->rmsnorm(x, ldx, w, eps, D, y, ldy, r0, r1);
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + (int64_t)r * ldx;
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
      const __m512 v = _mm512_loadu_ps(xr + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    float* yr = y + (int64_t)r * ldy;
    for (int i = 0; i < D; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xr + i), vinv);
      _mm512_storeu_ps(yr + i, _mm512_mul_ps(v, _mm512_loadu_ps(w + i)));
    }
  }
}

// 16 lanes of a KV row: fp32 as stored, fp16 widened (exact)
inline __m512 kv_load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv_load(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// The 16 scores of keys j0..j0+15 of one query (masked to -inf past its L keys).
template <int NV, class KV>
inline __m512 scores16(const __m512 (&q)[NV], const KV* kc, int64_t kv_stride,
                       const int64_t* slots, int j0, int L, __m512 scale) {
  __m512 p[16];
  for (int j = 0; j < 16; ++j) {
    if (j0 + j >= L) {
      p[j] = _mm512_setzero_ps();
      continue;
    }
    const KV* kp = kc + slots[j0 + j] * kv_stride;
    __m512 acc = _mm512_mul_ps(q[0], kv_load(kp));
    for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(q[v], kv_load(kp + 16 * v), acc);
    p[j] = acc;
  }
  const int valid = L - j0 < 16 ? L - j0 : 16;
  const __mmask16 m = valid == 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, _mm512_mul_ps(reduce16(p), scale));
}

// Heads whose value accumulators one pass holds in registers (NV each, plus a key's NV values).
template <int NV>
constexpr int values_heads() { return NV <= 4 ? 4 : NV <= 8 ? 2 : 1; }

// Keys [j0, j1) of one row (slots sl) into the output accumulators of H of its queries (heads in
// a row: their probabilities e0 + h * estride, their outputs o0 + h * D), each key's values read
// (and, fp16, widened) once for the H of them. Every query runs the FMAs it runs alone, o += e_j
// V_j in key order; H of them side by side give the FMA unit H independent chains where one
// query's NV-long chain per key waited out the FMA latency.
template <int NV, int H, class KV>
inline void accumulate_values(const float* e0, int64_t estride, float* o0, const KV* vc,
                              int64_t kv_stride, const int64_t* sl, int j0, int j1) {
  constexpr int D = 16 * NV;
  __m512 o[H][NV];
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < NV; ++v) o[h][v] = _mm512_loadu_ps(o0 + h * D + 16 * v);
  for (int j = j0; j < j1; ++j) {
    const KV* vp = vc + sl[j] * kv_stride;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = kv_load(vp + 16 * v);
    for (int h = 0; h < H; ++h) {
      const __m512 ej = _mm512_set1_ps(e0[h * estride + j]);
      for (int v = 0; v < NV; ++v) o[h][v] = _mm512_fmadd_ps(ej, vv[v], o[h][v]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o0 + h * D + 16 * v, o[h][v]);
}

// accumulate_values for nh <= H heads (one instantiation per count)
template <int NV, class KV, int H>
inline void accumulate_values_n(int nh, const float* e0, int64_t estride, float* o0,
                                const KV* vc, int64_t kv_stride, const int64_t* sl, int j0,
                                int j1) {
  if constexpr (H > 1) {
    if (nh < H) {
      return accumulate_values_n<NV, KV, H - 1>(nh, e0, estride, o0, vc, kv_stride, sl, j0, j1);
    }
  }
  accumulate_values<NV, H, KV>(e0, estride, o0, vc, kv_stride, sl, j0, j1);
}

// An item's queries (its rows x its heads, one KV group) go through the keys block by block
// together, so a block of K (and later V) rows is read from memory once and from L1 by the
// others. Every query's own float operations are those it would do alone (scores per block of
// 16 keys, lane maxima, exp, sums and V accumulation in key order): a verify or prefill row gives
// exactly the bits of the same token's decode row.
template <int NV, class KV>  // head_dim = 16 * NV; KV: float or uint16_t (fp16) cache
void attention_d(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  constexpr int D = 16 * NV;
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t kv_stride = (int64_t)a.num_kv_heads * D;
  const int64_t sstride = a.max_keys + 16;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int item = i0; item < i1; ++item) {
    const int32_t* it = a.items + 4 * item;
    const int t0 = it[0], R = it[1] - it[0], h0 = it[2], G = it[3] - it[2];
    const int g = h0 / group;
    int Lr[kAttnRows], Lmax = 0, rmax = 0;
    const int64_t* sl[kAttnRows];
    for (int r = 0; r < R; ++r) {
      int64_t* row = s.slots + (int64_t)r * a.max_keys;
      Lr[r] = visible_keys(a, t0 + r, row);
      sl[r] = row;
      if (Lr[r] > Lmax) Lmax = Lr[r], rmax = r;
    }
    // The item's rows are one request's: their key lists share its prefix, and a causal row's
    // list holds every earlier row's (a tree row's other branches are this forward's own KV
    // rows, just written). Prefetching along the longest alone covers them; per row, a 4-row
    // prefill item issued each prefetch four times, ~45% of its attention time (perf).
    const int64_t* psl = sl[rmax];
    const KV* kc = kv_cache_k<KV>(a) + (int64_t)g * D;
    const KV* vc = kv_cache_v<KV>(a) + (int64_t)g * D;
    __m512 vmax[kAttnRows * 8];
    for (int i = 0; i < R * G; ++i) vmax[i] = _mm512_set1_ps(-INFINITY);
    prefetch_kv_rows<3, D>(kc, kv_stride, psl, 0, std::min(Lmax, 16));  // the first block's keys
    for (int j0 = 0; j0 < Lmax; j0 += 16) {
      // the next block's keys to L1, this block's values to L2 (the value pass reads them)
      prefetch_kv_rows<3, D>(kc, kv_stride, psl, j0 + 16, std::min(Lmax, j0 + 32));
      prefetch_kv_rows<2, D>(vc, kv_stride, psl, j0, std::min(Lmax, j0 + 16));
      for (int r = 0; r < R; ++r) {
        if (Lr[r] <= j0) continue;
        for (int hh = 0; hh < G; ++hh) {
          const float* qp = a.q + (int64_t)(t0 + r) * a.ldq + (h0 + hh) * D;
          __m512 q[NV];
          for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qp + 16 * v);
          const __m512 sc = scores16<NV, KV>(q, kc, kv_stride, sl[r], j0, Lr[r], scale);
          const int qi = r * G + hh;
          _mm512_storeu_ps(s.scores + qi * sstride + j0, sc);
          vmax[qi] = _mm512_max_ps(vmax[qi], sc);
        }
      }
    }
    float inv_sum[kAttnRows * 8];
    for (int r = 0; r < R; ++r) {
      const int Lp = (Lr[r] + 15) & ~15;
      for (int hh = 0; hh < G; ++hh) {
        const int qi = r * G + hh;
        float* sc = s.scores + qi * sstride;
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[qi]));
        __m512 vsum = _mm512_setzero_ps();
        for (int j = 0; j < Lp; j += 16) {
          const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mx));
          _mm512_storeu_ps(sc + j, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        inv_sum[qi] = 1.f / _mm512_reduce_add_ps(vsum);
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s.out + qi * D + 16 * v, _mm512_setzero_ps());
      }
    }
    for (int j0 = 0; j0 < Lmax; j0 += 16) {
      prefetch_kv_rows<3, D>(vc, kv_stride, psl, std::min(Lmax, j0 + 16), std::min(Lmax, j0 + 32));
      for (int r = 0; r < R; ++r) {
        const int j1 = Lr[r] < j0 + 16 ? Lr[r] : j0 + 16;
        if (j1 <= j0) continue;
        constexpr int HB = values_heads<NV>();
        for (int hh = 0; hh < G; hh += HB) {
          const int qi = r * G + hh;
          accumulate_values_n<NV, KV, HB>(G - hh < HB ? G - hh : HB, s.scores + qi * sstride,
                                          sstride, s.out + qi * D, vc, kv_stride, sl[r], j0, j1);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int hh = 0; hh < G; ++hh) {
        const int qi = r * G + hh;
        const __m512 inv = _mm512_set1_ps(inv_sum[qi]);
        float* dst = a.out + (int64_t)(t0 + r) * a.ldo + (h0 + hh) * D;
        for (int v = 0; v < NV; ++v) {
          _mm512_storeu_ps(dst + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(s.out + qi * D + 16 * v),
                                                       inv));
        }
      }
    }
  }
}

template <class KV>
void attention_kv(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  switch (a.head_dim) {
    case 64: return attention_d<4, KV>(a, i0, i1, s);
    case 128: return attention_d<8, KV>(a, i0, i1, s);
    case 32: return attention_d<2, KV>(a, i0, i1, s);
    case 96: return attention_d<6, KV>(a, i0, i1, s);
    case 256: return attention_d<16, KV>(a, i0, i1, s);
    default: return generic_kernels()->attention(a, i0, i1, s);
  }
}

void attention(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  if (a.k_half) return attention_kv<uint16_t>(a, i0, i1, s);
  attention_kv<float>(a, i0, i1, s);
}

}  // namespace
}  // namespace specserve

// ---- AMX-INT8 block-format matmul ---------------------------------------------------------------
//
// The same integers, from the tile unit. For a tile-block (16 output rows x 32 weights) one
// TDPBSSD multiplies up to 16 activation-digit rows (A: digit rows x 32 int8, the digits as
// quantize() wrote them, stride K) by the weights (B: 8 x 64 bytes, exactly the packed
// "group g = 16 rows x weights 4g..4g+3" layout, as signed bytes: Q4 nibbles 0..15 unpacked,
// Q8 used as stored). C[digit row][output row] is then that digit's exact block dot product; the
// epilogue combines a row's digits by the same Horner steps, subtracts the same offsets and runs
// the same float conversion and FMAs, in the same block order, as block_tiles() above. Integer
// sums are exact (no overflow, see above), so every output is bit-identical to the AVX-512
// table's, whatever M (tests/unit/test_cpu_kernels.py). What changes is the cost per row: one
// TDPBSSD does the work of 8 vpdpbusd per digit row for 16 digit rows at once. From
// kAmxPairMinRows rows (kernels.h) three-digit Q4 calls multiply the same integers as paired
// digits instead: two tile rows of K = 64 per activation row against B = [8 q ; q].
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2,bmi,bmi2,amx-tile,amx-int8")

namespace specserve {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One row group of `rows` tile rows, its blocks alternating two sets of tiles so that one block's
// C stores issue after the next block's products: tmm0, 1 / tmm2, 3: C of the unit's two weight
// tiles for even / odd blocks (rows x 16 int32); tmm4 / tmm5: A of even / odd blocks (rows x
// `acols` bytes: 32 digit bytes, or 64 paired bytes); tmm6 / tmm7: B of the two weight tiles
// (acols / 4 rows x 64 bytes). The tile state is per thread: loaded on every call (a thread of
// the pool may run any call). Two row groups sharing each B load, all eight tiles busy with no
// second set, take 1.2-1.3x this one's time on a prefill's gate/up matmul
// (python -m benchmark.bench_gemm --rows 256 --shapes gate_up --isa amx).
inline void amx_config(int rows, int acols) {
  TileConfig c;
  for (int i = 0; i < 6; ++i) {
    c.rows[i] = (uint8_t)rows;
    c.colsb[i] = i < 4 ? 64 : acols;
  }
  c.rows[6] = c.rows[7] = (uint8_t)(acols / 4);
  c.colsb[6] = c.colsb[7] = 64;
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so without this
  // barrier the row and column counts are dead stores it may drop (it did, at -O3)
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Bytes a staged tile-block takes in AmxStage: a B tile of K = 32 (512) or, paired, K = 64.
constexpr int kStageBlock = 1024;

// Per-thread staging of one unit's weights: B tiles (Q4: nibbles unpacked to bytes) and scales.
struct AmxStage {
  uint8_t* b = nullptr;
  float* d = nullptr;
  float* mn = nullptr;
  int cap = 0;  // blocks per tile
  ~AmxStage() {
    std::free(b);
    std::free(d);
    std::free(mn);
  }
  void reserve(int nb) {
    if (nb <= cap) return;
    std::free(b);
    std::free(d);
    std::free(mn);
    b = (uint8_t*)std::aligned_alloc(64, (size_t)2 * nb * kStageBlock);
    d = (float*)std::aligned_alloc(64, (size_t)2 * nb * 64);
    mn = (float*)std::aligned_alloc(64, (size_t)2 * nb * 64);
    cap = nb;
  }
};

// Stage block b of tile `tile` as unit member t: its B tile and scales, at their place in `st`.
// Q4 nibbles are unpacked to bytes; PAIR (Q4 only) writes the K = 64 B tile of paired digits,
// [8 q ; q] (kernels.h): 8 q first, for the h bytes of A, then q for the l bytes.
template <int FMT, bool PAIR>
inline void amx_stage_block(const GemmArgs& a, int tile, int t, int b, AmxStage& st) {
  constexpr int TBB = tbb<FMT>();
  const int nb = a.K / QK;
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  uint8_t* out = st.b + ((size_t)t * st.cap + b) * kStageBlock;
  const uint8_t* tb = a.w + block_offset(tile, b, nb, a.tiles, TBB);
  if (FMT == Q8_0) {
    for (int g = 0; g < 8; ++g) _mm512_store_si512(out + 64 * g, _mm512_loadu_si512(tb + 64 * g));
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(tb + 64 * c);
      const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
      if (PAIR) {  // bytes <= 15, so a 16-bit shift by 3 keeps each in its own byte
        _mm512_store_si512(out + 64 * c, _mm512_slli_epi16(lo, 3));
        _mm512_store_si512(out + 64 * (c + 4), _mm512_slli_epi16(hi, 3));
        _mm512_store_si512(out + 512 + 64 * c, lo);
        _mm512_store_si512(out + 512 + 64 * (c + 4), hi);
      } else {
        _mm512_store_si512(out + 64 * c, lo);
        _mm512_store_si512(out + 64 * (c + 4), hi);
      }
    }
  }
  const uint8_t* sc = tb + (FMT == Q8_0 ? 512 : 256);
  const int sb = t * st.cap + b;
  _mm512_store_ps(st.d + 16 * sb, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc)));
  if (FMT == Q4_1) {
    _mm512_store_ps(st.mn + 16 * sb, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32))));
  }
}

// The first row group of a unit stages its weights block by block, kStageAhead blocks ahead of
// the block the tile unit multiplies (staging a whole unit first left the tile unit idle while
// the weights streamed in). Not the block itself: a tile load waits for the stores of the bytes
// it reads to complete (no store forwarding into tiles), and a block staged and multiplied at
// once took ~1.6x as long in a micro-benchmark.
constexpr int kStageAhead = 4;

// Block b of the unit's tiles staged, with the weights kPrefetchBlocks blocks ahead asked for
// (as block_tiles does: staging is too little work per block for the hardware prefetcher alone).
template <int FMT, bool PAIR>
inline void amx_stage_step(const GemmArgs& a, const int* tiles, int NT, int b, AmxStage& st) {
  constexpr int TBB = tbb<FMT>();
  const int nb = a.K / QK;
  if (b + kPrefetchBlocks < nb) {
    for (int t = 0; t < NT; ++t) {
      const char* pf = (const char*)a.w + block_offset(tiles[t], b + kPrefetchBlocks, nb, a.tiles, TBB);
      for (int off = 0; off < TBB; off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
    }
  }
  for (int t = 0; t < NT; ++t) amx_stage_block<FMT, PAIR>(a, tiles[t], t, b, st);
}

// One activation row's digit dots of one tile-block (C rows cr, cr + 16, ...) as floats: Horner
// over the digits, Q4_0's offset (`off`) subtracted, converted; Q8_0's first digit converted
// apart and met in one FMA (block_tiles' steps exactly).
template <int FMT, int L>
inline __m512 amx_digits(const int32_t* cr, __m512i off) {
  if (FMT == Q8_0) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(cr));
    if (L > 1) {
      __m512i lo = _mm512_load_si512(cr + 16);
      for (int l = 2; l < L; ++l) {
        lo = _mm512_add_epi32(_mm512_slli_epi32(lo, 7), _mm512_load_si512(cr + 16 * l));
      }
      f = _mm512_fmadd_ps(f, _mm512_set1_ps((float)(1 << (7 * (L - 1)))), _mm512_cvtepi32_ps(lo));
    }
    return f;
  }
  __m512i s = _mm512_load_si512(cr);
  for (int l = 1; l < L; ++l) {
    s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), _mm512_load_si512(cr + 16 * l));
  }
  if (FMT == Q4_0) s = _mm512_sub_epi32(s, off);
  return _mm512_cvtepi32_ps(s);
}

// The same integer from a row's two paired C rows (cr: sum R0 q, cr + 16: sum R1 q; kernels.h):
// (R0 << 11) + R1 is sum X q, which amx_digits' Horner steps build from three digit rows.
template <int FMT>
inline __m512 amx_pair_digits(const int32_t* cr, __m512i off) {
  __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cr), 11),
                               _mm512_load_si512(cr + 16));
  if (FMT == Q4_0) s = _mm512_sub_epi32(s, off);
  return _mm512_cvtepi32_ps(s);
}

// Row m's scalars for block b: activation scale, Q4_1's block sum, Q4_0's digit-sum offset.
template <int FMT, int L>
inline void amx_row_scalars(const GemmArgs& a, int64_t m, int b, __m512* sc, __m512* fs,
                            __m512i* off) {
  const int nb = a.K / QK;
  *sc = _mm512_set1_ps(a.act.scale[m * nb + b]);
  *fs = FMT == Q4_1 ? _mm512_set1_ps(a.act.fsum[m * nb + b]) : *sc;
  *off = FMT == Q4_0 ? _mm512_set1_epi32(8 * horner_sums<L>(a.act.sums + m * L * nb + b, nb, 0))
                     : _mm512_setzero_si512();
}

// acc + (d sc) f (+ mn fs for Q4_1): one block's contribution, in block_tiles' order.
template <int FMT>
inline __m512 amx_accumulate(__m512 acc, __m512 f, __m512 d, __m512 mn, __m512 sc, __m512 fs) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, sc), f, acc);
  if (FMT == Q4_1) acc = _mm512_fmadd_ps(mn, fs, acc);
  return acc;
}

// Block b's products issued into the C and A tiles of its parity (even blocks: C 0, 1 and A 4;
// odd: C 2, 3 and A 5): A is `ablock` bytes per block along rows of stride lda, B the staged
// tile-blocks ...
inline void amx_issue(const int8_t* a0, int ablock, int64_t lda, const uint8_t* const* bsrc,
                      int NT, int b) {
  const int8_t* ab = a0 + (int64_t)b * ablock;
  if ((b & 1) == 0) {
    _tile_zero(0);
    _tile_loadd(4, ab, lda);
    _tile_loadd(6, bsrc[0] + (int64_t)b * kStageBlock, 64);
    _tile_dpbssd(0, 4, 6);
    if (NT == 2) {
      _tile_zero(1);
      _tile_loadd(7, bsrc[1] + (int64_t)b * kStageBlock, 64);
      _tile_dpbssd(1, 4, 7);
    }
  } else {
    _tile_zero(2);
    _tile_loadd(5, ab, lda);
    _tile_loadd(6, bsrc[0] + (int64_t)b * kStageBlock, 64);
    _tile_dpbssd(2, 5, 6);
    if (NT == 2) {
      _tile_zero(3);
      _tile_loadd(7, bsrc[1] + (int64_t)b * kStageBlock, 64);
      _tile_dpbssd(3, 5, 7);
    }
  }
}

// ... and stored to cb[t]. The tile unit runs its instructions in order, so block b's stores
// are issued after block b + 1's products: they do not wait out the products' latency with
// nothing else queued.
inline void amx_store(int NT, int b, int32_t (*cb)[16][16]) {
  if ((b & 1) == 0) {
    _tile_stored(0, cb[0], 64);
    if (NT == 2) _tile_stored(1, cb[1], 64);
  } else {
    _tile_stored(2, cb[0], 64);
    if (NT == 2) _tile_stored(3, cb[1], 64);
  }
}

// Every block of one row group: staging (if `stage`: the first row group of a unit stages its
// weights, kStageAhead blocks ahead), tile work into C buffer b & 1, and `epilogue(b)` once
// block b's C is stored (block b - 1's epilogue runs after block b's stores are issued; they do
// not alias the buffer it reads).
template <int FMT, bool PAIR, class Epilogue>
inline void amx_blocks(const GemmArgs& a, AmxStage& st, const int8_t* a0, int ablock,
                       int64_t lda, const uint8_t* const* bsrc, int NT, const int* stage,
                       int32_t (*c)[2][16][16], Epilogue&& epilogue) {
  const int nb = a.K / QK;
  if (stage) {
    for (int b = 0; b < kStageAhead && b < nb; ++b) amx_stage_step<FMT, PAIR>(a, stage, NT, b, st);
  }
  if (nb > 0) amx_issue(a0, ablock, lda, bsrc, NT, 0);
  for (int b = 0; b < nb; ++b) {
    if (stage && b + kStageAhead < nb) amx_stage_step<FMT, PAIR>(a, stage, NT, b + kStageAhead, st);
    if (b + 1 < nb) amx_issue(a0, ablock, lda, bsrc, NT, b + 1);
    amx_store(NT, b, c[b & 1]);
    if (b > 0) epilogue(b - 1);
  }
  if (nb > 0) epilogue(nb - 1);
}

// acc[t][r] (16 floats) for rows m0..m0+mr-1 of the unit's NT tiles, every block, from digit
// rows (A: the rows' L digit rows each, tile rows configured to mr * L).
template <int FMT, int L>
inline void amx_rows(const GemmArgs& a, AmxStage& st, const uint8_t* const* bsrc, int NT,
                     int m0, int mr, float (*acc)[32][16], const int* stage) {
  alignas(64) int32_t c[2][2][16][16];  // [block parity][tile]
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < mr; ++r) _mm512_store_ps(acc[t][r], _mm512_setzero_ps());
  auto epilogue = [&](int b) {
    for (int r = 0; r < mr; ++r) {
      __m512 sc, fs;
      __m512i off;
      amx_row_scalars<FMT, L>(a, m0 + r, b, &sc, &fs, &off);
      for (int t = 0; t < NT; ++t) {
        const int sb = t * st.cap + b;
        const __m512 f = amx_digits<FMT, L>(c[b & 1][t][r * L], off);
        const __m512 d = _mm512_load_ps(st.d + 16 * sb);
        const __m512 mn = FMT == Q4_1 ? _mm512_load_ps(st.mn + 16 * sb) : d;
        _mm512_store_ps(acc[t][r],
                        amx_accumulate<FMT>(_mm512_load_ps(acc[t][r]), f, d, mn, sc, fs));
      }
    }
  };
  amx_blocks<FMT, false>(a, st, a.act.q + (int64_t)m0 * L * a.K, QK, a.K, bsrc, NT, stage, c,
                         epilogue);
}

// The same for a compile-time shape, the accumulators in registers across blocks instead of
// memory (two loads and a store fewer per row, tile and block); PAIR: from paired digits
// (kernels.h; three levels, Q4: tile rows configured to 2 * MR). The arithmetic is amx_rows'
// step for step.
template <int FMT, int L, int MR, int NT, bool PAIR>
inline void amx_rows_reg(const GemmArgs& a, AmxStage& st, const uint8_t* const* bsrc,
                         int m0, float (*accm)[32][16], const int* stage) {
  alignas(64) int32_t c[2][2][16][16];  // [block parity][tile]
  __m512 acc[NT][MR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < MR; ++r) acc[t][r] = _mm512_setzero_ps();
  auto epilogue = [&](int b) {
    __m512 d[NT], mn[NT];
    for (int t = 0; t < NT; ++t) {
      const int sb = t * st.cap + b;
      d[t] = _mm512_load_ps(st.d + 16 * sb);
      mn[t] = FMT == Q4_1 ? _mm512_load_ps(st.mn + 16 * sb) : d[t];
    }
    for (int r = 0; r < MR; ++r) {
      __m512 sc, fs;
      __m512i off;
      amx_row_scalars<FMT, L>(a, m0 + r, b, &sc, &fs, &off);
      for (int t = 0; t < NT; ++t) {
        const __m512 f = PAIR ? amx_pair_digits<FMT>(c[b & 1][t][2 * r], off)
                              : amx_digits<FMT, L>(c[b & 1][t][r * L], off);
        acc[t][r] = amx_accumulate<FMT>(acc[t][r], f, d[t], mn[t], sc, fs);
      }
    }
  };
  if (PAIR) {
    amx_blocks<FMT, true>(a, st, a.act.pairs + (int64_t)m0 * 4 * a.K, 64, 2 * a.K, bsrc, NT,
                          stage, c, epilogue);
  } else {
    amx_blocks<FMT, false>(a, st, a.act.q + (int64_t)m0 * L * a.K, QK, a.K, bsrc, NT, stage,
                           c, epilogue);
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < MR; ++r) _mm512_store_ps(accm[t][r], acc[t][r]);
}

// The register-accumulator shapes, R = mr .. RMAX rows (one instantiation each): every row
// count of a tile pair at three digits (5 rows per A tile) and, for paired digits (8 rows per
// A tile), of a pair or a lone last tile (paired digits have no amx_rows to fall back on).
// Returns false for any other shape.
template <int FMT, int NT, bool PAIR, int R = 1>
inline bool amx_rows_shape(const GemmArgs& a, AmxStage& st, const uint8_t* const* bsrc,
                           int m0, int mr, float (*acc)[32][16], const int* stage) {
  if constexpr (R > (PAIR ? 8 : 5)) {
    return false;
  } else {
    if (mr != R) return amx_rows_shape<FMT, NT, PAIR, R + 1>(a, st, bsrc, m0, mr, acc, stage);
    amx_rows_reg<FMT, 3, R, NT, PAIR>(a, st, bsrc, m0, acc, stage);
    return true;
  }
}

template <int FMT, int L, bool PAIR>
inline bool amx_rows_fixed(const GemmArgs& a, AmxStage& st, const uint8_t* const* bsrc,
                           int NT, int m0, int mr, float (*acc)[32][16], const int* stage) {
  if constexpr (L == 3) {
    if (NT == 2) return amx_rows_shape<FMT, 2, PAIR>(a, st, bsrc, m0, mr, acc, stage);
    if constexpr (PAIR) return amx_rows_shape<FMT, 1, true>(a, st, bsrc, m0, mr, acc, stage);
  }
  return false;
}

// One unit: tiles[0..NT-1] (a pair, a lone last tile, or a (gate, up) pair for a gated epilogue
// with column index `col`), every row, one row group of RPC rows at a time (PAIR: paired digits,
// 8 rows per A tile; else 16 / L rows).
template <int FMT, int L, bool PAIR>
void amx_unit(const GemmArgs& a, const int* tiles, int NT, int silu_col, AmxStage& st,
              int& configured) {
  const uint8_t* bsrc[2];
  for (int t = 0; t < NT; ++t) bsrc[t] = st.b + (size_t)t * st.cap * kStageBlock;
  constexpr int RPC = PAIR ? 8 : 16 / L;  // activation rows per A tile (all their rows in it)
  constexpr int TR = PAIR ? 2 : L;        // tile rows per activation row
  alignas(64) float acc[2][32][16];
  for (int m0 = 0; m0 < a.M; m0 += RPC) {
    const int left = a.M - m0;
    const int mr = left < RPC ? left : RPC;
    const int shape = mr * TR * 2 + PAIR;
    if (shape != configured) {
      amx_config(mr * TR, PAIR ? 64 : QK);
      configured = shape;
    }
    const int* stage = m0 == 0 ? tiles : nullptr;  // the first row group stages the weights
    if (!amx_rows_fixed<FMT, L, PAIR>(a, st, bsrc, NT, m0, mr, acc, stage)) {
      amx_rows<FMT, L>(a, st, bsrc, NT, m0, mr, acc, stage);
    }
    for (int t = 0; t < NT; ++t) {
      if (!a.bias) break;
      const __m512 bias = _mm512_loadu_ps(a.bias + tiles[t] * NR);
      for (int r = 0; r < mr; ++r) {
        _mm512_store_ps(acc[t][r], _mm512_add_ps(_mm512_load_ps(acc[t][r]), bias));
      }
    }
    if (silu_col >= 0) {
      const __mmask16 mask = col_mask(a, silu_col);
      for (int r = 0; r < mr; ++r) {
        float* out = a.y + (int64_t)(m0 + r) * a.ldy + silu_col;
        _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(gate_act512(a.epilogue,
                                                                   _mm512_load_ps(acc[0][r])),
                                                       _mm512_load_ps(acc[1][r])));
      }
      continue;
    }
    for (int t = 0; t < NT; ++t) {
      const __mmask16 mask = col_mask(a, tiles[t] * NR);
      if (!mask) continue;
      for (int r = 0; r < mr; ++r) {
        float* y = a.y + (int64_t)(m0 + r) * a.ldy + tiles[t] * NR;
        __m512 v = _mm512_load_ps(acc[t][r]);
        if (a.epilogue == EPI_ADD) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
        _mm512_mask_storeu_ps(y, mask, v);
      }
    }
  }
}

template <int FMT, int L, bool PAIR>
void amx_fmt(const GemmArgs& a, int t0, int t1) {
  thread_local AmxStage st;
  st.reserve(a.K / QK);
  int configured = -1;  // the tile shapes loaded (ldtilecfg is dear: once per shape, not per unit)
  if (gated_epilogue(a.epilogue)) {
    for (int t = t0; t < t1; ++t) {
      const int tiles[2] = {2 * t, 2 * t + 1};
      amx_unit<FMT, L, PAIR>(a, tiles, 2, t * NR, st, configured);
    }
  } else {
    int t = t0;
    for (; t + 1 < t1; t += 2) {
      const int tiles[2] = {t, t + 1};
      amx_unit<FMT, L, PAIR>(a, tiles, 2, -1, st, configured);
    }
    if (t < t1) {
      const int tiles[1] = {t};
      amx_unit<FMT, L, PAIR>(a, tiles, 1, -1, st, configured);
    }
  }
  _tile_release();
}

template <int FMT>
void amx_levels(const GemmArgs& a, int t0, int t1) {
  switch (a.act.levels) {
    case 1: amx_fmt<FMT, 1, false>(a, t0, t1); break;
    case 2: amx_fmt<FMT, 2, false>(a, t0, t1); break;
    default: amx_fmt<FMT, 3, false>(a, t0, t1); break;
  }
}

// quantize() at three levels with the digits written as pairs (kernels.h) straight from the
// registers: the same scales, sums and integers as quantize() followed by pairing its three digit
// rows, without storing and re-reading them (python -m benchmark.bench_gemm --rows 256
// --quantize).
void quantize_pairs(const float* x, int64_t ldx, int r0, int r1, int K, int8_t* pairs,
                    float* scale, int32_t* sums, float* fsum) {
  const __m512i half = _mm512_set1_epi32(1024), seven = _mm512_set1_epi32(7);
  __m512i xi[2];  // the block's digits so far, Horner: X = (a0 128 + a1) 128 + a2
  quantize_rows(
      x, ldx, r0, r1, K, 3, scale, sums, fsum,
      [&](int, int, int l, int h, __m512i di) {
        xi[h] = l == 0 ? di : _mm512_add_epi32(_mm512_slli_epi32(xi[h], 7), di);
      },
      [&](int r, int b) {
        int8_t* out = pairs + (int64_t)r * 4 * K;  // R0's row, then R1's (2 K bytes each)
        for (int h = 0; h < 2; ++h) {
          const __m512i r0v = _mm512_srai_epi32(_mm512_add_epi32(xi[h], half), 11);
          const __m512i r1v = _mm512_sub_epi32(xi[h], _mm512_slli_epi32(r0v, 11));
          int8_t* o = out + b * 64 + 16 * h;
          _mm_storeu_si128((__m128i*)o, _mm512_cvtepi32_epi8(_mm512_srai_epi32(r0v, 3)));
          _mm_storeu_si128((__m128i*)(o + 32),
                           _mm512_cvtepi32_epi8(_mm512_and_si512(r0v, seven)));
          _mm_storeu_si128((__m128i*)(o + 2 * K),
                           _mm512_cvtepi32_epi8(_mm512_srai_epi32(r1v, 3)));
          _mm_storeu_si128((__m128i*)(o + 2 * K + 32),
                           _mm512_cvtepi32_epi8(_mm512_and_si512(r1v, seven)));
        }
      });
}

// Below this many digit rows (M x digits) the tile unit's fixed cost per block (C tiles zeroed,
// multiplied and stored, then read back, whatever their fill) loses to the vpdpbusd kernel,
// which gives the same bits: with the switch at 24 digit rows a whole 8-row verify pass was
// slower through the tiles, at 30 it is as fast as vpdpbusd while 16 and 32 rows gain
// (`python -m benchmark.bench_one_batch --engines auto@amx,auto@avx512 --verify-ns 1,8,16,32`).
constexpr int kAmxMinDigitRows = 30;

void gemm_amx(const GemmArgs& a, int t0, int t1) {
  if (a.act.pairs && amx_pairs_apply(a.fmt, a.act.levels, a.M)) {  // the engine paired them
    if (a.fmt == Q4_0) return amx_fmt<Q4_0, 3, true>(a, t0, t1);
    return amx_fmt<Q4_1, 3, true>(a, t0, t1);
  }
  if (a.M * a.act.levels < kAmxMinDigitRows) return gemm(a, t0, t1);
  switch (a.fmt) {
    case Q8_0: amx_levels<Q8_0>(a, t0, t1); break;
    case Q4_0: amx_levels<Q4_0>(a, t0, t1); break;
    case Q4_1: amx_levels<Q4_1>(a, t0, t1); break;
    default: gemm(a, t0, t1); break;  // float and other block formats: the AVX-512 kernels
  }
}

}  // namespace
}  // namespace specserve

#pragma GCC pop_options

#pragma GCC pop_options

namespace specserve {
// Outside the target region: this runs on any CPU (the engine calls it only after checking).
const IsaKernels* avx512_kernels() {
  static const IsaKernels table = {"avx512", gemm, quantize, rmsnorm, attention, argmax,
                                   logit_stats};
  return &table;
}
// The AVX-512 table with the AMX-INT8 block-format matmul (the engine checks the CPU and asks
// the kernel for the tile state before choosing it).
const IsaKernels* amx_kernels() {
  static const IsaKernels table = {"amx", gemm_amx, quantize, rmsnorm, attention, argmax,
                                   logit_stats, quantize_pairs};
  return &table;
}
}  // namespace specserve
