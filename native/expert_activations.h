// The expert kernels' activations (experts_kernel.h): their dtype, their layout, their preparation
// from x, and the activation function that forms h from a tile's gate and up results (ExpertForm).
// Included by experts_kernel.h inside each ISA's anonymous namespace.
//
// Activations (xs: x converted, h) are tile-interleaved: per group of TB tokens, per block of `step`
// elements along K (one vector of weights: 64 bytes), the TB tokens' blocks one after another, so a
// tile step reads TB consecutive vectors from one pointer (few registers for addresses, no 4 KiB
// aliasing between tokens, a chunk of K is one contiguous run).

// Element (t, k) of tile-interleaved activations with K elements per token. kSplit: within each
// block of `step` elements, its even elements first, then its odd ones (kSplitPairs below).
template <int TB, int64_t step, bool kSplit = false> constexpr int64_t act_index(int64_t t, int64_t k, int64_t K) {
  const int64_t j = k % step;
  return t / TB * TB * K + k / step * TB * step + t % TB * step + (kSplit ? (j & 1) * (step / 2) + j / 2 : j);
}

// How a tile multiplies (the kernels' template argument M):
constexpr int kFma = 0;         // fp32 FMAs; weights widened to fp32 W at a time (Simd::load_f32)
constexpr int kDotPairs = 1;    // VDPBF16PS on bf16 pairs; bf16 activations
// fp32 FMAs on bf16 weights read 2W at a time and widened by one op per W (Simd::bf16_even/odd: the
// pairs' even and odd elements); fp32 activations stored split the same way (act_index kSplit).
// load_f32 takes two ops per W, on the ports the FMAs use. On a Sapphire Rapids-class core (one
// thread, expert in L2) this is faster: avx2 +25% at 1 token, +10% at 6-8; avx512 +12% at 1, +4-12%
// at 4-8.
constexpr int kSplitPairs = 2;

// Activations in bf16 when both stages can use pairwise bf16 dot products, else fp32.
DType expert_activation_dtype(const ExpertProblem& P) {
  constexpr int64_t K = 2 * Simd::W;
  const bool dp = Simd::kDpbf16 && P.w_dtype == DType::bf16 && P.hidden % K == 0 && P.inter % K == 0;
  return dp ? DType::bf16 : DType::f32;
}

// bf16 weights through fp32 FMAs, both stages in kSplitPairs (K a multiple of 2W; vector ISAs only).
bool expert_split_pairs(const ExpertProblem& P) {
  constexpr int64_t K = 2 * Simd::W;
  return Simd::W >= 8 && expert_activation_dtype(P) == DType::f32 && P.w_dtype == DType::bf16 &&
         P.hidden % K == 0 && P.inter % K == 0;
}

// n elements (a multiple of W) of dtype In → fp32 or bf16, W at a time.
template <DType In, DType Out>
inline void convert_row(const typename Elem<In>::type* src, typename Elem<Out>::type* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += Simd::W) {
    const Simd::V v = Simd::load_f32<In>(src + i);
    if constexpr (Out == DType::f32) Simd::store(dst + i, v);
    else Simd::store_bf16(dst + i, v);
  }
}

template <DType Out>
inline void convert_row_from(const void* src, DType in, typename Elem<Out>::type* dst, int64_t n) {
  switch (in) {
    case DType::f32: return convert_row<DType::f32, Out>(static_cast<const float*>(src), dst, n);
    case DType::bf16: return convert_row<DType::bf16, Out>(static_cast<const uint16_t*>(src), dst, n);
    default: return convert_row<DType::f16, Out>(static_cast<const uint16_t*>(src), dst, n);
  }
}

// Tokens [t_begin, t_end) of the padded activation scratch xs (n_pad × H, tile-interleaved for
// TB tokens per tile, from token t_first on: a narrower last group starts there); padding tokens
// are zero.
template <class AT, int TB, bool kSplit = false>
void prepare_x_tokens(const ExpertProblem& P, AT* xs, int64_t t_begin, int64_t t_end, int64_t t_first = 0) {
  if constexpr (Simd::W % TB != 0) {  // the layout of the kernel that expert_stage falls back to
    return prepare_x_tokens<AT, 1, kSplit>(P, xs, t_begin, t_end, t_first);
  }
  constexpr DType Out = sizeof(AT) == 2 ? DType::bf16 : DType::f32;
  constexpr int64_t step = Out == DType::bf16 || kSplit ? 2 * Simd::W : Simd::W;  // as the kernels step
  const int64_t H = P.hidden;
  alignas(64) AT block[step];  // kSplit: one block in order, before its even and odd elements part
  for (int64_t t = t_begin; t < t_end; ++t) {
    const char* src = static_cast<const char*>(P.x) + t * P.x_stride * int64_t(dtype_size(P.x_dtype));
    for (int64_t k = 0; k < H; k += step) {
      AT* dst = xs + t_first * H + act_index<TB, step, kSplit>(t - t_first, k, H);
      if (t >= P.n_tokens) {
        for (int64_t d = 0; d < step; ++d) dst[d] = AT(0);
      } else if constexpr (kSplit) {
        convert_row_from<Out>(src + k * int64_t(dtype_size(P.x_dtype)), P.x_dtype, block, step);
        for (int64_t j = 0; j < step; ++j) dst[(j & 1) * (step / 2) + j / 2] = block[j];
      } else {
        convert_row_from<Out>(src + k * int64_t(dtype_size(P.x_dtype)), P.x_dtype, dst, step);
      }
    }
  }
}

