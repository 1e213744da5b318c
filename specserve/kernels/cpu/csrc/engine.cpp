// The CPU engine: a Llama-family decoder stack run in one call per forward on a persistent
// thread pool, with the per-ISA kernels of kernels.h. Built with the baseline flags; picks the
// widest kernel table the CPU supports at run time (SPECSERVE_CPU_ISA can force a narrower one).
//
// One forward = embed -> per layer [rmsnorm -> qkv -> rope + KV write -> attention -> o (+= x)
// -> rmsnorm -> gate_up (silu * up) -> down (+= x)] -> final norm -> LM head rows. Every step
// splits its work over output columns, heads or rows, never over a reduction, so each output
// row is the same float computation whatever the batch: a verify row equals a decode row bit
// for bit (tests/unit/test_cpu_engine.py).
#include <torch/extension.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "shm_comm.h"

namespace specserve {
namespace {

bool cpu_has(const char* f) {
  __builtin_cpu_init();
  if (!std::strcmp(f, "avx512")) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
  }
  if (!std::strcmp(f, "amx")) {
    // AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), and the kernel's permission to use the
    // tile data state (Linux >= 5.16 asks each process to request it; it fails where the OS
    // does not enable AMX). Asked once.
    static const bool ok = [] {
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
      if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
      constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
      return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok && cpu_has("avx512");
  }
  if (!std::strcmp(f, "avx2")) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return true;
}

// The widest supported table, or the one SPECSERVE_CPU_ISA names (if the CPU supports it).
const IsaKernels* pick_isa(const std::string& want) {
  const char* env = std::getenv("SPECSERVE_CPU_ISA");
  std::string w = !want.empty() ? want : (env ? env : "auto");
  if ((w == "auto" || w == "amx") && cpu_has("amx")) return amx_kernels();
  if ((w == "auto" || w == "amx" || w == "avx512") && cpu_has("avx512")) return avx512_kernels();
  if ((w == "auto" || w == "amx" || w == "avx512" || w == "avx2") && cpu_has("avx2")) {
    return avx2_kernels();
  }
  if (w != "auto" && w != "amx" && w != "avx512" && w != "avx2" && w != "generic") {
    throw std::invalid_argument(
        "SPECSERVE_CPU_ISA must be auto, amx, avx512, avx2 or generic, got " + w);
  }
  return generic_kernels();
}

// One row of K or V into an fp16 cache. F16C's round-to-nearest-even conversion gives exactly
// float_to_half's bits (IEEE; tests/unit/test_cpu_kernels.py checks the scalar one against
// torch), so which one runs does not change the cache.
void half_row_scalar(const float* src, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
}

__attribute__((target("avx,f16c"))) void half_row_f16c(const float* src, uint16_t* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128((__m128i*)(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

using HalfRowFn = void (*)(const float*, uint16_t*, int);

HalfRowFn half_row() {
  static const HalfRowFn fn = cpu_has("avx2") ? half_row_f16c : half_row_scalar;
  return fn;
}

ThreadPool& pool(int nthreads) {
  static std::unique_ptr<ThreadPool> p;
  if (!p || p->size() != nthreads) p = std::make_unique<ThreadPool>(nthreads);
  return *p;
}

template <class F>
void parallel(int nthreads, F& f) {
  pool(nthreads).run([](void* ctx, int tid, int n) { (*static_cast<F*>(ctx))(tid, n); }, &f);
}

// Attention work items (kernels.h): blocks of rows of one request x the heads of one KV group (at
// most 8), so the group's keys are read once per block. A request's run of rows is cut into
// blocks of even size (at most kAttnRows). The threads split items by count, so where that gives
// fewer than 2 items per thread, or fewer than 4 of unequal sizes, the rows go one per item
// instead: a 4-row verify pass in 3 items (one per KV group) left one thread two thirds of the
// work (`python -m benchmark.profile_cpu_engine --tokens 2,3,4,5`: attention 12-18% faster).
// A single decode row goes one item per (row, head), which spreads it over the threads. Which
// item a query lands in never changes its result.
std::vector<int32_t> attention_items(int T, const int32_t* tok_req, int H, int KVH, int nthreads) {
  std::vector<int32_t> items;
  const int group = H / KVH, hchunk = std::min(group, 8);
  if (T * KVH < 2 * nthreads) {
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) items.insert(items.end(), {t, t + 1, h, h + 1});
    return items;
  }
  const int per_row = KVH * ((group + hchunk - 1) / hchunk);  // items per block of rows
  for (int single = 0; single < 2; ++single) {
    items.clear();
    bool even = true;  // every block of the same size
    for (int t = 0; t < T;) {
      int e = t;
      while (e < T && tok_req[e] == tok_req[t]) ++e;  // this request's run of rows
      const int run = e - t, blocks = single ? run : (run + kAttnRows - 1) / kAttnRows;
      for (int k = 0; k < blocks; ++k) {
        const int r0 = t + (int)((int64_t)run * k / blocks);
        const int r1 = t + (int)((int64_t)run * (k + 1) / blocks);
        even = even && r1 - r0 == (items.empty() ? r1 - r0 : items[1] - items[0]);
        for (int g = 0; g < KVH; ++g)
          for (int h = g * group; h < (g + 1) * group; h += hchunk)
            items.insert(items.end(), {r0, r1, h, std::min(h + hchunk, (g + 1) * group)});
      }
      t = e;
    }
    const int n = (int)items.size() / 4;
    if ((n >= 2 * nthreads && (even || n >= 4 * nthreads)) || n >= T * per_row) break;
  }
  return items;
}

// Where each thread's run of attention items begins and ends (bounds[tid], bounds[tid + 1]):
// contiguous runs of about equal work, not of equal count. A query's work grows with the keys it
// sees, so in a causal prefill the last rows cost several times the first (280 rows split by
// count left the thread holding the later half ~3/4 of the work), and a batch that mixes a
// prompt chunk with decode rows, or decode rows of short and long requests, is as uneven. An
// item costs its heads x the sum over its rows of (visible keys + a fixed per-query part), plus
// kItemKeyCost per key of its longest row: reading a key's K and V rows from memory, paid once
// per item whatever its rows and heads (fitted to `profile_cpu_engine` on an AVX-512 machine:
// a query-key pair of a 4-row prefill item cost ~3.8 ns, of a 1-row decode item ~8.9 ns, three
// heads each). The split only moves whole items between threads: no query's result changes.
std::vector<int> attention_bounds(const std::vector<int32_t>& items, const AttnArgs& a,
                                  int nthreads) {
  constexpr int64_t kQueryCost = 16;  // softmax and output work of one query, in keys
  constexpr int64_t kItemKeyCost = 8;
  nthreads = std::max(nthreads, 1);
  const int n_items = (int)items.size() / 4;
  std::vector<int64_t> cum(n_items + 1, 0);
  for (int i = 0; i < n_items; ++i) {
    const int32_t* it = items.data() + 4 * i;
    int64_t keys = 0, longest = 0;
    for (int t = it[0]; t < it[1]; ++t) {
      const int64_t seen = visible_key_count(a, t);
      keys += seen + kQueryCost;
      longest = std::max(longest, seen);
    }
    cum[i + 1] = cum[i] + keys * (it[3] - it[2]) + kItemKeyCost * longest;
  }
  std::vector<int> bounds(nthreads + 1, n_items);
  bounds[0] = 0;
  int i = 0;
  for (int k = 1; k < nthreads; ++k) {
    const int64_t target = cum[n_items] * k / nthreads;
    while (i < n_items && cum[i + 1] <= target) ++i;
    // item i straddles the target: it goes to whichever side leaves the nearer cut
    if (i < n_items && cum[i + 1] - target < target - cum[i]) ++i;
    bounds[k] = std::max(i, bounds[k - 1]);
  }
  return bounds;
}

// Per-thread attention scratch for items of up to kAttnRows rows x 8 heads.
struct AttnBuffers {
  std::vector<int64_t> slots;
  std::vector<float> scores, out;
  AttnScratch reserve(int64_t max_keys, int head_dim) {
    const int64_t q = (int64_t)kAttnRows * 8;
    if ((int64_t)slots.size() < kAttnRows * max_keys) slots.resize(kAttnRows * max_keys);
    if ((int64_t)scores.size() < q * (max_keys + 16)) scores.resize(q * (max_keys + 16));
    if ((int64_t)out.size() < q * head_dim) out.resize(q * head_dim);
    return AttnScratch{slots.data(), scores.data(), out.data()};
  }
};

}  // namespace

// ---- packed weights -----------------------------------------------------------------------

struct PackedLinear {
  int fmt = F32;
  int K = 0;
  int N = 0;      // output columns (EPI_SILU_MUL users: 2 x intermediate packed rows)
  int tiles = 0;  // packed row tiles of 16
  torch::Tensor data;  // uint8 tiles (kernels.h layouts)
  torch::Tensor bias;  // float32 [tiles * 16] in packed row order, or undefined

  PackedLinear() = default;
  PackedLinear(int fmt_, int K_, int N_, torch::Tensor data_, c10::optional<torch::Tensor> bias_)
      : fmt(fmt_), K(K_), N(N_), data(std::move(data_)) {
    TORCH_CHECK(fmt >= F32 && fmt <= Q6_K, "unknown weight format ", fmt);
    TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.device().is_cpu(),
                "packed weights must be a contiguous CPU uint8 tensor");
    TORCH_CHECK(!is_block_format(fmt) || K % block_weights(fmt) == 0, "this block format needs K"
                " % ", block_weights(fmt), " == 0, got ", K);
    tiles = (N + NR - 1) / NR;
    const int64_t per_tile = is_block_format(fmt)
                                 ? (int64_t)(K / block_weights(fmt)) * tile_block_bytes(fmt)
                                 : (int64_t)K * NR * float_elem_bytes(fmt);
    TORCH_CHECK(data.numel() == per_tile * tiles, "packed size ", data.numel(), " != ",
                per_tile * tiles, " for N=", N, " K=", K, " fmt=", fmt);
    if (bias_.has_value() && bias_->defined()) {
      bias = bias_->contiguous().to(torch::kFloat32);
      TORCH_CHECK(bias.numel() == (int64_t)tiles * NR, "bias must be padded to the tiles");
    }
  }
  const uint8_t* ptr() const { return data.data_ptr<uint8_t>(); }
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }

