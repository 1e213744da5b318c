// Plain-C++ interface between the engine (engine.cpp, built with the baseline flags) and the
// per-ISA kernel files (isa_avx512.cpp, isa_avx2.cpp, isa_generic.cpp). The ISA files include no
// torch headers and define nothing with external linkage but their `*_kernels()` table, so code
// compiled for AVX-512 can never be merged into code that runs on an AVX2 machine.
//
// Batch invariance is the contract of every kernel here: an output row is computed by the same
// sequence of float operations whatever M is, whichever rows share the call and however the work
// is split over threads (work is split over N, heads or rows, never over a reduction).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specserve {

// An activation block's exponent in quantize(): e with 2^e > amax / 127 (std::frexp's exponent
// of amax / 127), 0 for a block under 2^-100 (its digits are all zero). Read from the quotient's
// bits when it is a normal float (every live block's is: amax / 127 >= 2^-107), through
// std::frexp otherwise; pow2(n) is std::ldexp(1.f, n), built from bits inside the normal range.
// The same values as the libm calls (three per 32 activations: without them quantize() took
// 16% less time on AVX-512: python -m benchmark.bench_gemm --rows 32,256 --quantize).
inline int block_exponent(float amax) {
  if (!(amax >= 0x1p-100f)) return 0;
  const float v = amax / 127.f;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const int be = (int)((u >> 23) & 0xff);
  if (be == 0 || be == 0xff) {
    int e = 0;
    std::frexp(v, &e);
    return e;
  }
  return be - 126;
}

