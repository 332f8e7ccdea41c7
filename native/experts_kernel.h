// SwiGLU expert FFN pieces for one thread: y = down · (silu(gate·x) ⊙ (up·x)). Written once over
// `Simd`; each ISA translation unit includes this inside an anonymous namespace.
//
// Both stages are "weight rows × tokens" dot products. A tile is RB weight rows × TB tokens with
// RB·TB = W accumulators, reduced together into one vector (lane r·TB + t). Weight rows stream from
// DRAM once per call; the activations (≤ 256 tokens) come from L1/L2 for every tile.

// Activations in bf16 when both stages can use pairwise bf16 dot products, else fp32.
DType expert_activation_dtype(const ExpertProblem& P) {
  constexpr int64_t K = 2 * Simd::W;
  const bool dp = Simd::kDpbf16 && P.w_dtype == DType::bf16 && P.hidden % K == 0 && P.inter % K == 0;
  return dp ? DType::bf16 : DType::f32;
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

// Tokens [t_begin, t_end) of the padded activation scratch xs (n_pad, H); padding tokens are zero.
void expert_prepare_x(const ExpertProblem& P, void* xs, int64_t n_pad, int64_t t_begin, int64_t t_end) {
  (void)n_pad;
  const int64_t H = P.hidden;
  const bool bf16 = expert_activation_dtype(P) == DType::bf16;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const void* src = static_cast<const char*>(P.x) + t * P.x_stride * int64_t(dtype_size(P.x_dtype));
    if (bf16) {
      uint16_t* dst = static_cast<uint16_t*>(xs) + t * H;
      if (t < P.n_tokens) convert_row_from<DType::bf16>(src, P.x_dtype, dst, H);
      else for (int64_t d = 0; d < H; ++d) dst[d] = 0;
    } else {
      float* dst = static_cast<float*>(xs) + t * H;
      if (t < P.n_tokens) convert_row_from<DType::f32>(src, P.x_dtype, dst, H);
      else for (int64_t d = 0; d < H; ++d) dst[d] = 0.0f;
    }
  }
}

// Weights are prefetched this far ahead of their use: a thread's rows are one contiguous run, but
// the hardware prefetchers stop at every 4 KiB page (a 2048-wide bf16 row), and a single core must
// keep many lines in flight to read at DRAM speed.
constexpr int64_t kWeightPrefetchBytes = 2048;

// Prefetch the line kWeightPrefetchBytes past element k of `row` (K elements), continuing into
// `after` (the row read next) past the end.
template <class WT> TANDEM_ALWAYS_INLINE void prefetch_ahead(const WT* row, int64_t k, int64_t K, const WT* after) {
  const int64_t ahead = k + kWeightPrefetchBytes / int64_t(sizeof(WT));
  Simd::prefetch(ahead < K ? row + ahead : after + (ahead - K));
}