  // Row r of the (dequantized) weight matrix into out[K]: the embedding lookup of a tied or
  // packed embedding. Same float steps as gguf's dequantize (dequantize_tile_row).
  void row(int64_t r, float* out) const {
    const int tile = (int)(r / NR), j = (int)(r % NR);
    if (is_block_format(fmt)) {
      const int bw = block_weights(fmt), nb = K / bw, tbb = tile_block_bytes(fmt);
      for (int b = 0; b < nb; ++b) {
        dequantize_tile_row(fmt, ptr() + block_offset(tile, b, nb, tiles, tbb), j, out + b * bw);
      }
      return;
    }
    const int eb = float_elem_bytes(fmt);
    const uint8_t* tw = ptr() + (int64_t)tile * K * NR * eb;
    for (int k = 0; k < K; ++k) {
      const uint8_t* p = tw + ((int64_t)k * NR + j) * eb;
      if (fmt == F32) std::memcpy(out + k, p, 4);
      else if (fmt == BF16) out[k] = bf16_to_float(load_u16(p));
      else out[k] = half_to_float(load_u16(p));
    }
  }
};

// Activation buffers of block-format matmuls, grown on demand (never shrunk).
struct ActBuffers {
  std::vector<int8_t> q, pairs;
  std::vector<float> scale, fsum;
  std::vector<int32_t> sums, hsums;
  void reserve(int64_t rows, int K, int levels) {
    const int64_t nb = K / QK;
    if ((int64_t)q.size() < rows * levels * K) q.resize(rows * levels * K);
    if (levels == 3 && (int64_t)pairs.size() < rows * 4 * K) pairs.resize(rows * 4 * K);
    if ((int64_t)scale.size() < rows * nb) scale.resize(rows * nb), fsum.resize(rows * nb);
    if ((int64_t)sums.size() < rows * levels * nb) {
      sums.resize(rows * levels * nb);
      hsums.resize(rows * levels * nb);
    }
  }
  ActQ view(int K, int levels) const {
    ActQ a;
    a.levels = levels;
    a.K = K;
    a.q = q.data();
    a.scale = scale.data();
    a.sums = sums.data();
    a.fsum = fsum.data();
    a.pairs = pairs.empty() ? nullptr : pairs.data();
    return a;
  }
};

// ActQ::hsums of rows [r0, r1) from the digits quantize() wrote: Q6_K's scales and offsets go
// by 16 weights, so its kernels subtract 32 x the digit sum of each half of a block.
inline void half_digit_sums(const int8_t* q, int K, int levels, int r0, int r1, int32_t* hs) {
  const int nb = K / QK;
  for (int64_t row = (int64_t)r0 * levels; row < (int64_t)r1 * levels; ++row) {
    for (int b = 0; b < nb; ++b) {
      const int8_t* d = q + row * K + b * QK;
      int32_t s = 0;
      for (int i = 0; i < QK / 2; ++i) s += d[i];
      hs[row * nb + b] = s;
    }
  }
}

// One matmul step inside a parallel region: quantize rows [own rows] (block formats), barrier,
// Thread tid's tiles [t0, t1) of `tiles`, split in whole pairs: a thread's tiles start even, so
// it reads each pair as one stream.
inline void pair_split(int tiles, int tid, int n, int* t0, int* t1) {
  split_range((tiles + 1) / 2, tid, n, t0, t1);
  *t0 *= 2;
  *t1 = std::min(2 * *t1, tiles);
}

// multiply this thread's tiles. Callers put a barrier after it before reading y.
struct MatmulStep {
  const IsaKernels* isa;
  ThreadPool* pool;
  ActBuffers* act;
  int levels;

  void operator()(const PackedLinear& w, int M, const float* x, int64_t ldx, float* y,
                  int64_t ldy, int epilogue, int tid, int n) const {
    GemmArgs a;
    a.fmt = w.fmt;
    a.K = w.K;
    a.N = gated_epilogue(epilogue) ? w.N / 2 : w.N;
    a.M = M;
    a.tiles = w.tiles;
    a.w = w.ptr();
    a.bias = w.bias_ptr();
    a.x = x;
    a.ldx = ldx;
    a.y = y;
    a.ldy = ldy;
    a.epilogue = epilogue;
    if (is_block_format(w.fmt)) {
      int r0, r1;
      split_range(M, tid, n, &r0, &r1);
      a.act = act->view(w.K, levels);
      if (isa->quantize_pairs && amx_pairs_apply(w.fmt, levels, M) && w.K % QK == 0) {
        isa->quantize_pairs(x, ldx, r0, r1, w.K, act->pairs.data(), act->scale.data(),
                            act->sums.data(), act->fsum.data());
      } else {
        isa->quantize(x, ldx, r0, r1, w.K, levels, act->q.data(), act->scale.data(),
                      act->sums.data(), act->fsum.data());
        a.act.pairs = nullptr;
      }
      if (w.fmt == Q6_K) {
        half_digit_sums(act->q.data(), w.K, levels, r0, r1, act->hsums.data());
        a.act.hsums = act->hsums.data();
      }
      pool->barrier(tid);
    }
    int t0, t1;
    if (gated_epilogue(epilogue)) {
      split_range(w.tiles / 2, tid, n, &t0, &t1);
    } else {
      pair_split(w.tiles, tid, n, &t0, &t1);
    }
    if (t1 > t0) isa->gemm(a, t0, t1);
  }
};

// Row argmax of y[R][ldy] (N columns), split as MatmulStep splits a matrix of `tiles` tiles:
// each thread finds the first maximum of its own columns of every row (just stored by its
// share of the LM head, so still in its cache; read cold by the caller afterwards it cost
// ~0.2 ms for a 4-row verify pass), then, after a barrier, `argmax_merge` picks per row the
// first NaN or else the first largest in column order: numpy's argmax of the whole row.
inline void argmax_part(const IsaKernels* isa, const float* y, int R, int64_t ldy, int N,
                        int tiles, int tid, int n, float* pbest, int64_t* pidx) {
  int t0, t1;
  pair_split(tiles, tid, n, &t0, &t1);
  const int c0 = std::min(t0 * NR, N), c1 = std::min(t1 * NR, N);
  for (int r = 0; r < R; ++r) {
    float b = 0.f;
    const int64_t i = c1 > c0 ? isa->argmax(y + (int64_t)r * ldy + c0, c1 - c0, &b) : -1;
    pbest[(int64_t)tid * R + r] = b;
    pidx[(int64_t)tid * R + r] = i < 0 ? -1 : c0 + i;
  }
}

inline void argmax_merge(int R, int n, const float* pbest, const int64_t* pidx, int r0, int r1,
                         int64_t* out) {
  for (int r = r0; r < r1; ++r) {
    int64_t bi = -1;
    float b = 0.f;
    for (int t = 0; t < n; ++t) {  // threads in column order
      const int64_t i = pidx[(int64_t)t * R + r];
      if (i < 0) continue;
      const float v = pbest[(int64_t)t * R + r];
      if (bi < 0 || v != v || v > b) {
        b = v;
        bi = i;
        if (v != v) break;  // the first NaN
      }
    }
    out[r] = bi;
  }
}

// Logprob statistics of logits rows, split and merged as the argmax is: each thread, over its
// own columns of every row (still in its cache), the sum of exp(x - its maximum) and its top k
// (IsaKernels::logit_stats); after the barrier, per row, lse = M + log(sum_t s_t exp(m_t - M))
// over the threads in column order, and the threads' lists merged by (-value, index). A row's
// numbers depend on its values, the thread count and the kernel table, never on the other
// rows, so a verify row and a decode step's row agree bit for bit. A row holding a NaN, +inf
// or only -inf gets lse = NaN (the caller computes such rows another way).
struct RowStats {
  int R = 0, n = 0, k = 0;
  std::vector<float> psum, pvals;
  std::vector<int32_t> pids, pcnt;
  torch::Tensor lse, vals, ids;  // [R], [R, k], [R, k] (int64; -inf / -1 past a short row)

  RowStats(int R_, int n_, int k_) : R(R_), n(n_), k(k_) {
    psum.resize((size_t)n * std::max(R, 1));
    pcnt.resize((size_t)n * std::max(R, 1));
    pvals.resize((size_t)n * std::max(R, 1) * std::max(k, 1));
    pids.resize((size_t)n * std::max(R, 1) * std::max(k, 1));
    lse = torch::empty({R}, torch::kFloat32);
    vals = torch::empty({R, k}, torch::kFloat32);
    ids = torch::empty({R, k}, torch::kInt64);
  }

