// The hf engine's decode step on a CPU with AVX-512 BF16: its products at 1-8 rows, its attention, norms (with
// the residual sums before them), rotary embedding and SiLU (engines/decode_kernels.py says why and when).
//
// y (M, N) = x (M, K) @ W.T (+ bias), bf16 in and out, float32 accumulation. W is packed once as
// (N/16 blocks, K/2 pairs, 16 outputs, 2): each (block, pair) is one 64-byte line, so a product streams
// the weight once, in order, and each line feeds one VDPBF16PS per row of x (x's pair broadcast); the
// 16 lanes hold 16 outputs, so nothing is summed across lanes.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#include <cstdint>

#define KAIZEN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KAIZEN_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
// AMX's intrinsics came with GCC 11 and clang 12; an older compiler builds the rest, and the products stay on AVX-512 BF16
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define KAIZEN_HAS_AMX 1
#else
#define KAIZEN_HAS_AMX 0
#endif

namespace {

constexpr int kMaxRows = 8;
constexpr int kMaxAmxRows = 32;  // AMX: two tiles of 16 rows of x
// How far ahead of its reads a product asks for each block's lines, into L2: at 8 rows a line feeds 8
// VDPBF16PS, and without it the core waited on memory between them (SmolLM2's products at 8 rows, one
// thread: 25.3 -> 21.2 ms a step; 32 and 96 lines measured within 4 % of 64)
constexpr int kPrefetchLines = 64;
constexpr int kMaxGroup = 8;      // attention: query heads a key-value head
constexpr int kMaxHeadDim = 256;  // attention: a head's dimension

// Ask for the line at base + n bfloat16 values (an address that may lie past the tensor's end: a prefetch never faults,
// and the address is formed as an integer, not as a pointer past the allocation). LEVEL: 3 into L1 (T0), 2 into L2 (T1)
template <int LEVEL>
inline void prefetch(const uint16_t* base, int64_t n) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(n) * sizeof(uint16_t)),
                     0, LEVEL);
}

// R blocks of 16 outputs from block nb on, for M rows of x
template <int M, int R>
KAIZEN_TARGET inline void blocks(const uint32_t* x, int64_t K2, const uint16_t* w, const float* bias, uint16_t* y,
                                 int64_t N, int64_t nb) {
  __m512 acc[M][R];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* w0 = w + nb * K2 * 32;
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      prefetch<2>(w0, (r * K2 + k + kPrefetchLines) * 32);
      wv[r] = (__m512bh)_mm512_loadu_si512(w0 + (r * K2 + k) * 32);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[m * K2 + k]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t n = (nb + r) * 16;
    const __mmask16 mask = n + 16 <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][r], b));  // round to nearest even, as torch does
      _mm256_mask_storeu_epi16(y + m * N + n, mask, (__m256i)o);
    }
  }
}

template <int M>
KAIZEN_TARGET void run(const uint32_t* x, int64_t K2, const uint16_t* w, const float* bias, uint16_t* y, int64_t N,
                       int64_t b0, int64_t b1) {
  // blocks in flight: enough independent sums to hide VDPBF16PS's latency, within 32 registers
  constexpr int R = M == 1 ? 8 : (M <= 6 ? 4 : 3);
  int64_t nb = b0;
  for (; nb + R <= b1; nb += R) blocks<M, R>(x, K2, w, bias, y, N, nb);
  for (; nb < b1; ++nb) blocks<M, 1>(x, K2, w, bias, y, N, nb);
}

using RunFn = void (*)(const uint32_t*, int64_t, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, int64_t);
const RunFn kRuns[kMaxRows + 1] = {nullptr, run<1>, run<2>, run<3>, run<4>, run<5>, run<6>, run<7>, run<8>};

bool supported() { return __builtin_cpu_supports("avx512bf16"); }

// ---------------------------------------------------------------------------------------------- AMX products
//
// On a CPU with AMX the same packed weight feeds TDPBF16PS: a block's lines k/2 .. k/2 + 15 are one
// 16 x 64-byte tile (32 inputs x 16 outputs, in pairs: the layout AMX's B operand wants), x's rows
// and 32 inputs another, and the sums of up to 16 rows x 16 outputs a third. The tile's product does
// 16 x 16 x 32 multiply-adds where VDPBF16PS does 16 x 2, so at 8 to 32 rows the product reads the
// weight at the memory's pace instead of waiting on the multiply-adds.

std::atomic<bool> g_amx{false};        // amx_enable: the kernel asked for the tiles and got them
std::atomic<int> g_amx_min_rows{3};    // from this many rows on, products of inputs a multiple of 32 run on AMX

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX's tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
bool amx_enable() {
  if (KAIZEN_HAS_AMX && !g_amx.load()) g_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return g_amx.load();
}

void set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxAmxRows + 1, "decode_kernels.set_amx_min_rows: 1 to ", kMaxAmxRows + 1, ", got ", rows);
  g_amx_min_rows = static_cast<int>(rows);
}