// Lane r·TB + t = w[r] · a[t] over K elements (lanes past RB·TB: 0); a holds TB rows of K contiguous
// activations.
// Few tokens (TB < 4, memory-bound): each weight row is read start to end (ascending addresses, the
// prefetchers' favourite), with U interleaved partial sums per (row, token) so that ≥ 4 independent
// chains hide the latency. Four tokens (compute-bound): 4 rows × 4 tokens at once, so each loaded
// weight vector serves 4 tokens and each activation vector 4 rows.
// `next`: elements from w[r] to row r of the tile after this one (for prefetching across tiles).
template <DType WD, bool DP, int RB, int TB>
inline Simd::V dot_tile(const typename Elem<WD>::type* const* w, const void* act, int64_t K, int64_t next) {
  static_assert(RB * TB <= Simd::W, "a tile fits one vector of results (unused lanes stay zero)");
  constexpr int64_t step = DP ? 2 * Simd::W : Simd::W;  // elements per vector of weights
  const uint16_t* a16 = static_cast<const uint16_t*>(act);
  const float* a32 = static_cast<const float*>(act);
  Simd::V acc[Simd::W];
  for (auto& v : acc) v = Simd::zero();
  if constexpr (TB >= 4) {
    for (int64_t k = 0; k < K; k += step) {
      for (int r = 0; r < RB; ++r) prefetch_ahead(w[r], k, K, w[r] + next);
      if constexpr (DP) {
        Simd::VI wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = Simd::load_raw(w[r] + k);
        for (int t = 0; t < TB; ++t) {
          const Simd::VI xv = Simd::load_raw(a16 + t * K + k);
          for (int r = 0; r < RB; ++r) acc[r * TB + t] = Simd::dp(acc[r * TB + t], wv[r], xv);
        }
      } else {
        Simd::V wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = Simd::load_f32<WD>(w[r] + k);
        for (int t = 0; t < TB; ++t) {
          const Simd::V xv = Simd::load(a32 + t * K + k);
          for (int r = 0; r < RB; ++r) acc[r * TB + t] = Simd::fma(wv[r], xv, acc[r * TB + t]);
        }
      }
    }
    return Simd::transpose_reduce(acc);
  }
  constexpr int U = TB >= 4 ? 1 : 4 / TB;
  for (int r = 0; r < RB; ++r) {
    Simd::V part[U * TB];
    for (auto& v : part) v = Simd::zero();
    const auto* after = r + 1 < RB ? w[r + 1] : w[0] + next;  // the row read after this one
    int64_t k = 0;
    for (; k + U * step <= K; k += U * step)
      for (int u = 0; u < U; ++u) {
        const int64_t ku = k + u * step;
        prefetch_ahead(w[r], ku, K, after);
        if constexpr (DP) {
          const Simd::VI wv = Simd::load_raw(w[r] + ku);
          for (int t = 0; t < TB; ++t)
            part[u * TB + t] = Simd::dp(part[u * TB + t], wv, Simd::load_raw(a16 + t * K + ku));
        } else {
          const Simd::V wv = Simd::load_f32<WD>(w[r] + ku);
          for (int t = 0; t < TB; ++t) part[u * TB + t] = Simd::fma(wv, Simd::load(a32 + t * K + ku), part[u * TB + t]);
        }
      }
    for (; k < K; k += step) {  // K not a multiple of U·step
      prefetch_ahead(w[r], k, K, after);
      if constexpr (DP) {
        const Simd::VI wv = Simd::load_raw(w[r] + k);
        for (int t = 0; t < TB; ++t) part[t] = Simd::dp(part[t], wv, Simd::load_raw(a16 + t * K + k));
      } else {
        const Simd::V wv = Simd::load_f32<WD>(w[r] + k);
        for (int t = 0; t < TB; ++t) part[t] = Simd::fma(wv, Simd::load(a32 + t * K + k), part[t]);
      }
    }
    for (int t = 0; t < TB; ++t) {
      Simd::V sum = part[t];
      for (int u = 1; u < U; ++u) sum = Simd::add(sum, part[u * TB + t]);
      acc[r * TB + t] = sum;
    }
  }
  return Simd::transpose_reduce(acc);
}

// silu(g)·u = g·u / (1 + e^−g), with e^−g = 2^(−g·log2 e): exp2's clamp at 2^−126 leaves silu(g) = g
// for large g, and its overflow to inf gives −0 for very negative g.
inline Simd::V swiglu(Simd::V g, Simd::V u) {
  const Simd::V e = Simd::exp2(Simd::mul(g, Simd::set1(-1.4426950408889634f)));
  return Simd::div(Simd::mul(g, u), Simd::add(Simd::set1(1.0f), e));
}

// Stage 1, rows [j0, j1) of the intermediate: h[t][j] = silu(gate_j · x_t) · (up_j · x_t).
template <DType WD, bool DP, int TB>
void gate_up_rows(const ExpertProblem& P, const void* xs, void* h, int64_t n_pad, int64_t j0, int64_t j1) {
  constexpr int W = Simd::W, RB = expert_tile_rows(W, TB);
  using WT = typename Elem<WD>::type;
  using AT = typename Elem<DP ? DType::bf16 : DType::f32>::type;
  const WT* gu = static_cast<const WT*>(P.gate_up);
  const int64_t H = P.hidden, I = P.inter;
  alignas(64) float hs[W];  // one tile of h, lane r·TB + t
  for (int64_t j = j0; j < j1; j += RB) {
    const WT* gate[RB];
    const WT* up[RB];
    for (int r = 0; r < RB; ++r) {
      gate[r] = gu + (j + r) * P.gate_up_stride;
      up[r] = gu + (I + j + r) * P.gate_up_stride;
    }
    for (int64_t t0 = 0; t0 < n_pad; t0 += TB) {
      const AT* a = static_cast<const AT*>(xs) + t0 * H;
      const Simd::V hv = swiglu(dot_tile<WD, DP, RB, TB>(gate, a, H, RB * P.gate_up_stride),
                                     dot_tile<WD, DP, RB, TB>(up, a, H, RB * P.gate_up_stride));
      Simd::store(hs, hv);
      for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t)
          static_cast<AT*>(h)[(t0 + t) * I + j + r] = from_f32<DP ? DType::bf16 : DType::f32>(hs[r * TB + t]);
    }
  }
}