  void part(const IsaKernels* isa, const float* y, int64_t ldy, int N, int tiles, int tid,
            const float* pbest, const int64_t* pidx) {
    int t0, t1;
    pair_split(tiles, tid, n, &t0, &t1);
    const int c0 = std::min(t0 * NR, N), c1 = std::min(t1 * NR, N);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (int64_t)tid * R + r;
      const float m = pbest[at];
      int* cnt = &pcnt[at];
      *cnt = 0;
      psum[at] = 0.f;
      if (pidx[at] < 0 || m != m || m == INFINITY) continue;  // NaN / +inf: the row is bad
      float* v = &pvals[at * k];
      int32_t* ix = &pids[at * k];
      // columns all -inf: their exps are 0 (exp(-inf - 0)), their ids still candidates
      psum[at] = isa->logit_stats(y + (int64_t)r * ldy + c0, c1 - c0, m == -INFINITY ? 0.f : m,
                                  k, v, ix, cnt);
      for (int j = 0; j < *cnt; ++j) ix[j] += c0;
    }
  }

  void merge(const float* pbest, const int64_t* pidx, int r0, int r1) {
    float* lp = lse.data_ptr<float>();
    float* vp = vals.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    std::vector<std::pair<float, int32_t>> cand;
    for (int r = r0; r < r1; ++r) {
      float M = -INFINITY;
      bool bad = false, any = false;
      for (int t = 0; t < n; ++t) {
        const int64_t at = (int64_t)t * R + r;
        if (pidx[at] < 0) continue;
        any = true;
        if (pbest[at] != pbest[at] || pbest[at] == INFINITY) bad = true;
        else M = std::max(M, pbest[at]);
      }
      cand.clear();
      float S = 0.f;
      for (int t = 0; t < n && !bad; ++t) {  // threads in column order
        const int64_t at = (int64_t)t * R + r;
        if (pidx[at] < 0) continue;
        if (pbest[at] > -INFINITY) S += psum[at] * std::exp(pbest[at] - M);
        for (int j = 0; j < pcnt[at]; ++j) cand.emplace_back(pvals[at * k + j], pids[at * k + j]);
      }
      lp[r] = bad || !any || M == -INFINITY ? NAN : M + std::log(S);
      std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      for (int j = 0; j < k; ++j) {
        const bool have = j < (int)cand.size();
        vp[(int64_t)r * k + j] = have ? cand[j].first : -INFINITY;
        ip[(int64_t)r * k + j] = have ? cand[j].second : -1;
      }
    }
  }
};

// ---- the model ----------------------------------------------------------------------------

struct Layer {
  // q/k/v: one fused matrix, or parts concatenated along N whose formats differ (a Q4_K_M
  // file's Q4_K q/k beside a Q6_K v), each multiplied in its own format
  std::vector<PackedLinear> qkv;
  PackedLinear o, gate_up, down;
  torch::Tensor in_norm, post_norm, q_norm, k_norm;  // q/k norms: Qwen3, Gemma 3
  // Gemma 3: the attention and MLP outputs are normed before their residual adds, and
  // sliding-window layers (window > 0) see only their last `window` positions, with local RoPE
  torch::Tensor attn_out_norm, mlp_out_norm;
  int window = 0;
};

class CpuModel {
 public:
  CpuModel(int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate,
           int vocab, double eps, int levels, int nthreads, const std::string& isa)
      : H_(hidden), Hq_(num_heads), KVH_(num_kv_heads), D_(head_dim), I_(intermediate),
        V_(vocab), eps_((float)eps), levels_(levels), nthreads_(nthreads), isa_(pick_isa(isa)) {
    TORCH_CHECK(levels >= 1 && levels <= 3, "activation digits must be 1, 2 or 3");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even (rotary)");
  }

  std::string isa_name() const { return isa_->name; }
  int attn_in_width() const { return eagle3_ ? 2 * H_ : H_; }

  // Per-phase wall time of thread 0 (each phase ends at a barrier, so waits count where they
  // occur); off by default, for profiling (benchmark/profile_cpu_engine.py).
  void set_profile(bool on) {
    profile_ = on;
    prof_.assign(kPhases, 0.0);
    prof_calls_ = 0;
  }
  std::map<std::string, double> profile() const {
    static const char* names[kPhases] = {"embed", "attn_norm", "qkv", "rope_kv", "attention",
                                         "o_proj", "mlp_norm", "gate_up", "down", "final_norm",
                                         "lm_head"};
    std::map<std::string, double> out;
    for (int i = 0; i < kPhases; ++i) out[names[i]] = prof_calls_ ? prof_[i] / prof_calls_ : 0;
    return out;
  }
  int num_threads() const { return nthreads_; }
  void set_num_threads(int n) { nthreads_ = n < 1 ? 1 : n; }

  void add_layer(std::vector<PackedLinear> qkv, PackedLinear o, PackedLinear gate_up,
                 PackedLinear down, torch::Tensor in_norm, torch::Tensor post_norm,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm) {
    int qkv_n = 0;
    for (const PackedLinear& p : qkv) {
      TORCH_CHECK(p.K == attn_in_width() && (qkv.size() == 1 || p.N % NR == 0), "qkv part shape");
      qkv_n += p.N;
    }
    TORCH_CHECK(!qkv.empty() && qkv_n == (Hq_ + 2 * KVH_) * D_, "qkv shape");
    TORCH_CHECK(o.K == Hq_ * D_ && o.N == H_, "o_proj shape");
    TORCH_CHECK(gate_up.K == H_ && gate_up.N == 2 * I_ && gate_up.tiles % 2 == 0 &&
                I_ % NR == 0, "gate_up shape (interleaved gate/up tiles)");
    TORCH_CHECK(down.K == I_ && down.N == H_, "down_proj shape");
    Layer l{std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
            f32(in_norm), f32(post_norm), {}, {}};
    if (q_norm.has_value()) l.q_norm = f32(*q_norm);
    if (k_norm.has_value()) l.k_norm = f32(*k_norm);
    layers_.push_back(std::move(l));
  }
  // Gemma 3's block (Layer's fields above) for layer `li`, once it is added.
  void set_layer_gemma(int64_t li, torch::Tensor attn_out_norm, torch::Tensor mlp_out_norm,
                       int64_t window) {
    TORCH_CHECK(li >= 0 && li < (int64_t)layers_.size(), "no layer ", li);
    TORCH_CHECK(window >= 0, "window must be >= 0");
    layers_[li].attn_out_norm = f32(attn_out_norm);
    layers_[li].mlp_out_norm = f32(mlp_out_norm);
    layers_[li].window = (int)window;
  }
  // Model-wide differences from Llama: embeddings times embed_scale, attention scores times
  // attn_scale (else 1 / sqrt(head_dim)), a GELU-tanh MLP instead of SiLU; the RoPE tables of
  // sliding-window layers (set_rope's serve the others).
  void configure(double embed_scale, double attn_scale, bool gelu) {
    embed_scale_ = (float)embed_scale;
    attn_scale_ = (float)attn_scale;
    gelu_ = gelu;
  }
  void set_rope_local(torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(cos.size(1) == D_ / 2 && sin.sizes() == cos.sizes(), "rope tables [pos, D/2]");
    cos_local_ = f32(cos);
    sin_local_ = f32(sin);
  }
  void set_head(PackedLinear embed, PackedLinear lm_head, torch::Tensor final_norm) {
    TORCH_CHECK(embed.K == H_ && (eagle3_ || embed.N == V_) && lm_head.K == H_ &&
                lm_head.N == V_, "vocab");
    embed_ = std::move(embed);
    lm_head_ = std::move(lm_head);
    final_norm_ = f32(final_norm);
  }
  // An EAGLE-3 draft head (before add_layer): its one layer's q/k/v read
  // [rmsnorm(embed(token), in_norm) | rmsnorm(h, hidden_norm)] (2H wide) while the residual
  // stream is h; the embedding is the target's (set_head's, over the target's vocabulary),
  // the LM head the draft vocabulary's (V). h is hidden_in itself, or fc(hidden_in) when
  // hidden_in is the target's fused features (set_fc).
  void set_eagle3(torch::Tensor hidden_norm) {
    TORCH_CHECK(layers_.empty(), "set_eagle3 before add_layer");
    TORCH_CHECK(hidden_norm.numel() == H_, "hidden_norm must have hidden_size weights");
    eagle3_ = true;
    hidden_norm_ = f32(hidden_norm);
  }
  void set_fc(PackedLinear fc) {
    TORCH_CHECK(fc.N == H_ && fc.K > H_, "fc maps [T, K > hidden] to [T, hidden]");
    fc_ = std::move(fc);
  }
  void set_rope(torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(cos.size(1) == D_ / 2 && sin.sizes() == cos.sizes(), "rope tables [pos, D/2]");
    cos_ = f32(cos);
    sin_ = f32(sin);
  }
  // One fp32 or one fp16 tensor per layer, all of the same dtype (fp16: the cache holds the
  // half-rounded K / V, written by float_to_half and widened exactly by every read).
  void set_kv(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one KV per layer");
    TORCH_CHECK(!k.empty(), "no KV tensors");
    const auto dt = k[0].dtype();
    TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kFloat16, "KV must be float32 or float16");
    for (auto* list : {&k, &v}) {
      for (auto& t : *list) TORCH_CHECK(t.dtype() == dt && t.is_contiguous(), "KV dtype mixed");
    }
    kv_half_ = dt == torch::kFloat16;
    k_ = std::move(k);
    v_ = std::move(v);
  }

  // Tensor parallelism: this model holds one rank's shard (its KV heads with their query
  // heads, a slice of the MLP's columns, vocabulary rows [vocab_start, vocab_start + V)).
  // `reduce` sums a [rows, H] partial over the ranks in place, in a fixed rank order (the
  // caller's collective), after the embedding and each row-parallel o / down projection.
  void set_tensor_parallel(int64_t vocab_start, int64_t vocab_full, py::function reduce) {
    TORCH_CHECK(vocab_start >= 0 && vocab_start + V_ <= vocab_full, "vocab shard");
    vocab_start_ = vocab_start;
    vocab_full_ = vocab_full;
    reduce_ = [reduce](float* p, int64_t rows, int64_t cols) {
      py::gil_scoped_acquire gil;
      reduce(torch::from_blob(p, {rows, cols}, torch::kFloat32));
    };
  }
  // The same with the ranks' sum through this host's shared segment (shm_comm.h), no Python.
  void set_tensor_parallel_shm(int64_t vocab_start, int64_t vocab_full,
                               std::shared_ptr<ShmComm> comm) {
    TORCH_CHECK(vocab_start >= 0 && vocab_start + V_ <= vocab_full, "vocab shard");
    vocab_start_ = vocab_start;
    vocab_full_ = vocab_full;
    reduce_ = [comm](float* p, int64_t rows, int64_t cols) { comm->allreduce(p, rows * cols); };
  }
  bool tensor_parallel() const { return (bool)reduce_; }

  // Returns [logits [R, V], final_hidden [T, H] or empty, captured hidden [T, H] per layer].
  std::vector<torch::Tensor> forward(torch::Tensor input_ids, torch::Tensor positions,
                                     torch::Tensor out_loc, torch::Tensor tok_req,
                                     torch::Tensor tok_local, torch::Tensor kv_indptr,
                                     torch::Tensor kv_indices, torch::Tensor prefix_len,
                                     torch::Tensor extend_len, torch::Tensor masks,
                                     torch::Tensor mask_indptr, torch::Tensor logits_rows,
                                     std::vector<int64_t> capture, bool final_hidden,
                                     int64_t layer_begin, int64_t layer_end,
                                     c10::optional<torch::Tensor> hidden_in,
                                     int64_t logit_top);

  torch::Tensor linear(const PackedLinear& w, torch::Tensor x) {
    x = f32(x);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, K]");
    const int M = (int)x.size(0);
    auto y = torch::empty({M, w.N}, torch::kFloat32);
    act_.reserve(M, w.K, levels_);
    MatmulStep mm{isa_, &pool(nthreads_), &act_, levels_};
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    auto body = [&](int tid, int n) { mm(w, M, xp, w.K, yp, w.N, EPI_STORE, tid, n); };
    if (M > 0) parallel(nthreads_, body);
    return y;
  }
  torch::Tensor lm_head(torch::Tensor x) { return linear(lm_head_, x); }
  torch::Tensor embed(torch::Tensor ids) {
    ids = ids.contiguous().to(torch::kInt64);
    auto out = torch::empty({ids.numel(), H_}, torch::kFloat32);
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < ids.numel(); ++t) {
      TORCH_CHECK(ip[t] >= 0 && ip[t] < V_, "token id out of range: ", ip[t]);
      float* row = out.data_ptr<float>() + t * H_;
      embed_.row(ip[t], row);
      if (embed_scale_ != 1.f) for (int i = 0; i < H_; ++i) row[i] *= embed_scale_;
    }
    return out;
  }
  torch::Tensor final_norm(torch::Tensor x) {
    x = f32(x);
    auto y = torch::empty_like(x);
    isa_->rmsnorm(x.data_ptr<float>(), H_, final_norm_.data_ptr<float>(), eps_, H_,
                  y.data_ptr<float>(), H_, 0, (int)x.size(0));
    return y;
  }

 private:
  static torch::Tensor f32(torch::Tensor t) { return t.contiguous().to(torch::kFloat32); }

  int H_, Hq_, KVH_, D_, I_, V_;
  float eps_;
  int levels_, nthreads_;
  const IsaKernels* isa_;
  std::vector<Layer> layers_;
  PackedLinear embed_, lm_head_;
  torch::Tensor final_norm_, cos_, sin_, cos_local_, sin_local_;
  float embed_scale_ = 1.f, attn_scale_ = 0.f;  // attn_scale_ 0: 1 / sqrt(head_dim)
  bool gelu_ = false;
  bool eagle3_ = false;  // set_eagle3
  torch::Tensor hidden_norm_;
  PackedLinear fc_;  // fc_.K == 0: none
  std::vector<torch::Tensor> k_, v_;
  bool kv_half_ = false;
  int64_t vocab_start_ = 0, vocab_full_ = 0;  // set_tensor_parallel
  std::function<void(float*, int64_t, int64_t)> reduce_;
  // scratch, grown on demand
  std::vector<float> x_, xn_, qkv_, attn_, h_, fin_, e_;
  ActBuffers act_;
  std::vector<AttnBuffers> attn_bufs_;
  static constexpr int kPhases = 11;
  bool profile_ = false;
  std::vector<double> prof_ = std::vector<double>(kPhases, 0.0);
  int64_t prof_calls_ = 0;
};