#if KAIZEN_HAS_AMX
// the tile intrinsics name their tiles by literal numbers (GCC pastes them into the assembly): one function each
template <int T> void tile_zero();
template <int T> void tile_load(const void* p, int64_t stride);
template <int T> void tile_store(void* p, int64_t stride);
template <int C, int A, int B> void tile_dp();
#define KAIZEN_TILE(T)                                                                                            \
  template <> KAIZEN_AMX inline void tile_zero<T>() { _tile_zero(T); }                                            \
  template <> KAIZEN_AMX inline void tile_load<T>(const void* p, int64_t stride) { _tile_loadd(T, p, stride); }  \
  template <> KAIZEN_AMX inline void tile_store<T>(void* p, int64_t stride) { _tile_stored(T, p, stride); }
KAIZEN_TILE(0) KAIZEN_TILE(1) KAIZEN_TILE(2) KAIZEN_TILE(3) KAIZEN_TILE(4) KAIZEN_TILE(5) KAIZEN_TILE(6) KAIZEN_TILE(7)
#define KAIZEN_DP(C, A, B) template <> KAIZEN_AMX inline void tile_dp<C, A, B>() { _tile_dpbf16ps(C, A, B); }
#define KAIZEN_DP_C(C) KAIZEN_DP(C, 4, 6) KAIZEN_DP(C, 4, 7) KAIZEN_DP(C, 5, 6) KAIZEN_DP(C, 5, 7)
KAIZEN_DP_C(0) KAIZEN_DP_C(1) KAIZEN_DP_C(2) KAIZEN_DP_C(3)
#undef KAIZEN_DP_C
#undef KAIZEN_DP
#undef KAIZEN_TILE

// Tiles: 0-3 sums, 4 (and 5) x's rows 0-15 (16-31), 6 and 7 the weight. With RC tiles of x's rows, the
// sums of rows 0-15 of block g are tile g and those of rows 16-31 tile 4 / RC + g, whatever the group's size.

// block g of a group of G: its weight tile (6 or 7, alternating) into its sums
template <int RC, int G, int g>
KAIZEN_AMX inline void amx_block(const uint16_t* w, int64_t K2, int64_t nb, int64_t kc) {
  if constexpr (g < G) {
    const uint16_t* bp = w + ((nb + g) * K2 + kc * 16) * 32;
#pragma GCC unroll 16
    for (int line = 0; line < 16; ++line) prefetch<2>(bp, (kPrefetchLines + line) * 32);
    tile_load<6 + g % 2>(bp, 64);
    tile_dp<g, 4, 6 + g % 2>();
    if constexpr (RC == 2) tile_dp<4 / RC + g, 5, 6 + g % 2>();
  }
}

template <int RC, int G, int g>
KAIZEN_AMX inline void amx_zero() {
  if constexpr (g < G) {
    tile_zero<g>();
    if constexpr (RC == 2) tile_zero<4 / RC + g>();
  }
}

template <int T>
KAIZEN_AMX inline void amx_put(float* buf, int64_t rows, int64_t row0, int64_t n, int64_t N, const float* bias, uint16_t* y) {
  tile_store<T>(buf, 64);
  const __mmask16 mask = n + 16 <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(buf + m * 16), b));
    _mm256_mask_storeu_epi16(y + (row0 + m) * N + n, mask, (__m256i)o);
  }
}

// G blocks of 16 outputs from block nb on, for x's rows in RC tiles of up to 16
template <int RC, int G>
KAIZEN_AMX void amx_blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                           int64_t N, int64_t nb) {
  const int64_t K2 = K / 2;
  amx_zero<RC, G, 0>();
  amx_zero<RC, G, 1>();
  amx_zero<RC, G, 2>();
  amx_zero<RC, G, 3>();
  for (int64_t kc = 0; kc < K / 32; ++kc) {
    tile_load<4>(x + kc * 32, K * 2);
    if constexpr (RC == 2) tile_load<5>(x + 16 * K + kc * 32, K * 2);
    amx_block<RC, G, 0>(w, K2, nb, kc);
    amx_block<RC, G, 1>(w, K2, nb, kc);
    amx_block<RC, G, 2>(w, K2, nb, kc);
    amx_block<RC, G, 3>(w, K2, nb, kc);
  }
  alignas(64) float buf[16 * 16];
  const int64_t m0 = std::min<int64_t>(M, 16), m1 = M - m0;
  amx_put<0>(buf, m0, 0, nb * 16, N, bias, y);
  if constexpr (G > 1) amx_put<1>(buf, m0, 0, (nb + 1) * 16, N, bias, y);
  if constexpr (G > 2) amx_put<2>(buf, m0, 0, (nb + 2) * 16, N, bias, y);
  if constexpr (G > 3) amx_put<3>(buf, m0, 0, (nb + 3) * 16, N, bias, y);
  if constexpr (RC == 2) {
    amx_put<2>(buf, m1, 16, nb * 16, N, bias, y);
    if constexpr (G > 1) amx_put<3>(buf, m1, 16, (nb + 1) * 16, N, bias, y);
  }
}

