// Decode attention of one work item: ≤ kMaxRows query rows of each of a few KV heads of one
// sequence, over a range of that sequence's KV blocks. Written once over `Simd`; each ISA translation
// unit includes this inside an anonymous namespace after its target pragma.
//
// Zero copy: K and V rows are read in place through each block's strides. The tile loop takes W
// tokens (one vector of scores per query row, never a score row in memory); online softmax keeps a
// running max m and sum l per row in log2 units; the fp32 output accumulators (≤ 32 KiB) stay in
// L1/L2. Per tile: (1) every row's scores, (2) every row's softmax update, (3) o += p·V for all rows.

template <DType KV> using KvElem = typename Elem<KV>::type;

// o[g][c : c + CU·W] ← alpha[g]·o[g] + Σ_t p[g·W + t]·v_t for G rows and CU chunks of head_dim at
// once: G·CU independent accumulators in registers, each V row read once, in order.
template <DType KV, int G, int CU>
inline void pv_block(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                     int64_t hs, int64_t c) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  V acc[G][CU];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) acc[g][u] = Simd::mul(Simd::load(o + g * hs + c + u * W), Simd::set1(alpha[g]));
  for (int t = 0; t < n; ++t)
    for (int u = 0; u < CU; ++u) {
      const V v = Simd::load_f32<KV>(vrow[t] + c + u * W);  // one conversion serves G rows
      for (int g = 0; g < G; ++g) acc[g][u] = Simd::fma(Simd::set1(p[g * W + t]), v, acc[g][u]);
    }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) Simd::store(o + g * hs + c + u * W, acc[g][u]);
}

// Few rows get several chunks per pass, so that ≥ 8 FMA chains hide the FMA latency.
template <DType KV, int G>
inline void pv_group(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                     int64_t hs) {
  constexpr int CU = G >= 8 ? 1 : 8 / G;
  int64_t c = 0;
  for (; c + CU * Simd::W <= hs; c += CU * Simd::W) pv_block<KV, G, CU>(o, p, alpha, vrow, n, hs, c);
  for (; c < hs; c += Simd::W) pv_block<KV, G, 1>(o, p, alpha, vrow, n, hs, c);
}

// bf16 V, head_dim a multiple of 2·W: a 2·W-dim block of an o row is kept as [even dims | odd dims],
// the order Simd::bf16_even/odd produce, and put back in order once at the end of the item.
template <int G, int CU>
inline void pv_block_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                           int64_t hs, int64_t c) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  V acc[G][2 * CU];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 2 * CU; ++u) acc[g][u] = Simd::mul(Simd::load(o + g * hs + c + u * W), Simd::set1(alpha[g]));
  for (int t = 0; t < n; ++t)
    for (int u = 0; u < CU; ++u) {
      const Simd::VI x = Simd::load_raw(vrow[t] + c + 2 * u * W);
      const V even = Simd::bf16_even(x), odd = Simd::bf16_odd(x);
      for (int g = 0; g < G; ++g) {
        const V pg = Simd::set1(p[g * W + t]);
        acc[g][2 * u] = Simd::fma(pg, even, acc[g][2 * u]);
        acc[g][2 * u + 1] = Simd::fma(pg, odd, acc[g][2 * u + 1]);
      }
    }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 2 * CU; ++u) Simd::store(o + g * hs + c + u * W, acc[g][u]);
}

template <int G>
inline void pv_group_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                           int64_t hs) {
  constexpr int CU = G >= 4 ? 1 : 4 / G;  // ≥ 8 accumulator chains
  int64_t c = 0;
  for (; c + 2 * CU * Simd::W <= hs; c += 2 * CU * Simd::W) pv_block_split<G, CU>(o, p, alpha, vrow, n, hs, c);
  for (; c < hs; c += 2 * Simd::W) pv_block_split<G, 1>(o, p, alpha, vrow, n, hs, c);
}

inline void pv_rows_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                          int64_t hs, int rows) {
  constexpr int W = Simd::W;
  int r = 0;
  for (; r + 8 <= rows; r += 8) pv_group_split<8>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  if (rows - r >= 4) { pv_group_split<4>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 4; }
  if (rows - r >= 2) { pv_group_split<2>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 2; }
  if (rows - r >= 1) pv_group_split<1>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
}