namespace {

void rope_inplace(float* x, const float* cos, const float* sin, int D) {
  // rotate-half pairs (i, i + D/2), as specserve/runtime/layers/rotary.py
  const int h = D / 2;
  for (int i = 0; i < h; ++i) {
    const float x1 = x[i], x2 = x[i + h];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + h] = x2 * cos[i] + x1 * sin[i];
  }
}

template <class T>
const T* ptr_of(const torch::Tensor& t) { return t.numel() ? t.data_ptr<T>() : nullptr; }

}  // namespace

std::vector<torch::Tensor> CpuModel::forward(
    torch::Tensor input_ids, torch::Tensor positions, torch::Tensor out_loc, torch::Tensor tok_req,
    torch::Tensor tok_local, torch::Tensor kv_indptr, torch::Tensor kv_indices,
    torch::Tensor prefix_len, torch::Tensor extend_len, torch::Tensor masks,
    torch::Tensor mask_indptr, torch::Tensor logits_rows, std::vector<int64_t> capture,
    bool final_hidden, int64_t layer_begin, int64_t layer_end,
    c10::optional<torch::Tensor> hidden_in, int64_t logit_top) {
  TORCH_CHECK(!layers_.empty() && k_.size() == layers_.size() && cos_.defined(),
              "model not fully set up (layers, head, rope, KV)");
  // layers [begin, end): begin > 0 starts from hidden_in (the hidden state entering layer
  // begin, e.g. an early-exit draft's), end < num_layers exits early into the final norm
  if (layer_end < 0) layer_end = (int64_t)layers_.size();
  TORCH_CHECK(0 <= layer_begin && layer_begin <= layer_end &&
              layer_end <= (int64_t)layers_.size(), "forward: bad layer range");
  TORCH_CHECK(layer_begin == 0 || hidden_in.has_value(), "forward: layer_begin > 0 needs "
              "hidden_in");
  torch::Tensor hin;
  if (hidden_in.has_value()) {
    hin = hidden_in->contiguous().to(torch::kFloat32);
    TORCH_CHECK(hin.dim() == 2 && hin.size(0) == input_ids.numel() &&
                (hin.size(1) == H_ || (fc_.K > 0 && hin.size(1) == fc_.K)),
                "forward: hidden_in must be [T, hidden] (or [T, fc in] with an fc)");
  }
  const bool fused_in = hin.defined() && hin.size(1) != H_;  // h = fc(hidden_in)
  const int T = (int)input_ids.numel();
  const int R = (int)logits_rows.numel();
  const int B = (int)prefix_len.numel();
  const int nl = (int)layers_.size();
  const int Nqkv = (Hq_ + 2 * KVH_) * D_, Nq = Hq_ * D_;
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* loc = out_loc.data_ptr<int64_t>();
  const int64_t* rows = ptr_of<int64_t>(logits_rows);
  const int64_t max_pos = cos_.size(0);
  const bool sharded = (bool)reduce_;
  const int64_t vocab = sharded ? vocab_full_ : embed_.N;
  for (int t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id out of range: ", ids[t]);
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range: ", pos[t]);
  }
  // the longest key list one query row can see; every index checked against its array, so a
  // bad batch is an exception, never a write outside the KV pool
  const int64_t slots = k_[0].size(0);
  TORCH_CHECK(out_loc.numel() == T && positions.numel() == T && tok_req.numel() == T &&
              tok_local.numel() == T && kv_indptr.numel() == B + 1 && extend_len.numel() == B,
              "forward: inconsistent batch arrays");
  for (int t = 0; t < T; ++t) TORCH_CHECK(loc[t] > 0 && loc[t] < slots, "KV slot out of range");
  int64_t max_keys = 0;
  const int64_t* ip = kv_indptr.data_ptr<int64_t>();
  const int64_t* kvi = kv_indices.data_ptr<int64_t>();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  const int32_t* el = extend_len.data_ptr<int32_t>();
  TORCH_CHECK(ip[0] == 0 && ip[B] == kv_indices.numel(), "forward: kv_indptr");
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(ip[b + 1] - ip[b] == (int64_t)pl[b] + el[b], "forward: kv list length");
    max_keys = std::max(max_keys, ip[b + 1] - ip[b]);
  }
  for (int64_t i = 0; i < kv_indices.numel(); ++i) {
    TORCH_CHECK(kvi[i] >= 0 && kvi[i] < slots, "KV slot out of range");
  }
  const int32_t* tr = tok_req.data_ptr<int32_t>();
  const int32_t* tl = tok_local.data_ptr<int32_t>();
  for (int t = 0; t < T; ++t) {
    TORCH_CHECK(tr[t] >= 0 && tr[t] < B && tl[t] >= 0 && tl[t] < el[tr[t]], "forward: tokens");
  }
  int min_window = 0;  // a tree's rows must all lie inside every sliding window (kernels.h)
  for (const Layer& l : layers_) {
    if (l.window > 0) min_window = min_window ? std::min(min_window, l.window) : l.window;
  }
  if (masks.numel()) {
    for (int b = 0; b < B && min_window; ++b) {
      TORCH_CHECK(el[b] <= min_window, "forward: a tree of ", el[b], " nodes is wider than "
                  "the sliding window (", min_window, ")");
    }
    const int64_t* mi = mask_indptr.data_ptr<int64_t>();
    TORCH_CHECK(mask_indptr.numel() == B + 1 && mi[B] == masks.numel(), "forward: masks");
    for (int b = 0; b < B; ++b) {
      TORCH_CHECK(mi[b + 1] - mi[b] == (int64_t)el[b] * el[b], "forward: mask size");
    }
  }

  const int Win = attn_in_width();
  x_.resize((size_t)T * H_);
  xn_.resize((size_t)T * std::max(Win, Nq));
  if (eagle3_) e_.resize((size_t)T * H_);
  qkv_.resize((size_t)T * Nqkv);
  attn_.resize((size_t)T * Nq);
  h_.resize((size_t)T * I_);
  const int F = final_hidden ? T : R;
  fin_.resize((size_t)std::max(F, 1) * H_);
  const int max_k = std::max({H_, Nq, I_, Win, fc_.K});
  act_.reserve(std::max(T, 1), max_k, levels_);
  attn_bufs_.resize(nthreads_);
  std::vector<AttnScratch> scratch(nthreads_);
  for (int i = 0; i < nthreads_; ++i) scratch[i] = attn_bufs_[i].reserve(max_keys, D_);
  const std::vector<int32_t> items = attention_items(T, tr, Hq_, KVH_, nthreads_);
  auto logits = torch::empty({R, V_}, torch::kFloat32);
  auto amax = torch::empty({R}, torch::kInt64);
  std::vector<float> pbest((size_t)nthreads_ * std::max(R, 1));
  std::vector<int64_t> pidx((size_t)nthreads_ * std::max(R, 1));
  // logit_top >= 0: each logits row's log-sum-exp and its logit_top largest (RowStats)
  std::unique_ptr<RowStats> stats;
  if (logit_top >= 0) stats.reset(new RowStats(R, nthreads_, (int)std::min<int64_t>(logit_top, V_)));
  torch::Tensor fh = final_hidden ? torch::empty({T, H_}, torch::kFloat32) : torch::Tensor();
  std::vector<torch::Tensor> caps;
  std::vector<float*> cap_at(nl + 1, nullptr);
  for (int64_t c : capture) {
    TORCH_CHECK(c >= layer_begin && c <= layer_end, "capture layer out of range: ", c);
    caps.push_back(torch::empty({T, H_}, torch::kFloat32));
    cap_at[c] = caps.back().data_ptr<float>();
  }

  AttnArgs aa;
  aa.num_heads = Hq_;
  aa.num_kv_heads = KVH_;
  aa.head_dim = D_;
  aa.scale = attn_scale_ > 0.f ? attn_scale_ : 1.f / std::sqrt((float)D_);
  aa.q = qkv_.data();
  aa.ldq = Nqkv;
  aa.out = attn_.data();
  aa.ldo = Nq;
  aa.tok_req = tok_req.data_ptr<int32_t>();
  aa.tok_local = tok_local.data_ptr<int32_t>();
  aa.kv_indptr = ip;
  aa.kv_indices = kv_indices.data_ptr<int64_t>();
  aa.prefix_len = prefix_len.data_ptr<int32_t>();
  aa.extend_len = extend_len.data_ptr<int32_t>();
  aa.masks = ptr_of<uint8_t>(masks);
  aa.mask_indptr = ptr_of<int64_t>(mask_indptr);
  aa.items = items.data();
  aa.max_keys = (int)max_keys;
  const std::vector<int> item_bounds = attention_bounds(items, aa, nthreads_);

  ThreadPool& tp = pool(nthreads_);
  MatmulStep mm{isa_, &tp, &act_, levels_};
  float* x = x_.data();
  float* xn = xn_.data();
  float* qkv = qkv_.data();
  float* h = h_.data();
  float* fin = fin_.data();
  const float* cosp = cos_.data_ptr<float>();
  const float* sinp = sin_.data_ptr<float>();
  const int half = D_ / 2;
  // barrier; one thread runs the ranks' collective on buf [T, H]; barrier
  auto tp_barrier_reduce = [&](int tid, float* buf) {
    tp.barrier(tid);
    if (tid == 0) reduce_(buf, T, H_);
    tp.barrier(tid);
  };

  // x += in W^T, or (Gemma) x += rmsnorm(in W^T) (the product stored in xn first); then a
  // barrier
  auto residual_step = [&](const PackedLinear& w, const torch::Tensor& out_norm, const float* in,
                           int64_t ldin, int tid, int n, int r0, int r1) {
    if (sharded) {  // this rank's partial product, summed over the ranks, then added
      mm(w, T, in, ldin, xn, H_, EPI_STORE, tid, n);
      tp_barrier_reduce(tid, xn);
      if (out_norm.defined()) {
        isa_->rmsnorm(xn, H_, out_norm.data_ptr<float>(), eps_, H_, xn, H_, r0, r1);
      }
      for (int64_t i = (int64_t)r0 * H_; i < (int64_t)r1 * H_; ++i) x[i] += xn[i];
      tp.barrier(tid);
      return;
    }
    if (!out_norm.defined()) {
      mm(w, T, in, ldin, x, H_, EPI_ADD, tid, n);
      tp.barrier(tid);
      return;
    }
    mm(w, T, in, ldin, xn, H_, EPI_STORE, tid, n);
    tp.barrier(tid);
    isa_->rmsnorm(xn, H_, out_norm.data_ptr<float>(), eps_, H_, xn, H_, r0, r1);
    for (int64_t i = (int64_t)r0 * H_; i < (int64_t)r1 * H_; ++i) x[i] += xn[i];
    tp.barrier(tid);
  };
  const bool prof = profile_;
  auto body = [&](int tid, int n) {
    auto last = std::chrono::steady_clock::now();
    auto mark = [&](int phase) {  // thread 0, after a barrier: the phase's wall time
      if (!prof || tid != 0) return;
      const auto now = std::chrono::steady_clock::now();
      prof_[phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    };
    int r0, r1;
    split_range(T, tid, n, &r0, &r1);
    if (fused_in) {
      mm(fc_, T, hin.data_ptr<float>(), fc_.K, x, H_, EPI_STORE, tid, n);
    } else if (hin.defined()) {
      std::memcpy(x + (int64_t)r0 * H_, hin.data_ptr<float>() + (int64_t)r0 * H_,
                  sizeof(float) * (r1 - r0) * H_);
    }
    if (eagle3_) {  // the target's embedding of each token, for the layer's q/k/v input
      for (int t = r0; t < r1; ++t) embed_.row(ids[t], e_.data() + (int64_t)t * H_);
    } else if (!hin.defined()) {
      for (int t = r0; t < r1; ++t) {
        float* xt = x + (int64_t)t * H_;
        const int64_t row = ids[t] - vocab_start_;
        if (row < 0 || row >= V_) {  // another rank's vocabulary row: it adds the embedding
          std::memset(xt, 0, sizeof(float) * H_);
          continue;
        }
        embed_.row(row, xt);
        if (embed_scale_ != 1.f) for (int i = 0; i < H_; ++i) xt[i] *= embed_scale_;
      }
      if (sharded) tp_barrier_reduce(tid, x);
    }
    tp.barrier(tid);
    mark(0);
    for (int li = (int)layer_begin; li < (int)layer_end; ++li) {
      const Layer& L = layers_[li];
      if (cap_at[li]) std::memcpy(cap_at[li] + (int64_t)r0 * H_, x + (int64_t)r0 * H_,
                                  sizeof(float) * (r1 - r0) * H_);
      if (eagle3_) {
        isa_->rmsnorm(e_.data(), H_, L.in_norm.data_ptr<float>(), eps_, H_, xn, Win, r0, r1);
        isa_->rmsnorm(x, H_, hidden_norm_.data_ptr<float>(), eps_, H_, xn + H_, Win, r0, r1);
      } else {
        isa_->rmsnorm(x, H_, L.in_norm.data_ptr<float>(), eps_, H_, xn, H_, r0, r1);
      }
      tp.barrier(tid);
      mark(1);
      for (size_t p = 0, col = 0; p < L.qkv.size(); col += L.qkv[p].N, ++p) {
        if (p) tp.barrier(tid);  // the next part quantizes into the activation buffers again
        mm(L.qkv[p], T, xn, Win, qkv + col, Nqkv, EPI_STORE, tid, n);
      }
      tp.barrier(tid);
      mark(2);
      // q/k norm (Qwen3), rotary, and this layer's K/V into the cache: items (token, head)
      int i0, i1;
      split_range(T * (Hq_ + KVH_), tid, n, &i0, &i1);
      float* kc = kv_half_ ? nullptr : k_[li].data_ptr<float>();
      float* vc = kv_half_ ? nullptr : v_[li].data_ptr<float>();
      uint16_t* kh16 = kv_half_ ? (uint16_t*)k_[li].data_ptr<at::Half>() : nullptr;
      uint16_t* vh16 = kv_half_ ? (uint16_t*)v_[li].data_ptr<at::Half>() : nullptr;
      for (int it = i0; it < i1; ++it) {
        const int t = it / (Hq_ + KVH_), hh = it % (Hq_ + KVH_);
        float* row = qkv + (int64_t)t * Nqkv;
        const bool local = L.window > 0 && cos_local_.defined();
        const float* c = (local ? cos_local_.data_ptr<float>() : cosp) + pos[t] * half;
        const float* s = (local ? sin_local_.data_ptr<float>() : sinp) + pos[t] * half;
        if (hh < Hq_) {
          float* qh = row + hh * D_;
          if (L.q_norm.defined()) isa_->rmsnorm(qh, D_, L.q_norm.data_ptr<float>(), eps_, D_, qh,
                                                D_, 0, 1);
          rope_inplace(qh, c, s, D_);
        } else {
          const int g = hh - Hq_;
          float* kh = row + Nq + g * D_;
          if (L.k_norm.defined()) isa_->rmsnorm(kh, D_, L.k_norm.data_ptr<float>(), eps_, D_, kh,
                                                D_, 0, 1);
          rope_inplace(kh, c, s, D_);
          const float* vh = row + Nq + KVH_ * D_ + g * D_;
          const int64_t at = (loc[t] * KVH_ + g) * D_;
          if (kv_half_) {
            half_row()(kh, kh16 + at, D_);
            half_row()(vh, vh16 + at, D_);
          } else {
            std::memcpy(kc + at, kh, sizeof(float) * D_);
            std::memcpy(vc + at, vh, sizeof(float) * D_);
          }
        }
      }
      tp.barrier(tid);
      mark(3);
      AttnArgs la = aa;
      la.k_cache = kc;
      la.v_cache = vc;
      la.k_half = kh16;
      la.v_half = vh16;
      la.window = L.window;
      la.positions = pos;
      i0 = item_bounds[tid];
      i1 = item_bounds[tid + 1];
      if (i1 > i0) isa_->attention(la, i0, i1, scratch[tid]);
      tp.barrier(tid);
      mark(4);
      residual_step(L.o, L.attn_out_norm, attn_.data(), Nq, tid, n, r0, r1);
      mark(5);
      isa_->rmsnorm(x, H_, L.post_norm.data_ptr<float>(), eps_, H_, xn, H_, r0, r1);
      tp.barrier(tid);
      mark(6);
      mm(L.gate_up, T, xn, H_, h, I_, gelu_ ? EPI_GELU_MUL : EPI_SILU_MUL, tid, n);
      tp.barrier(tid);
      mark(7);
      residual_step(L.down, L.mlp_out_norm, h, I_, tid, n, r0, r1);
      mark(8);
    }
    if (float* c = cap_at[layer_end]) {  // the hidden state after the last layer run
      std::memcpy(c + (int64_t)r0 * H_, x + (int64_t)r0 * H_, sizeof(float) * (r1 - r0) * H_);
    }
    // final norm: every row when the caller wants final hidden states, else the logits rows
    int f0, f1;
    split_range(F, tid, n, &f0, &f1);
    for (int f = f0; f < f1; ++f) {
      const int64_t src = final_hidden ? f : rows[f];
      isa_->rmsnorm(x + src * H_, H_, final_norm_.data_ptr<float>(), eps_, H_,
                    fin + (int64_t)f * H_, H_, 0, 1);
    }
    tp.barrier(tid);
    mark(9);
    if (R == 0) return;
    if (final_hidden) {
      // logits rows are a subset: gather them after the norm (rows of fin)
      split_range(R, tid, n, &f0, &f1);
      for (int r = f0; r < f1; ++r) {
        std::memcpy(xn + (int64_t)r * H_, fin + rows[r] * H_, sizeof(float) * H_);
      }
      tp.barrier(tid);
      mm(lm_head_, R, xn, H_, logits.data_ptr<float>(), V_, EPI_STORE, tid, n);
    } else {
      mm(lm_head_, R, fin, H_, logits.data_ptr<float>(), V_, EPI_STORE, tid, n);
    }
    argmax_part(isa_, logits.data_ptr<float>(), R, V_, V_, lm_head_.tiles, tid, n, pbest.data(),
                pidx.data());
    if (stats) {
      stats->part(isa_, logits.data_ptr<float>(), V_, V_, lm_head_.tiles, tid, pbest.data(),
                  pidx.data());
    }
    tp.barrier(tid);
    split_range(R, tid, n, &f0, &f1);
    argmax_merge(R, n, pbest.data(), pidx.data(), f0, f1, amax.data_ptr<int64_t>());
    if (stats) stats->merge(pbest.data(), pidx.data(), f0, f1);
    if (prof) tp.barrier(tid);  // (profiling only) so the LM head's time is all of it
    mark(10);
  };
  for (int r = 0; r < R; ++r) TORCH_CHECK(rows[r] >= 0 && rows[r] < T, "logits row out of range");
  if (R > T) xn_.resize((size_t)R * H_), xn = xn_.data();
  act_.reserve(std::max(T, R), max_k, levels_);
  if (T > 0) parallel(nthreads_, body);
  if (prof) ++prof_calls_;
  if (final_hidden) std::memcpy(fh.data_ptr<float>(), fin, sizeof(float) * T * H_);
  std::vector<torch::Tensor> out{logits, final_hidden ? fh : torch::Tensor(), amax,
                                 stats ? stats->lse : torch::Tensor(),
                                 stats ? stats->vals : torch::Tensor(),
                                 stats ? stats->ids : torch::Tensor()};
  for (auto& c : caps) out.push_back(c);
  return out;
}

