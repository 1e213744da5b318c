// AVX2 + FMA + F16C kernels, for CPUs without AVX-512. Same tile layouts as isa_avx512.cpp: a
// 16-row tile is processed as two halves of 8 rows (one 8-lane vector each).
//
// Q4 dot products use vpmaddubsw (u8 x s8 -> pairs summed into int16) and vpmaddwd (int16
// pairs -> int32). Q4 weights are 0..15 and digits within +-127, so a pair sum stays within
// +-3810 and eight of them within int16: no saturation. Q8_0 weights are signed and take
// vpmaddwd on int16 directly (half_q8).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

#ifndef PREFETCH_BLOCKS_AVX2
#define PREFETCH_BLOCKS_AVX2 16
#endif

namespace specserve {
namespace {

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float hmax256(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256 exp256(__m256 x) {
  // as exp512 in isa_avx512.cpp; 2^n built in the exponent bits (n in [-126, 127] after clamp)
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r),
                                   _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline __m256 silu256(__m256 g) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

// gelu_tanh (kernels.h: g / (1 + exp(g (c1 + c3 g^2)))), or silu: a gated epilogue's activation
inline __m256 gate_act256(int epi, __m256 g) {
  if (epi != EPI_GELU_MUL) return silu256(g);
  const __m256 u = _mm256_mul_ps(g, _mm256_add_ps(_mm256_set1_ps(kGeluC1),
                                                  _mm256_mul_ps(_mm256_set1_ps(kGeluC3),
                                                                _mm256_mul_ps(g, g))));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(u)));
}

// ---- block formats: half-tile `half` (rows 8 * half .. + 7) ----------------------------------

// Blocks ahead that the first pass over a tile prefetches (see TilePrefetch).
constexpr int kPrefetchBlocks = PREFETCH_BLOCKS_AVX2;

// The first pass over a tile's weights (`first`: rows from the first of the call, first half)
// prefetches kPrefetchBlocks blocks ahead: a block's loads otherwise wait a DRAM round trip
// each, the hardware prefetcher does not run ahead of the block loops. An even tile of a memory
// pair (kernels.h) prefetches its partner's interleaved blocks too, so the pair is one stream,
// and past its last block the stream runs on into the next pair, the next tiles this thread
// multiplies.
struct TilePrefetch {
  bool on;
  int64_t step;
  const char* base;
  TilePrefetch(const GemmArgs& a, int tile, bool first, int tbb) {
    const bool pair_lead = tile % 2 == 0 && tile < a.tiles - a.tiles % 2;
    const bool lone = tile >= a.tiles - a.tiles % 2;
    on = first && (pair_lead || lone);
    step = pair_lead ? 2 * tbb : tbb;
    base = (const char*)a.w + block_offset(tile, 0, a.K / QK, a.tiles, tbb);
  }
  // always_inline: GCC 12 finds a function holding only prefetches free of side effects
  // (IPA pure-const) and deletes the calls to it, prefetches and all
  __attribute__((always_inline)) void block(int b) const {
    if (!on) return;
    const char* p = base + (b + kPrefetchBlocks) * step;
    for (int off = 0; off < step; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
};

// Q4 at three digits (the default): a block's exact integer sums for MR rows (1-4) in one asm
// statement. Written out by hand because GCC, given the same steps as intrinsics, builds each
// row's sum as a tree, hoists the broadcasts and spills the weights: the row chains then wait on
// each other and the kernel ran at ~0.55 vpmaddubsw per cycle. Here each row's three digits are
// three chains stepping through the block's eight weight groups together, one broadcast, one
// vpmaddubsw and one vpaddw per chain and group (one temporary each, so the three are in flight
// at once), and the digits are combined without the Horner shifts: hi = 2^14 s_0 + 2^7 s_1 + s_2
// through vpmaddwd by those constants, the same integers (|hi| < 1.003e9 < 2^31; a digit
// chain's int16 lanes hold 16 products, <= 16 * 15 * 127 = 30480). The float steps that follow
// are those of the intrinsic path, so the outputs are its bits.
// Weights: the tile-half's eight groups of four k in ymm0-7 (low nibbles of the four 64-byte
// quarters, then the high ones); a row's chains ymm8-10, their temporaries ymm11-13.
alignas(32) constexpr int16_t kQ4Asm[4][16] = {
    {0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f,
     0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f, 0x0f0f},  // nibble mask
    {16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384,
     16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384},  // 2^14: digit 0
    {128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};

#define Q4_UNPACK(C, HI)                                                    \
  "vmovdqu " #C "*64(%[w]), %%ymm" #C "\n\t"                                \
  "vpsrlw $4, %%ymm" #C ", %%ymm" #HI "\n\t"                                \
  "vpand (%[c]), %%ymm" #C ", %%ymm" #C "\n\t"                              \
  "vpand (%[c]), %%ymm" #HI ", %%ymm" #HI "\n\t"
// group 0 of a row: the products start the three chains
#define Q4_FIRST(A)                                                         \
  "vpbroadcastd (%[" A "]), %%ymm8\n\t"                                     \
  "vpbroadcastd (%[" A "],%[K]), %%ymm9\n\t"                                \
  "vpbroadcastd (%[" A "],%[K],2), %%ymm10\n\t"                             \
  "vpmaddubsw %%ymm8, %%ymm0, %%ymm8\n\t"                                   \
  "vpmaddubsw %%ymm9, %%ymm0, %%ymm9\n\t"                                   \
  "vpmaddubsw %%ymm10, %%ymm0, %%ymm10\n\t"
// group G (weights ymmG, activations at byte 4 G of each digit row)
#define Q4_NEXT(A, G)                                                       \
  "vpbroadcastd 4*" #G "(%[" A "]), %%ymm11\n\t"                            \
  "vpbroadcastd 4*" #G "(%[" A "],%[K]), %%ymm12\n\t"                       \
  "vpbroadcastd 4*" #G "(%[" A "],%[K],2), %%ymm13\n\t"                     \
  "vpmaddubsw %%ymm11, %%ymm" #G ", %%ymm11\n\t"                            \
  "vpmaddubsw %%ymm12, %%ymm" #G ", %%ymm12\n\t"                            \
  "vpmaddubsw %%ymm13, %%ymm" #G ", %%ymm13\n\t"                            \
  "vpaddw %%ymm11, %%ymm8, %%ymm8\n\t"                                      \
  "vpaddw %%ymm12, %%ymm9, %%ymm9\n\t"                                      \
  "vpaddw %%ymm13, %%ymm10, %%ymm10\n\t"
#define Q4_ROW(A, R)                                                        \
  Q4_FIRST(A) Q4_NEXT(A, 1) Q4_NEXT(A, 2) Q4_NEXT(A, 3) Q4_NEXT(A, 4)       \
  Q4_NEXT(A, 5) Q4_NEXT(A, 6) Q4_NEXT(A, 7)                                 \
  "vpmaddwd 32(%[c]), %%ymm8, %%ymm8\n\t"                                   \
  "vpmaddwd 64(%[c]), %%ymm9, %%ymm9\n\t"                                   \
  "vpmaddwd 96(%[c]), %%ymm10, %%ymm10\n\t"                                 \
  "vpaddd %%ymm9, %%ymm8, %%ymm8\n\t"                                       \
  "vpaddd %%ymm10, %%ymm8, %%ymm8\n\t"                                      \
  "vmovdqa %%ymm8, " #R "*32(%[hi])\n\t"
#define Q4_WEIGHTS Q4_UNPACK(0, 4) Q4_UNPACK(1, 5) Q4_UNPACK(2, 6) Q4_UNPACK(3, 7)
#define Q4_CLOBBERS                                                         \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
      "xmm11", "xmm12", "xmm13", "memory"

// hi[r][0..8) = the block's sums for rows r < MR of one tile-half: w points at the half's
// first weight byte of the block (tile-block + 32 * half), a at row 0's digit 0 of the block,
// rs the distance between rows' digits, K between a row's digit rows.
template <int MR>
__attribute__((always_inline)) inline void q4_sums3(const uint8_t* w, const int8_t* a,
                                                    int64_t rs, int64_t K, int32_t* hi) {
  const int8_t* a1 = a + rs;
  const int8_t* a2 = a + 2 * rs;
  const int8_t* a3 = a + 3 * rs;
  if constexpr (MR == 1) {
    __asm__ volatile(Q4_WEIGHTS Q4_ROW("a0", 0)
                     : : [w] "r"(w), [a0] "r"(a), [K] "r"(K), [hi] "r"(hi), [c] "r"(kQ4Asm)
                     : Q4_CLOBBERS);
  } else if constexpr (MR == 2) {
    __asm__ volatile(Q4_WEIGHTS Q4_ROW("a0", 0) Q4_ROW("a1", 1)
                     : : [w] "r"(w), [a0] "r"(a), [a1] "r"(a1), [K] "r"(K), [hi] "r"(hi),
                       [c] "r"(kQ4Asm)
                     : Q4_CLOBBERS);
  } else if constexpr (MR == 3) {
    __asm__ volatile(Q4_WEIGHTS Q4_ROW("a0", 0) Q4_ROW("a1", 1) Q4_ROW("a2", 2)
                     : : [w] "r"(w), [a0] "r"(a), [a1] "r"(a1), [a2] "r"(a2), [K] "r"(K),
                       [hi] "r"(hi), [c] "r"(kQ4Asm)
                     : Q4_CLOBBERS);
  } else {
    static_assert(MR == 4, "one to four rows");
    __asm__ volatile(Q4_WEIGHTS Q4_ROW("a0", 0) Q4_ROW("a1", 1) Q4_ROW("a2", 2) Q4_ROW("a3", 3)
                     : : [w] "r"(w), [a0] "r"(a), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3),
                       [K] "r"(K), [hi] "r"(hi), [c] "r"(kQ4Asm)
                     : Q4_CLOBBERS);
  }
}

// One row, both halves of the tile (the decode step's matmul): a lone row's three chains wait
// on each other's latency (each step of a chain is a broadcast, a vpmaddubsw and a vpaddw in a
// row), so the row here runs six, one per half and digit, and each broadcast serves both
// halves. Sixteen weight registers do not fit beside them: the block goes in two passes, the
// low nibbles of its four 64-byte quarters (groups 0-3 of both halves, ymm0-3 and ymm4-7),
// then the high ones (groups 4-7). Chains ymm8-10 (half 0, digits 0-2) and ymm11-13 (half 1),
// the broadcast ymm14, products ymm15. hi[h][0..8) = half h's sums, as q4_sums3 gives them.
#define Q4P_LOAD(SHIFT)                                                                     \
  "vmovdqu 0(%[w]), %%ymm0\n\t" "vmovdqu 64(%[w]), %%ymm1\n\t"                              \
  "vmovdqu 128(%[w]), %%ymm2\n\t" "vmovdqu 192(%[w]), %%ymm3\n\t"                           \
  "vmovdqu 32(%[w]), %%ymm4\n\t" "vmovdqu 96(%[w]), %%ymm5\n\t"                             \
  "vmovdqu 160(%[w]), %%ymm6\n\t" "vmovdqu 224(%[w]), %%ymm7\n\t"                           \
  SHIFT(0) SHIFT(1) SHIFT(2) SHIFT(3) SHIFT(4) SHIFT(5) SHIFT(6) SHIFT(7)                   \
  "vpand (%[c]), %%ymm0, %%ymm0\n\t" "vpand (%[c]), %%ymm1, %%ymm1\n\t"                     \
  "vpand (%[c]), %%ymm2, %%ymm2\n\t" "vpand (%[c]), %%ymm3, %%ymm3\n\t"                     \
  "vpand (%[c]), %%ymm4, %%ymm4\n\t" "vpand (%[c]), %%ymm5, %%ymm5\n\t"                     \
  "vpand (%[c]), %%ymm6, %%ymm6\n\t" "vpand (%[c]), %%ymm7, %%ymm7\n\t"
#define Q4P_NOSHIFT(R)
#define Q4P_SHIFT(R) "vpsrlw $4, %%ymm" #R ", %%ymm" #R "\n\t"
#define Q4P_FIRST(WA, WB, ADDR, AA, AB)                                                     \
  "vpbroadcastd " ADDR ", %%ymm14\n\t"                                                      \
  "vpmaddubsw %%ymm14, %%ymm" WA ", %%ymm" AA "\n\t"                                        \
  "vpmaddubsw %%ymm14, %%ymm" WB ", %%ymm" AB "\n\t"
#define Q4P_NEXT(WA, WB, ADDR, AA, AB)                                                      \
  "vpbroadcastd " ADDR ", %%ymm14\n\t"                                                      \
  "vpmaddubsw %%ymm14, %%ymm" WA ", %%ymm15\n\t"                                            \
  "vpaddw %%ymm15, %%ymm" AA ", %%ymm" AA "\n\t"                                            \
  "vpmaddubsw %%ymm14, %%ymm" WB ", %%ymm15\n\t"                                            \
  "vpaddw %%ymm15, %%ymm" AB ", %%ymm" AB "\n\t"
#define Q4P_GROUP(STEP, G, WA, WB)                                                          \
  STEP(WA, WB, "4*" #G "(%[a])", "8", "11")                                                 \
  STEP(WA, WB, "4*" #G "(%[a],%[K])", "9", "12")                                            \
  STEP(WA, WB, "4*" #G "(%[a],%[K],2)", "10", "13")

__attribute__((always_inline)) inline void q4_row_sums3(const uint8_t* w, const int8_t* a,
                                                        int64_t K, int32_t* hi) {
  __asm__ volatile(
      Q4P_LOAD(Q4P_NOSHIFT)
      Q4P_GROUP(Q4P_FIRST, 0, "0", "4") Q4P_GROUP(Q4P_NEXT, 1, "1", "5")
      Q4P_GROUP(Q4P_NEXT, 2, "2", "6") Q4P_GROUP(Q4P_NEXT, 3, "3", "7")
      Q4P_LOAD(Q4P_SHIFT)
      Q4P_GROUP(Q4P_NEXT, 4, "0", "4") Q4P_GROUP(Q4P_NEXT, 5, "1", "5")
      Q4P_GROUP(Q4P_NEXT, 6, "2", "6") Q4P_GROUP(Q4P_NEXT, 7, "3", "7")
      "vpmaddwd 32(%[c]), %%ymm8, %%ymm8\n\t" "vpmaddwd 64(%[c]), %%ymm9, %%ymm9\n\t"
      "vpmaddwd 96(%[c]), %%ymm10, %%ymm10\n\t" "vpmaddwd 32(%[c]), %%ymm11, %%ymm11\n\t"
      "vpmaddwd 64(%[c]), %%ymm12, %%ymm12\n\t" "vpmaddwd 96(%[c]), %%ymm13, %%ymm13\n\t"
      "vpaddd %%ymm9, %%ymm8, %%ymm8\n\t" "vpaddd %%ymm10, %%ymm8, %%ymm8\n\t"
      "vpaddd %%ymm12, %%ymm11, %%ymm11\n\t" "vpaddd %%ymm13, %%ymm11, %%ymm11\n\t"
      "vmovdqa %%ymm8, (%[hi])\n\t" "vmovdqa %%ymm11, 32(%[hi])\n\t"
      : : [w] "r"(w), [a] "r"(a), [K] "r"(K), [hi] "r"(hi), [c] "r"(kQ4Asm)
      : Q4_CLOBBERS, "xmm14", "xmm15");
}
#undef Q4P_LOAD
#undef Q4P_NOSHIFT
#undef Q4P_SHIFT
#undef Q4P_FIRST
#undef Q4P_NEXT
#undef Q4P_GROUP
#undef Q4_UNPACK
#undef Q4_FIRST
#undef Q4_NEXT
#undef Q4_ROW
#undef Q4_WEIGHTS
#undef Q4_CLOBBERS

// A row's per-block activation data, located once per call of the block loop (held in locals:
// the asm statements' memory clobber would make the loop reload anything read through `a`).
struct Q4Row {
  const float* scale = nullptr;   // [nb]
  const float* fsum = nullptr;    // [nb]
  const int32_t* sums = nullptr;  // [L][nb]
  Q4Row() = default;
  Q4Row(const GemmArgs& a, int64_t m, int L, int nb)
      : scale(a.act.scale + m * nb), fsum(a.act.fsum + m * nb), sums(a.act.sums + m * L * nb) {}
};

// A block's float steps for one row of 8 columns (both Q4 paths): hi the block's integer sums.
template <int FMT, int L>
__attribute__((always_inline)) inline __m256 q4_block_float(const Q4Row& row, int nb, int b,
                                                            __m256i hi, __m256 d, __m256 mins,
                                                            __m256 acc) {
  if (FMT == Q4_0) {
    int32_t sa = 0;
    for (int l = 0; l < L; ++l) sa = sa * 128 + row.sums[l * nb + b];
    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8 * sa));
  }
  const __m256 f = _mm256_cvtepi32_ps(hi);
  const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(row.scale[b]));
  acc = _mm256_fmadd_ps(ds, f, acc);
  if (FMT == Q4_1) acc = _mm256_fmadd_ps(mins, _mm256_set1_ps(row.fsum[b]), acc);
  return acc;
}

// Q4_0 / Q4_1: MR rows x 8 columns (half `half` of the tile).
template <int FMT, int L, int MR>
inline void half_block(const GemmArgs& a, int tile, int half, int m0, int m_first,
                       __m256 acc[MR]) {
  const int nb = a.K / QK, K = a.K;
  constexpr int TBB = FMT == Q4_0 ? 288 : 320;
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const TilePrefetch pf(a, tile, m0 == m_first && half == 0, TBB);
  alignas(32) int32_t sums3[MR][8];
  const uint8_t* const w = a.w;
  const int tiles = a.tiles;
  const int8_t* const q = a.act.q + (int64_t)m0 * L * K;
  Q4Row rows[MR];
  for (int r = 0; r < MR; ++r) rows[r] = Q4Row(a, m0 + r, L, nb);
  for (int b = 0; b < nb; ++b) {
    pf.block(b);
    const uint8_t* tb = w + block_offset(tile, b, nb, tiles, TBB);
    __m256i wq[8];
    if constexpr (L == 3) {
      q4_sums3<MR>(tb + 32 * half, q + b * QK, (int64_t)L * K, K, &sums3[0][0]);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(tb + 64 * c + 32 * half));
        wq[c] = _mm256_and_si256(v, lo4);
        wq[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      }
    }
    const uint8_t* sc = tb + 256 + 16 * half;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc));
    __m256 mins = _mm256_setzero_ps();
    if (FMT == Q4_1) mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32)));
    for (int r = 0; r < MR; ++r) {
      __m256i hi = _mm256_setzero_si256();
      if constexpr (L == 3) {
        hi = _mm256_load_si256((const __m256i*)sums3[r]);
      } else {
        // digits combined exactly in int32 (Horner, see isa_avx512.cpp)
        const int8_t* ab = q + (int64_t)r * L * K + b * QK;
        for (int l = 0; l < L; ++l) {
          const int8_t* al = ab + (int64_t)l * K;
          __m256i s16 = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(load_i32(al)));
          for (int g = 1; g < 8; ++g) {
            s16 = _mm256_add_epi16(
                s16, _mm256_maddubs_epi16(wq[g], _mm256_set1_epi32(load_i32(al + 4 * g))));
          }
          hi = _mm256_add_epi32(_mm256_slli_epi32(hi, 7), _mm256_madd_epi16(s16, ones));
        }
      }
      acc[r] = q4_block_float<FMT, L>(rows[r], nb, b, hi, d, mins, acc[r]);
    }
  }
}

