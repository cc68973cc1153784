// The local engine's CPU kernels, where torch's ops leave most of the memory rate unused
// (`machine.cpu_kernels` builds them with -march=native, so the compiler vectorizes the inner
// loops, and says what they replace). fp32 or bf16 in and out, fp32 inside.
//
// gemv: one-row matmul, y = W x (+ residual, in place), W an [out, in] weight with contiguous
// rows. Each thread of torch's pool takes a contiguous block of rows and reads it front to back,
// one dot product at a time: one sequential stream per core.
//
// decode_attention: one query token per cache row over that row's keys and values, each
// (row, kv head) read once for its whole query group (GQA), softmax in between.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 32;  // independent partial sums: several vector FMAs in flight

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bf16 bits -> fp32
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T, typename U>
float dot(const T* __restrict w, const U* __restrict x, int64_t n) {
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

inline float exp_nonpositive(float x) {  // Cephes' expf, vectorizable; x <= 0
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Attention {
  int64_t kv_heads, group, dim, q_row, q_head, kv_task, kv_pos;
  float scale;
};

template <int64_t D, typename T>  // a dot product of D (a head's dim) held in registers
float dot_fixed(const T* __restrict k, const float* __restrict q) {
  float acc[8] = {};
  for (int64_t i = 0; i < D; i += 8) {
#pragma omp simd
    for (int64_t l = 0; l < 8; ++l) acc[l] += widen(k[i + l]) * q[i + l];
  }
  float sum = 0;
  for (int64_t l = 0; l < 8; ++l) sum += acc[l];
  return sum;
}

template <int64_t D, typename T, typename Out>  // D: head_dim if 64 or 128 (faster), else 0
void attend(const Attention& a, const T* q, const T* k, const T* v, const int64_t* lengths,
            Out* out, int64_t begin, int64_t end) {
  const int64_t g = a.group, d = D ? D : a.dim;
  std::vector<float> query(g * d), acc(g * d), weights;
  for (int64_t task = begin; task < end; ++task) {  // task = row * kv_heads + kv head
    const int64_t row = task / a.kv_heads, head = task % a.kv_heads * g, n = lengths[row];
    const T* keys = k + task * a.kv_task;
    const T* values = v + task * a.kv_task;
    for (int64_t j = 0; j < g; ++j) {
      const T* qj = q + row * a.q_row + (head + j) * a.q_head;
      for (int64_t i = 0; i < d; ++i) query[j * d + i] = widen(qj[i]) * a.scale;
    }
    weights.resize(g * n);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t j = 0; j < g; ++j)
        weights[j * n + p] = D ? dot_fixed<D>(keys + p * a.kv_pos, &query[j * d])
                               : dot(keys + p * a.kv_pos, &query[j * d], d);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < g; ++j) {
      float* w = &weights[j * n];
      float top = *std::max_element(w, w + n), total = 0;
#pragma omp simd reduction(+ : total)
      for (int64_t p = 0; p < n; ++p) {
        w[p] = exp_nonpositive(w[p] - top);
        total += w[p];
      }
      const float inv = 1.0f / total;
      for (int64_t p = 0; p < n; ++p) w[p] *= inv;
    }
    for (int64_t p = 0; p < n; ++p) {
      const T* vp = values + p * a.kv_pos;
      for (int64_t j = 0; j < g; ++j) {
        const float w = weights[j * n + p];
        float* o = &acc[j * d];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += w * widen(vp[i]);
      }
    }
    Out* o = out + row * (a.kv_heads * g * d) + head * d;
    for (int64_t i = 0; i < g * d; ++i) o[i] = static_cast<Out>(acc[i]);
  }
}

template <typename T, typename Out>
void run_attention(const Attention& a, const T* q, const T* k, const T* v, const int64_t* lengths,
                   Out* out, int64_t begin, int64_t end) {
  if (a.dim == 64)
    attend<64>(a, q, k, v, lengths, out, begin, end);
  else if (a.dim == 128)
    attend<128>(a, q, k, v, lengths, out, begin, end);
  else
    attend<0>(a, q, k, v, lengths, out, begin, end);
}

template <typename T>
const T* raw(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor lengths, double scale) {
  // q [rows, heads, dim]; k, v [rows * kv_heads, width, dim]; lengths [rows] (int64): keys
  // [0, lengths[r]) of row r are attended to. Returns [rows, heads * dim].
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q, k, v are 3-d");
  TORCH_CHECK(k.strides() == v.strides() && k.sizes() == v.sizes(), "decode_attention: k, v alike");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "decode_attention: contiguous head_dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "decode_attention: one dtype");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(0) % rows == 0 && heads % (k.size(0) / rows) == 0 && k.size(2) == dim,
              "decode_attention: shapes");
  auto lens = lengths.to(torch::kLong).contiguous();
  TORCH_CHECK(lens.numel() == rows && lens.max().item<int64_t>() <= k.size(1) &&
                  lens.min().item<int64_t>() >= 1,
              "decode_attention: every length in [1, width]");
  const int64_t kv_heads = k.size(0) / rows;
  const Attention a{kv_heads, heads / kv_heads, dim, q.stride(0), q.stride(1), k.stride(0),
                    k.stride(1), static_cast<float>(scale)};
  auto out = torch::empty({rows, heads * dim}, q.options());
  const int64_t* L = lens.data_ptr<int64_t>();
  const bool fp32 = q.scalar_type() == torch::kFloat;
  TORCH_CHECK(fp32 || q.scalar_type() == torch::kBFloat16, "decode_attention: fp32 or bf16 only");
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t b, int64_t e) {
    if (fp32)
      run_attention(a, raw<float>(q), raw<float>(k), raw<float>(v), L, out.data_ptr<float>(), b, e);
    else
      run_attention(a, raw<uint16_t>(q), raw<uint16_t>(k), raw<uint16_t>(v), L,
                    out.data_ptr<at::BFloat16>(), b, e);
  });
  return out;
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv);
  m.def("decode_attention", &decode_attention);
}