// Stage 2, rows [r0, r1) of the output: y[t][r] = down_r · h_t, written in y's dtype.
template <DType WD, bool DP, int TB>
void down_rows(const ExpertProblem& P, const void* h, int64_t n_pad, int64_t r0, int64_t r1) {
  constexpr int W = Simd::W, RB = expert_tile_rows(W, TB);
  using WT = typename Elem<WD>::type;
  using AT = typename Elem<DP ? DType::bf16 : DType::f32>::type;
  const WT* dn = static_cast<const WT*>(P.down);
  const int64_t I = P.inter;
  alignas(64) float y[W];
  for (int64_t r = r0; r < r1; r += RB) {
    const WT* rows[RB];
    for (int i = 0; i < RB; ++i) rows[i] = dn + (r + i) * P.down_stride;
    for (int64_t t0 = 0; t0 < n_pad; t0 += TB) {
      Simd::store(y, dot_tile<WD, DP, RB, TB>(rows, static_cast<const AT*>(h) + t0 * I, I, RB * P.down_stride));
      for (int i = 0; i < RB; ++i)
        for (int t = 0; t < TB && t0 + t < P.n_tokens; ++t)
          store_from_f32(P.y, P.y_dtype, (t0 + t) * P.y_stride + r + i, y[i * TB + t]);
    }
  }
}

// One (stage, tokens per tile) instantiation per weight dtype; TB ≤ W is guaranteed by dispatch.
template <bool kDown, int TB>
void expert_stage(const ExpertProblem& P, const void* in, void* h, int64_t n_pad, int64_t b, int64_t e) {
  if constexpr (Simd::W % TB != 0) {
    expert_stage<kDown, 1>(P, in, h, n_pad, b, e);
  } else if (expert_activation_dtype(P) == DType::bf16) {
    if constexpr (kDown) down_rows<DType::bf16, true, TB>(P, in, n_pad, b, e);
    else gate_up_rows<DType::bf16, true, TB>(P, in, h, n_pad, b, e);
  } else {
    switch (P.w_dtype) {
      case DType::f32:
        if constexpr (kDown) down_rows<DType::f32, false, TB>(P, in, n_pad, b, e);
        else gate_up_rows<DType::f32, false, TB>(P, in, h, n_pad, b, e);
        break;
      case DType::bf16:
        if constexpr (kDown) down_rows<DType::bf16, false, TB>(P, in, n_pad, b, e);
        else gate_up_rows<DType::bf16, false, TB>(P, in, h, n_pad, b, e);
        break;
      default:
        if constexpr (kDown) down_rows<DType::f16, false, TB>(P, in, n_pad, b, e);
        else gate_up_rows<DType::f16, false, TB>(P, in, h, n_pad, b, e);
    }
  }
}

void expert_gate_up(const ExpertProblem& P, const void* xs, void* h, int64_t n_pad, int tokens_per_tile,
                    int64_t row_begin, int64_t row_end) {
  switch (tokens_per_tile) {
    case 1: return expert_stage<false, 1>(P, xs, h, n_pad, row_begin, row_end);
    case 2: return expert_stage<false, 2>(P, xs, h, n_pad, row_begin, row_end);
    default: return expert_stage<false, 4>(P, xs, h, n_pad, row_begin, row_end);
  }
}

void expert_down(const ExpertProblem& P, const void* h, int64_t n_pad, int tokens_per_tile, int64_t row_begin,
                 int64_t row_end) {
  switch (tokens_per_tile) {
    case 1: return expert_stage<true, 1>(P, h, nullptr, n_pad, row_begin, row_end);
    case 2: return expert_stage<true, 2>(P, h, nullptr, n_pad, row_begin, row_end);
    default: return expert_stage<true, 4>(P, h, nullptr, n_pad, row_begin, row_end);
  }
}
