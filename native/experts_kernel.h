// Expert FFN pieces for one thread: y = down · act(gate·x, up·x) (+ the form's biases; SwiGLU or
// gpt-oss's clamped SwiGLU, see ExpertForm in common.h). Written once over `Simd`; each ISA
// translation unit includes this inside an anonymous namespace.
//
// Both stages are "weight rows × tokens" dot products. A tile is RB weight rows × TB tokens with
// RB·TB ≤ W accumulators, reduced together into one vector (lane r·TB + t). Weight rows stream from
// DRAM once per call; the activations (≤ 256 tokens) come from L1/L2 for every tile. A pass over a
// block of rows serves GP groups of TB tokens (GP = 2 for 4-token tiles: a K chunk of a tile's rows is
// re-read from L1 by the second group); more tokens take more passes, re-reading the block from L2.
//
// The activations' layout and their preparation are in expert_activations.h.
#include "expert_activations.h"

// The vector tiles' plan for P.n_tokens tokens (see expert_tile_tokens in common.h). 5 and 6 tokens:
// a 4-token group and a 1- or 2-token one in the same pass (dot_groups), not two 4-token groups: at
// 5–8 tokens the tiles are bound by their dot products (on a Xeon server with AMX from L2 only
// 6–11% faster than from DRAM), and padding 5 tokens to 8 does 8 per weight vector.
ExpertTiling expert_tiling(const ExpertProblem& P) {
  const int tpt = expert_tile_tokens(P.n_tokens, Simd::W);
  const int64_t n = P.n_tokens;
  const int last = tpt == 4 && (n == 5 || n == 6) ? int(n - 4) : tpt;
  const int64_t n_pad = last != tpt ? n : (n + tpt - 1) / tpt * tpt;
  // Memory-bound up to ~8 tokens per weight row, then the dot products grow with the tokens.
  return {tpt, false, n_pad, expert_tile_rows(Simd::W, tpt), std::max<int64_t>(8, n_pad), last};
}

// Weights are prefetched this far ahead of their use: a thread's rows are one contiguous run, but
// the hardware prefetchers stop at every 4 KiB page (a 2048-wide bf16 row), and a single core must
// keep many lines in flight to read at DRAM speed.
constexpr int64_t kWeightPrefetchBytes = 2048;

// Activation bytes of one tile's K range that should stay in L1 (32 KiB on Zen 4, 48 KiB on Sapphire
// Rapids) next to the streaming weights. 8 tokens × H = 2048 in bf16 are 32 KiB: swept once per tile,
// they were evicted by the weights and came from L2 at half the dot-product rate.
constexpr int64_t kActivationL1Bytes = 16384;

// Elements of K per chunk for TB tokens of AT activations, a multiple of `step` (≥ one step).
template <class AT, int TB, int64_t step> constexpr int64_t k_chunk() {
  constexpr int64_t fit = kActivationL1Bytes / (TB * int64_t(sizeof(AT))) / step * step;
  return fit > step ? fit : step;
}

// Prefetch the line kWeightPrefetchBytes past element k of `row`, whose segment being read ends at
// k_end; past that end, continue at `after` (where this row slot reads next).
template <class WT> TANDEM_ALWAYS_INLINE void prefetch_ahead(const WT* row, int64_t k, int64_t k_end, const WT* after) {
  const int64_t ahead = k + kWeightPrefetchBytes / int64_t(sizeof(WT));
  Simd::prefetch(ahead < k_end ? row + ahead : after + (ahead - k_end));
}