inline void unsplit_rows(float* o, int64_t hs, int rows) {
  constexpr int W = Simd::W;
  float block[2 * W];
  for (int64_t i = 0; i < rows * hs; i += 2 * W) {
    for (int j = 0; j < 2 * W; ++j) block[j] = o[i + j];
    for (int j = 0; j < W; ++j) o[i + 2 * j] = block[j], o[i + 2 * j + 1] = block[W + j];
  }
}

template <DType KV>
inline void pv_rows(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                    int64_t hs, int rows) {
  constexpr int W = Simd::W;
  int r = 0;
  if constexpr (Simd::kMaxGroup >= 16)
    for (; r + 16 <= rows; r += 16) pv_group<KV, 16>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  for (; r + 8 <= rows; r += 8) pv_group<KV, 8>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  if (rows - r >= 4) { pv_group<KV, 4>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 4; }
  if (rows - r >= 2) { pv_group<KV, 2>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 2; }
  if (rows - r >= 1) pv_group<KV, 1>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
}

// Scores (unscaled q·k) of one fp32 query row against the W fp32 rows of a tile. Rows are read
// one after another, so addresses only ascend (the hardware prefetchers' favourite pattern); the W
// accumulator chains are independent.
inline Simd::V tile_scores_f32(const float* q, const float* const* krow, int64_t hs) {
  Simd::V acc[Simd::W];
  for (int t = 0; t < Simd::W; ++t) {
    Simd::V a = Simd::zero();
    for (int64_t c = 0; c < hs; c += Simd::W) a = Simd::fma(Simd::load(krow[t] + c), Simd::load(q + c), a);
    acc[t] = a;
  }
  return Simd::transpose_reduce(acc);
}

// The same against bf16 rows with pairwise bf16 dot products; q ≈ q_hi + q_lo keeps an fp32 query
// exact to ~2^-17 (a bf16 query has q_lo = 0 and skips that pass).
template <bool kHasLo>
inline Simd::V tile_scores_dp(const uint16_t* q_hi, const uint16_t* q_lo, const uint16_t* const* krow,
                              int64_t hs) {
  Simd::V acc[Simd::W];
  for (int t = 0; t < Simd::W; ++t) {
    Simd::V a = Simd::zero();
    for (int64_t c = 0; c < hs; c += 2 * Simd::W) {
      const Simd::VI kv = Simd::load_raw(krow[t] + c);
      a = Simd::dp(a, kv, Simd::load_raw(q_hi + c));
      if constexpr (kHasLo) a = Simd::dp(a, kv, Simd::load_raw(q_lo + c));
    }
    acc[t] = a;
  }
  return Simd::transpose_reduce(acc);
}

// n elements of a row of runtime dtype d, from element offset `off`, as fp32 (n a multiple of W).
inline void load_row_f32(const void* src, DType d, int64_t off, float* dst, int64_t n) {
  const float* f32 = static_cast<const float*>(src) + off;
  const uint16_t* u16 = static_cast<const uint16_t*>(src) + off;
  for (int64_t i = 0; i < n; i += Simd::W) {
    switch (d) {
      case DType::f32: Simd::store(dst + i, Simd::load_f32<DType::f32>(f32 + i)); break;
      case DType::bf16: Simd::store(dst + i, Simd::load_f32<DType::bf16>(u16 + i)); break;
      default: Simd::store(dst + i, Simd::load_f32<DType::f16>(u16 + i));
    }
  }
}