// ---- MLPSpeculator stages (specserve/speculative/models/mlp_speculator_cpu.py) --------------

// A draft head of n small MLP stages, each run over a batch of rows in one parallel region, so a
// proposal costs one pool run instead of a dozen small ops (each of which, right after a target
// forward, pays tens of microseconds). Stage i over rows r: z = emb[i][row_r] (float tables,
// pre-scaled), z += x proj[i]^T (the state weight folded into the packed weight), s =
// gelu(rmsnorm(z) * ln_w[i] + ln_b[i]) (exact erf gelu), logits = s head[i]^T and each row's
// log-sum-exp and top k. Several stages in one call chain them: stage i + 1 reads s and each
// row's top-1 id as its emb row (draft ids are the first emb rows).
class MlpStages {
 public:
  MlpStages(std::vector<PackedLinear> proj, std::vector<PackedLinear> head,
            std::vector<torch::Tensor> emb, std::vector<torch::Tensor> ln_w,
            std::vector<torch::Tensor> ln_b, double eps, int levels, int nthreads,
            const std::string& isa)
      : proj_(std::move(proj)), head_(std::move(head)), eps_((float)eps), levels_(levels),
        nthreads_(nthreads), isa_(pick_isa(isa)) {
    const size_t n = proj_.size();
    TORCH_CHECK(n >= 1 && head_.size() == n && emb.size() == n && ln_w.size() == n &&
                ln_b.size() == n, "one proj, head, emb table and norm per stage");
    D_ = proj_[0].N;
    V_ = head_[0].N;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(is_block_format(proj_[i].fmt) && is_block_format(head_[i].fmt),
                  "stage matmuls in block formats");
      TORCH_CHECK(proj_[i].N == D_ && (i == 0 || proj_[i].K == D_) && head_[i].K == D_ &&
                  head_[i].N == V_, "stage shapes");
      emb_.push_back(emb[i].contiguous().to(torch::kFloat32));
      ln_w_.push_back(ln_w[i].contiguous().to(torch::kFloat32));
      ln_b_.push_back(ln_b[i].contiguous().to(torch::kFloat32));
      TORCH_CHECK(emb_[i].dim() == 2 && emb_[i].size(1) == D_ && emb_[i].size(0) >= V_ &&
                  ln_w_[i].numel() == D_ && ln_b_[i].numel() == D_, "emb tables and norms");
    }
  }

  // Stages [first, first + count) over x [M, K_first] and emb rows [M]: {s [M, D], the last
  // stage's logits [M, V], lse [count, M], top values [count, M, k], top ids [count, M, k]}.
  std::vector<torch::Tensor> run(torch::Tensor x, torch::Tensor rows, int first, int count,
                                 int k) {
    x = x.contiguous().to(torch::kFloat32);
    rows = rows.contiguous().to(torch::kInt64);
    const int M = (int)x.size(0), S = (int)proj_.size();
    TORCH_CHECK(count >= 1 && first >= 0 && first + count <= S && k >= 1, "stage range, k");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == proj_[first].K && rows.numel() == M, "x, rows");
    std::vector<int64_t> cur(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + M);
    for (int64_t e : cur) TORCH_CHECK(e >= 0 && e < emb_[first].size(0), "emb row ", e);
    auto s = torch::empty({M, D_}, torch::kFloat32), z = torch::empty({M, D_}, torch::kFloat32);
    auto logits = torch::empty({M, V_}, torch::kFloat32);
    std::vector<RowStats> st;
    for (int c = 0; c < count; ++c) st.emplace_back(M, nthreads_, std::min(k, V_));
    std::vector<float> pbest((size_t)nthreads_ * std::max(M, 1));
    std::vector<int64_t> pidx((size_t)nthreads_ * std::max(M, 1));
    thread_local ActBuffers act;
    act.reserve(std::max(M, 1), std::max<int>(x.size(1), D_), levels_);
    ThreadPool& tp = pool(nthreads_);
    MatmulStep mm{isa_, &tp, &act, levels_};
    float *zp = z.data_ptr<float>(), *sp = s.data_ptr<float>(), *lp = logits.data_ptr<float>();
    auto body = [&](int tid, int n) {
      const float* in = x.data_ptr<float>();
      int64_t ld = x.size(1);
      int r0, r1;
      split_range(M, tid, n, &r0, &r1);
      for (int c = 0; c < count; ++c) {
        const int i = first + c;
        const float* E = emb_[i].data_ptr<float>();
        for (int r = r0; r < r1; ++r) std::memcpy(zp + (int64_t)r * D_, E + cur[r] * D_,
                                                  sizeof(float) * D_);
        tp.barrier(tid);
        mm(proj_[i], M, in, ld, zp, D_, EPI_ADD, tid, n);
        tp.barrier(tid);
        isa_->rmsnorm(zp, D_, ln_w_[i].data_ptr<float>(), eps_, D_, sp, D_, r0, r1);
        const float* b = ln_b_[i].data_ptr<float>();
        for (int r = r0; r < r1; ++r) {
          float* row = sp + (int64_t)r * D_;
          for (int j = 0; j < D_; ++j) {
            const float v = row[j] + b[j];
            row[j] = 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
          }
        }
        tp.barrier(tid);
        mm(head_[i], M, sp, D_, lp, V_, EPI_STORE, tid, n);
        tp.barrier(tid);
        argmax_part(isa_, lp, M, V_, V_, head_[i].tiles, tid, n, pbest.data(), pidx.data());
        st[c].part(isa_, lp, V_, V_, head_[i].tiles, tid, pbest.data(), pidx.data());
        tp.barrier(tid);
        st[c].merge(pbest.data(), pidx.data(), r0, r1);
        const int64_t* top = st[c].ids.data_ptr<int64_t>();
        for (int r = r0; r < r1; ++r) cur[r] = std::max<int64_t>(top[(int64_t)r * st[c].k], 0);
        tp.barrier(tid);
        in = sp;
        ld = D_;
      }
    };
    if (M > 0) parallel(nthreads_, body);
    std::vector<torch::Tensor> lse, vals, ids;
    for (auto& r : st) lse.push_back(r.lse), vals.push_back(r.vals), ids.push_back(r.ids);
    return {s, logits, torch::stack(lse), torch::stack(vals), torch::stack(ids)};
  }

 private:
  std::vector<PackedLinear> proj_, head_;
  std::vector<torch::Tensor> emb_, ln_w_, ln_b_;
  int D_ = 0, V_ = 0;
  float eps_;
  int levels_, nthreads_;
  const IsaKernels* isa_;
};