template <int RC>
KAIZEN_AMX void amx_run(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                        int64_t N, int64_t b0, int64_t b1) {
  constexpr int G = 4 / RC;  // four tiles of sums
  TileConfig cfg{};
  cfg.palette_id = 1;
  const int64_t m0 = std::min<int64_t>(M, 16), m1 = M - m0;
  for (int t = 0; t < 4; ++t) {  // sums: 16 float32 columns a row
    cfg.rows[t] = static_cast<uint8_t>(t < G ? m0 : m1);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = static_cast<uint8_t>(m0), cfg.colsb[4] = 64;  // x: 32 bfloat16 inputs a row
  if (RC == 2) cfg.rows[5] = static_cast<uint8_t>(m1), cfg.colsb[5] = 64;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // the weight: 16 pairs of inputs x 16 outputs
  _tile_loadconfig(&cfg);
  int64_t nb = b0;
  for (; nb + G <= b1; nb += G) amx_blocks<RC, G>(x, M, K, w, bias, y, N, nb);
  for (; nb < b1; ++nb) amx_blocks<RC, 1>(x, M, K, w, bias, y, N, nb);
  _tile_release();
}
#endif  // KAIZEN_HAS_AMX

torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2, "decode_kernels.pack: a bfloat16 (N, K) CPU weight, got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, K2 = (K + 1) / 2;
  auto padded = torch::zeros({NB * 16, K2 * 2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NB, 16, K2, 2}).permute({0, 2, 1, 3}).contiguous();  // (NB, K2, 16, 2)
}

torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& w, int64_t N, int64_t K_w, const torch::Tensor& bias) {
  TORCH_CHECK(supported(), "decode_kernels.linear: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x_in.is_cpu() && w.is_cpu() && (!bias.defined() || bias.is_cpu()), "decode_kernels.linear: CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2, "decode_kernels.linear: x must be bfloat16 (M, K)");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.is_contiguous(),
              "decode_kernels.linear: w must come from decode_kernels.pack");
  const int64_t M = x_in.size(0), K = x_in.size(1), K2 = w.size(1), NB = w.size(0);
  const bool amx = g_amx.load() && K % 32 == 0 && M >= g_amx_min_rows.load() && M <= kMaxAmxRows;
  TORCH_CHECK(M >= 1 && (M <= kMaxRows || amx), "decode_kernels.linear: 1 to ", kMaxRows, " rows",
              g_amx.load() ? " (on AMX, inputs a multiple of 32: up to 32)" : "", ", got ", M);
  TORCH_CHECK(K == K_w && (K + 1) / 2 == K2 && N > (NB - 1) * 16 && N <= NB * 16, "decode_kernels.linear: x (", M, ", ", K,
              ") does not match a packed weight of ", N, " outputs and ", K_w, " inputs");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N &&
              bias.is_contiguous()), "decode_kernels.linear: bias must be float32 (N,)");
  torch::Tensor x = x_in.contiguous();
  if (K % 2) x = torch::constant_pad_nd(x, {0, 1});
  auto y = torch::empty({M, N}, x.options());
  const float* b = bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if KAIZEN_HAS_AMX
  if (amx) {
    const auto* xs = reinterpret_cast<const uint16_t*>(xp);
    at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
      if (M <= 16) amx_run<1>(xs, M, K, wp, b, yp, N, b0, b1);
      else amx_run<2>(xs, M, K, wp, b, yp, N, b0, b1);
    });
    return y;
  }
#endif
  const RunFn fn = kRuns[M];
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) { fn(xp, K2, wp, b, yp, N, b0, b1); });
  return y;
}

// ---------------------------------------------------------------------------------------------- attention

// e^x for x <= 0 (softmax's shifted scores), 16 at a time: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by a degree-6 polynomial (relative error ~2e-7, a float's rounding); below -87 it is 0
KAIZEN_TARGET inline __m512 exp_neg(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // (t - n) ln 2
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512 r = _mm512_scalef_ps(p, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), r, _mm512_setzero_ps());
}