// A row-block's digit sums combined like the digits (Horner over the L levels).
template <int L>
inline int32_t horner_sums(const int32_t* sums, int nb) {
  int32_t v = 0;
  for (int l = 0; l < L; ++l) v = v * 128 + sums[l * nb];
  return v;
}

// ---- 5- and 6-bit and K-quant formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), half `half` ----------
//
// isa_avx512.cpp's scheme on 8 rows: q unpacked to bytes, vpmaddubsw pair sums in int16 (q <= 63
// and a digit <= 127 make a pair at most 16002), widened by vpmaddwd before the int16 lanes could
// overflow: every 8 groups for 4-bit weights (<= 30480), 4 for 5-bit (<= 31496), 2 for 6-bit
// (<= 32004). The same exact integers and float steps as the scalar kernel, so its bits.

template <int FMT>
constexpr int wide_groups() { return FMT == Q4_K ? 8 : FMT == Q6_K ? 2 : 4; }

inline __m256i or_masked8(__m256i w, __m256i x, __m256i m) {
  return _mm256_or_si256(w, _mm256_and_si256(x, m));
}

// Group g (weights 4 g .. 4 g + 3) of 8 rows as unsigned bytes (layouts: kernels.h).
template <int FMT>
inline void sub_weights8(const uint8_t* sb, int half, __m256i (&w)[8]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(sb + 64 * c + 32 * half));
    w[c] = _mm256_and_si256(v, lo4);
    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
  }
  if constexpr (FMT == Q5_0 || FMT == Q5_1 || FMT == Q5_K) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)(sb + 256 + 32 * half));
    const __m256i m = _mm256_set1_epi8(0x10);
    w[0] = or_masked8(w[0], _mm256_slli_epi16(h, 4), m);
    w[1] = or_masked8(w[1], _mm256_slli_epi16(h, 3), m);
    w[2] = or_masked8(w[2], _mm256_slli_epi16(h, 2), m);
    w[3] = or_masked8(w[3], _mm256_slli_epi16(h, 1), m);
    w[4] = or_masked8(w[4], h, m);
    w[5] = or_masked8(w[5], _mm256_srli_epi16(h, 1), m);
    w[6] = or_masked8(w[6], _mm256_srli_epi16(h, 2), m);
    w[7] = or_masked8(w[7], _mm256_srli_epi16(h, 3), m);
  }
  if constexpr (FMT == Q6_K) {
    const __m256i m = _mm256_set1_epi8(0x30);
    for (int p = 0; p < 2; ++p) {
      const __m256i h = _mm256_loadu_si256((const __m256i*)(sb + 256 + 64 * p + 32 * half));
      w[4 * p] = or_masked8(w[4 * p], _mm256_slli_epi16(h, 4), m);
      w[4 * p + 1] = or_masked8(w[4 * p + 1], _mm256_slli_epi16(h, 2), m);
      w[4 * p + 2] = or_masked8(w[4 * p + 2], h, m);
      w[4 * p + 3] = or_masked8(w[4 * p + 3], _mm256_srli_epi16(h, 2), m);
    }
  }
}

