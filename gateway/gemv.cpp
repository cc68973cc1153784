// One-row matmul for the local engine's decode steps: y = W x (+ residual, in place), W an
// [out, in] weight with contiguous rows, fp32 or bf16, summed in fp32. Each thread of torch's
// pool takes a contiguous block of rows and reads it front to back, one dot product at a time:
// one sequential stream per core, which reads the weights as fast as a plain reduction over
// them does (`machine.fast_gemv` says what MKL's GEMV reaches). Built on first use by
// torch.utils.cpp_extension with -march=native, so the compiler vectorizes the inner loops.
#include <torch/extension.h>

#include <cstring>

namespace {

constexpr int64_t LANES = 32;  // independent partial sums: several vector FMAs in flight

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bf16 bits -> fp32
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T>
float dot(const T* __restrict w, const T* __restrict x, int64_t n) {
  float acc[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
#pragma omp simd
    for (int64_t j = 0; j < LANES; ++j) acc[j] += widen(w[i + j]) * widen(x[i + j]);
  }
  float sum = 0;
  for (int64_t j = 0; j < LANES; ++j) sum += acc[j];
  for (; i < n; ++i) sum += widen(w[i]) * widen(x[i]);
  return sum;
}

template <typename T, typename Out>
void rows(const T* w, const T* x, Out* y, const Out* residual, int64_t n_in, int64_t begin,
          int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    float v = dot(w + o * n_in, x, n_in);
    y[o] = static_cast<Out>(residual ? static_cast<float>(residual[o]) + v : v);
  }
}

}  // namespace

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "gemv: x must be [1, in]");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && w.size(1) == x.size(1),
              "gemv: w must be [out, in] with contiguous rows");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "gemv: x and w must have one dtype");
  const int64_t n_out = w.size(0), n_in = w.size(1), stride = w.stride(0);
  TORCH_CHECK(stride == n_in, "gemv: w's rows must be adjacent");
  torch::Tensor y = residual ? *residual : torch::empty({1, n_out}, x.options());
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.is_contiguous() && y.numel() == n_out,
              "gemv: residual must be a contiguous [1, out] of x's dtype");
  const int64_t grain = std::max<int64_t>(1, (n_out + at::get_num_threads() - 1) /
                                                 std::max(1, at::get_num_threads()));
  if (x.scalar_type() == torch::kFloat) {
    const float *W = w.data_ptr<float>(), *X = x.data_ptr<float>();
    float* Y = y.data_ptr<float>();
    const float* R = residual ? Y : nullptr;
    at::parallel_for(0, n_out, grain, [&](int64_t b, int64_t e) { rows(W, X, Y, R, n_in, b, e); });
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "gemv: float32 or bfloat16 only");
    auto W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    auto X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    at::BFloat16* Y = y.data_ptr<at::BFloat16>();
    const at::BFloat16* R = residual ? Y : nullptr;
    at::parallel_for(0, n_out, grain, [&](int64_t b, int64_t e) { rows(W, X, Y, R, n_in, b, e); });
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv); }
