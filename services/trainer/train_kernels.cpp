// The Trainer's kernels for bfloat16 on a CPU (services/trainer/train_kernels.py says why and when).
//
// RMSNorm, forward and backward, one pass over a row each. It rounds where transformers' llama RMSNorm
// rounds, so the outputs are its: y = bf16(w * bf16(x * rstd)), rstd = 1 / sqrt(mean(x^2) + eps) in float32,
// its mean summed in another order (so an output can round the other way, rarely). The backward is the
// derivative autograd takes through those ops, the weight frozen: gx = bf16(rstd gh - x rstd^3 mean(gh x)),
// gh = bf16(g w).
//
// The response tokens' statistics (services/trainer/token_stats.py): z = logits / temperature, each
// sampled token's log-softmax and each position's entropy, from two passes over a position's logits
// (max; then the sums of e^(z - max) and e^(z - max) (z - max)); the backward, one pass writing the
// gradient p (-g_ent (log p + H) - g_lp) / temperature, plus g_lp / temperature at the sampled token.
//
// Plain C++ that the compiler vectorises (AVX2 and FMA; -fno-trapping-math lets it turn the selects into
// blends); rows or positions split over torch's threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf2f(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// round to nearest even, as torch's conversion (NaN stays a quiet NaN)
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t r = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7fc0) : r;
}

inline float round_bf(float f) { return bf2f(f2bf(f)); }

// the sum of term(0 .. n-1) in 16 running sums, so that the loop vectorises without reordering licence
template <typename F>
inline float row_sum(int64_t n, F term) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += term(i + j);
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += acc[j];
  for (; i < n; ++i) total += term(i);
  return total;
}

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.device().is_cpu(), "train_kernels: ", what, " must be bfloat16 on the CPU");
}

// one row of RMSNorm: y from x, the weight and rstd (returned)
float norm_row(const uint16_t* __restrict x, const uint16_t* __restrict w, uint16_t* __restrict y, int64_t H, float eps) {
  const float ss = row_sum(H, [&](int64_t i) {
    const float v = bf2f(x[i]);
    return v * v;
  });
  const float s = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = f2bf(bf2f(w[i]) * round_bf(bf2f(x[i]) * s));
  return s;
}

// one row of RMSNorm's gradient to x
void norm_grad_row(const uint16_t* __restrict g, const uint16_t* __restrict x, const uint16_t* __restrict w,
                   uint16_t* __restrict gx, int64_t H, float s) {
  // the sum of (the gradient at the normalised x) * x
  const float dot = row_sum(H, [&](int64_t i) { return round_bf(bf2f(g[i]) * bf2f(w[i])) * bf2f(x[i]); });
  const float c = s * s * s * dot / static_cast<float>(H);
  for (int64_t i = 0; i < H; ++i) gx[i] = f2bf(round_bf(bf2f(g[i]) * bf2f(w[i])) * s - bf2f(x[i]) * c);
}

// e^x for x <= 0: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial (relative
// error ~2e-7, a float's rounding); below -87 it is 0. Branch-free, so the loops over it vectorise.
inline float exp_neg(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float t = xc * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// one position's statistics over its V logits z = x / temperature: (max, sum e^(z - max), sum e^(z - max) (z - max))
struct RowSums {
  float max, sum, dot;
};

RowSums row_sums(const uint16_t* __restrict x, int64_t V, float inv_t) {
  float acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] = std::max(acc[j], bf2f(x[i + j]) * inv_t);
  float m = -INFINITY;
  for (int j = 0; j < 16; ++j) m = std::max(m, acc[j]);
  for (; i < V; ++i) m = std::max(m, bf2f(x[i]) * inv_t);
  const float sum = row_sum(V, [&](int64_t k) { return exp_neg(bf2f(x[k]) * inv_t - m); });
  const float dot = row_sum(V, [&](int64_t k) {
    const float d = bf2f(x[k]) * inv_t - m;
    return exp_neg(d) * d;
  });
  return {m, sum, dot};
}