inline __m256 u8x8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 i8x8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 half8_to_ps(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// A sub-block's scales for rows 8 half .. 8 half + 7 (isa_avx512.cpp's sub_scales).
template <int FMT>
inline void sub_scales8(const uint8_t* tb, int s, int half, __m256 (&D)[2], __m256* mn) {
  if constexpr (FMT == Q5_0 || FMT == Q5_1) {
    D[0] = half8_to_ps(tb + 320 + 16 * half);
    if (FMT == Q5_1) *mn = half8_to_ps(tb + 352 + 16 * half);
  } else {
    const uint8_t* sc = kquant_scales(FMT, tb) + 8 * half;
    const uint8_t* dp = kquant_d(FMT, tb) + 16 * half;
    const __m256 d = half8_to_ps(dp);
    if (FMT == Q6_K) {
      D[0] = _mm256_mul_ps(d, i8x8_to_ps(sc + 16 * (2 * s)));
      D[1] = _mm256_mul_ps(d, i8x8_to_ps(sc + 16 * (2 * s + 1)));
    } else {
      D[0] = _mm256_mul_ps(d, u8x8_to_ps(sc + 16 * s));
      *mn = _mm256_mul_ps(half8_to_ps(dp + 32), u8x8_to_ps(sc + 128 + 16 * s));
    }
  }
}

// MR rows x 8 columns (half `half` of the tile), every sub-block.
template <int FMT, int L, int MR>
inline void half_sub(const GemmArgs& a, int tile, int half, int m0, int m_first,
                     __m256 acc[MR]) {
  constexpr int TBB = tile_block_bytes(FMT), PER = block_weights(FMT) / QK;
  constexpr int SBB = sub_block_bytes(FMT), GS = wide_groups<FMT>();
  constexpr int P = FMT == Q6_K ? 2 : 1;  // integer sums per sub-block: Q6_K's halves
  constexpr int32_t OFF = FMT == Q5_0 ? 16 : FMT == Q6_K ? 32 : 0;
  const int nb = a.K / QK, K = a.K, nbw = a.K / block_weights(FMT);
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const bool pair_lead = tile % 2 == 0 && tile < a.tiles - a.tiles % 2;
  const bool first = m0 == m_first && half == 0 && (pair_lead || tile >= a.tiles - a.tiles % 2);
  const uint8_t* base = a.w + block_offset(tile, 0, nbw, a.tiles, TBB);
  const int64_t step = tile < a.tiles - a.tiles % 2 ? 2 * TBB : TBB;
  for (int b = 0; b < nb; ++b) {
    if (first) {  // this sub-block's share of the stream, kPrefetchBlocks sub-blocks ahead
      const int at = b + kPrefetchBlocks;
      const char* p = (const char*)base + (at / PER) * step + (at % PER) * (step / PER);
      for (int off = 0; off < step / PER + 64; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
    const uint8_t* tb = base + (b / PER) * step;
    __m256i w[8];
    sub_weights8<FMT>(tb + (b % PER) * SBB, half, w);
    __m256 D[2], mn = _mm256_setzero_ps();
    D[1] = D[0] = _mm256_setzero_ps();
    sub_scales8<FMT>(tb, b % PER, half, D, &mn);
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const int8_t* ab = a.act.q + m * L * K + b * QK;
      __m256i hi[P];
      for (int p = 0; p < P; ++p) hi[p] = _mm256_setzero_si256();
      for (int l = 0; l < L; ++l) {
        const int8_t* al = ab + (int64_t)l * K;
        __m256i s32[P];
        for (int p = 0; p < P; ++p) s32[p] = _mm256_setzero_si256();
        for (int g0 = 0; g0 < 8; g0 += GS) {
          __m256i s16 = _mm256_maddubs_epi16(w[g0], _mm256_set1_epi32(load_i32(al + 4 * g0)));
          for (int g = g0 + 1; g < g0 + GS; ++g) {
            s16 = _mm256_add_epi16(
                s16, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(load_i32(al + 4 * g))));
          }
          const int p = P == 2 ? g0 / 4 : 0;
          s32[p] = _mm256_add_epi32(s32[p], _mm256_madd_epi16(s16, ones));
        }
        for (int p = 0; p < P; ++p) hi[p] = _mm256_add_epi32(_mm256_slli_epi32(hi[p], 7), s32[p]);
      }
      int32_t off[2] = {0, 0};
      if (OFF) {
        const int64_t all = (int64_t)OFF * horner_sums<L>(a.act.sums + m * L * nb + b, nb);
        if (P == 2) {
          off[0] = OFF * horner_sums<L>(a.act.hsums + m * L * nb + b, nb);
          off[1] = (int32_t)(all - off[0]);
        } else {
          off[0] = (int32_t)all;
        }
      }
      const __m256 sc = _mm256_set1_ps(a.act.scale[m * nb + b]);
      for (int p = 0; p < P; ++p) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(hi[p], _mm256_set1_epi32(off[p])));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[p], sc), f, acc[r]);
      }
      const __m256 fs = _mm256_set1_ps(a.act.fsum[m * nb + b]);
      if (FMT == Q5_1) acc[r] = _mm256_fmadd_ps(mn, fs, acc[r]);
      if (FMT == Q4_K || FMT == Q5_K) acc[r] = _mm256_fnmadd_ps(mn, fs, acc[r]);
    }
  }
}

