// The hf engine's decode products at 1-8 rows on a CPU with AVX-512 BF16 (engines/gemv.py says why and when).
//
// y (M, N) = x (M, K) @ W.T (+ bias), bf16 in and out, float32 accumulation. W is packed once as
// (N/16 blocks, K/2 pairs, 16 outputs, 2): each (block, pair) is one 64-byte line, so a product streams
// the weight once, in order, and each line feeds one VDPBF16PS per row of x (x's pair broadcast); the
// 16 lanes hold 16 outputs, so nothing is summed across lanes.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define KAIZEN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int kMaxRows = 8;

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
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w0 + (r * K2 + k) * 32);
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

torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "gemv.pack: a bfloat16 (N, K) weight, got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, K2 = (K + 1) / 2;
  auto padded = torch::zeros({NB * 16, K2 * 2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NB, 16, K2, 2}).permute({0, 2, 1, 3}).contiguous();  // (NB, K2, 16, 2)
}

torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& w, int64_t N, const torch::Tensor& bias) {
  TORCH_CHECK(supported(), "gemv.linear: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2, "gemv.linear: x must be bfloat16 (M, K)");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.is_contiguous(),
              "gemv.linear: w must come from gemv.pack");
  const int64_t M = x_in.size(0), K = x_in.size(1), K2 = w.size(1), NB = w.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "gemv.linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK((K + 1) / 2 == K2 && N > (NB - 1) * 16 && N <= NB * 16, "gemv.linear: x (", M, ", ", K,
              ") does not match a packed weight of ", N, " outputs and ", K2 * 2, " inputs");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N &&
              bias.is_contiguous()), "gemv.linear: bias must be float32 (N,)");
  torch::Tensor x = x_in.contiguous();
  if (K % 2) x = torch::constant_pad_nd(x, {0, 1});
  auto y = torch::empty({M, N}, x.options());
  const float* b = bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const RunFn fn = kRuns[M];
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) { fn(xp, K2, wp, b, yp, N, b0, b1); });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU has AVX-512 BF16");
  m.def("pack", &pack, "a bfloat16 (N, K) weight in the layout linear reads");
  m.def("linear", &linear, "x (M <= 8, K) @ W.T + bias, W packed by pack, bias float32 or empty");
  m.attr("MAX_ROWS") = kMaxRows;
}