// one position's gradient to its logits: p (inv_t (-g_ent (log p + H) - g_lp)) + [the sampled token] g_lp inv_t
void row_grad(const uint16_t* __restrict x, uint16_t* __restrict out, int64_t V, float inv_t, float lse, float ent,
              float g_lp, float g_ent) {
  for (int64_t i = 0; i < V; ++i) {
    const float logp = bf2f(x[i]) * inv_t - lse;
    out[i] = f2bf(exp_neg(logp) * inv_t * (-g_ent * (logp + ent) - g_lp));
  }
}

constexpr int64_t kGrainRows = 8;

}  // namespace

// RMSNorm's forward on x (..., H): (y bf16 (..., H), rstd float32 (rows,))
std::vector<torch::Tensor> rms_norm_forward(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  check_bf16(x_in, "x");
  check_bf16(w_in, "weight");
  const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(w.numel() == H, "train_kernels.rms_norm_forward: weight has ", w.numel(), " values, x's rows ", H);
  torch::Tensor y = torch::empty_like(x);
  torch::Tensor rstd = torch::empty({N}, x.options().dtype(torch::kFloat32));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  float* rp = rstd.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, N, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rp[r] = norm_row(xp + r * H, wp, yp + r * H, H, epsf);
  });
  return {y, rstd};
}

// RMSNorm's backward to x (the weight frozen): gx bf16 (..., H) from g, x, weight and the forward's rstd
torch::Tensor rms_norm_backward(const torch::Tensor& g_in, const torch::Tensor& x_in, const torch::Tensor& w_in,
                                const torch::Tensor& rstd_in) {
  check_bf16(g_in, "grad");
  check_bf16(x_in, "x");
  check_bf16(w_in, "weight");
  const torch::Tensor g = g_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(g.sizes() == x.sizes() && rstd.numel() == N && rstd.scalar_type() == torch::kFloat32,
              "train_kernels.rms_norm_backward: grad, x and rstd do not match");
  torch::Tensor gx = torch::empty_like(x);
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(gx.data_ptr());
  const float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_grad_row(gp + r * H, xp + r * H, wp, op + r * H, H, rp[r]);
  });
  return gx;
}

// What a training step needs from the logits at the response positions (services/trainer/token_stats.py):
// logits (B, R', V) bfloat16, R' >= R; inv_t (B,) float32, 1 / each row's temperature; targets (B, R) int64.
// Returns (logprob of each target, entropy of each position, log-sum-exp of each position), each (B, R) float32.
std::vector<torch::Tensor> token_stats_forward(const torch::Tensor& logits_in, const torch::Tensor& inv_t_in,
                                               const torch::Tensor& targets_in) {
  check_bf16(logits_in, "logits");
  const torch::Tensor logits = logits_in.contiguous(), targets = targets_in.contiguous().to(torch::kInt64);
  const torch::Tensor inv_t = inv_t_in.contiguous().to(torch::kFloat32);
  TORCH_CHECK(logits.dim() == 3 && targets.dim() == 2 && targets.size(0) == logits.size(0) && targets.size(1) <= logits.size(1)
                  && inv_t.numel() == logits.size(0),
              "train_kernels.token_stats_forward: logits (B, R', V), inv_t (B,), targets (B, R <= R')");
  const int64_t B = targets.size(0), R = targets.size(1), Rp = logits.size(1), V = logits.size(2);
  TORCH_CHECK(targets.numel() == 0 || (targets.min().item<int64_t>() >= 0 && targets.max().item<int64_t>() < V),
              "train_kernels.token_stats_forward: a target lies outside the vocabulary of ", V);
  const auto opts = logits.options().dtype(torch::kFloat32);
  torch::Tensor lp = torch::empty({B, R}, opts), ent = torch::empty({B, R}, opts), lse = torch::empty({B, R}, opts);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(logits.data_ptr());
  const int64_t* tp = targets.data_ptr<int64_t>();
  const float* ip = inv_t.data_ptr<float>();
  float *lpp = lp.data_ptr<float>(), *ep = ent.data_ptr<float>(), *sp = lse.data_ptr<float>();
  at::parallel_for(0, B * R, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / R, r = p % R;
      const uint16_t* x = xp + (b * Rp + r) * V;
      const int64_t t = tp[p];
      const RowSums s = row_sums(x, V, ip[b]);
      const float log_sum = std::log(s.sum);
      sp[p] = s.max + log_sum;
      lpp[p] = bf2f(x[t]) * ip[b] - sp[p];
      ep[p] = log_sum - s.dot / s.sum;
    }
  });
  return {lp, ent, lse};
}