// Three-digit Q4, one row: both halves of tile `tile` (q4_row_sums3), bias included.
template <int FMT>
inline void q4_row_tile(const GemmArgs& a, int tile, int m, bool first, __m256 acc[2]) {
  const int nb = a.K / QK, K = a.K;
  constexpr int TBB = FMT == Q4_0 ? 288 : 320;
  acc[0] = acc[1] = _mm256_setzero_ps();
  const TilePrefetch pf(a, tile, first, TBB);
  alignas(32) int32_t sums3[2][8];
  const uint8_t* const w = a.w;
  const int tiles = a.tiles;
  const int8_t* const q = a.act.q + (int64_t)m * 3 * K;
  const Q4Row row(a, m, 3, nb);
  for (int b = 0; b < nb; ++b) {
    pf.block(b);
    const uint8_t* tb = w + block_offset(tile, b, nb, tiles, TBB);
    q4_row_sums3(tb, q + b * QK, K, &sums3[0][0]);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* sc = tb + 256 + 16 * half;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc));
      __m256 mins = _mm256_setzero_ps();
      if (FMT == Q4_1) mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32)));
      const __m256i hi = _mm256_load_si256((const __m256i*)sums3[half]);
      acc[half] = q4_block_float<FMT, 3>(row, nb, b, hi, d, mins, acc[half]);
    }
  }
  if (a.bias) {
    for (int half = 0; half < 2; ++half) {
      acc[half] = _mm256_add_ps(acc[half], _mm256_loadu_ps(a.bias + tile * NR + 8 * half));
    }
  }
}

