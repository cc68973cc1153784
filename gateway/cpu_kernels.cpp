// The local engine's CPU kernels, where torch's ops leave most of the memory rate unused
// (`machine.cpu_kernels` builds them with -march=native, so the compiler vectorizes the inner
// loops, and says what they replace). fp32 or bf16 in and out, fp32 inside.
//
// gemv: one-row matmul, y = W x (+ residual, in place), W an [out, in] weight with contiguous
// rows. Each thread of torch's pool takes a contiguous block of rows (at::parallel_for hands
// each thread one block) and reads it front to back, one dot product at a time: one sequential
// stream per core. x may first go through the op before the matmul in a Llama layer, as
// transformers computes it (rounded as it rounds in bf16): RMSNorm with a weight, or SwiGLU
// (x = gate | up -> silu(gate) * up).
//
// decode_attention: a decode step's attention: per (row, kv head), RoPE on the token's key and
// queries, its key and value written into the cache, then the queries of the whole group (GQA)
// over the row's keys and values, each read once, softmax in between.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
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
void rows(const T* w, const float* x, Out* y, const Out* residual, int64_t n_in, int64_t begin,
          int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    float v = dot(w + o * n_in, x, n_in);
    y[o] = static_cast<Out>(residual ? static_cast<float>(residual[o]) + v : v);
  }
}

inline float exp_nonpositive(float x) {  // Cephes' expf, vectorizable; x <= 0
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round (floor: no SIMD)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);  // p * 2^n
}

struct Attention {
  int64_t heads, kv_heads, group, dim, qkv_row, cache_row, cache_head, cache_pos;
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

template <typename T>  // rotate-half RoPE of one head, sin's first half negated (as _llama._rope)
void rope(const T* x, const T* cos, const T* sin, int64_t d, float scale, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i)
    out[i] = (widen(x[i]) * widen(cos[i]) + widen(x[i + half]) * widen(sin[i])) * scale;
#pragma omp simd
  for (int64_t i = half; i < d; ++i)
    out[i] = (widen(x[i]) * widen(cos[i]) + widen(x[i - half]) * widen(sin[i])) * scale;
}

// T reads the tensors (float, or bf16 as its bits), Out writes them (float, at::BFloat16).
template <int64_t D, typename T, typename Out>  // D: head_dim if 64 or 128 (faster), else 0
void attend(const Attention& a, const T* qkv, const T* cos, const T* sin, T* k_cache,
            T* v_cache, const int64_t* positions, Out* out, int64_t begin, int64_t end) {
  const int64_t g = a.group, d = D ? D : a.dim;
  std::vector<float> query(g * d), acc(g * d), key(d), weights;
  for (int64_t task = begin; task < end; ++task) {  // task = row * kv_heads + kv head
    const int64_t row = task / a.kv_heads, kv = task % a.kv_heads, head = kv * g;
    const int64_t n = positions[row] + 1;
    const T *x = qkv + row * a.qkv_row, *c = cos + row * d, *s = sin + row * d;
    T* keys = k_cache + row * a.cache_row + kv * a.cache_head;
    T* values = v_cache + row * a.cache_row + kv * a.cache_head;
    // This token's key (rotated) and value, into the cache at its position.
    rope(x + (a.heads + kv) * d, c, s, d, 1.0f, key.data());
    Out* k_out = reinterpret_cast<Out*>(keys + (n - 1) * a.cache_pos);
    Out* v_out = reinterpret_cast<Out*>(values + (n - 1) * a.cache_pos);
    const T* v_new = x + (a.heads + a.kv_heads + kv) * d;
    for (int64_t i = 0; i < d; ++i) {
      k_out[i] = static_cast<Out>(key[i]);
      v_out[i] = static_cast<Out>(widen(v_new[i]));
    }
    for (int64_t j = 0; j < g; ++j) rope(x + (head + j) * d, c, s, d, a.scale, &query[j * d]);
    weights.resize(g * n);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t j = 0; j < g; ++j)
        weights[j * n + p] = D ? dot_fixed<D>(keys + p * a.cache_pos, &query[j * d])
                               : dot(keys + p * a.cache_pos, &query[j * d], d);
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
      const T* vp = values + p * a.cache_pos;
      for (int64_t j = 0; j < g; ++j) {
        const float w = weights[j * n + p];
        float* o = &acc[j * d];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += w * widen(vp[i]);
      }
    }
    Out* o = out + row * (a.heads * d) + head * d;
    for (int64_t i = 0; i < g * d; ++i) o[i] = static_cast<Out>(acc[i]);
  }
}