// ---- standalone ops (tests, and modules outside the fused stack) --------------------------

torch::Tensor linear_op(const PackedLinear& w, torch::Tensor x, int levels, int nthreads,
                        const std::string& isa, int epilogue, c10::optional<torch::Tensor> y_in) {
  x = x.contiguous().to(torch::kFloat32);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, K]");
  const int M = (int)x.size(0);
  const int ncols = gated_epilogue(epilogue) ? w.N / 2 : w.N;
  torch::Tensor y = y_in.has_value() ? *y_in : torch::zeros({M, ncols}, torch::kFloat32);
  TORCH_CHECK(y.is_contiguous() && y.dtype() == torch::kFloat32 && y.size(0) == M &&
              y.size(1) == ncols, "y must be a contiguous float32 [M, N]");
  const IsaKernels* k = pick_isa(isa);
  thread_local ActBuffers act;  // kept across calls (grown, never shrunk), as a forward keeps its own
  act.reserve(std::max(M, 1), w.K, levels);
  MatmulStep mm{k, &pool(nthreads), &act, levels};
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto body = [&](int tid, int n) { mm(w, M, xp, w.K, yp, ncols, epilogue, tid, n); };
  if (M > 0) parallel(nthreads, body);
  return y;
}

// Row argmax of x [R, N] the way a forward finds its logits' (tiles of NR columns split over
// `nthreads`, then merged): for tests
torch::Tensor argmax_op(torch::Tensor x, int nthreads, const std::string& isa) {
  x = x.contiguous().to(torch::kFloat32);
  TORCH_CHECK(x.dim() == 2, "x must be [R, N]");
  const int R = (int)x.size(0), N = (int)x.size(1);
  const IsaKernels* k = pick_isa(isa);
  auto out = torch::empty({R}, torch::kInt64);
  std::vector<float> pbest((size_t)nthreads * std::max(R, 1));
  std::vector<int64_t> pidx((size_t)nthreads * std::max(R, 1));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int tiles = (N + NR - 1) / NR;
  ThreadPool& tp = pool(nthreads);
  auto body = [&](int tid, int n) {
    argmax_part(k, xp, R, N, N, tiles, tid, n, pbest.data(), pidx.data());
    tp.barrier(tid);
    int r0, r1;
    split_range(R, tid, n, &r0, &r1);
    argmax_merge(R, n, pbest.data(), pidx.data(), r0, r1, op);
  };
  if (R > 0) parallel(nthreads, body);
  return out;
}