inline float pow2(int n) {
  if (n < -126 || n > 127) return std::ldexp(1.f, n);
  const uint32_t u = (uint32_t)(n + 127) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Weight formats of a packed linear (values shared with specserve/kernels/cpu/packing.py).
enum WeightFormat : int32_t {
  F32 = 0, BF16 = 1, F16 = 2, Q8_0 = 3, Q4_0 = 4, Q4_1 = 5,
  Q5_0 = 6, Q5_1 = 7, Q4_K = 8, Q5_K = 9, Q6_K = 10,
};

constexpr int NR = 16;   // output rows per tile
constexpr int QK = 32;   // weights per quantization block (activation blocks too)
constexpr int QKK = 256;  // weights per K-quant super-block

constexpr bool is_block_format(int fmt) { return fmt >= Q8_0 && fmt <= Q6_K; }
constexpr bool is_kquant(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K; }
// Weights per addressed block along K: a K-quant tile-block is a whole super-block (its scales
// are stored once per super-block), the other block formats' one 32-weight block.
constexpr int block_weights(int fmt) { return is_kquant(fmt) ? QKK : QK; }

// ---- tile-block layouts (specserve/kernels/cpu/packing.py writes them) ----------------------------------
//
// A 32-weight sub-block of 16 rows keeps its quantized integers q (unsigned as GGUF stores them,
// but Q8_0's int8) in these parts, each laid out so byte 4 j + t of a 64-byte group is row j:
//   nibbles (Q4_*, Q5_*, Q4_K, Q5_K, Q6_K): 4 x 64 bytes; group c holds weights 4 c + t in its
//     low nibbles and 16 + 4 c + t in its high ones (so weights 4 g + t are group g % 4's
//     nibble g / 4);
//   bit 4 (Q5_*): 64 bytes, bit g of byte 4 j + t = bit 4 of q(row j, weight 4 g + t);
//   bits 4-5 (Q6_K): 2 x 64 bytes, plane p's bits 2 s, 2 s + 1 of byte 4 j + t = bits 4-5 of
//     q(row j, weight 4 (4 p + s) + t): plane 0 is weights 0-15, plane 1 weights 16-31.
// A block format's tile-block is then (fp16 per row, unless said otherwise):
//   Q8_0 [512 int8][16 d]             Q4_0 [256 nib][16 d]          Q4_1 [256 nib][16 d][16 m]
//   Q5_0 [256 nib][64 bit 4][16 d]    Q5_1 [256 nib][64 bit 4][16 d][16 m]
//   Q4_K 8 x [256 nib], Q5_K 8 x [256 nib][64 bit 4], Q6_K 8 x [256 nib][128 bits 4-5]
//     (one per sub-block), then Q4_K / Q5_K: [8 x 16 scales u8][8 x 16 mins u8][16 d][16 dmin],
//     Q6_K: [16 x 16 scales int8, one per 16 weights][16 d].
// A weight is w = d (q - 16) (Q5_0), d q + m (Q5_1), d sc q - dmin mn (Q4_K, Q5_K: the
// sub-block's 6-bit scale and min), d sc (q - 32) (Q6_K: the 16-weight half's int8 scale), as
// gguf's dequantize computes them (d sc and dmin mn are exact in float32).

// Bytes of one 32-weight sub-block's integers.
constexpr int sub_block_bytes(int fmt) {
  switch (fmt) {
    case Q8_0: return 512;
    case Q5_0: case Q5_1: case Q5_K: return 256 + 64;
    case Q6_K: return 256 + 128;
    default: return 256;
  }
}

// Bytes of one tile-block (16 rows x block_weights), 0 for float formats.
constexpr int tile_block_bytes(int fmt) {
  switch (fmt) {
    case Q8_0: return 512 + 32;       // int8 weights, 16 fp16 scales
    case Q4_0: return 256 + 32;       // nibbles, 16 fp16 scales
    case Q4_1: return 256 + 32 + 32;  // nibbles, 16 fp16 scales, 16 fp16 mins
    case Q5_0: return 320 + 32;
    case Q5_1: return 320 + 64;
    case Q4_K: return 8 * 256 + 256 + 64;
    case Q5_K: return 8 * 320 + 256 + 64;
    case Q6_K: return 8 * 384 + 256 + 32;
    default: return 0;
  }
}

// q(row j, weight k) of a sub-block whose integers start at sb (not Q8_0).
inline int sub_block_weight(int fmt, const uint8_t* sb, int j, int k) {
  const uint8_t byte = sb[64 * ((k % 16) / 4) + 4 * j + k % 4];
  int q = k < 16 ? byte & 0x0f : byte >> 4;
  const int at = 256 + 4 * j + k % 4;
  if (fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K) q |= ((sb[at] >> (k / 4)) & 1) << 4;
  if (fmt == Q6_K) q |= ((sb[at + 64 * (k / 16)] >> (2 * ((k / 4) % 4))) & 3) << 4;
  return q;
}

// Where the scales of a K-quant tile-block start (after its 8 sub-blocks' integers).
inline const uint8_t* kquant_scales(int fmt, const uint8_t* tb) {
  return tb + 8 * sub_block_bytes(fmt);
}
// Its 16 fp16 super-block scales d (then, Q4_K / Q5_K, 16 dmin).
inline const uint8_t* kquant_d(int fmt, const uint8_t* tb) {
  return kquant_scales(fmt, tb) + 256;
}

// Block formats store tiles in pairs with their blocks interleaved: pair p = tiles 2p, 2p+1 is
// [block 0 of 2p][block 0 of 2p+1][block 1 of 2p]..., so a kernel multiplying a pair reads one
// sequential stream (measured 1.36x the bandwidth of two streams at one row); an odd last tile
// follows alone. Byte offset of (tile, block b) in a matrix of `tiles` tiles and nb blocks
// (blocks of block_weights(fmt) weights, tbb = tile_block_bytes(fmt) bytes):
inline int64_t block_offset(int tile, int b, int nb, int tiles, int tbb) {
  const int pairs = tiles / 2;
  if (tile < 2 * pairs) return (((int64_t)(tile / 2) * nb + b) * 2 + (tile & 1)) * tbb;
  return ((int64_t)pairs * nb * 2 + b) * tbb;
}
inline int float_elem_bytes(int fmt) { return fmt == F32 ? 4 : 2; }

// Activations of a block-format matmul: each row split into blocks of 32, each block scaled by a
// power of two d = 2^e (>= amax / 127) and written as `levels` int8 digits:
// x / d ~= a_0 + a_1 / 128 + a_2 / 128^2 (a_0 in [-127, 127], later digits in [-64, 64]).
// One level is llama.cpp's int8 activations; three carry ~22 bits, near float32.
struct ActQ {
  int levels = 1;
  int K = 0;
  const int8_t* q = nullptr;      // [M][levels][K]
  const float* scale = nullptr;   // [M][K/32]: d / 128^(levels-1)
  const int32_t* sums = nullptr;  // [M][levels][K/32]: sum of each level's digits per block
  const float* fsum = nullptr;    // [M][K/32]: sum of the block's quantized values (Q4_1 mins)
  // [M][levels][K/32]: sum of each level's digits over the block's first 16 (Q6_K, whose
  // scales and offsets go by 16 weights; set by the engine for Q6_K only, else null)
  const int32_t* hsums = nullptr;
  // Three-level Q4 calls on AMX only (`amx_pairs_apply`): the same digits as two "paired" tile
  // rows per activation row, [M][2][K / 32][64] (`quantize_pairs` in IsaKernels), else null.
  const int8_t* pairs = nullptr;
};

// AMX's paired digits. A row's three digits are one integer per weight, X = a_0 128^2 + a_1 128 +
// a_2 (|X| < 127 * 2^14 + 64 * 129 < 2^21). Written as X = R0 2^11 + R1 with R1 in [-1024, 1023]
// (so R0 in [-1021, 1020]), and each R as 8 h + l with h = R >> 3 in [-128, 127] and l = R & 7,
// a block's 32 weights of R take 64 bytes [h of the 32 | l of the 32]. One TDPBSSD row of K = 64
// against B = [8 q ; q] (Q4 weights q in 0..15, so 8 q <= 120 is still a byte) sums exactly
// sum R q, and (sum R0 q << 11) + sum R1 q is the very integer sum X q that three digit rows and
// their Horner steps give (no overflow: |sum X q| < 32 * 15 * 2^21 ~ 1.0e9 < 2^31). Two tile rows
// per activation row instead of three, each using all 64 bytes of K instead of 32.
// The tile unit's time goes with the bytes of K it multiplies (pairs: 128 per row and block,
// three digit rows: 96), so pairs pay there and win on what follows each block (two C rows
// stored and read back per row instead of three, one Horner step instead of two, 8 rows per
// group instead of 5). Measured (`python -m benchmark.bench_one_batch --verify-ns 8,...,32`,
// prefill, decode at batch 8-32): faster from 32 rows (verify T(32) -6%, decode bs 32 +5%,
// prefill -8-10%), level or slower below (T(20) +12%), so pairs start at 32 rows.
constexpr int kAmxPairMinRows = 32;
inline bool amx_pairs_apply(int fmt, int levels, int M) {
  return levels == 3 && (fmt == Q4_0 || fmt == Q4_1) && M >= kAmxPairMinRows;
}

enum Epilogue : int32_t {
  EPI_STORE = 0,     // y = x W^T (+ bias)
  EPI_ADD = 1,       // y += x W^T (+ bias): the residual add, fused
  EPI_SILU_MUL = 2,  // tiles come in (gate, up) pairs: y = silu(gate) * up, N counts pairs' rows
  EPI_GELU_MUL = 3,  // the same with gelu_tanh(gate) (Gemma)
};
inline bool gated_epilogue(int epi) { return epi == EPI_SILU_MUL || epi == EPI_GELU_MUL; }

// gelu_tanh(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
// g / (1 + exp(-2 u)) (the same function) so each table reuses its silu's exp.
constexpr float kGeluC1 = -2.f * 0.7978845608028654f, kGeluC3 = kGeluC1 * 0.044715f;

struct GemmArgs {
  int fmt = F32;
  int K = 0;
  int N = 0;  // valid output columns (EPI_SILU_MUL: columns of y, half the packed rows)
  int M = 0;
  int tiles = 0;  // packed tiles (block formats address them through block_offset)
  const uint8_t* w = nullptr;  // packed tiles
  const float* bias = nullptr;  // [packed rows] or null
  ActQ act;                     // block formats
  const float* x = nullptr;     // float formats: [M][ldx]
  int64_t ldx = 0;
  float* y = nullptr;  // [M][ldy]
  int64_t ldy = 0;
  int epilogue = EPI_STORE;
};

// Which keys each query row sees, and where the keys live.
struct AttnArgs {
  int num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 1.f;
  const float* q = nullptr;  // [T][ldq], heads contiguous
  int64_t ldq = 0;
  float* out = nullptr;  // [T][ldo]
  int64_t ldo = 0;
  const float* k_cache = nullptr;  // [slots][num_kv_heads][head_dim]
  const float* v_cache = nullptr;
  // fp16 KV (`--kv-cache-dtype float16`): IEEE half values, widened exactly by the kernels;
  // when set the kernels read these instead of k_cache / v_cache
  const uint16_t* k_half = nullptr;
  const uint16_t* v_half = nullptr;
  const int32_t* tok_req = nullptr;    // [T] request of each query row
  const int32_t* tok_local = nullptr;  // [T] index of the row among its request's new tokens
  const int64_t* kv_indptr = nullptr;  // [B+1] into kv_indices
  const int64_t* kv_indices = nullptr;  // per request: prefix slots, then its new tokens' slots
  const int32_t* prefix_len = nullptr;  // [B]
  const int32_t* extend_len = nullptr;  // [B]
  const uint8_t* masks = nullptr;       // per request [n][n] custom mask, or null: causal
  const int64_t* mask_indptr = nullptr;  // [B+1]
  // Work items: rows [t0, t1) of one request x heads [h0, h1) of one KV group, 4 ints each.
  // A query's result does not depend on which item it is in (attention_items()).
  const int32_t* items = nullptr;
  int max_keys = 0;  // the longest key list of any row
  // A sliding-window layer (window > 0): query row t sees only keys less than `window`
  // positions before its own, positions[t] (a prefix key's position is its index; a new
  // token's, prefix_len + its index; a tree's rows are all inside the window, the engine checks)
  int window = 0;
  const int64_t* positions = nullptr;
};

// Rows per attention item when several rows of a request share their keys (prefill, verify).
constexpr int kAttnRows = 4;

// The KV slots query row t attends, in position order: its request's prefix, then its ancestors
// in the tree (custom mask) or its causal predecessors and itself. A decode step at the same
// position sees exactly the same list. Returns the count.
// The first key position row t sees: 0, or in a window the oldest one inside it.
inline int64_t first_visible(const AttnArgs& a, int t) {
  return a.window > 0 ? std::max<int64_t>(0, a.positions[t] - a.window + 1) : 0;
}

inline int visible_keys(const AttnArgs& a, int t, int64_t* slots) {
  const int req = a.tok_req[t], local = a.tok_local[t];
  const int64_t* kv = a.kv_indices + a.kv_indptr[req];
  const int P = a.prefix_len[req], n = a.extend_len[req];
  const int64_t lo = first_visible(a, t);
  int L = 0;
  for (int j = (int)std::min<int64_t>(lo, P); j < P; ++j) slots[L++] = kv[j];
  if (a.masks) {
    const uint8_t* row = a.masks + a.mask_indptr[req] + (int64_t)local * n;
    for (int j = 0; j < n; ++j) if (row[j]) slots[L++] = kv[P + j];
  } else {
    for (int j = (int)std::max<int64_t>(0, lo - P); j <= local; ++j) slots[L++] = kv[P + j];
  }
  return L;
}

// How many keys visible_keys() lists for query row t, without listing them.
inline int visible_key_count(const AttnArgs& a, int t) {
  const int req = a.tok_req[t], local = a.tok_local[t];
  const int n = a.extend_len[req], P = a.prefix_len[req];
  const int64_t lo = first_visible(a, t);
  int L = P - (int)std::min<int64_t>(lo, P);
  if (a.masks) {
    const uint8_t* row = a.masks + a.mask_indptr[req] + (int64_t)local * n;
    for (int j = 0; j < n; ++j) L += row[j] != 0;
  } else {
    L += local + 1 - (int)std::max<int64_t>(0, lo - P);
  }
  return L;
}

// Per-thread scratch for attention, sized for one item: kAttnRows rows' key slot lists, and per
// query (row x head) its scores and output accumulator.
struct AttnScratch {
  int64_t* slots = nullptr;   // [kAttnRows][max_keys]
  float* scores = nullptr;    // [kAttnRows * heads per group][max_keys + 16]
  float* out = nullptr;       // [kAttnRows * heads per group][head_dim]
};

struct IsaKernels {
  const char* name;
  // tiles [t0, t1) of the packed matrix, t0 even (EPI_SILU_MUL: tile pairs)
  void (*gemm)(const GemmArgs&, int t0, int t1);
  // rows [r0, r1) of x[M][ldx] (K columns) into the ActQ buffers (writable aliases of `out`)
  void (*quantize)(const float* x, int64_t ldx, int r0, int r1, int K, int levels, int8_t* q,
                   float* scale, int32_t* sums, float* fsum);
  // y = rmsnorm(x) * w for rows [r0, r1)
  void (*rmsnorm)(const float* x, int64_t ldx, const float* w, float eps, int D, float* y,
                  int64_t ldy, int r0, int r1);
  // attention work items [i0, i1) of a.items
  void (*attention)(const AttnArgs&, int i0, int i1, AttnScratch&);
  // the first maximum of x[0, n) as numpy's argmax finds it (a NaN is the maximum, the first
  // one wins; -0 and +0 tie): its index (-1 when n == 0) and *best its value
  int64_t (*argmax)(const float* x, int64_t n, float* best);
  // For logprobs, over x[0, n) whose maximum is mx (finite, as argmax found it): returns the
  // sum of exp(x[i] - mx), and merges the k largest entries into the list vals / ids (*cnt of
  // them, see top_insert; ids are offsets into x). A row's result depends only on its values
  // and n (not on other rows); the sum's bits depend on the table (lane count).
  float (*logit_stats)(const float* x, int64_t n, float mx, int k, float* vals, int32_t* ids,
                       int* cnt);
  // quantize() at three levels for rows [r0, r1), K % QK == 0, writing the digits in ActQ::pairs'
  // layout (above) instead of q (scales and sums as quantize() writes them); set only by tables
  // whose gemm reads pairs (amx): the engine calls it instead of quantize when amx_pairs_apply
  void (*quantize_pairs)(const float* x, int64_t ldx, int r0, int r1, int K, int8_t* pairs,
                         float* scale, int32_t* sums, float* fsum) = nullptr;
};

// argmax (above) one element at a time: the generic table's, and the SIMD ones' way for a row
// holding a NaN
inline int64_t argmax_scalar(const float* x, int64_t n, float* best) {
  int64_t bi = -1;
  float b = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (v != v) {
      *best = v;
      return i;
    }
    if (bi < 0 || v > b) b = v, bi = i;
  }
  *best = b;
  return bi;
}