// Q8_0 with vpmaddwd on int16: a group of MR rows sign-extends each weight once, and each row
// brings two int16 activation streams (Q8Act), its first digit a_0 and the rest, a_1 * 128 + a_2
// at three digits or a_1 at two. One vpmaddwd then takes 16 weights of a stream, where
// vpmaddubsw needs the sign trick (two vpsignb) and a vpmaddwd to widen for every 32 weights and
// digit. The two sums are exactly the Horner hi (first digit) and lo (the rest) of the scalar
// kernel (|lo| <= 32 * 127 * 8256 < 2^31), so the float steps and the bits are the same.
// Four weights of four columns widen to one vector, 32-bit lanes (c0: k0 k1, c0: k2 k3, c1: ..),
// multiplied by the row's four activations broadcast; vphaddd of the two column quads gives the
// per-column sums in the order c0 c1 c4 c5 c2 c3 c6 c7. A block's float steps run in that order
// (lane for lane the same operations, the scales permuted to match), and the accumulator goes
// back to column order once, at the end.
struct Q8Act {
  int m_first = 0;               // rows [m_first, m_first + rows) of the call
  int rows = 0;
  const int16_t* a0 = nullptr;   // [rows][K]
  const int16_t* a12 = nullptr;  // [rows][K] when L > 1
};

// Calls of fewer rows than this (at two or three digits) take them one at a time through
// q8_row_tile rather than in pairs through half_q8: the LM head of a 2-row call 1.26x, 3 rows
// 1.14x, 5 rows level, 8 rows 0.94x (one thread, alternating builds). Both give the same bits.
constexpr int kQ8PairMinRows = 4;

// Rows a Q8Act holds at a time: its two streams, 2 x 32 x K int16 (72 KB at K = 576), stay in
// L2 while every tile of the call goes by.
constexpr int kQ8Rows = 32;

// Rows the other formats multiply against every tile before the next rows (gemm_fmt).
constexpr int kRowChunk = 32;

template <int L>
void q8_act16(const GemmArgs& a, int m_first, int rows, int16_t* a0, int16_t* a12) {
  const int K = a.K;
  for (int i = 0; i < rows; ++i) {
    const int8_t* q = a.act.q + (int64_t)(m_first + i) * L * K;
    for (int k = 0; k < K; k += 16) {
      const __m256i d0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + k)));
      _mm256_storeu_si256((__m256i*)(a0 + (int64_t)i * K + k), d0);
      if (L > 1) {
        __m256i d1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + K + k)));
        if (L > 2) {
          d1 = _mm256_add_epi16(
              _mm256_slli_epi16(d1, 7),
              _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + 2 * K + k))));
        }
        _mm256_storeu_si256((__m256i*)(a12 + (int64_t)i * K + k), d1);
      }
    }
  }
}

inline __m256i bcast4x16(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

template <int L, int MR>
inline void half_q8(const GemmArgs& a, const Q8Act& x, int tile, int half, int m0,
                    __m256 acc[MR]) {
  const int nb = a.K / QK, K = a.K;
  constexpr int TBB = 544;
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const TilePrefetch pf(a, tile, m0 == x.m_first && half == 0, TBB);
  for (int b = 0; b < nb; ++b) {
    pf.block(b);
    const uint8_t* tb = a.w + block_offset(tile, b, nb, a.tiles, TBB);
    __m256i hu[MR], hv[MR], lu[MR], lv[MR];
    for (int g = 0; g < 8; ++g) {
      const uint8_t* wg = tb + 64 * g + 32 * half;
      const __m256i wu = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wg));
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wg + 16)));
      for (int r = 0; r < MR; ++r) {
        const int64_t off = (int64_t)(m0 - x.m_first + r) * K + b * QK + 4 * g;
        const __m256i b0 = bcast4x16(x.a0 + off);
        const __m256i pu = _mm256_madd_epi16(wu, b0), pv = _mm256_madd_epi16(wv, b0);
        hu[r] = g ? _mm256_add_epi32(hu[r], pu) : pu;
        hv[r] = g ? _mm256_add_epi32(hv[r], pv) : pv;
        if (L > 1) {
          const __m256i b1 = bcast4x16(x.a12 + off);
          const __m256i qu = _mm256_madd_epi16(wu, b1), qv = _mm256_madd_epi16(wv, b1);
          lu[r] = g ? _mm256_add_epi32(lu[r], qu) : qu;
          lv[r] = g ? _mm256_add_epi32(lv[r], qv) : qv;
        }
      }
    }
    const __m128i dh = _mm_loadu_si128((const __m128i*)(tb + 512 + 16 * half));
    const __m256 d = _mm256_castsi256_ps(
        _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_cvtph_ps(dh)), 0xd8));
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(hu[r], hv[r]));
      if (L > 1) {
        f = _mm256_fmadd_ps(f, _mm256_set1_ps((float)(1 << (7 * (L - 1)))),
                            _mm256_cvtepi32_ps(_mm256_hadd_epi32(lu[r], lv[r])));
      }
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.act.scale[m * nb + b]));
      acc[r] = _mm256_fmadd_ps(ds, f, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_castsi256_ps(_mm256_permute4x64_epi64(_mm256_castps_si256(acc[r]), 0xd8));
  }
}

// Q8_0 at two or three digits, one row (the decode step's LM head): both halves of the tile in
// one pass, eight chains (a half, a column quad and a stream each, ymm8-15) where half_q8's
// lone row has four, and each group's two broadcasts (ymm4, ymm5) serve both halves. Per group
// of four k the four quads' weights are widened into ymm0-3; products ymm6, ymm7. Writes, per
// half h, hs[h] = hadd(hu, hv) and hs[2 + h] = hadd(lu, lv): the integer sums half_q8 forms,
// in its column order.
#define Q8P_PRODS(FIRST, G)                                                                 \
  "vpmovsxbw 64*" #G "(%[w]), %%ymm0\n\t" "vpmovsxbw 64*" #G "+16(%[w]), %%ymm1\n\t"        \
  "vpmovsxbw 64*" #G "+32(%[w]), %%ymm2\n\t" "vpmovsxbw 64*" #G "+48(%[w]), %%ymm3\n\t"     \
  "vpbroadcastq 8*" #G "(%[a0]), %%ymm4\n\t" "vpbroadcastq 8*" #G "(%[a12]), %%ymm5\n\t"    \
  FIRST("0", "8", "12") FIRST("1", "9", "13") FIRST("2", "10", "14") FIRST("3", "11", "15")
#define Q8P_FIRST(W, H, L)                                                                  \
  "vpmaddwd %%ymm4, %%ymm" W ", %%ymm" H "\n\t" "vpmaddwd %%ymm5, %%ymm" W ", %%ymm" L "\n\t"
#define Q8P_NEXT(W, H, L)                                                                   \
  "vpmaddwd %%ymm4, %%ymm" W ", %%ymm6\n\t" "vpaddd %%ymm6, %%ymm" H ", %%ymm" H "\n\t"     \
  "vpmaddwd %%ymm5, %%ymm" W ", %%ymm7\n\t" "vpaddd %%ymm7, %%ymm" L ", %%ymm" L "\n\t"