template <typename T, typename Out>
void run_attention(const Attention& a, const T* qkv, const T* cos, const T* sin, T* k_cache,
                   T* v_cache, const int64_t* positions, Out* out, int64_t begin, int64_t end) {
  if (a.dim == 64)
    attend<64>(a, qkv, cos, sin, k_cache, v_cache, positions, out, begin, end);
  else if (a.dim == 128)
    attend<128>(a, qkv, cos, sin, k_cache, v_cache, positions, out, begin, end);
  else
    attend<0>(a, qkv, cos, sin, k_cache, v_cache, positions, out, begin, end);
}

template <typename T>
T* raw(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
float as_stored(float v) {  // v rounded to T, as torch stores an intermediate
  if constexpr (std::is_same_v<T, float>) return v;
  else return static_cast<float>(at::BFloat16(v));
}

// gemv's input in fp32, into `in` [n]: x, RMSNorm(x) * norm, or silu(gate) * up for x = gate |
// up. Vectorizable: silu(g) = g / (1 + e^-g), e^-|g| from exp_nonpositive.
template <typename T>
void gemv_input(const T* x, int64_t n, const T* norm, float eps, bool glu, float* in) {
  if (glu) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = widen(x[i]), e = exp_nonpositive(-std::abs(g));
      const float silu = as_stored<T>(g * ((g >= 0 ? 1.0f : e) / (1.0f + e)));
      in[i] = as_stored<T>(silu * widen(x[n + i]));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) in[i] = widen(x[i]);
  }
  if (norm) {
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += in[i] * in[i];
    const float inv = 1.0f / std::sqrt(squares / n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      in[i] = as_stored<T>(widen(norm[i]) * as_stored<T>(in[i] * inv));
  }
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                               torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor positions, int64_t heads, double scale) {
  // qkv [rows, (heads + 2 kv_heads) * dim]: one token per row, its q, k and v heads in that
  // order; cos, sin [rows, 1, dim] at each token's position; k_cache, v_cache [cache rows,
  // kv_heads, capacity, dim]; positions [rows] int64. Row r's key (RoPE'd) and value are
  // written at its position in cache row r, then its queries attend over positions [0, it].
  // Returns [rows, heads * dim].
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(3);
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16,
              "decode_attention: float32 or bfloat16 only");
  for (const auto& t : {cos, sin, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == dtype, "decode_attention: one dtype for every tensor");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && kv_heads > 0 && heads % kv_heads == 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "decode_attention: qkv must be [rows, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim,
              "decode_attention: cos, sin must be [rows, 1, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                  k_cache.size(0) >= rows,
              "decode_attention: k_cache, v_cache alike, [cache rows, kv_heads, capacity, dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
                  positions.numel() == rows,
              "decode_attention: positions must be [rows] int64");
  const int64_t* P = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(P[r] >= 0 && P[r] < k_cache.size(2), "decode_attention: position past capacity");
  const Attention a{heads,           kv_heads,          heads / kv_heads,
                    dim,             qkv.size(1),       k_cache.stride(0),
                    k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale)};
  auto out = torch::empty({rows, heads * dim}, qkv.options());
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t b, int64_t e) {
    if (dtype == torch::kFloat)
      run_attention(a, raw<float>(qkv), raw<float>(cos), raw<float>(sin), raw<float>(k_cache),
                    raw<float>(v_cache), P, out.data_ptr<float>(), b, e);
    else
      run_attention(a, raw<uint16_t>(qkv), raw<uint16_t>(cos), raw<uint16_t>(sin),
                    raw<uint16_t>(k_cache), raw<uint16_t>(v_cache), P,
                    out.data_ptr<at::BFloat16>(), b, e);
  });
  return out;
}