// HS: head_dim known at compile time (fully unrolled inner loops), or 0 for any multiple of W.
template <DType KV, int HS>
void attention_item_kv(const AttentionProblem& P, const AttentionItem& it, float* o_acc, float* m_out,
                       float* l_out) {
  using T = KvElem<KV>;
  using V = Simd::V;
  constexpr int W = Simd::W;
  constexpr bool kDp = Simd::kDpbf16 && KV == DType::bf16;  // bf16 dot products available
  const int64_t hs = HS ? HS : P.head_dim, group = P.n_heads / P.n_kv_heads;
  const bool use_dp = kDp && hs % (2 * W) == 0;  // else K tiles go through fp32 like fp16 does
  const bool split_v = KV == DType::bf16 && hs % (2 * W) == 0;  // see pv_block_split
  const int rows = int(it.row_end - it.row_begin), heads = int(it.g_end - it.g);
  const int all_rows = rows * heads;  // item row i = (head it.g + i / rows, row it.row_begin + i % rows)
  const float log2_scale = P.scale * 1.4426950408889634f;  // scores in log2 units: 2^x is cheaper than e^x

  alignas(64) float q[kMaxItemElems];  // (all_rows, hs) fp32 queries
  alignas(64) uint16_t q_hi[kDp ? kMaxItemElems : 1], q_lo[kDp ? kMaxItemElems : 1];
  for (int i = 0; i < all_rows; ++i) {
    const int64_t row = it.row_begin + i % rows, head = (it.g + i / rows) * group + row / P.T, t = row % P.T;
    load_row_f32(P.q, P.q_dtype, it.b * P.q_stride_b + head * P.q_stride_h + t * P.q_stride_t, q + i * hs, hs);
  }
  bool has_lo = false;  // q ≈ q_hi + q_lo in bf16; a bf16 query has q_lo = 0
  if (use_dp) {
    uint32_t lo_bits = 0;
    for (int64_t i = 0; i < all_rows * hs; i += W) {
      const V x = Simd::load(q + i);
      Simd::store_bf16(q_hi + i, x);
      Simd::store_bf16(q_lo + i, Simd::sub(x, Simd::load_f32<DType::bf16>(q_hi + i)));
    }
    for (int64_t i = 0; i < all_rows * hs; ++i) lo_bits |= q_lo[i] & 0x7fffu;
    has_lo = lo_bits != 0;
  }

  float m_run[kMaxItemRows], l_run[kMaxItemRows], alpha[kMaxRows];
  alignas(64) float p[kMaxRows * W];  // probabilities of the current tile, (rows, W)
  alignas(64) float k_f32[KV == DType::f32 ? 1 : W * kMaxHeadDim];  // K tile converted once
  for (int i = 0; i < all_rows; ++i) m_run[i] = -INFINITY, l_run[i] = 0.0f;
  for (int64_t i = 0; i < all_rows * hs; ++i) o_acc[i] = 0.0f;

  // Whatever the layout, the reads should form a few long ascending runs: when the heads of a block
  // are adjacent (a block-major pool), walk block by block and head by head within it; otherwise
  // (each head's blocks adjacent), head by head over all the item's blocks.
  const KVBlock* B0 = it.blk_begin < it.blk_end ? &P.blocks[it.blk_begin] : nullptr;
  const bool heads_inner = B0 && B0->k_stride_head == B0->n_tokens * B0->k_stride_token;
  for (int64_t outer = 0; outer < (heads_inner ? it.blk_end - it.blk_begin : heads); ++outer)
    for (int64_t inner = 0; inner < (heads_inner ? heads : it.blk_end - it.blk_begin); ++inner) {
      const int h = int(heads_inner ? inner : outer);
      const KVBlock& B = P.blocks[it.blk_begin + (heads_inner ? outer : inner)];
      const T* kb = reinterpret_cast<const T*>(B.k_ptr) + (it.g + h) * B.k_stride_head;
      const T* vb = reinterpret_cast<const T*>(B.v_ptr) + (it.g + h) * B.v_stride_head;
      const int i0 = h * rows;  // this head's first item row
      float* o_head = o_acc + i0 * hs;
      const T* krow[W];
      const T* vrow[W];
      const float* kfrow[W];
      for (int64_t t0 = 0; t0 < B.n_tokens; t0 += W) {
        const int n = int(B.n_tokens - t0 < W ? B.n_tokens - t0 : W);
        for (int t = 0; t < W; ++t) {  // lanes past n read token t0 again and are masked out
          const int64_t tok = t0 + (t < n ? t : 0);
          krow[t] = kb + tok * B.k_stride_token;
          vrow[t] = vb + tok * B.v_stride_token;
        }
        if constexpr (KV == DType::f32) {
          for (int t = 0; t < W; ++t) kfrow[t] = reinterpret_cast<const float*>(krow[t]);
        } else if (!use_dp) {
          for (int t = 0; t < W; ++t) {
            kfrow[t] = k_f32 + (t < n ? t : 0) * hs;
            if (t < n)
              for (int64_t c = 0; c < hs; c += W) Simd::store(k_f32 + t * hs + c, Simd::load_f32<KV>(krow[t] + c));
          }
        }
        // Phase 1: every row's scores of the tile (independent dot products), in log2 units.
        for (int r = 0; r < rows; ++r) {
          const int i = i0 + r;
          V s;
          if constexpr (kDp) {
            if (use_dp) {
              const uint16_t* const* kr = reinterpret_cast<const uint16_t* const*>(krow);
              s = has_lo ? tile_scores_dp<true>(q_hi + i * hs, q_lo + i * hs, kr, hs)
                         : tile_scores_dp<false>(q_hi + i * hs, nullptr, kr, hs);
            } else {
              s = tile_scores_f32(q + i * hs, kfrow, hs);
            }
          } else {
            s = tile_scores_f32(q + i * hs, kfrow, hs);
          }
          Simd::store(p + r * W, Simd::first_n(Simd::mul(s, Simd::set1(log2_scale)), n, -INFINITY));
        }
        // Phase 2: online softmax per row (independent chains): p = 2^(s − m), l and o rescaled by α.
        for (int r = 0; r < rows; ++r) {
          const int i = i0 + r;
          const V s = Simd::load(p + r * W);
          const float tile_max = Simd::reduce_max(s);
          const float m_new = m_run[i] > tile_max ? m_run[i] : tile_max;
          if (m_new == -INFINITY) {  // every score −inf so far: nothing to weigh yet
            alpha[r] = 1.0f;
            Simd::store(p + r * W, Simd::zero());
            continue;
          }
          const V pv = Simd::first_n(Simd::exp2(Simd::sub(s, Simd::set1(m_new))), n, 0.0f);
          alpha[r] = Simd::lane0(Simd::exp2(Simd::set1(m_run[i] - m_new)));  // first tile: ~0 × zero state
          l_run[i] = l_run[i] * alpha[r] + Simd::reduce_add(pv);
          Simd::store(p + r * W, pv);
          m_run[i] = m_new;
        }
        // Phase 3: o ← α·o + p·V for all rows, each V row converted once.
        if constexpr (KV == DType::bf16) {
          if (split_v) {
            pv_rows_split(o_head, p, alpha, reinterpret_cast<const uint16_t* const*>(vrow), n, hs, rows);
            continue;
          }
        }
        pv_rows<KV>(o_head, p, alpha, vrow, n, hs, rows);
      }
    }
  if (split_v) unsplit_rows(o_acc, hs, all_rows);
  for (int i = 0; i < all_rows; ++i) m_out[i] = m_run[i], l_out[i] = l_run[i];
}

template <DType KV>
void attention_item_dtype(const AttentionProblem& P, const AttentionItem& it, float* o, float* m, float* l) {
  if constexpr (Simd::W == 1) return attention_item_kv<KV, 0>(P, it, o, m, l);  // nothing to unroll
  switch (P.head_dim) {
    case 64: return attention_item_kv<KV, 64>(P, it, o, m, l);
    case 128: return attention_item_kv<KV, 128>(P, it, o, m, l);
    default: return attention_item_kv<KV, 0>(P, it, o, m, l);
  }
}

void attention_item(const AttentionProblem& P, const AttentionItem& it, float* o, float* m, float* l) {
  switch (P.kv_dtype) {
    case DType::f32: return attention_item_dtype<DType::f32>(P, it, o, m, l);
    case DType::bf16: return attention_item_dtype<DType::bf16>(P, it, o, m, l);
    default: return attention_item_dtype<DType::f16>(P, it, o, m, l);
  }
}