__attribute__((always_inline)) inline void q8_row_sums(const uint8_t* w, const int16_t* a0,
                                                       const int16_t* a12, int32_t* hs) {
  __asm__ volatile(
      Q8P_PRODS(Q8P_FIRST, 0) Q8P_PRODS(Q8P_NEXT, 1) Q8P_PRODS(Q8P_NEXT, 2)
      Q8P_PRODS(Q8P_NEXT, 3) Q8P_PRODS(Q8P_NEXT, 4) Q8P_PRODS(Q8P_NEXT, 5)
      Q8P_PRODS(Q8P_NEXT, 6) Q8P_PRODS(Q8P_NEXT, 7)
      "vphaddd %%ymm9, %%ymm8, %%ymm8\n\t" "vphaddd %%ymm11, %%ymm10, %%ymm10\n\t"
      "vphaddd %%ymm13, %%ymm12, %%ymm12\n\t" "vphaddd %%ymm15, %%ymm14, %%ymm14\n\t"
      "vmovdqa %%ymm8, (%[hs])\n\t" "vmovdqa %%ymm10, 32(%[hs])\n\t"
      "vmovdqa %%ymm12, 64(%[hs])\n\t" "vmovdqa %%ymm14, 96(%[hs])\n\t"
      : : [w] "r"(w), [a0] "r"(a0), [a12] "r"(a12), [hs] "r"(hs)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");
}
#undef Q8P_PRODS
#undef Q8P_FIRST
#undef Q8P_NEXT

// Q8_0, one row (m, L > 1): both halves of tile `tile` from q8_row_sums, bias included; each
// half's float steps are half_q8's.
template <int L>
inline void q8_row_tile(const GemmArgs& a, const Q8Act& x, int tile, int m, __m256 acc[2]) {
  const int nb = a.K / QK, K = a.K;
  constexpr int TBB = 544;
  acc[0] = acc[1] = _mm256_setzero_ps();
  const TilePrefetch pf(a, tile, m == x.m_first, TBB);
  alignas(32) int32_t hs[4][8];
  const int16_t* a0 = x.a0 + (int64_t)(m - x.m_first) * K;
  const int16_t* a12 = x.a12 + (int64_t)(m - x.m_first) * K;
  for (int b = 0; b < nb; ++b) {
    pf.block(b);
    const uint8_t* tb = a.w + block_offset(tile, b, nb, a.tiles, TBB);
    q8_row_sums(tb, a0 + b * QK, a12 + b * QK, &hs[0][0]);
    for (int half = 0; half < 2; ++half) {
      const __m128i dh = _mm_loadu_si128((const __m128i*)(tb + 512 + 16 * half));
      const __m256 d = _mm256_castsi256_ps(
          _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_cvtph_ps(dh)), 0xd8));
      __m256 f = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)hs[half]));
      f = _mm256_fmadd_ps(f, _mm256_set1_ps((float)(1 << (7 * (L - 1)))),
                          _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)hs[2 + half])));
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.act.scale[(int64_t)m * nb + b]));
      acc[half] = _mm256_fmadd_ps(ds, f, acc[half]);
    }
  }
  for (int half = 0; half < 2; ++half) {
    acc[half] = _mm256_castsi256_ps(
        _mm256_permute4x64_epi64(_mm256_castps_si256(acc[half]), 0xd8));
    if (a.bias) {
      acc[half] = _mm256_add_ps(acc[half], _mm256_loadu_ps(a.bias + tile * NR + 8 * half));
    }
  }
}

template <int FMT>
inline __m256 load_w8(const uint8_t* p) {
  if (FMT == F32) return _mm256_loadu_ps((const float*)p);
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  if (FMT == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int FMT, int MR>
inline void half_float(const GemmArgs& a, int tile, int half, int m0, __m256 acc[MR]) {
  constexpr int EB = FMT == F32 ? 4 : 2;
  const uint8_t* tw = a.w + (int64_t)tile * a.K * NR * EB + 8 * half * EB;
  __m256 e[MR], o[MR];
  for (int r = 0; r < MR; ++r) e[r] = o[r] = _mm256_setzero_ps();
  const float* x = a.x + (int64_t)m0 * a.ldx;
  int k = 0;
  for (; k + 1 < a.K; k += 2) {
    const __m256 w0 = load_w8<FMT>(tw + (int64_t)k * NR * EB);
    const __m256 w1 = load_w8<FMT>(tw + (int64_t)(k + 1) * NR * EB);
    for (int r = 0; r < MR; ++r) {
      e[r] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[r * a.ldx + k]), e[r]);
      o[r] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[r * a.ldx + k + 1]), o[r]);
    }
  }
  if (k < a.K) {
    const __m256 w0 = load_w8<FMT>(tw + (int64_t)k * NR * EB);
    for (int r = 0; r < MR; ++r) e[r] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[r * a.ldx + k]), e[r]);
  }
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_add_ps(e[r], o[r]);
}

template <int FMT, int L, int MR>
inline void half_acc(const GemmArgs& a, const Q8Act* q8, int tile, int half, int m0,
                     int m_first, __m256 acc[MR]) {
  if constexpr (FMT == Q8_0) {
    half_q8<L, MR>(a, *q8, tile, half, m0, acc);
  } else if constexpr (FMT == Q4_0 || FMT == Q4_1) {
    half_block<FMT, L, MR>(a, tile, half, m0, m_first, acc);
  } else if constexpr (FMT >= Q5_0) {
    half_sub<FMT, L, MR>(a, tile, half, m0, m_first, acc);
  } else {
    half_float<FMT, MR>(a, tile, half, m0, acc);
  }
  if (a.bias) {
    const __m256 bias = _mm256_loadu_ps(a.bias + tile * NR + 8 * half);
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_add_ps(acc[r], bias);
  }
}

inline void store8(float* y, int valid, __m256 v, bool add) {
  if (valid >= 8) {
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(y), v);
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int j = 0; j < valid; ++j) y[j] = add ? y[j] + tmp[j] : tmp[j];
}

template <int FMT, int L, int MR>
inline void tile_rows(const GemmArgs& a, const Q8Act* q8, int t, int m0, int m_first) {
  constexpr bool q4_row = (FMT == Q4_0 || FMT == Q4_1) && L == 3 && MR == 1;
  constexpr bool q8_row = FMT == Q8_0 && L > 1 && MR == 1;
  if constexpr (q4_row || q8_row) {  // one row: both halves in one pass
    __m256 acc[2], up[2];
    const bool silu = gated_epilogue(a.epilogue);
    if constexpr (q4_row) {
      q4_row_tile<FMT>(a, silu ? 2 * t : t, m0, m0 == m_first, acc);
      if (silu) q4_row_tile<FMT>(a, 2 * t + 1, m0, m0 == m_first, up);
    } else {
      q8_row_tile<L>(a, *q8, silu ? 2 * t : t, m0, acc);
      if (silu) q8_row_tile<L>(a, *q8, 2 * t + 1, m0, up);
    }
    for (int half = 0; half < 2; ++half) {
      const int col = t * NR + 8 * half;
      const int valid = a.N - col;
      if (valid <= 0) return;
      float* y = a.y + (int64_t)m0 * a.ldy + col;
      if (silu) {
        store8(y, valid, _mm256_mul_ps(gate_act256(a.epilogue, acc[half]), up[half]), false);
      }
      else store8(y, valid, acc[half], a.epilogue == EPI_ADD);
    }
    return;
  }
  for (int half = 0; half < 2; ++half) {
    const int col = t * NR + 8 * half;
    const int valid = a.N - col;
    if (valid <= 0) return;
    __m256 acc[MR];
    if (gated_epilogue(a.epilogue)) {
      __m256 up[MR];
      half_acc<FMT, L, MR>(a, q8, 2 * t, half, m0, m_first, acc);
      half_acc<FMT, L, MR>(a, q8, 2 * t + 1, half, m0, m_first, up);
      for (int r = 0; r < MR; ++r) {
        store8(a.y + (int64_t)(m0 + r) * a.ldy + col, valid,
               _mm256_mul_ps(gate_act256(a.epilogue, acc[r]), up[r]),
               false);
      }
      continue;
    }
    half_acc<FMT, L, MR>(a, q8, t, half, m0, m_first, acc);
    for (int r = 0; r < MR; ++r) {
      store8(a.y + (int64_t)(m0 + r) * a.ldy + col, valid, acc[r], a.epilogue == EPI_ADD);
    }
  }
}