KAIZEN_TARGET inline __m512 bf16_to_f32(const uint16_t* p) {  // 16 bfloat16 to float32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

KAIZEN_TARGET inline __m512 bf16_to_f32_reg(__m256i x) {  // 16 bfloat16 in a register to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// One decode step's attention for one (row, key-value head): its G query heads over T keys and values
template <int GT, int DT>  // G and D known at compile time (0: given at run time): sums kept in registers
KAIZEN_TARGET void attend(const uint16_t* q, int64_t q_head_stride, const uint16_t* k, const uint16_t* v,
                          const uint8_t* keep, int64_t T, int64_t D_, int G_, float scale, float* scores, uint16_t* out) {
  const int G = GT ? GT : G_;
  const int64_t D = DT ? DT : D_;
  const int64_t D2 = D / 32;  // whole 32s of D; D is a multiple of 16 (checked): a last half, masked
  const bool half = D % 32 != 0;
  float* s = scores;  // (G, T)
  for (int64_t t = 0; t < T; ++t) {
    if (!keep[t]) {
      for (int g = 0; g < G; ++g) s[g * T + t] = -INFINITY;
      continue;
    }
    const uint16_t* kt = k + t * D;
    for (int64_t c = 0; c < D; c += 32) {  // the keys 8 positions on, and this position's values, read next
      prefetch<3>(kt, 8 * D + c);
      prefetch<3>(v, t * D + c);
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint16_t* qg = q + g * q_head_stride;
      __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t c = 0; c < D2; ++c)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + c * 32), (__m512bh)_mm512_loadu_si512(kt + c * 32));
      if (half)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, qg + D2 * 32),
                               (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, kt + D2 * 32));
      s[g * T + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * T;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= T; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    float m = _mm512_reduce_max_ps(mx);
    for (; t < T; ++t) m = std::max(m, sg[t]);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    t = 0;
    for (; t + 16 <= T; t += 16) {
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
      _mm512_storeu_ps(sg + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < T) {
      const __mmask16 mask = (__mmask16)((1u << (T - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + t), mv)));
      _mm512_mask_storeu_ps(sg + t, mask, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
    for (t = 0; t < T; ++t) sg[t] *= inv;
  }
  // out_g = sum_t p_gt v_t, D at a time in float32 (D / 16 registers per head; D <= 256)
  __m512 acc[8][16];
  const int64_t D16 = D / 16;
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int64_t c = 0; c < D16; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; ++t) {
    if (!keep[t]) continue;
    const uint16_t* vt = v + t * D;
#pragma GCC unroll 16
    for (int64_t c = 0; c < D16; ++c) {
      const __m512 vv = bf16_to_f32(vt + c * 16);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * T + t]), vv, acc[g][c]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int64_t c = 0; c < D16; ++c)
      _mm256_storeu_si256((__m256i*)(out + g * D + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

using AttendFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, const uint8_t*, int64_t, int64_t, int, float,
                          float*, uint16_t*);

// attend compiled for common head shapes (heads of 64 with 1-5 query heads a key-value head, of 128 with 1-2: their
// G x D / 16 sums fit in registers), any other as given at run time: with G and D known the compiler keeps every sum
// in a register (SmolLM2's G 3, D 64: 2.7 -> 0.9 ms a step at 8 rows)
AttendFn attend_for(int G, int64_t D) {
  if (D == 64 && G >= 1 && G <= 5) {
    const AttendFn fns[] = {attend<1, 64>, attend<2, 64>, attend<3, 64>, attend<4, 64>, attend<5, 64>};
    return fns[G - 1];
  }
  if (D == 128 && G == 1) return attend<1, 128>;
  if (D == 128 && G == 2) return attend<2, 128>;
  return attend<0, 0>;
}

}  // namespace

// q (B, H, D) bf16 (any row and head strides, unit stride within a head); k, v (B, KV, >=T, D) bf16
// contiguous, the first T positions used; keep (B, T) bool: the positions each row attends to.
// Returns (B, H * D) bf16: softmax(q k^T * scale) v per head, in float32, rounded once.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& keep,
                        double scale) {
  TORCH_CHECK(supported(), "decode_kernels.attention: this CPU has no AVX-512 BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "decode_kernels.attention: bfloat16 q, k and v");
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu() && keep.is_cpu(), "decode_kernels.attention: CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
              k.size(1) > 0 && keep.dim() == 2, "decode_kernels.attention: q (B, H, D), k and v (B, KV, T, D) contiguous, keep (B, T)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), cap = k.size(2), T = keep.size(1);
  TORCH_CHECK(q.stride(2) == 1 && k.size(0) == B && k.size(3) == D && H % KV == 0 && H / KV <= kMaxGroup && D % 16 == 0 &&
              D <= kMaxHeadDim, "decode_kernels.attention: up to ", kMaxGroup, " query heads a key-value head, a head dimension a ",
              "multiple of 16 up to ", kMaxHeadDim);
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.size(0) == B && T <= cap && T >= 1,
              "decode_kernels.attention: keep must be bool (B, T), T at most the cache's positions");
  const int G = (int)(H / KV);
  auto out = torch::empty({B, H * D}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const auto* mp = reinterpret_cast<const uint8_t*>(keep.data_ptr<bool>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const AttendFn attend_fn = attend_for(G, D);
  at::parallel_for(0, B * KV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores((size_t)G * T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KV, h = i % KV;
      if (i + 1 < i1) {  // the next head's first keys, while this one is computed
        const uint16_t* kn = kp + (i + 1) * cap * D;
        for (int64_t c = 0; c < 8 * D; c += 32) prefetch<3>(kn, c);
      }
      attend_fn(qp + b * qs0 + h * G * qs1, qs1, kp + (b * KV + h) * cap * D, vp + (b * KV + h) * cap * D, mp + b * T, T, D, G,
             (float)scale, scores.data(), op + b * H * D + h * G * D);
    }
  });
  return out;
}

// ------------------------------------------------------------------------------- norm, rotary embedding

KAIZEN_TARGET inline __m256i f32_to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// rows b0..b1 of rms_norm
KAIZEN_TARGET static void rms_rows(const uint16_t* xp, const uint16_t* wp, uint16_t* yp, int64_t N, float eps, int64_t b0,
                                   int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* xr = xp + b * N;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < N; c += 16) {
      const __m512 v = bf16_to_f32(xr + c);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)N + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t c = 0; c < N; c += 16) {
      const __m512 h = bf16_to_f32_reg(f32_to_bf16(_mm512_mul_ps(bf16_to_f32(xr + c), rv)));
      _mm256_storeu_si256((__m256i*)(yp + b * N + c), f32_to_bf16(_mm512_mul_ps(h, bf16_to_f32(wp + c))));
    }
  }
}

