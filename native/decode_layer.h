// One decoder layer's decode step on the CPU, as one call, for B sequences of one token each: the
// weights in GGUF blocks, the activations fp32, each sequence's KV cache rows read and written in place.
//
//   x ← x + o · attention(rope(qkv · norm₁(x)))           the attention half, K and V stored at `write_row`
//   normed ← norm₂(x)
//   x ← x + down · (silu(gate · normed) ⊙ up · normed)    the FFN half, where the layer's FFN is dense
//
// The same kernels as the per-operation path (quant_matmul, rms_norm, add_rms_norm, rope_rotate_half,
// attention_decode), in the same order and precision, so the two agree up to SiLU's exp. A MoE layer
// builds its plan without the FFN half; given its router and quantised experts (`set_routed`), the step
// routes `normed` and adds the experts' output itself (moe_route.h, quant_moe.h), else the caller does.
// What the call saves is the dispatch between those kernels: at one token of a small model each is
// µs of work, and as torch operations and modules a layer cost about as much again in the interpreter.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common.h"
#include "interleaved16.h"
#include "moe_route.h"
#include "quant_blocks.h"

namespace tandem {

// One matrix in blocks: its rows' address, type, row count and row bytes (quant_matmul's parts).
struct BlockMatrix {
  const uint8_t* w;
  QType type;
  int64_t rows, row_bytes;
  const Interleaved16* interleaved = nullptr;  // its rows re-laid for one-token products (interleaved16.h), or null
};

struct DecodeLayerShape {
  int64_t dim, n_heads, n_kv_heads, head_dim, rotary, ffn;  // ffn 0: no FFN half (a MoE layer)
  int64_t kv_slots;                                        // rows of each cache
  float norm_eps, qk_norm_eps, scale;                      // scale: the softmax's on q·k
};

struct DecodeLayerWeights {
  const float* norm1;                      // (dim,)
  const float* norm2;                      // (dim,)
  const float* q_norm;                     // (head_dim,) per-head norms of q and k before RoPE, or null
  const float* k_norm;
  std::vector<BlockMatrix> qkv;            // rows q (nh·hs), k (n_kv·hs), v (n_kv·hs), one after another
  const float* qkv_bias;                   // ((nh + 2·n_kv)·hs,) or null
  std::vector<BlockMatrix> o;              // (dim, nh·hs)
  std::vector<BlockMatrix> gate_up;        // (2·ffn, dim): gate rows, then up rows
  std::vector<BlockMatrix> down;           // (dim, ffn)
  void* k_cache;                           // (slots, n_kv, hs) contiguous, kv_dtype
  void* v_cache;
  DType kv_dtype;
};

class DecodeLayer {
 public:
  DecodeLayer(const DecodeLayerShape& shape, DecodeLayerWeights weights);

  // B tokens, one a sequence: x (B, dim) fp32 in/out; normed (B, dim) out; cos, sin (B, rotary) each
  // token's angles. Sequence b's rows of the cache, in order, are runs [offsets[b], offsets[b + 1]) of
  // runs (R, 2) = (first slot, count) of consecutive slots; write_rows[b], among them, takes its token's
  // K and V.
  // Returns whether x has the FFN half: a dense layer's always, a MoE layer's where it has its experts
  // (set_routed) and B ≤ their max_tokens.
  bool step(float* x, float* normed, const float* cos, const float* sin, int64_t B, const int64_t* write_rows,
            const int64_t* runs, const int64_t* offsets, int n_threads);

  // A MoE layer's router and experts (a layer without the dense FFN half only).
  void set_routed(RoutedExperts routed);

  bool has_ffn() const { return shape_.ffn > 0; }
  int64_t dim() const { return shape_.dim; }
  int64_t kv_slots() const { return shape_.kv_slots; }

 private:
  // y (B, Σ rows) = x (B, k; rows x_stride apart) · [W₁; W₂; …]ᵀ
  void matmul(const std::vector<BlockMatrix>& w, int64_t k, const float* x, int64_t x_stride, int64_t B, float* y,
              int n_threads) const;
  void attention(const float* cos, const float* sin, int64_t B, const int64_t* write_rows, const int64_t* runs,
                 const int64_t* offsets, int n_threads);
  void reserve(int64_t B);
  // A Q4_0/Q4_1 matrix's interleaved copy, kept for this layer's one-token products where the ISA reads
  // them and the process's budget has room (interleaved16.h); else null.
  const Interleaved16* keep_copy(const uint8_t* w, QType type, int64_t rows, int64_t k, int64_t row_bytes);

  DecodeLayerShape shape_;
  DecodeLayerWeights w_;
  std::vector<float> xn_, qkv_, attn_, lse_, o_, gate_up_;  // scratch of one step, B rows each
  RoutedExperts routed_;                                    // n_experts 0: the caller's
  MoeRoute route_;
  std::vector<KVBlock> blocks_;                             // the step's runs as the attention's blocks
  std::vector<std::unique_ptr<InterleavedCopy>> copies_;    // the products' interleaved copies (w_'s views)
};

}  // namespace tandem