// Each row of x [R, N]: [argmax, lse, top values [R, k], top ids [R, k]] as a forward with
// logit_top = k computes them (RowStats): for tests
std::vector<torch::Tensor> logit_stats_op(torch::Tensor x, int k, int nthreads,
                                          const std::string& isa) {
  x = x.contiguous().to(torch::kFloat32);
  TORCH_CHECK(x.dim() == 2 && k >= 0, "x must be [R, N], k >= 0");
  const int R = (int)x.size(0), N = (int)x.size(1);
  const IsaKernels* ks = pick_isa(isa);
  auto am = torch::empty({R}, torch::kInt64);
  std::vector<float> pbest((size_t)nthreads * std::max(R, 1));
  std::vector<int64_t> pidx((size_t)nthreads * std::max(R, 1));
  RowStats st(R, nthreads, std::min(k, N));
  const float* xp = x.data_ptr<float>();
  const int tiles = (N + NR - 1) / NR;
  ThreadPool& tp = pool(nthreads);
  auto body = [&](int tid, int n) {
    argmax_part(ks, xp, R, N, N, tiles, tid, n, pbest.data(), pidx.data());
    st.part(ks, xp, N, N, tiles, tid, pbest.data(), pidx.data());
    tp.barrier(tid);
    int r0, r1;
    split_range(R, tid, n, &r0, &r1);
    argmax_merge(R, n, pbest.data(), pidx.data(), r0, r1, am.data_ptr<int64_t>());
    st.merge(pbest.data(), pidx.data(), r0, r1);
  };
  if (R > 0) parallel(nthreads, body);
  return {am, st.lse, st.vals, st.ids};
}

torch::Tensor attention_op(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           int num_heads, torch::Tensor tok_req, torch::Tensor tok_local,
                           torch::Tensor kv_indptr, torch::Tensor kv_indices,
                           torch::Tensor prefix_len, torch::Tensor extend_len, torch::Tensor masks,
                           torch::Tensor mask_indptr, double scale, int nthreads,
                           const std::string& isa) {
  q = q.contiguous().to(torch::kFloat32);
  const int T = (int)q.size(0);
  const int KVH = (int)k_cache.size(1), D = (int)k_cache.size(2);
  TORCH_CHECK(q.size(1) == (int64_t)num_heads * D, "q must be [T, heads * head_dim]");
  auto out = torch::empty({T, (int64_t)num_heads * D}, torch::kFloat32);
  AttnArgs a;
  a.num_heads = num_heads;
  a.num_kv_heads = KVH;
  a.head_dim = D;
  a.scale = (float)scale;
  a.q = q.data_ptr<float>();
  a.ldq = (int64_t)num_heads * D;
  a.out = out.data_ptr<float>();
  a.ldo = a.ldq;
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "k / v caches: one dtype, contiguous");
  if (k_cache.dtype() == torch::kFloat16) {
    a.k_half = (const uint16_t*)k_cache.data_ptr<at::Half>();
    a.v_half = (const uint16_t*)v_cache.data_ptr<at::Half>();
  } else {
    a.k_cache = k_cache.data_ptr<float>();
    a.v_cache = v_cache.data_ptr<float>();
  }
  a.tok_req = tok_req.data_ptr<int32_t>();
  a.tok_local = tok_local.data_ptr<int32_t>();
  a.kv_indptr = kv_indptr.data_ptr<int64_t>();
  a.kv_indices = kv_indices.data_ptr<int64_t>();
  a.prefix_len = prefix_len.data_ptr<int32_t>();
  a.extend_len = extend_len.data_ptr<int32_t>();
  a.masks = ptr_of<uint8_t>(masks);
  a.mask_indptr = ptr_of<int64_t>(mask_indptr);
  int64_t max_keys = 0;
  for (int64_t b = 0; b + 1 < kv_indptr.numel(); ++b) {
    max_keys = std::max(max_keys, a.kv_indptr[b + 1] - a.kv_indptr[b]);
  }
  a.max_keys = (int)max_keys;
  const std::vector<int32_t> items = attention_items(T, a.tok_req, num_heads, KVH, nthreads);
  a.items = items.data();
  const IsaKernels* k = pick_isa(isa);
  std::vector<AttnBuffers> bufs(nthreads);
  std::vector<AttnScratch> scratch(nthreads);
  for (int i = 0; i < nthreads; ++i) scratch[i] = bufs[i].reserve(max_keys, D);
  const std::vector<int> bounds = attention_bounds(items, a, nthreads);
  auto body = [&](int tid, int) {
    const int i0 = bounds[tid], i1 = bounds[tid + 1];
    if (i1 > i0) k->attention(a, i0, i1, scratch[tid]);
  };
  if (T > 0) parallel(nthreads, body);
  return out;
}