// rows b0..b1 of silu_mul: x / (1 + e^-x) from e^-|x| (never overflows), the product of bfloat16 values
KAIZEN_TARGET static void silu_rows(const uint16_t* gp, uint16_t* op, int64_t I, int64_t b0, int64_t b1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* g = gp + b * 2 * I;
    for (int64_t c = 0; c < I; c += 16) {
      const __m512 x = bf16_to_f32(g + c);
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // e^-|x|
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      // x >= 0: x / (1 + e^-x); x < 0: x e^x / (e^x + 1)
      const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
      const __m512 silu = bf16_to_f32_reg(f32_to_bf16(_mm512_div_ps(num, _mm512_add_ps(one, e))));
      _mm256_storeu_si256((__m256i*)(op + b * I + c), f32_to_bf16(_mm512_mul_ps(silu, bf16_to_f32(g + I + c))));
    }
  }
}

// transformers' RMSNorm of the llama family: float32 inside, rounded to bfloat16, then times the weight
// (a bfloat16 product): y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w, double eps) {
  TORCH_CHECK(supported(), "decode_kernels.rms_norm: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x_in.is_cpu() && w.is_cpu(), "decode_kernels.rms_norm: CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x_in.dim() == 2 && w.dim() == 1 &&
              x_in.size(1) == w.size(0) && x_in.size(1) % 16 == 0 && w.is_contiguous(),
              "decode_kernels.rms_norm: bfloat16 x (B, N) and weight (N,), N a multiple of 16");
  const torch::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1);
  auto y = torch::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) { rms_rows(xp, wp, yp, N, (float)eps, b0, b1); });
  return y;
}

// rows b0..b1 of add_rms_norm
KAIZEN_TARGET static void add_rms_rows(const uint16_t* xp, const uint16_t* yp, const uint16_t* wp, uint16_t* sp, uint16_t* op,
                                       int64_t N, float eps, int64_t b0, int64_t b1) {
  for (int64_t i = b0 * N; i < b1 * N; i += 16)
    _mm256_storeu_si256((__m256i*)(sp + i), f32_to_bf16(_mm512_add_ps(bf16_to_f32(xp + i), bf16_to_f32(yp + i))));
  rms_rows(sp, wp, op, N, eps, b0, b1);
}

// x + y rounded to bfloat16 (as torch adds two bfloat16 tensors), then rms_norm of the sum: (sum, norm). Both (B, N).
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x_in, const torch::Tensor& y_in, const torch::Tensor& w, double eps) {
  TORCH_CHECK(supported(), "decode_kernels.add_rms_norm: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x_in.is_cpu() && y_in.is_cpu() && w.is_cpu(), "decode_kernels.add_rms_norm: CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && y_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              x_in.dim() == 2 && x_in.sizes() == y_in.sizes() && w.dim() == 1 && x_in.size(1) == w.size(0) && x_in.size(1) % 16 == 0 &&
              w.is_contiguous(), "decode_kernels.add_rms_norm: bfloat16 x and y (B, N) and weight (N,), N a multiple of 16");
  const torch::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1);
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* sp = reinterpret_cast<uint16_t*>(sum.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) { add_rms_rows(xp, yp, wp, sp, op, N, (float)eps, b0, b1); });
  return {sum, out};
}

// SiLU(gate) * up on gu = [gate | up] (B, 2I) bfloat16, as torch computes it on bfloat16: silu in float32
// (x / (1 + e^-x)), rounded, then the product rounded: (B, I).
torch::Tensor silu_mul(const torch::Tensor& gu_in, int64_t I) {
  TORCH_CHECK(supported(), "decode_kernels.silu_mul: this CPU has no AVX-512 BF16");
  TORCH_CHECK(gu_in.is_cpu() && gu_in.scalar_type() == at::kBFloat16 && gu_in.dim() == 2 && gu_in.size(1) == 2 * I && I % 16 == 0,
              "decode_kernels.silu_mul: bfloat16 (B, 2I), I a multiple of 16");
  const torch::Tensor gu = gu_in.contiguous();
  const int64_t B = gu.size(0);
  auto out = torch::empty({B, I}, gu.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) { silu_rows(gp, op, I, b0, b1); });
  return out;
}

// heads i0..i1 (over B x (H + 2 KV)) of rope_into_cache
KAIZEN_TARGET static void rope_heads(const uint16_t* xp, const uint16_t* cp, const uint16_t* sp, uint16_t* qp, uint16_t* kp,
                                     uint16_t* vp, int64_t H, int64_t KV, int64_t D, int64_t cap, int64_t T, int64_t i0,
                                     int64_t i1) {
  const int64_t half = D / 2;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / (H + 2 * KV), h = i % (H + 2 * KV);
    const uint16_t* x = xp + i * D;
    if (h >= H + KV) {  // a value: into the buffer as it is
      std::memcpy(vp + ((b * KV + (h - H - KV)) * cap + T) * D, x, D * sizeof(uint16_t));
      continue;
    }
    uint16_t* out = h < H ? qp + (b * H + h) * D : kp + ((b * KV + (h - H)) * cap + T) * D;
    for (int64_t c = 0; c < D; c += 16) {
      const int64_t r = c < half ? c + half : c - half;  // roll(x, D/2)[c] = x[c - D/2 mod D]
      const __m512 a = bf16_to_f32_reg(f32_to_bf16(_mm512_mul_ps(bf16_to_f32(x + c), bf16_to_f32(cp + b * D + c))));
      const __m512 e = bf16_to_f32_reg(f32_to_bf16(_mm512_mul_ps(bf16_to_f32(x + r), bf16_to_f32(sp + b * D + c))));
      _mm256_storeu_si256((__m256i*)(out + c), f32_to_bf16(_mm512_add_ps(a, e)));
    }
  }
}