// (v, i) into vals / ids [*cnt <= k], kept in (value descending, index ascending) order, for
// candidates offered in increasing i: a value equal to the k-th does not displace it (its index
// is larger), so the list is the k first of the row sorted by (-value, index), as a stable
// descending sort would give. NaN is never offered (a NaN row's logprobs go the torch way).
inline void top_insert(float v, int32_t i, int k, float* vals, int32_t* ids, int* cnt) {
  int j = *cnt;
  if (j == k) {
    if (k == 0 || !(v > vals[k - 1])) return;
    --j;  // the last one drops out
  } else {
    ++*cnt;
  }
  for (; j > 0 && vals[j - 1] < v; --j) vals[j] = vals[j - 1], ids[j] = ids[j - 1];
  vals[j] = v;
  ids[j] = i;
}

// logit_stats (above) one element at a time: the generic table's
inline float logit_stats_scalar(const float* x, int64_t n, float mx, int k, float* vals,
                                int32_t* ids, int* cnt) {
  double s = 0.;
  for (int64_t i = 0; i < n; ++i) {
    s += std::exp(x[i] - mx);
    if (k && x[i] == x[i]) top_insert(x[i], (int32_t)i, k, vals, ids, cnt);
  }
  return (float)s;
}

// fp16 / bf16 -> float32, exact (scalar; the SIMD files convert with F16C / shifts)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      do { mant <<= 1; ++e; } while (!(mant & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> fp16, round to nearest even (IEEE; what F16C's vcvtps2ph does with RNE): overflow
// to infinity, subnormal halves, NaN kept quiet. Scalar, so every ISA writes the same KV bits.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN
    return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
  }
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds to >= 65520: infinity
  if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (ax < 0x33000000u) return sign;  // below half of the smallest subnormal (2^-25): zero
    const uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    const int shift = 126 - (int)e;  // 14..24: the half subnormal is m >> shift (2^-24 units)
    uint32_t v = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (v & 1))) ++v;
    return (uint16_t)(sign | v);
  }
  uint32_t v = ax - 0x38000000u;  // rebias the exponent (127 -> 15)
  const uint32_t rem = v & 0x1fff;
  v >>= 13;
  if (rem > 0x1000 || (rem == 0x1000 && (v & 1))) ++v;  // may carry into the exponent: fine
  return (uint16_t)(sign | v);
}