// Checks x ([rows, in], or [rows, 2 in] with glu) and norm ([in]) for the ops before a matmul.
void check_input(const torch::Tensor& x, int64_t n_in, const std::optional<torch::Tensor>& norm,
                 bool glu, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == (glu ? 2 : 1) * n_in, op,
              ": x must be a contiguous [rows, in] ([rows, 2 in] with glu)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, op, ": float32 or bfloat16");
  TORCH_CHECK(!norm || (norm->scalar_type() == dtype && norm->is_contiguous() &&
                        norm->numel() == n_in),
              op, ": norm must be a contiguous [in] of x's dtype");
}

torch::Tensor layer_input(torch::Tensor x, std::optional<torch::Tensor> norm, double eps,
                          bool glu) {
  // x [rows, in] (with glu [rows, 2 in]) -> [rows, in]: what gemv multiplies, for a matmul of
  // many rows (torch's RMSNorm and SwiGLU take several ops, each waking the threads).
  const int64_t n_rows = x.size(0), n_in = glu ? x.size(1) / 2 : x.size(1);
  check_input(x, n_in, norm, glu, "layer_input");
  auto out = torch::empty({n_rows, n_in}, x.options());
  auto run = [&](auto* X, auto* N, auto* Y) {
    at::parallel_for(0, n_rows, 1, [&](int64_t b, int64_t e) {
      std::vector<float> in(n_in);
      for (int64_t r = b; r < e; ++r) {
        gemv_input(X + r * x.size(1), n_in, N, eps, glu, in.data());
        for (int64_t i = 0; i < n_in; ++i) Y[r * n_in + i] = in[i];
      }
    });
  };
  if (x.scalar_type() == torch::kFloat)
    run(raw<float>(x), norm ? raw<float>(*norm) : nullptr, raw<float>(out));
  else
    run(raw<uint16_t>(x), norm ? raw<uint16_t>(*norm) : nullptr, raw<at::BFloat16>(out));
  return out;
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> residual,
                   std::optional<torch::Tensor> norm, double eps, bool glu) {
  // x [1, in] (with glu [1, 2 in]); w [out, in]; residual [1, out], added to in place;
  // norm [in]: x is RMS-normed and scaled by it first.
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "gemv: w must be a contiguous [out, in] of x's dtype");
  const int64_t n_out = w.size(0), n_in = w.size(1);
  check_input(x, n_in, norm, glu, "gemv");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.size(0) == 1, "gemv: x must be one row");
  torch::Tensor y = residual ? *residual : torch::empty({1, n_out}, x.options());
  TORCH_CHECK(y.scalar_type() == dtype && y.is_contiguous() && y.numel() == n_out,
              "gemv: residual must be a contiguous [1, out] of x's dtype");
  auto run = [&](auto* X, auto* N, auto* W, auto* Y) {
    std::vector<float> in(n_in);
    gemv_input(X, n_in, N, eps, glu, in.data());
    const auto* R = residual ? Y : nullptr;
    at::parallel_for(0, n_out, 1, [&](int64_t b, int64_t e) {
      rows(W, in.data(), Y, R, n_in, b, e);
    });
  };
  if (dtype == torch::kFloat)
    run(raw<float>(x), norm ? raw<float>(*norm) : nullptr, raw<float>(w), raw<float>(y));
  else
    run(raw<uint16_t>(x), norm ? raw<uint16_t>(*norm) : nullptr, raw<uint16_t>(w),
        raw<at::BFloat16>(y));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, py::arg("x"), py::arg("w"), py::arg("residual") = py::none(),
        py::arg("norm") = py::none(), py::arg("eps") = 0.0, py::arg("glu") = false);
  m.def("layer_input", &layer_input, py::arg("x"), py::arg("norm") = py::none(),
        py::arg("eps") = 0.0, py::arg("glu") = false);
  m.def("decode_attention", &decode_attention);
}