template <int FMT, int L>
void gemm_fmt(const GemmArgs& a, int t0, int t1) {
  if constexpr (FMT == Q8_0) {
    // rows kQ8Rows at a time: their int16 streams, then every tile (two rows at a time: four
    // streams' sums per row is what the registers hold)
    static thread_local std::vector<int16_t> buf;
    const size_t n = (size_t)kQ8Rows * a.K;
    if (buf.size() < 2 * n) buf.resize(2 * n);
    for (int m_first = 0; m_first < a.M; m_first += kQ8Rows) {
      Q8Act x;
      x.m_first = m_first;
      x.rows = std::min(kQ8Rows, a.M - m_first);
      x.a0 = buf.data();
      x.a12 = buf.data() + n;
      q8_act16<L>(a, m_first, x.rows, buf.data(), buf.data() + n);
      const int m_end = m_first + x.rows;
      for (int t = t0; t < t1; ++t) {
        int m = m_first;
        if (L == 1 || a.M >= kQ8PairMinRows) {
          for (; m + 2 <= m_end; m += 2) tile_rows<FMT, L, 2>(a, &x, t, m, m_first);
        }
        for (; m < m_end; ++m) tile_rows<FMT, L, 1>(a, &x, t, m, m_first);
      }
    }
    return;
  }
  // rows kRowChunk at a time, every tile for each chunk: the chunk's activations (three digit
  // rows of K bytes each) stay in L2 while the weights go by, where one pass over all the rows
  // per tile read them from L3 again for every tile (256 rows, one thread: 1.03-1.05x, in a
  // throwaway harness timing the asm kernel with and without the chunks)
  for (int m_first = 0; m_first < a.M; m_first += kRowChunk) {
    const int m_end = std::min(a.M, m_first + kRowChunk);
    for (int t = t0; t < t1; ++t) {
      int m = m_first;
      for (; m + 4 <= m_end; m += 4) tile_rows<FMT, L, 4>(a, nullptr, t, m, m_first);
      switch (m_end - m) {
        case 3: tile_rows<FMT, L, 3>(a, nullptr, t, m, m_first); break;
        case 2: tile_rows<FMT, L, 2>(a, nullptr, t, m, m_first); break;
        case 1: tile_rows<FMT, L, 1>(a, nullptr, t, m, m_first); break;
        default: break;
      }
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

// activation digits: the same values as isa_generic.cpp's scalar quantize
void quantize(const float* x, int64_t ldx, int r0, int r1, int K, int L, int8_t* q, float* scale,
              int32_t* sums, float* fsum) {
  if (K % QK) return generic_kernels()->quantize(x, ldx, r0, r1, K, L, q, scale, sums, fsum);
  const int nb = K / QK;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int r = r0; r < r1; ++r) {
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + (int64_t)r * ldx + b * QK;
      __m256 v[4];
      __m256 m = _mm256_setzero_ps();
      for (int h = 0; h < 4; ++h) {
        v[h] = _mm256_loadu_ps(xb + 8 * h);
        m = _mm256_max_ps(m, _mm256_and_ps(v[h], absmask));
      }
      const float amax = hmax256(m);
      const bool live = amax >= 0x1p-100f;
      const int e = block_exponent(amax);  // 2^e > amax / 127
      const __m256 inv = _mm256_set1_ps(live ? pow2(-e) : 0.f);
      for (int h = 0; h < 4; ++h) v[h] = _mm256_mul_ps(v[h], inv);
      int64_t total = 0;
      for (int l = 0; l < L; ++l) {
        __m256i acc = _mm256_setzero_si256();
        int8_t* out = q + ((int64_t)r * L + l) * K + b * QK;
        for (int h = 0; h < 4; ++h) {
          __m256 d = _mm256_round_ps(v[h], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          if (l == 0) d = _mm256_min_ps(_mm256_max_ps(d, _mm256_set1_ps(-127.f)),
                                        _mm256_set1_ps(127.f));
          const __m256i di = _mm256_cvtps_epi32(d);
          alignas(32) int32_t tmp[8];
          _mm256_store_si256((__m256i*)tmp, di);
          for (int i = 0; i < 8; ++i) out[8 * h + i] = (int8_t)tmp[i];
          acc = _mm256_add_epi32(acc, di);
          v[h] = _mm256_mul_ps(_mm256_sub_ps(v[h], d), _mm256_set1_ps(128.f));
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc),
                                         _mm256_extracti128_si256(acc, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        const int32_t sl = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
        sums[((int64_t)r * L + l) * nb + b] = sl;
        total = total * 128 + sl;
      }
      const float sc = pow2(e - 7 * (L - 1));
      scale[(int64_t)r * nb + b] = sc;
      fsum[(int64_t)r * nb + b] = (float)total * sc;
    }
  }
}

void rmsnorm(const float* x, int64_t ldx, const float* w, float eps, int D, float* y, int64_t ldy,
             int r0, int r1) {
  if (D % 8) return generic_kernels()->rmsnorm(x, ldx, w, eps, D, y, ldy, r0, r1);
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + (int64_t)r * ldx;
    __m256 ss = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 vinv = _mm256_set1_ps(1.f / std::sqrt(hsum256(ss) / (float)D + eps));
    float* yr = y + (int64_t)r * ldy;
    for (int i = 0; i < D; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv);
      _mm256_storeu_ps(yr + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
    }
  }
}

// 8 lanes of a KV row: fp32 as stored, fp16 widened (exact)
inline __m256 kv_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 kv_load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// Keys per block of the item-blocked attention below.
constexpr int kKeyBlock = 16;

// An item's queries (its rows x its heads, one KV group) go through the keys kKeyBlock at a
// time together, so a block of K (then V) rows comes from memory once and from L1 for the
// item's other queries (before, each query made its own pass over every key). Each query's own
// float operations are unchanged and in the same order: per key the products of its head_dim
// lanes summed in 8 lanes then across them, times the scale; the maximum over 8-lane chunks;
// exp and sums in 8 lanes; values accumulated in key order (the accumulators wait in scratch
// between blocks, exactly); one multiply by the inverse sum. So a verify or prefill row still
// gives exactly the bits of the same token's decode row.
template <int NV, class KV>  // head_dim = 8 * NV; KV: float or uint16_t (fp16) cache
void attention_d(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  constexpr int D = 8 * NV;
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t kv_stride = (int64_t)a.num_kv_heads * D;
  const int64_t sstride = a.max_keys + 16;
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
    // the rows' key lists share the request's prefix (a causal row's holds every earlier
    // row's): prefetching along the longest covers them all
    const int64_t* psl = sl[rmax];
    const KV* kc = kv_cache_k<KV>(a) + (int64_t)g * D;
    const KV* vc = kv_cache_v<KV>(a) + (int64_t)g * D;
    prefetch_kv_rows<3, D>(kc, kv_stride, psl, 0, std::min(Lmax, kKeyBlock));
    for (int j0 = 0; j0 < Lmax; j0 += kKeyBlock) {
      // the next block's keys to L1, this block's values to L2 (the value pass reads them)
      prefetch_kv_rows<3, D>(kc, kv_stride, psl, std::min(Lmax, j0 + kKeyBlock),
                             std::min(Lmax, j0 + 2 * kKeyBlock));
      prefetch_kv_rows<2, D>(vc, kv_stride, psl, j0, std::min(Lmax, j0 + kKeyBlock));
      for (int r = 0; r < R; ++r) {
        const int j1 = std::min(Lr[r], j0 + kKeyBlock);
        for (int hh = 0; hh < G; ++hh) {
          const float* qp = a.q + (int64_t)(t0 + r) * a.ldq + (h0 + hh) * D;
          __m256 q[NV];
          for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(qp + 8 * v);
          float* sc = s.scores + (r * G + hh) * sstride;
          for (int j = j0; j < j1; ++j) {
            const KV* kp = kc + sl[r][j] * kv_stride;
            __m256 p = _mm256_mul_ps(q[0], kv_load8(kp));
            for (int v = 1; v < NV; ++v) p = _mm256_fmadd_ps(q[v], kv_load8(kp + 8 * v), p);
            sc[j] = hsum256(p) * a.scale;
          }
        }
      }
    }
    float inv_sum[kAttnRows * 8];
    for (int r = 0; r < R; ++r) {
      const int L = Lr[r], Lp = (L + 7) & ~7;
      for (int hh = 0; hh < G; ++hh) {
        const int qi = r * G + hh;
        float* sc = s.scores + qi * sstride;
        for (int j = L; j < Lp; ++j) sc[j] = -INFINITY;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < Lp; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + j));
        const __m256 mx = _mm256_set1_ps(hmax256(vmax));
        __m256 vsum = _mm256_setzero_ps();
        for (int j = 0; j < Lp; j += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mx));
          _mm256_storeu_ps(sc + j, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        inv_sum[qi] = 1.f / hsum256(vsum);
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(s.out + qi * D + 8 * v, _mm256_setzero_ps());
      }
    }
    for (int j0 = 0; j0 < Lmax; j0 += kKeyBlock) {
      prefetch_kv_rows<3, D>(vc, kv_stride, psl, std::min(Lmax, j0 + kKeyBlock),
                             std::min(Lmax, j0 + 2 * kKeyBlock));
      for (int r = 0; r < R; ++r) {
        const int j1 = std::min(Lr[r], j0 + kKeyBlock);
        for (int hh = 0; hh < G; ++hh) {
          const int qi = r * G + hh;
          const float* e = s.scores + qi * sstride;
          float* op = s.out + qi * D;
          __m256 o[NV];
          for (int v = 0; v < NV; ++v) o[v] = _mm256_loadu_ps(op + 8 * v);
          for (int j = j0; j < j1; ++j) {
            const KV* vp = vc + sl[r][j] * kv_stride;
            const __m256 ej = _mm256_set1_ps(e[j]);
            for (int v = 0; v < NV; ++v) o[v] = _mm256_fmadd_ps(ej, kv_load8(vp + 8 * v), o[v]);
          }
          for (int v = 0; v < NV; ++v) _mm256_storeu_ps(op + 8 * v, o[v]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int hh = 0; hh < G; ++hh) {
        const int qi = r * G + hh;
        const __m256 inv = _mm256_set1_ps(inv_sum[qi]);
        float* dst = a.out + (int64_t)(t0 + r) * a.ldo + (h0 + hh) * D;
        for (int v = 0; v < NV; ++v) {
          _mm256_storeu_ps(dst + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(s.out + qi * D + 8 * v), inv));
        }
      }
    }
  }
}