// The attention work a forward of these rows plans: its items ([n][4]: rows t0, t1, heads h0,
// h1) and each thread's run of them (bounds [nthreads + 1]), for tests of the split.
std::vector<torch::Tensor> attention_plan_op(int num_heads, int num_kv_heads, torch::Tensor tok_req,
                                             torch::Tensor tok_local, torch::Tensor prefix_len,
                                             torch::Tensor extend_len, torch::Tensor masks,
                                             torch::Tensor mask_indptr, int nthreads) {
  AttnArgs a;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.tok_req = tok_req.data_ptr<int32_t>();
  a.tok_local = tok_local.data_ptr<int32_t>();
  a.prefix_len = prefix_len.data_ptr<int32_t>();
  a.extend_len = extend_len.data_ptr<int32_t>();
  a.masks = ptr_of<uint8_t>(masks);
  a.mask_indptr = ptr_of<int64_t>(mask_indptr);
  const int T = (int)tok_req.numel();
  const std::vector<int32_t> items = attention_items(T, a.tok_req, num_heads, num_kv_heads,
                                                     std::max(nthreads, 1));
  const std::vector<int> bounds = attention_bounds(items, a, nthreads);
  auto it = torch::tensor(items, torch::kInt32).reshape({-1, 4});
  auto bt = torch::tensor(std::vector<int32_t>(bounds.begin(), bounds.end()), torch::kInt32);
  return {it, bt};
}

// float32 -> float16 by the engine's own conversion (the one that writes fp16 KV: F16C where
// the CPU has it, else scalar; `scalar` forces the scalar one): for tests
torch::Tensor to_half_op(torch::Tensor x, bool scalar) {
  x = x.contiguous().to(torch::kFloat32);
  auto out = torch::empty(x.sizes(), torch::kFloat16);
  const HalfRowFn fn = scalar ? half_row_scalar : half_row();
  fn(x.data_ptr<float>(), (uint16_t*)out.data_ptr<at::Half>(), (int)x.numel());
  return out;
}

torch::Tensor rmsnorm_op(torch::Tensor x, torch::Tensor w, double eps, const std::string& isa) {
  x = x.contiguous().to(torch::kFloat32);
  w = w.contiguous().to(torch::kFloat32);
  auto y = torch::empty_like(x);
  const int D = (int)x.size(-1);
  pick_isa(isa)->rmsnorm(x.data_ptr<float>(), D, w.data_ptr<float>(), (float)eps, D,
                         y.data_ptr<float>(), D, 0, (int)(x.numel() / D));
  return y;
}

std::vector<torch::Tensor> quantize_op(torch::Tensor x, int levels, const std::string& isa) {
  x = x.contiguous().to(torch::kFloat32);
  const int M = (int)x.size(0), K = (int)x.size(1), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && levels >= 1 && levels <= 3, "K % 32 == 0 and 1-3 digits");
  auto q = torch::empty({M, levels, K}, torch::kInt8);
  auto scale = torch::empty({M, nb}, torch::kFloat32);
  auto sums = torch::empty({M, levels, nb}, torch::kInt32);
  auto fsum = torch::empty({M, nb}, torch::kFloat32);
  pick_isa(isa)->quantize(x.data_ptr<float>(), K, 0, M, K, levels, q.data_ptr<int8_t>(),
                          scale.data_ptr<float>(), sums.data_ptr<int32_t>(),
                          fsum.data_ptr<float>());
  return {q, scale, sums, fsum};
}

std::string isa_name(const std::string& isa) { return pick_isa(isa)->name; }

void register_ngram_trie(pybind11::module_& m);  // ngram_trie.cpp

}  // namespace specserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace specserve;
  namespace py = pybind11;
  py::class_<ShmComm, std::shared_ptr<ShmComm>>(m, "ShmComm")
      .def(py::init<const std::string&, int, int, int64_t>(), py::arg("name"), py::arg("rank"),
           py::arg("world"), py::arg("cap_bytes"))
      .def("unlink", &ShmComm::unlink)
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("world", &ShmComm::world)
      .def("allreduce_", [](ShmComm& c, torch::Tensor x) {
             TORCH_CHECK(x.is_contiguous() && x.dtype() == torch::kFloat32, "float32, contiguous");
             py::gil_scoped_release nogil;
             c.allreduce(x.data_ptr<float>(), x.numel());
           })
      .def("broadcast_", [](ShmComm& c, torch::Tensor x) {
             TORCH_CHECK(x.is_contiguous(), "contiguous");
             py::gil_scoped_release nogil;
             c.broadcast(x.data_ptr(), x.numel() * (int64_t)x.element_size());
           })
      .def("gather", [](ShmComm& c, torch::Tensor x) {
             // rank 0: [world, *x.shape]; the others: an empty tensor
             TORCH_CHECK(x.is_contiguous(), "contiguous");
             std::vector<int64_t> shape{c.rank() == 0 ? c.world() : 0};
             for (int64_t d : x.sizes()) shape.push_back(d);
             auto out = torch::empty(shape, x.options());
             py::gil_scoped_release nogil;
             c.gather(x.data_ptr(), x.numel() * (int64_t)x.element_size(), out.data_ptr());
             return out;
           });
  py::class_<PackedLinear>(m, "PackedLinear")
      .def(py::init<int, int, int, torch::Tensor, c10::optional<torch::Tensor>>(), py::arg("fmt"),
           py::arg("K"), py::arg("N"), py::arg("data"), py::arg("bias") = py::none())
      .def_readonly("fmt", &PackedLinear::fmt)
      .def_readonly("K", &PackedLinear::K)
      .def_readonly("N", &PackedLinear::N)
      .def_readonly("tiles", &PackedLinear::tiles)
      .def_readonly("data", &PackedLinear::data)
      .def("dense", [](const PackedLinear& w) {
        auto out = torch::empty({w.N, w.K}, torch::kFloat32);
        float* p = out.data_ptr<float>();
        for (int64_t r = 0; r < w.N; ++r) w.row(r, p + r * w.K);
        return out;
      })
      .def("row", [](const PackedLinear& w, int64_t r) {
        TORCH_CHECK(r >= 0 && r < w.N, "row out of range");
        auto out = torch::empty({w.K}, torch::kFloat32);
        w.row(r, out.data_ptr<float>());
        return out;
      });
  py::class_<CpuModel>(m, "CpuModel")
      .def(py::init<int, int, int, int, int, int, double, int, int, const std::string&>())
      .def("add_layer", &CpuModel::add_layer)
      .def("set_head", &CpuModel::set_head)
      .def("set_layer_gemma", &CpuModel::set_layer_gemma)
      .def("set_eagle3", &CpuModel::set_eagle3)
      .def("set_fc", &CpuModel::set_fc)
      .def("configure", &CpuModel::configure)
      .def("set_rope_local", &CpuModel::set_rope_local)
      .def("set_rope", &CpuModel::set_rope)
      .def("set_kv", &CpuModel::set_kv)
      .def("set_tensor_parallel", &CpuModel::set_tensor_parallel)
      .def("set_tensor_parallel_shm", &CpuModel::set_tensor_parallel_shm)
      .def_property_readonly("tensor_parallel", &CpuModel::tensor_parallel)
      .def("forward", &CpuModel::forward, py::arg("input_ids"), py::arg("positions"),
           py::arg("out_loc"), py::arg("tok_req"), py::arg("tok_local"), py::arg("kv_indptr"),
           py::arg("kv_indices"), py::arg("prefix_len"), py::arg("extend_len"),
           py::arg("masks"), py::arg("mask_indptr"), py::arg("logits_rows"),
           py::arg("capture"), py::arg("final_hidden"), py::arg("layer_begin") = 0,
           py::arg("layer_end") = -1, py::arg("hidden_in") = py::none(),
           py::arg("logit_top") = -1, py::call_guard<py::gil_scoped_release>())
      .def("linear", &CpuModel::linear, py::call_guard<py::gil_scoped_release>())
      .def("lm_head", &CpuModel::lm_head, py::call_guard<py::gil_scoped_release>())
      .def("embed", &CpuModel::embed)
      .def("final_norm", &CpuModel::final_norm)
      .def_property_readonly("isa", &CpuModel::isa_name)
      .def("set_profile", &CpuModel::set_profile)
      .def("profile", &CpuModel::profile)
      .def_property("num_threads", &CpuModel::num_threads, &CpuModel::set_num_threads);
  py::class_<MlpStages>(m, "MlpStages")
      .def(py::init<std::vector<PackedLinear>, std::vector<PackedLinear>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, double, int, int, const std::string&>(),
           py::arg("proj"), py::arg("head"), py::arg("emb"), py::arg("ln_w"), py::arg("ln_b"),
           py::arg("eps"), py::arg("levels"), py::arg("nthreads"), py::arg("isa") = "")
      .def("run", &MlpStages::run, py::arg("x"), py::arg("rows"), py::arg("first"),
           py::arg("count"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear_op, py::arg("w"), py::arg("x"), py::arg("levels") = 3,
        py::arg("nthreads") = 1, py::arg("isa") = "", py::arg("epilogue") = 0,
        py::arg("y") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("attention", &attention_op, py::call_guard<py::gil_scoped_release>());
  m.def("attention_plan", &attention_plan_op);
  m.def("argmax", &argmax_op, py::arg("x"), py::arg("nthreads") = 1, py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("logit_stats", &logit_stats_op, py::arg("x"), py::arg("k"), py::arg("nthreads") = 1,
        py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
  m.def("rmsnorm", &rmsnorm_op, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("isa") = "");
  m.def("isa_name", &isa_name, py::arg("isa") = "");
  m.def("to_half", &to_half_op, py::arg("x"), py::arg("scalar") = false);
  m.def("quantize", &quantize_op, py::arg("x"), py::arg("levels"), py::arg("isa") = "");
  register_ngram_trie(m);
}