// The rotary embedding of a decode step's queries and keys as the fast step computes it in bfloat16
// (q * cos + roll(q, D/2) * sin_signed, each product and the sum rounded to bfloat16), the keys and
// values written into the cache buffers at position T. qkv (B, H + 2 KV, D) contiguous; cos and sin
// (B, D); kbuf, vbuf (B, KV, cap, D) contiguous. Returns the rotated queries (B, H, D).
torch::Tensor rope_into_cache(const torch::Tensor& qkv, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                              torch::Tensor kbuf, torch::Tensor vbuf, int64_t H, int64_t T) {
  TORCH_CHECK(supported(), "decode_kernels.rope_into_cache: this CPU has no AVX-512 BF16");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos_in.scalar_type() == at::kBFloat16 && sin_in.scalar_type() == at::kBFloat16 &&
              kbuf.scalar_type() == at::kBFloat16 && vbuf.scalar_type() == at::kBFloat16, "decode_kernels.rope_into_cache: bfloat16 tensors");
  TORCH_CHECK(qkv.is_cpu() && cos_in.is_cpu() && sin_in.is_cpu() && kbuf.is_cpu() && vbuf.is_cpu(),
              "decode_kernels.rope_into_cache: CPU tensors");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && kbuf.dim() == 4 && kbuf.is_contiguous() && vbuf.is_contiguous() &&
              kbuf.sizes() == vbuf.sizes(), "decode_kernels.rope_into_cache: contiguous qkv (B, H + 2 KV, D) and buffers (B, KV, cap, D)");
  const int64_t B = qkv.size(0), D = qkv.size(2), KV = kbuf.size(1), cap = kbuf.size(2);
  TORCH_CHECK(qkv.size(1) == H + 2 * KV && kbuf.size(0) == B && kbuf.size(3) == D && D % 32 == 0 && T >= 0 && T < cap,
              "decode_kernels.rope_into_cache: shapes (D a multiple of 32, T within the buffers)");
  const torch::Tensor cs = cos_in.reshape({B, D}).contiguous(), sn = sin_in.reshape({B, D}).contiguous();
  auto q = torch::empty({B, H, D}, qkv.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cs.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sn.data_ptr<at::BFloat16>());
  auto* qp = reinterpret_cast<uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<uint16_t*>(kbuf.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<uint16_t*>(vbuf.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * (H + 2 * KV), 64, [&](int64_t i0, int64_t i1) { rope_heads(xp, cp, sp, qp, kp, vp, H, KV, D, cap, T, i0, i1); });
  return q;
}

// ---------------------------------------------------------------------------------------------- sampling
//
// What the engine's sampler computes from a step's float32 logits, without top-p or top logprobs: per row,
// the logits divided by its temperature (a row at temperature <= 0 takes the most likely token), the
// log-softmax, and a token drawn by inverse CDF at u; returns (tokens, their log-probabilities). torch
// took 0.6-1.1 ms for this at 8 rows of SmolLM2's 49,152 on one core (its exp and argmax are not
// vectorised there); this takes two passes over each row.
constexpr int64_t kSampleBlock = 256;  // the inverse CDF's first level: sums of 256 probabilities

// the lanes of x[i .. i + 16) within V
inline __mmask16 lanes(int64_t i, int64_t V) { return i + 16 <= V ? (__mmask16)0xFFFF : (__mmask16)((1u << (V - i)) - 1); }

// 16 logits from i on (those past V 0), divided by the temperature when ``divide``
KAIZEN_TARGET inline __m512 scaled16(const float* x, int64_t i, __mmask16 k, bool divide, __m512 tv) {
  const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
  return divide ? _mm512_div_ps(v, tv) : v;
}