template <class KV>
void attention_kv(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  switch (a.head_dim) {
    case 64: return attention_d<8, KV>(a, i0, i1, s);
    case 128: return attention_d<16, KV>(a, i0, i1, s);
    case 32: return attention_d<4, KV>(a, i0, i1, s);
    case 96: return attention_d<12, KV>(a, i0, i1, s);
    case 256: return attention_d<32, KV>(a, i0, i1, s);  // Gemma 3
    default: return generic_kernels()->attention(a, i0, i1, s);
  }
}

void attention(const AttnArgs& a, int i0, int i1, AttnScratch& s) {
  if (a.k_half) return attention_kv<uint16_t>(a, i0, i1, s);
  attention_kv<float>(a, i0, i1, s);
}

// argmax (kernels.h): the maximum in one pass (NaNs noted: such a row goes the scalar way),
// then the first lane equal to it
int64_t argmax(const float* x, int64_t n, float* best) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int nan = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  if (nan || n <= 0) return argmax_scalar(x, n, best);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = -INFINITY;
  for (float v : lanes) mx = v > mx ? v : mx;
  for (int64_t j = i; j < n; ++j) {
    if (x[j] != x[j]) return argmax_scalar(x, n, best);
    mx = x[j] > mx ? x[j] : mx;
  }
  *best = mx;
  const __m256 vm = _mm256_set1_ps(mx);
  for (i = 0; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz((unsigned)eq);
  }
  for (; i < n; ++i) {
    if (x[i] == mx) return i;
  }
  return -1;  // not reached: the maximum is one of the elements
}

// logit_stats (kernels.h): 8 lanes of exp sums in two chains, top-k as in the AVX-512 table
float logit_stats(const float* x, int64_t n, float mx, int k, float* vals, int32_t* ids,
                  int* cnt) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  auto top = [&](__m256 v, int64_t i) {
    if (!k) return;
    int c = *cnt < k ? _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_ORD_Q))
                     : _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(vals[k - 1]),
                                                        _CMP_GT_OQ));
    for (; c; c &= c - 1) {
      const int j = __builtin_ctz((unsigned)c);
      // (lanes that a previous insert of this vector lifted the k-th above: top_insert drops)
      top_insert(x[i + j], (int32_t)(i + j), k, vals, ids, cnt);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(a, vm)));
    s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(b, vm)));
    top(a, i);
    top(b, i + 8);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(a, vm)));
    top(a, i);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
  float s = 0.f;
  for (float v : lanes) s += v;
  for (; i < n; ++i) {  // the tail, one at a time
    s += std::exp(x[i] - mx);
    if (k && x[i] == x[i]) top_insert(x[i], (int32_t)i, k, vals, ids, cnt);
  }
  return s;
}

}  // namespace
}  // namespace specserve

#pragma GCC pop_options

namespace specserve {
const IsaKernels* avx2_kernels() {
  static const IsaKernels table = {"avx2", gemm, quantize, rmsnorm, attention, argmax,
                                   logit_stats};
  return &table;
}
}  // namespace specserve