// Lane r·TB + t = w[r][k0:k1] · a[t][k0:k1] (lanes past RB·TB: 0); a: one tile-interleaved group of
// TB tokens.
// Few tokens (TB < 4, memory-bound): each weight row is read start to end (ascending addresses, the
// prefetchers' favourite), with U interleaved partial sums per (row, token) so that ≥ 4 independent
// chains hide the latency. Four or more tokens, or kRowsTogether (a narrow second group, whose rows
// come from L1): RB rows × TB tokens at once (4 × 4, 2 × 8: the 16 accumulators of one result
// vector), so each loaded weight vector serves every token of the tile and each activation vector RB
// rows.
// `next`: elements from w[r] to the segment row slot r reads after this one (for prefetching).
// kPrefetchRows: the rows (bit r: row r) this call prefetches for; see dot_groups.
// Always inlined: out of line, the call passes the row pointers and the result through memory, and
// measured ~5% slower per tile.
template <DType WD, int M, int RB, int TB, unsigned kPrefetchRows = ~0u, bool kRowsTogether = (TB >= 4)>
TANDEM_ALWAYS_INLINE Simd::V dot_tile(const typename Elem<WD>::type* const* w, const void* act, int64_t k0, int64_t k1, int64_t next) {
  static_assert(RB * TB <= Simd::W, "a tile fits one vector of results (unused lanes stay zero)");
  constexpr bool DP = M == kDotPairs, SP = M == kSplitPairs;
  static_assert(!SP || WD == DType::bf16, "split pairs are bf16 weights");
  constexpr int64_t step = DP || SP ? 2 * Simd::W : Simd::W;  // elements per load of weights
  const uint16_t* a16 = static_cast<const uint16_t*>(act);
  const float* a32 = static_cast<const float*>(act);
  // Zeroed by an unrolled loop: a plain loop became a memset (rep stos) of the array's stack copy
  // on every tile, a tenth of a down-stage tile's time.
  Simd::V acc[Simd::W];
#pragma GCC unroll 16
  for (int i = 0; i < Simd::W; ++i) acc[i] = Simd::zero();
  if constexpr (kRowsTogether) {
    for (int64_t k = k0; k < k1; k += step) {
      for (int r = 0; r < RB; ++r)
        if ((kPrefetchRows >> r) & 1u) prefetch_ahead(w[r], k, k1, w[r] + next);
      if constexpr (DP) {
        Simd::VI wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = Simd::load_raw(w[r] + k);
        for (int t = 0; t < TB; ++t) {
          const Simd::VI xv = Simd::load_raw(a16 + k * TB + t * step);
          for (int r = 0; r < RB; ++r) acc[r * TB + t] = Simd::dp(acc[r * TB + t], wv[r], xv);
        }
      } else if constexpr (SP) {
        Simd::V we[RB], wo[RB];  // each row's 2W weights: even elements, odd elements
        for (int r = 0; r < RB; ++r) {
          const Simd::VI raw = Simd::load_raw(w[r] + k);
          we[r] = Simd::bf16_even(raw), wo[r] = Simd::bf16_odd(raw);
        }
        for (int t = 0; t < TB; ++t) {
          const float* x = a32 + k * TB + t * step;  // the token's block: W even elements, W odd ones
          const Simd::V xe = Simd::load(x), xo = Simd::load(x + Simd::W);
          for (int r = 0; r < RB; ++r) acc[r * TB + t] = Simd::fma(wo[r], xo, Simd::fma(we[r], xe, acc[r * TB + t]));
        }
      } else {
        Simd::V wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = Simd::load_f32<WD>(w[r] + k);
        for (int t = 0; t < TB; ++t) {
          const Simd::V xv = Simd::load(a32 + k * TB + t * step);
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
    const auto* after = r + 1 < RB ? w[r + 1] + k0 : w[0] + next;  // the segment read after this one
    int64_t k = k0;
    for (; k + U * step <= k1; k += U * step)
      for (int u = 0; u < U; ++u) {
        const int64_t ku = k + u * step;
        if ((kPrefetchRows >> r) & 1u) prefetch_ahead(w[r], ku, k1, after);
        if constexpr (DP) {
          const Simd::VI wv = Simd::load_raw(w[r] + ku);
          for (int t = 0; t < TB; ++t)
            part[u * TB + t] = Simd::dp(part[u * TB + t], wv, Simd::load_raw(a16 + ku * TB + t * step));
        } else if constexpr (SP) {
          const Simd::VI raw = Simd::load_raw(w[r] + ku);
          const Simd::V we = Simd::bf16_even(raw), wo = Simd::bf16_odd(raw);
          for (int t = 0; t < TB; ++t) {
            const float* x = a32 + ku * TB + t * step;
            part[u * TB + t] = Simd::fma(wo, Simd::load(x + Simd::W), Simd::fma(we, Simd::load(x), part[u * TB + t]));
          }
        } else {
          const Simd::V wv = Simd::load_f32<WD>(w[r] + ku);
          for (int t = 0; t < TB; ++t) part[u * TB + t] = Simd::fma(wv, Simd::load(a32 + ku * TB + t * step), part[u * TB + t]);
        }
      }
    for (; k < k1; k += step) {  // the segment not a multiple of U·step
      if ((kPrefetchRows >> r) & 1u) prefetch_ahead(w[r], k, k1, after);
      if constexpr (DP) {
        const Simd::VI wv = Simd::load_raw(w[r] + k);
        for (int t = 0; t < TB; ++t) part[t] = Simd::dp(part[t], wv, Simd::load_raw(a16 + k * TB + t * step));
      } else if constexpr (SP) {
        const Simd::VI raw = Simd::load_raw(w[r] + k);
        const Simd::V we = Simd::bf16_even(raw), wo = Simd::bf16_odd(raw);
        for (int t = 0; t < TB; ++t) {
          const float* x = a32 + k * TB + t * step;
          part[t] = Simd::fma(wo, Simd::load(x + Simd::W), Simd::fma(we, Simd::load(x), part[t]));
        }
      } else {
        const Simd::V wv = Simd::load_f32<WD>(w[r] + k);
        for (int t = 0; t < TB; ++t) part[t] = Simd::fma(wv, Simd::load(a32 + k * TB + t * step), part[t]);
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

// Tiles per block: a block's rows are read one K chunk at a time (chunk c of every tile, then chunk
// c + 1), with each tile's partial results kept in a vector between chunks.
constexpr int kBlockTiles = 8;

// Token groups per pass: a tile's K chunk of weight rows serves GP ≤ 2 groups of TB tokens while it
// is in L1 (RB rows × KC elements: 4 × 1024 bf16 = 8 KiB next to 8 tokens' 16 KiB of activations): the
// first group's dot_tile reads the chunk from DRAM, the second re-reads it from L1 at once. 5…8 tokens
// run as 4-token tiles × 2 groups rather than 2-row × 8-token tiles: the same dot products per weight
// byte, but 4 rows stream at a time and each weight vector loaded from DRAM serves 4 tokens before the
// next (measured on Zen 4, H = 2048, I = 768, bf16, 8 tokens: +5–11% weight GB/s on 1 and 2 threads).
// Prefetching with two groups: a chunk is no longer than the prefetch distance (static_assert in the
// callers), so every prefetch of a pass lands in the segment read next, and the two passes share them:
// the first prefetches rows 0, 2, the second rows 1, 3. A pass without prefetches (about half the time
// at 8 tokens) would let the core's outstanding misses drain while it computes from L1. Measured
// neutral on Zen 4, whose hardware prefetchers already cover this path (dropping every software
// prefetch here changed nothing there); meant for cores whose bandwidth is bounded by the misses they
// keep in flight and whose prefetchers stop at each 4 KiB row (see kWeightPrefetchBytes).
// TT: the second group's tokens per tile: TB, or 1 or 2 at 5 and 6 tokens (expert_tiling). A narrow
// group still reads its RB rows together (kRowsTogether), as a full one does: read a row at a time it
// lost 12–30% of its DRAM rate on Zen 4.
template <DType WD, int M, int RB, int TB, int GP, int TT = TB>
TANDEM_ALWAYS_INLINE void dot_groups(Simd::V* acc, const typename Elem<WD>::type* const* w, const void* act,
                                     int64_t group_elems, int ng, int64_t k0, int64_t k1, int64_t next) {
  static_assert(GP == 1 || GP == 2, "one or two token groups per pass");
  using AT = typename Elem<M == kDotPairs ? DType::bf16 : DType::f32>::type;
  const AT* a = static_cast<const AT*>(act);  // group gi at a + gi·group_elems (TB tokens × K)
  if constexpr (GP == 2) {
    if (ng == 2) {
      constexpr unsigned kEvenRows = 0x5555u, kOddRows = 0xaaaau;
      acc[0] = Simd::add(acc[0], dot_tile<WD, M, RB, TB, kEvenRows>(w, a, k0, k1, next));
      acc[1] = Simd::add(acc[1], dot_tile<WD, M, RB, TT, kOddRows, true>(w, a + group_elems, k0, k1, next));
      return;
    }
  }
  // One group (GP = 1, or the last pass of 9…12 tokens): it prefetches every row.
  acc[0] = Simd::add(acc[0], dot_tile<WD, M, RB, TB>(w, a, k0, k1, next));
}

// Stage 1, rows [j0, j1) of the intermediate: h[t][j] = act(gate_j · x_t + bg_j, up_j · x_t + bu_j).
// Order of reading within a block: for each K chunk, for each tile: its gate rows (for each token
// group of the pass, the first from DRAM, the others from L1), then its up rows the same way.
template <DType WD, int M, int TB, int GP, int TT>
void gate_up_rows(const ExpertProblem& P, const void* xs, void* h, int64_t n_pad, int64_t j0, int64_t j1) {
  constexpr int W = Simd::W, RB = expert_tile_rows(W, TB);
  using WT = typename Elem<WD>::type;
  constexpr bool DP = M == kDotPairs, SP = M == kSplitPairs;
  using AT = typename Elem<DP ? DType::bf16 : DType::f32>::type;
  constexpr int64_t step = DP || SP ? 2 * W : W, KC = k_chunk<AT, TB * GP, step>();
  static_assert(GP == 1 || KC * int64_t(sizeof(WT)) <= kWeightPrefetchBytes, "groups share prefetches (dot_groups)");
  const WT* gu = static_cast<const WT*>(P.gate_up);
  const int64_t H = P.hidden, I = P.inter, S = P.gate_up_stride;
  alignas(64) float hs[W];  // one tile of h, lane r·TB + t
  for (int64_t jb = j0; jb < j1; jb += kBlockTiles * RB) {
    const int nb = int(std::min<int64_t>(kBlockTiles, (j1 - jb) / RB));
    for (int64_t t0 = 0; t0 < n_pad; t0 += GP * TB) {  // a pass: up to GP groups of TB tokens
      const int ng = int(std::min<int64_t>(GP, (n_pad - t0 + TB - 1) / TB));  // the last may be narrower (TT)
      const AT* a = static_cast<const AT*>(xs) + t0 * H;  // group gi: tokens t0 + gi·TB …, TB·H elements
      Simd::V g[kBlockTiles][GP], u[kBlockTiles][GP];  // per tile and group: lane r·TB + t
      for (int b = 0; b < nb; ++b)
        for (int gi = 0; gi < GP; ++gi) g[b][gi] = u[b][gi] = Simd::zero();
      for (int64_t k0 = 0; k0 < H; k0 += KC) {
        const int64_t k1 = std::min(H, k0 + KC);
        for (int b = 0; b < nb; ++b) {
          const WT* gate[RB];
          const WT* up[RB];
          for (int r = 0; r < RB; ++r) {
            gate[r] = gu + (jb + b * RB + r) * S;
            up[r] = gu + (I + jb + b * RB + r) * S;
          }
          // After the up rows: the next tile's gate rows at this chunk, or the block's first at the
          // next chunk, or the next block's first at chunk 0.
          const int64_t up_next = b + 1 < nb ? (RB - I) * S + k0
                                  : k1 < H    ? (-I - b * RB) * S + k1
                                              : (RB - I) * S;
          dot_groups<WD, M, RB, TB, GP, TT>(g[b], gate, a, TB * H, ng, k0, k1, I * S + k0);
          dot_groups<WD, M, RB, TB, GP, TT>(u[b], up, a, TB * H, ng, k0, k1, up_next);
        }
      }
      for (int b = 0; b < nb; ++b)
        for (int gi = 0; gi < ng; ++gi) {
          const int wg = gi == 1 ? TT : TB;  // the group's tokens per tile: lane r·wg + t
          Simd::V gv = g[b][gi], uv = u[b][gi];
          if (P.form.gate_up_bias) {  // padding tokens' lanes get them too: their h is never stored in y
            const int64_t j = jb + b * RB;
            gv = Simd::add(gv, tile_bias<RB>(P.form.gate_up_bias, P.form.bias_dtype, j, wg));
            uv = Simd::add(uv, tile_bias<RB>(P.form.gate_up_bias, P.form.bias_dtype, I + j, wg));
          }
          Simd::store(hs, expert_act(P.form, gv, uv));
          AT* group = static_cast<AT*>(h) + (t0 + gi * TB) * I;  // its tile-interleaved rows start here
          for (int r = 0; r < RB; ++r)
            for (int t = 0; t < wg; ++t)
              group[wg == TB ? act_index<TB, step, SP>(t, jb + b * RB + r, I) : act_index<TT, step, SP>(t, jb + b * RB + r, I)] =
                  from_f32<DP ? DType::bf16 : DType::f32>(hs[r * wg + t]);
        }
    }
  }
}

// n fp32 values → elements [i, i + n) of y (dtype d), a vector at a time for fp32 and bf16.
inline void store_run(void* y, DType d, int64_t i, const float* src, int64_t n) {
  int64_t k = 0;
  if (d == DType::f32)
    for (; k + Simd::W <= n; k += Simd::W) Simd::store(static_cast<float*>(y) + i + k, Simd::load(src + k));
  else if (d == DType::bf16)
    for (; k + Simd::W <= n; k += Simd::W) Simd::store_bf16(static_cast<uint16_t*>(y) + i + k, Simd::load(src + k));
  for (; k < n; ++k) store_from_f32(y, d, i + k, src[k]);
}

// Stage 2, rows [r0, r1) of the output: y[t][r] = down_r · h_t (+ bd_r), written in y's dtype.
template <DType WD, int M, int TB, int GP, int TT>
void down_rows(const ExpertProblem& P, const void* h, int64_t n_pad, int64_t r0, int64_t r1) {
  constexpr int W = Simd::W, RB = expert_tile_rows(W, TB);
  using WT = typename Elem<WD>::type;
  constexpr bool DP = M == kDotPairs, SP = M == kSplitPairs;
  using AT = typename Elem<DP ? DType::bf16 : DType::f32>::type;
  constexpr int64_t step = DP || SP ? 2 * W : W, KC = k_chunk<AT, TB * GP, step>();
  static_assert(GP == 1 || KC * int64_t(sizeof(WT)) <= kWeightPrefetchBytes, "groups share prefetches (dot_groups)");
  const WT* dn = static_cast<const WT*>(P.down);
  const int64_t I = P.inter, S = P.down_stride;
  alignas(64) float y[kBlockTiles * W];   // one group's tiles of the block, lane r·TB + t each
  alignas(64) float run[kBlockTiles * RB];  // one token's outputs of the block
  alignas(64) float bias[kBlockTiles * RB];  // the block's down biases, fp32
  const void* down_bias = P.form.down_bias;
  for (int64_t rb = r0; rb < r1; rb += kBlockTiles * RB) {
    const int nb = int(std::min<int64_t>(kBlockTiles, (r1 - rb) / RB));
    if (down_bias)
      for (int i = 0; i < nb * RB; ++i) bias[i] = load_as_f32(down_bias, P.form.bias_dtype, rb + i);
    for (int64_t t0 = 0; t0 < n_pad; t0 += GP * TB) {  // a pass: up to GP groups of TB tokens
      const int ng = int(std::min<int64_t>(GP, (n_pad - t0 + TB - 1) / TB));  // the last may be narrower (TT)
      const AT* a = static_cast<const AT*>(h) + t0 * I;
      Simd::V acc[kBlockTiles][GP];
      for (int b = 0; b < nb; ++b)
        for (int gi = 0; gi < GP; ++gi) acc[b][gi] = Simd::zero();
      for (int64_t k0 = 0; k0 < I; k0 += KC) {
        const int64_t k1 = std::min(I, k0 + KC);
        for (int b = 0; b < nb; ++b) {
          const WT* rows[RB];
          for (int i = 0; i < RB; ++i) rows[i] = dn + (rb + b * RB + i) * S;
          const int64_t next = b + 1 < nb ? RB * S + k0 : k1 < I ? -b * RB * S + k1 : RB * S;
          dot_groups<WD, M, RB, TB, GP, TT>(acc[b], rows, a, TB * I, ng, k0, k1, next);
        }
      }
      // Per token, the block's nb·RB outputs as one run (lanes r·TB + t of each tile → row b·RB + r).
      for (int gi = 0; gi < ng; ++gi) {
        const int64_t tg = t0 + gi * TB;  // the group's first token
        const int wg = gi == 1 ? TT : TB;  // its tokens per tile: lane r·wg + t
        for (int b = 0; b < nb; ++b) Simd::store(y + b * W, acc[b][gi]);
        for (int t = 0; t < wg && tg + t < P.n_tokens; ++t) {
          for (int b = 0; b < nb; ++b)
            for (int r = 0; r < RB; ++r) run[b * RB + r] = y[b * W + r * wg + t];
          if (down_bias)
            for (int i = 0; i < nb * RB; ++i) run[i] += bias[i];
          store_run(P.y, P.y_dtype, (tg + t) * P.y_stride + rb, run, nb * RB);
        }
      }
    }
  }
}

// One (stage, tokens per tile, groups per pass, last group's tokens per tile) instantiation per weight
// dtype; TB ≤ W is guaranteed by dispatch (and by expert_stage below).
template <bool kDown, int TB, int GP, int TT = TB>
void expert_stage_groups(const ExpertProblem& P, const void* in, void* h, int64_t n_pad, int64_t b, int64_t e) {
  if (expert_activation_dtype(P) == DType::bf16) {
    if constexpr (kDown) down_rows<DType::bf16, kDotPairs, TB, GP, TT>(P, in, n_pad, b, e);
    else gate_up_rows<DType::bf16, kDotPairs, TB, GP, TT>(P, in, h, n_pad, b, e);
  } else if (expert_split_pairs(P)) {
    if constexpr (kDown) down_rows<DType::bf16, kSplitPairs, TB, GP, TT>(P, in, n_pad, b, e);
    else gate_up_rows<DType::bf16, kSplitPairs, TB, GP, TT>(P, in, h, n_pad, b, e);
  } else {
    switch (P.w_dtype) {
      case DType::f32:
        if constexpr (kDown) down_rows<DType::f32, kFma, TB, GP, TT>(P, in, n_pad, b, e);
        else gate_up_rows<DType::f32, kFma, TB, GP, TT>(P, in, h, n_pad, b, e);
        break;
      case DType::bf16:
        if constexpr (kDown) down_rows<DType::bf16, kFma, TB, GP, TT>(P, in, n_pad, b, e);
        else gate_up_rows<DType::bf16, kFma, TB, GP, TT>(P, in, h, n_pad, b, e);
        break;
      default:
        if constexpr (kDown) down_rows<DType::f16, kFma, TB, GP, TT>(P, in, n_pad, b, e);
        else gate_up_rows<DType::f16, kFma, TB, GP, TT>(P, in, h, n_pad, b, e);
    }
  }
}

// Groups of 4-token tiles go through in passes of 2 (see dot_groups): 2 × 4 tokens' activations per
// K chunk fill the L1 share that 8 tokens of one tile had. Other tile widths take one group per pass:
// at 16 tokens, 4 groups of 4 per pass and 2 passes of 2 × 4 both measured ~10% slower on Zen 4 than
// 2 passes of 2-row × 8-token tiles, which expert_tile_tokens picks there.
constexpr int kPassGroups = 2;

template <bool kDown, int TB>
void expert_stage(const ExpertProblem& P, const void* in, void* h, const ExpertTiling& T, int64_t b, int64_t e) {
  const int64_t n_pad = T.n_pad;
  if constexpr (Simd::W % TB != 0) {
    expert_stage<kDown, 1>(P, in, h, T, b, e);
  } else if constexpr (TB == 4) {
    if (T.last_tile_tokens == 1) expert_stage_groups<kDown, TB, kPassGroups, 1>(P, in, h, n_pad, b, e);
    else if (T.last_tile_tokens == 2) expert_stage_groups<kDown, TB, kPassGroups, 2>(P, in, h, n_pad, b, e);
    else if (n_pad >= kPassGroups * TB) expert_stage_groups<kDown, TB, kPassGroups>(P, in, h, n_pad, b, e);
    else expert_stage_groups<kDown, TB, 1>(P, in, h, n_pad, b, e);
  } else {
    expert_stage_groups<kDown, TB, 1>(P, in, h, n_pad, b, e);
  }
}

void expert_gate_up(const ExpertProblem& P, const void* xs, void* h, const ExpertTiling& T, int64_t row_begin,
                    int64_t row_end) {
  switch (T.tokens_per_tile) {
    case 1: return expert_stage<false, 1>(P, xs, h, T, row_begin, row_end);
    case 4: return expert_stage<false, 4>(P, xs, h, T, row_begin, row_end);
    default: return expert_stage<false, 8>(P, xs, h, T, row_begin, row_end);
  }
}

void expert_down(const ExpertProblem& P, const void* h, const ExpertTiling& T, int64_t row_begin, int64_t row_end) {
  switch (T.tokens_per_tile) {
    case 1: return expert_stage<true, 1>(P, h, nullptr, T, row_begin, row_end);
    case 4: return expert_stage<true, 4>(P, h, nullptr, T, row_begin, row_end);
    default: return expert_stage<true, 8>(P, h, nullptr, T, row_begin, row_end);
  }
}