template <class AT, bool kSplit = false>
void prepare_x_as(const ExpertProblem& P, AT* xs, const ExpertTiling& T, int64_t t_begin, int64_t t_end) {
  const int64_t last = T.n_pad - T.last_tile_tokens;  // the last group's first token
  for (int64_t t = t_begin; t < t_end; ++t) {
    if (T.last_tile_tokens != T.tokens_per_tile && t >= last) {  // a narrower last group
      if (T.last_tile_tokens == 1) prepare_x_tokens<AT, 1, kSplit>(P, xs, t, t + 1, last);
      else prepare_x_tokens<AT, 2, kSplit>(P, xs, t, t + 1, last);
      continue;
    }
    switch (T.tokens_per_tile) {
      case 1: prepare_x_tokens<AT, 1, kSplit>(P, xs, t, t + 1); break;
      case 4: prepare_x_tokens<AT, 4, kSplit>(P, xs, t, t + 1); break;
      default: prepare_x_tokens<AT, 8, kSplit>(P, xs, t, t + 1);
    }
  }
}

void expert_prepare_x(const ExpertProblem& P, void* xs, const ExpertTiling& T, int64_t t_begin, int64_t t_end) {
  if (expert_activation_dtype(P) == DType::bf16)
    prepare_x_as(P, static_cast<uint16_t*>(xs), T, t_begin, t_end);
  else if (expert_split_pairs(P))
    prepare_x_as<float, true>(P, static_cast<float*>(xs), T, t_begin, t_end);
  else
    prepare_x_as(P, static_cast<float*>(xs), T, t_begin, t_end);
}

// -- The intermediate's activation function (ExpertForm::act) -------------------------------------
// Applied to one vector of a tile's fp32 results (lane r·TB + t of the vector tiles, or 16 elements of
// an AMX tile), after the biases are added. Its cost is one vector per RB·H (or 16·H) multiply-adds.

// silu(g)·u = g·u / (1 + e^−g), with e^−g = 2^(−g·log2 e): exp2's clamp at 2^−126 leaves silu(g) = g
// for large g, and its overflow to inf gives −0 for very negative g.
inline Simd::V swiglu(Simd::V g, Simd::V u) {
  const Simd::V e = Simd::exp2(Simd::mul(g, Simd::set1(-1.4426950408889634f)));
  return Simd::div(Simd::mul(g, u), Simd::add(Simd::set1(1.0f), e));
}

// gpt-oss: g = min(g, limit), u = clamp(u, ±limit), (u + 1)·g·σ(alpha·g) = (u + 1)·g / (1 + 2^(−alpha·g·log2 e)),
// the same exp2 as swiglu (its limits give the same large-|g| behaviour).
inline Simd::V clamped_swiglu(Simd::V g, Simd::V u, float alpha, float limit) {
  g = Simd::min(g, Simd::set1(limit));
  u = Simd::max(Simd::min(u, Simd::set1(limit)), Simd::set1(-limit));
  const Simd::V e = Simd::exp2(Simd::mul(g, Simd::set1(-1.4426950408889634f * alpha)));
  return Simd::div(Simd::mul(g, Simd::add(u, Simd::set1(1.0f))), Simd::add(Simd::set1(1.0f), e));
}

// The form's activation of one vector of gate and up results (biases added).
TANDEM_ALWAYS_INLINE Simd::V expert_act(const ExpertForm& f, Simd::V g, Simd::V u) {
  return f.act == ExpertAct::clamped_swiglu ? clamped_swiglu(g, u, f.alpha, f.limit) : swiglu(g, u);
}

// A vector tile's biases: bias[row0 + r] (fp32 from `d`) in lane r·tb + t for r < RB rows, t < tb
// tokens; the other lanes 0.
template <int RB> inline Simd::V tile_bias(const void* bias, DType d, int64_t row0, int tb) {
  alignas(64) float lanes[Simd::W] = {};
  for (int r = 0; r < RB; ++r) {
    const float b = load_as_f32(bias, d, row0 + r);
    for (int t = 0; t < tb; ++t) lanes[r * tb + t] = b;
  }
  return Simd::load(lanes);
}