KAIZEN_TARGET static void sample_row(const float* x, int64_t V, float temp, float u, float* sums, int64_t* token, float* logp) {
  const bool greedy = temp <= 0.0f;
  const bool divide = !greedy && temp != 1.0f;
  const __m512 tv = _mm512_set1_ps(divide ? temp : 1.0f);
#define KAIZEN_MASK(i) lanes(i, V)
#define KAIZEN_LOAD(i, k) scaled16(x, i, k, divide, tv)
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < V; i += 16) mv = _mm512_mask_max_ps(mv, KAIZEN_MASK(i), mv, KAIZEN_LOAD(i, KAIZEN_MASK(i)));
  const float m = _mm512_reduce_max_ps(mv);
  if (!(m > -INFINITY)) {  // nothing allowed (or NaN): the first token, at -inf
    *token = 0;
    *logp = -INFINITY;
    return;
  }
  const __m512 mb = _mm512_set1_ps(m);
  const int64_t blocks = (V + kSampleBlock - 1) / kSampleBlock;
  float total = 0.0f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m512 acc = _mm512_setzero_ps();
    const int64_t end = std::min(V, (blk + 1) * kSampleBlock);
    for (int64_t i = blk * kSampleBlock; i < end; i += 16)
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(KAIZEN_MASK(i), exp_neg(_mm512_sub_ps(KAIZEN_LOAD(i, KAIZEN_MASK(i)), mb))));
    sums[blk] = _mm512_reduce_add_ps(acc);
    total += sums[blk];
  }
  const float logz = m + std::log(total);
  int64_t tok = -1;
  if (greedy) {  // the first position of the largest (as torch's argmax)
    for (int64_t i = 0; i < V && tok < 0; i += 16) {
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(KAIZEN_MASK(i), KAIZEN_LOAD(i, KAIZEN_MASK(i)), mb, _CMP_EQ_OQ);
      if (hit) tok = i + __builtin_ctz((unsigned)hit);
    }
  } else {
    const float target = std::max(u * total, 1e-12f);
    float cum = 0.0f;
    int64_t blk = 0;
    while (blk + 1 < blocks && cum + sums[blk] < target) cum += sums[blk++];
    while (blk > 0 && !(sums[blk] > 0.0f)) --blk;  // the sums' rounding ran past every block with a token above 0
    // within the block, one probability at a time; a rounding at its edge lands on its last token above 0
    const int64_t end = std::min(V, (blk + 1) * kSampleBlock);
    alignas(64) float p[16];
    int64_t last = -1;
    for (int64_t i = blk * kSampleBlock; i < end && tok < 0; i += 16) {
      _mm512_store_ps(p, _mm512_maskz_mov_ps(KAIZEN_MASK(i), exp_neg(_mm512_sub_ps(KAIZEN_LOAD(i, KAIZEN_MASK(i)), mb))));
      for (int j = 0; j < 16 && i + j < end; ++j) {
        if (!(p[j] > 0.0f)) continue;
        last = i + j;
        cum += p[j];
        if (cum >= target) {
          tok = last;
          break;
        }
      }
    }
    if (tok < 0) tok = last >= 0 ? last : blk * kSampleBlock;
  }
  const float xt = divide ? x[tok] / temp : x[tok];
  *token = tok;
  *logp = xt - logz;
#undef KAIZEN_MASK
#undef KAIZEN_LOAD
}

// logits (B, V) float32, temperatures (B,) float32, u (B,) float32 in [0, 1): (tokens (B,) int64, their
// log-probabilities under the temperature (B,) float32)
std::vector<torch::Tensor> sample(const torch::Tensor& logits_in, const torch::Tensor& temps_in, const torch::Tensor& u_in) {
  TORCH_CHECK(supported(), "decode_kernels.sample: this CPU has no AVX-512 BF16");
  TORCH_CHECK(logits_in.is_cpu() && logits_in.scalar_type() == at::kFloat && logits_in.dim() == 2 && logits_in.size(1) >= 1,
              "decode_kernels.sample: float32 logits (B, V)");
  const int64_t B = logits_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(temps_in.numel() == B && u_in.numel() == B, "decode_kernels.sample: a temperature and a u a row");
  const torch::Tensor logits = logits_in.contiguous(), temps = temps_in.to(at::kFloat).contiguous(), u = u_in.to(at::kFloat).contiguous();
  auto tokens = torch::empty({B}, logits.options().dtype(at::kLong));
  auto logps = torch::empty({B}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* kp = tokens.data_ptr<int64_t>();
  float* lp = logps.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums((size_t)((V + kSampleBlock - 1) / kSampleBlock));
    for (int64_t b = b0; b < b1; ++b) sample_row(xp + b * V, V, tp[b], up[b], sums.data(), kp + b, lp + b);
  });
  return {tokens, logps};
}

// ----------------------------------------------------------------------------------- a step's layers
//
// The decode step's layers as one call: what fast_decode.FastDecoder._step does a layer on the kernels, in
// the same order on the same values (so the same bits), without the ~15 calls from Python a layer (0.3-1.5 ms
// of a 12-15 ms step of SmolLM2 on one core, by sitting). Each layer's weights are given once (``DecodeLayers``);
// a step gives its inputs, the cache buffers and its adapters' terms.
class DecodeLayers {
 public:
  // per layer: its four products' packed weights (qkv, o, gate_up, down), their float32 biases (empty: none),
  // their outputs, and its two norms' weights (input, post-attention)
  DecodeLayers(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases, std::vector<int64_t> outs,
               std::vector<int64_t> inputs, std::vector<torch::Tensor> norms, int64_t heads, int64_t intermediate, double eps)
      : w_(std::move(weights)), b_(std::move(biases)), n_(std::move(outs)), k_(std::move(inputs)), norms_(std::move(norms)),
        H_(heads), I_(intermediate), eps_(eps) {
    L_ = (int64_t)w_.size() / 4;
    TORCH_CHECK(L_ >= 1 && (int64_t)w_.size() == 4 * L_ && (int64_t)b_.size() == 4 * L_ && (int64_t)n_.size() == 4 * L_ &&
                (int64_t)k_.size() == 4 * L_ && (int64_t)norms_.size() == 2 * L_,
                "decode_kernels.DecodeLayers: 4 products and 2 norms a layer");
  }
  int64_t layers() const { return L_; }