// The gradient to the logits (B, R', V) bfloat16 of sum(g_lp * logprob) + sum(g_ent * entropy) (either may be
// empty: no gradient through it), from the forward's lse and entropy; positions past R get 0
torch::Tensor token_stats_backward(const torch::Tensor& logits_in, const torch::Tensor& inv_t_in, const torch::Tensor& targets_in,
                                   const torch::Tensor& lse_in, const torch::Tensor& ent_in, const torch::Tensor& g_lp_in,
                                   const torch::Tensor& g_ent_in) {
  check_bf16(logits_in, "logits");
  const torch::Tensor logits = logits_in.contiguous(), targets = targets_in.contiguous().to(torch::kInt64);
  const torch::Tensor inv_t = inv_t_in.contiguous().to(torch::kFloat32), lse = lse_in.contiguous(), ent = ent_in.contiguous();
  const int64_t B = targets.size(0), R = targets.size(1), Rp = logits.size(1), V = logits.size(2);
  const bool has_lp = g_lp_in.numel() > 0, has_ent = g_ent_in.numel() > 0;
  const torch::Tensor g_lp = has_lp ? g_lp_in.contiguous().to(torch::kFloat32) : g_lp_in;
  const torch::Tensor g_ent = has_ent ? g_ent_in.contiguous().to(torch::kFloat32) : g_ent_in;
  TORCH_CHECK(lse.numel() == B * R && ent.numel() == B * R && (!has_lp || g_lp.numel() == B * R) && (!has_ent || g_ent.numel() == B * R),
              "train_kernels.token_stats_backward: lse, entropy and the gradients must be (B, R)");
  torch::Tensor grad = Rp > R ? torch::zeros_like(logits) : torch::empty_like(logits);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(logits.data_ptr());
  uint16_t* gp = reinterpret_cast<uint16_t*>(grad.data_ptr());
  const int64_t* tp = targets.data_ptr<int64_t>();
  const float *ip = inv_t.data_ptr<float>(), *sp = lse.data_ptr<float>(), *ep = ent.data_ptr<float>();
  const float* glp = has_lp ? g_lp.data_ptr<float>() : nullptr;
  const float* gep = has_ent ? g_ent.data_ptr<float>() : nullptr;
  at::parallel_for(0, B * R, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / R, r = p % R, at = (b * Rp + r) * V;
      const float gl = glp ? glp[p] : 0.0f, ge = gep ? gep[p] : 0.0f;
      row_grad(xp + at, gp + at, V, ip[b], sp[p], ep[p], gl, ge);
      const int64_t t = tp[p];  // the sampled token's: its own term too, summed in float32 before rounding
      const float logp = bf2f(xp[at + t]) * ip[b] - sp[p];
      gp[at + t] = f2bf(std::exp(logp) * ip[b] * (-ge * (logp + ep[p]) - gl) + gl * ip[b]);
    }
  });
  return grad;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm_forward", &rms_norm_forward, "llama RMSNorm in bfloat16: (y, rstd) from x (..., H), weight (H,), eps", nogil());
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm's gradient to x: grad, x, weight, rstd", nogil());
  m.def("token_stats_forward", &token_stats_forward, "(logprobs, entropy, lse) (B, R) from bfloat16 logits (B, R', V)", nogil());
  m.def("token_stats_backward", &token_stats_backward, "the gradient to the logits of the logprobs and entropy", nogil());
}
