// decode_layer.h: a decoder layer's step for one token, composed of the kernels the per-operation
// path calls one by one.
#include "decode_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "convert.h"
#include "layer_ops.h"

namespace tandem {

namespace {

constexpr size_t kMaxParts = 4;  // a product's matrices: q, k and v may each be of another type

int64_t total_rows(const std::vector<BlockMatrix>& w) {
  int64_t n = 0;
  for (const BlockMatrix& m : w) n += m.rows;
  return n;
}

}  // namespace

DecodeLayer::DecodeLayer(const DecodeLayerShape& shape, DecodeLayerWeights weights)
    : shape_(shape), w_(std::move(weights)) {
  const DecodeLayerShape& s = shape_;
  const int64_t q_width = s.n_heads * s.head_dim, kv_width = s.n_kv_heads * s.head_dim;
  if (s.dim <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads)
    throw std::invalid_argument("dim and head counts must be positive, n_heads a multiple of n_kv_heads");
  if (s.head_dim < 16 || s.head_dim > kMaxHeadDim || s.head_dim % 16)
    throw std::invalid_argument("head_dim must be a multiple of 16 in [16, 256]");
  if (s.rotary < 2 || s.rotary % 2 || s.rotary > s.head_dim) throw std::invalid_argument("rotary must be even, ≤ head_dim");
  if (total_rows(w_.qkv) != q_width + 2 * kv_width) throw std::invalid_argument("qkv rows must be (nh + 2·n_kv)·hs");
  if (total_rows(w_.o) != s.dim) throw std::invalid_argument("o rows must be dim");
  if (s.ffn > 0 && (total_rows(w_.gate_up) != 2 * s.ffn || total_rows(w_.down) != s.dim))
    throw std::invalid_argument("gate_up rows must be 2·ffn and down rows dim");
  for (const auto* w : {&w_.qkv, &w_.o, &w_.gate_up, &w_.down})
    if (w->size() > kMaxParts) throw std::invalid_argument("a product has at most 4 matrices");
  if (!w_.norm1 || !w_.norm2 || !w_.k_cache || !w_.v_cache) throw std::invalid_argument("null pointer");
  if (bool(w_.q_norm) != bool(w_.k_norm)) throw std::invalid_argument("q_norm and k_norm come together");
  auto interleave = [this](std::vector<BlockMatrix>& w, int64_t k) {
    for (BlockMatrix& m : w) m.interleaved = keep_copy(m.w, m.type, m.rows, k, m.row_bytes);
  };
  interleave(w_.qkv, s.dim), interleave(w_.o, q_width), interleave(w_.gate_up, s.dim), interleave(w_.down, s.ffn);
}

const Interleaved16* DecodeLayer::keep_copy(const uint8_t* w, QType type, int64_t rows, int64_t k, int64_t row_bytes) {
  if (!active_quant_table().interleaved_rows) return nullptr;  // this ISA's one-token products read rows
  auto copy = std::make_unique<InterleavedCopy>(w, type, rows, k, row_bytes);
  const Interleaved16* view = copy->view();
  if (view) copies_.push_back(std::move(copy));
  return view;
}

void DecodeLayer::reserve(int64_t B) {
  const DecodeLayerShape& s = shape_;
  const size_t b = size_t(B), q_width = size_t(s.n_heads * s.head_dim), kv_width = size_t(s.n_kv_heads * s.head_dim);
  if (xn_.size() >= b * size_t(s.dim)) return;
  xn_.resize(b * size_t(s.dim));
  qkv_.resize(b * (q_width + 2 * kv_width));
  attn_.resize(b * q_width);
  lse_.resize(b * size_t(s.n_heads));
  o_.resize(b * size_t(s.dim));
  gate_up_.resize(b * size_t(2 * s.ffn));
}

void DecodeLayer::matmul(const std::vector<BlockMatrix>& w, int64_t k, const float* x, int64_t x_stride, int64_t B,
                         float* y, int n_threads) const {
  QuantMatmulProblem parts[kMaxParts];
  const int64_t width = total_rows(w);  // y's row: every part's rows one after another
  int n = 0;
  int64_t column = 0;
  for (const BlockMatrix& m : w) {
    parts[n++] = {m.w, m.type, m.rows, k, m.row_bytes, x, B, x_stride, y + column, width, m.interleaved};
    column += m.rows;
  }
  quant_matmul(parts, n, n_threads);
}

void DecodeLayer::attention(const float* cos, const float* sin, int64_t B, const int64_t* write_rows,
                            const int64_t* runs, const int64_t* offsets, int n_threads) {
  const DecodeLayerShape& s = shape_;
  const int64_t hs = s.head_dim, q_width = s.n_heads * hs, kv_width = s.n_kv_heads * hs;
  const int64_t width = q_width + 2 * kv_width;  // a token's row of qkv_: q, k, v
  float* q = qkv_.data();
  float* k = q + q_width;
  for (int64_t b = 0; b < B && w_.q_norm; ++b) {  // each head normed on its own (Qwen3), before RoPE
    rms_norm(q + b * width, hs, w_.q_norm, q + b * width, hs, s.n_heads, hs, s.qk_norm_eps, 1);
    rms_norm(k + b * width, hs, w_.k_norm, k + b * width, hs, s.n_kv_heads, hs, s.qk_norm_eps, 1);
  }
  rope_rotate_half(q, B, width, s.n_heads, hs, s.rotary, cos, sin, 1);
  rope_rotate_half(k, B, width, s.n_kv_heads, hs, s.rotary, cos, sin, 1);
  for (int64_t b = 0; b < B; ++b) {  // each token's row of the cache, in the cache's dtype
    const float* kb = k + b * width;
    const float* vb = kb + kv_width;
    for (int64_t i = 0; i < kv_width; ++i) {
      store_from_f32(w_.k_cache, w_.kv_dtype, write_rows[b] * kv_width + i, kb[i]);
      store_from_f32(w_.v_cache, w_.kv_dtype, write_rows[b] * kv_width + i, vb[i]);
    }
  }
  const int64_t row_bytes = kv_width * int64_t(dtype_size(w_.kv_dtype));
  const int64_t k_base = reinterpret_cast<int64_t>(w_.k_cache), v_base = reinterpret_cast<int64_t>(w_.v_cache);
  const int64_t n_runs = offsets[B];
  blocks_.resize(size_t(n_runs));
  for (int64_t i = 0; i < n_runs; ++i) {
    const int64_t first = runs[2 * i], count = runs[2 * i + 1];
    blocks_[size_t(i)] = {k_base + first * row_bytes, v_base + first * row_bytes, count, hs, kv_width, hs, kv_width};
  }
  const AttentionProblem p{q, DType::f32, B, 1, s.n_heads, hs, width, hs, hs, blocks_.data(), offsets,
                           s.n_kv_heads, w_.kv_dtype, s.scale, attn_.data(), lse_.data()};
  attention_decode(p, n_threads);  // → attn_ (B, nh, hs)
}

void DecodeLayer::set_routed(RoutedExperts routed) {
  if (shape_.ffn > 0) throw std::invalid_argument("a layer with a dense FFN has no routed experts");
  if (!routed.router || routed.n_experts < 1 || routed.top_k < 1 || routed.top_k > routed.n_experts)
    throw std::invalid_argument("a router of E ≥ 1 experts choosing 1 ≤ k ≤ E");
  if (int64_t(routed.group.size()) != routed.n_experts || routed.blocks.empty())
    throw std::invalid_argument("every expert needs its group, and there is at least one");
  for (int64_t g : routed.group)
    if (g < 0 || g >= int64_t(routed.blocks.size())) throw std::invalid_argument("an expert's group is out of range");
  routed_ = std::move(routed);
  const int64_t H = shape_.dim, I = routed_.inter;
  const QType gt = routed_.gate_type, ut = routed_.up_type, dt = routed_.down_type;
  for (QuantMoeExpert& e : routed_.blocks) {  // a decode step's experts mostly have one pair each
    e.gate_rows = keep_copy(e.gate, gt, I, H, quant_row_bytes(gt, H));
    e.up_rows = keep_copy(e.up, ut, I, H, quant_row_bytes(ut, H));
    e.down_rows = keep_copy(e.down, dt, H, I, quant_row_bytes(dt, I));
  }
}

bool DecodeLayer::step(float* x, float* normed, const float* cos, const float* sin, int64_t B,
                       const int64_t* write_rows, const int64_t* runs, const int64_t* offsets, int n_threads) {
  const DecodeLayerShape& s = shape_;
  const int64_t q_width = s.n_heads * s.head_dim, width = q_width + 2 * s.n_kv_heads * s.head_dim;
  reserve(B);
  rms_norm(x, s.dim, w_.norm1, xn_.data(), s.dim, B, s.dim, s.norm_eps, 1);
  matmul(w_.qkv, s.dim, xn_.data(), s.dim, B, qkv_.data(), n_threads);  // (B, (nh + 2·n_kv)·hs)
  if (w_.qkv_bias)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < width; ++i) qkv_[size_t(b * width + i)] += w_.qkv_bias[i];
  attention(cos, sin, B, write_rows, runs, offsets, n_threads);  // → attn_ (B, nh·hs)
  matmul(w_.o, q_width, attn_.data(), q_width, B, o_.data(), n_threads);  // (B, dim)
  add_rms_norm(x, o_.data(), w_.norm2, x, normed, B, s.dim, s.norm_eps, 1);  // x += o; normed = norm₂(x)
  if (s.ffn == 0) {
    if (routed_.n_experts == 0 || B > routed_.max_tokens) return false;
    std::fill(o_.begin(), o_.begin() + B * s.dim, 0.0f);  // (B, dim) the experts' sum
    quant_moe(route_.route(routed_, normed, s.dim, B, s.dim, o_.data(), s.dim, n_threads), n_threads);
    for (int64_t i = 0; i < B * s.dim; ++i) x[i] += o_[size_t(i)];
    return true;
  }
  matmul(w_.gate_up, s.dim, normed, s.dim, B, gate_up_.data(), n_threads);  // (B, 2·ffn): gate, then up
  for (int64_t b = 0; b < B; ++b) {
    float* act = gate_up_.data() + b * 2 * s.ffn;
    const float* up = act + s.ffn;
    for (int64_t i = 0; i < s.ffn; ++i) {
      const float g = act[i];
      act[i] = g / (1.0f + std::exp(-g)) * up[i];  // SiLU(gate) · up, in place over gate
    }
  }
  matmul(w_.down, s.ffn, gate_up_.data(), 2 * s.ffn, B, o_.data(), n_threads);  // (B, dim)
  for (int64_t i = 0; i < B * s.dim; ++i) x[i] += o_[size_t(i)];
  return true;
}

}  // namespace tandem