  // x (B, hidden) the residual stream, h its input norm for the first layer; cos, sin (B, 1, D) bfloat16 (sin's first
  // half negated); keep (B, T + 1) bool; kbufs, vbufs a layer each (B, KV, cap, D), position T written here.
  // Adapters: groups of rows (rows[g] a long tensor, or empty: every row), and lora[((g * L + layer) * 4 + product) * 2]
  // its A (in, r) and [.. + 1] its B (r, out), scaling folded in (empty: that product not adapted).
  // Returns [x after the last layer, then each layer's keys and values over positions 0..T].
  std::vector<torch::Tensor> run(torch::Tensor x, torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& keep, int64_t T, double scale, const std::vector<torch::Tensor>& kbufs,
                                 const std::vector<torch::Tensor>& vbufs, const std::vector<torch::Tensor>& rows,
                                 const std::vector<torch::Tensor>& lora) const {
    TORCH_CHECK((int64_t)kbufs.size() == L_ && (int64_t)vbufs.size() == L_, "decode_kernels.DecodeLayers.run: a cache buffer a layer");
    TORCH_CHECK(lora.size() == rows.size() * (size_t)L_ * 8, "decode_kernels.DecodeLayers.run: 8 adapter tensors a layer a group");
    const int64_t B = x.size(0), D = kbufs[0].size(3), KV = kbufs[0].size(1);
    std::vector<torch::Tensor> out;
    out.reserve(1 + 2 * L_);
    out.push_back(torch::Tensor());
    auto product = [&](int64_t li, int j, const torch::Tensor& in) {
      const int64_t p = li * 4 + j;
      torch::Tensor y = linear(in, w_[p], n_[p], k_[p], b_[p]);
      for (size_t g = 0; g < rows.size(); ++g) {  // as fast_decode._apply: each adapter's term on its rows
        const size_t at = ((g * L_ + li) * 4 + j) * 2;
        const torch::Tensor &a = lora[at], &b = lora[at + 1];
        if (!a.defined() || a.numel() == 0) continue;
        if (!rows[g].defined() || rows[g].numel() == 0) y = y + at::matmul(at::matmul(in, a), b);
        else y = y.index_add(0, rows[g], at::matmul(at::matmul(in.index_select(0, rows[g]), a), b));
      }
      return y;
    };
    for (int64_t li = 0; li < L_; ++li) {
      const torch::Tensor qkv = product(li, 0, h).view({B, H_ + 2 * KV, D});
      const torch::Tensor q = rope_into_cache(qkv, cos, sin, kbufs[li], vbufs[li], H_, T);
      out.push_back(kbufs[li].narrow(2, 0, T + 1));
      out.push_back(vbufs[li].narrow(2, 0, T + 1));
      const torch::Tensor a = attention(q, kbufs[li], vbufs[li], keep, scale);
      std::vector<torch::Tensor> xh = add_rms_norm(x, product(li, 1, a), norms_[2 * li + 1], eps_);
      x = xh[0];
      const torch::Tensor act = silu_mul(product(li, 2, xh[1]), I_);
      const torch::Tensor down = product(li, 3, act);
      if (li + 1 < L_) {
        xh = add_rms_norm(x, down, norms_[2 * (li + 1)], eps_);
        x = xh[0];
        h = xh[1];
      } else {
        x = x + down;
      }
    }
    out[0] = x;
    return out;
  }

 private:
  std::vector<torch::Tensor> w_, b_;
  std::vector<int64_t> n_, k_;
  std::vector<torch::Tensor> norms_;
  int64_t L_ = 0, H_, I_;
  double eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // each call lets go of the GIL, as torch's own ops do: the server's thread runs while the engine's computes
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("supported", &supported, "whether this CPU has AVX-512 BF16");
  m.def("pack", &pack, "a bfloat16 (N, K) weight in the layout linear reads", nogil());
  m.def("linear", &linear, "x (M <= 8, K) @ W.T + bias: W (N outputs, K inputs) packed by pack, bias float32 or empty", nogil());
  m.def("attention", &attention, "a decode step's attention: q (B, H, D), k and v (B, KV, >=T, D), keep (B, T)", nogil());
  m.def("rms_norm", &rms_norm, "transformers' llama RMSNorm in bfloat16: x (B, N), weight (N,), eps", nogil());
  m.def("add_rms_norm", &add_rms_norm, "(x + y, rms_norm(x + y)) in bfloat16: x, y (B, N), weight (N,), eps", nogil());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up on [gate | up] (B, 2I) in bfloat16", nogil());
  m.def("rope_into_cache", &rope_into_cache, "rotary embedding of q and k, k and v into the cache at T; returns q", nogil());
  m.def("amx_enable", &amx_enable, "ask Linux for AMX's tiles; true when granted (products may then run on AMX)");
  m.def("set_amx_min_rows", &set_amx_min_rows, "from how many rows on a product runs on AMX (once enabled)");
  m.def("sample", &sample, "tokens and their log-probabilities from float32 logits (B, V), temperatures and u (B,)", nogil());
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<torch::Tensor>, int64_t, int64_t, double>())
      .def("layers", &DecodeLayers::layers)
      .def("run", &DecodeLayers::run, "a decode step's layers (see decode_kernels.cpp)", nogil());
  m.attr("MAX_ROWS") = kMaxRows;
  m.attr("MAX_AMX_ROWS") = kMaxAmxRows;
  m.attr("MAX_GROUP") = kMaxGroup;
  m.attr("MAX_HEAD_DIM") = kMaxHeadDim;
}