// The K / V cache pointer of an attention call, typed: float (fp32 KV) or uint16_t (fp16 KV).
template <class KV> inline const KV* kv_cache_k(const AttnArgs& a);
template <class KV> inline const KV* kv_cache_v(const AttnArgs& a);
template <> inline const float* kv_cache_k<float>(const AttnArgs& a) { return a.k_cache; }
template <> inline const float* kv_cache_v<float>(const AttnArgs& a) { return a.v_cache; }
template <> inline const uint16_t* kv_cache_k<uint16_t>(const AttnArgs& a) { return a.k_half; }
template <> inline const uint16_t* kv_cache_v<uint16_t>(const AttnArgs& a) { return a.v_half; }

// Prefetch the cache rows of keys [j0, j1) of a slot list, `D` elements each (one KV head),
// to L1 (LOCALITY 3) or L2 (2). A request's keys sit wherever its slots are: the decode steps of
// a busy batch interleave the requests' slots, so consecutive keys lie batch x row bytes apart,
// a stride no hardware prefetcher follows across pages, and a decode row's attention otherwise
// waits on each row in turn (AVX-512, 32 decode rows over 160 keys: attention -23 to -27%
// whether the slots are contiguous or interleaved, a whole step -6 to -12%: `python -m
// benchmark.profile_cpu_engine --context 160 --tokens 1 --batch 32 --layout interleaved`).
// always_inline: GCC 12 may find a function that only prefetches free of side effects (IPA
// pure-const) and delete the calls to it (it did to isa_avx2.cpp's TilePrefetch::block).
template <int LOCALITY, int D, class KV>
__attribute__((always_inline)) inline void prefetch_kv_rows(const KV* base, int64_t kv_stride,
                                                            const int64_t* slots, int j0, int j1) {
  constexpr int kLines = (int)((D * sizeof(KV) + 63) / 64);
  for (int j = j0; j < j1; ++j) {
    const char* p = reinterpret_cast<const char*>(base + slots[j] * kv_stride);
    for (int l = 0; l < kLines; ++l) __builtin_prefetch(p + 64 * l, 0, LOCALITY);
  }
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Sub-block s (0-7) of a K-quant tile-block, row j: its scale D = d sc and (Q4_K / Q5_K) min
// M = dmin mn, exact in float32; Q6_K has two scales per sub-block, D[0] for weights 0-15.
inline void kquant_scale(int fmt, const uint8_t* tb, int s, int j, float D[2], float* M) {
  const uint8_t* sc = kquant_scales(fmt, tb);
  const float d = half_to_float(load_u16(kquant_d(fmt, tb) + 2 * j));
  if (fmt == Q6_K) {
    D[0] = d * (float)(int8_t)sc[16 * (2 * s) + j];
    D[1] = d * (float)(int8_t)sc[16 * (2 * s + 1) + j];
    *M = 0.f;
    return;
  }
  D[0] = D[1] = d * (float)sc[16 * s + j];
  *M = half_to_float(load_u16(kquant_d(fmt, tb) + 32 + 2 * j)) * (float)sc[128 + 16 * s + j];
}

// Row j of a tile-block as floats (block_weights(fmt) of them): the embedding lookup, with the
// float steps of gguf's dequantize (d q, d (q - 8), d q + m, D q - M, D (q - 32)).
inline void dequantize_tile_row(int fmt, const uint8_t* tb, int j, float* out) {
  if (fmt == Q8_0) {
    const float d = half_to_float(load_u16(tb + 512 + 2 * j));
    for (int k = 0; k < QK; ++k) out[k] = d * (float)(int8_t)tb[64 * (k / 4) + 4 * j + k % 4];
    return;
  }
  if (!is_kquant(fmt)) {
    const uint8_t* sc = tb + sub_block_bytes(fmt);
    const float d = half_to_float(load_u16(sc + 2 * j));
    const float m = fmt == Q4_1 || fmt == Q5_1 ? half_to_float(load_u16(sc + 32 + 2 * j)) : 0.f;
    for (int k = 0; k < QK; ++k) {
      const int q = sub_block_weight(fmt, tb, j, k);
      if (fmt == Q4_0) out[k] = d * (float)(q - 8);
      else if (fmt == Q5_0) out[k] = d * (float)(q - 16);
      else out[k] = d * (float)q + m;
    }
    return;
  }
  for (int s = 0; s < 8; ++s) {
    const uint8_t* sb = tb + s * sub_block_bytes(fmt);
    float D[2], M;
    kquant_scale(fmt, tb, s, j, D, &M);
    for (int k = 0; k < QK; ++k) {
      const int q = sub_block_weight(fmt, sb, j, k);
      out[QK * s + k] = fmt == Q6_K ? D[k / 16] * (float)(q - 32) : D[0] * (float)q - M;
    }
  }
}

const IsaKernels* avx512_kernels();  // null when not compiled in
const IsaKernels* amx_kernels();     // AVX-512 + AMX-INT8 block-format matmul
const IsaKernels* avx2_kernels();
const IsaKernels* generic_kernels();

}  // namespace specserve
