// Decode attention of one work item: ≤ kMaxRows query rows of each of a few KV heads of one
// sequence, over a range of that sequence's KV blocks. Written once over `Simd`; each ISA translation
// unit includes this inside an anonymous namespace after its target pragma.
//
// Zero copy: K and V rows are read in place through each block's strides. The tile loop takes W
// tokens (one vector of scores per query row, never a score row in memory); online softmax keeps a
// reference m (the running max, moved only when passed by kLazyMax) and sum l per row in log2 units;
// the fp32 output accumulators (≤ 32 KiB) stay in L1/L2. Per tile: (1) every row's scores, with the
// prefetch of a tile kPrefetchTiles ahead spread over the rows, (2) every row's softmax update,
// (3) o += p·V for all rows (o rescaled only in the rare tiles where some row's m moved).

template <DType KV> using KvElem = typename Elem<KV>::type;

// Scores may pass the softmax reference m by this much (log2 units) before m moves: p ≤ 2^8, far
// from fp32 overflow, and o is rescaled only a few times per item instead of every tile.
constexpr float kLazyMax = 8.0f;
// KV tiles (W tokens of one head, K and V) prefetched ahead of the one being computed: the blocks of a
// pool lie anywhere and a head's tile spans one 4 KiB page, where the hardware prefetchers stop, so
// without this each tile's first reads wait on DRAM. 2 measured best (1 and 3–8: slower).
constexpr int kPrefetchTiles = 2;

template <bool kScale> TANDEM_ALWAYS_INLINE Simd::V scaled(Simd::V v, float alpha) {
  if constexpr (kScale) return Simd::mul(v, Simd::set1(alpha));
  else return v;
}

// The walk over an item's KV: segment after segment (one KV head of one block each), tile after tile
// of W tokens within a segment. `k`, `v` point at the current segment's first token.
template <class T> struct SegmentWalk {
  const KVBlock* blocks;
  int64_t n_blocks;
  int heads, g;
  bool heads_inner;  // block-major: the heads of a block first, then the next block
  int64_t seg = 0, tok = 0;  // tok: the tile's first token (prefetching walk only)
  int head = 0;
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t k_stride = 0, v_stride = 0, n = 0;

  SegmentWalk(const KVBlock* b, int64_t nb, int h, int64_t g0, bool hi)
      : blocks(b), n_blocks(nb), heads(h), g(int(g0)), heads_inner(hi) { load(); }
  void load() {
    if (seg >= n_blocks * heads) { n = 0; return; }
    const KVBlock& B = blocks[heads_inner ? seg / heads : seg % n_blocks];
    head = int(heads_inner ? seg % heads : seg / n_blocks);
    k = reinterpret_cast<const T*>(B.k_ptr) + (g + head) * B.k_stride_head;
    v = reinterpret_cast<const T*>(B.v_ptr) + (g + head) * B.v_stride_head;
    k_stride = B.k_stride_token, v_stride = B.v_stride_token, n = B.n_tokens;
  }
  int64_t n_tokens() const { return n; }
  void next_segment() { ++seg, tok = 0, load(); }
  void advance() {  // to the next tile
    tok += Simd::W;
    if (tok >= n) next_segment();
  }
  // Prefetch the K and V rows of part `part` of `parts` of the current tile's tokens: a tile's
  // prefetches are spread over the compute (one part per query row) rather than issued in a burst.
  void prefetch_part(int64_t hs, int part, int parts) const {
    const int64_t m = n - tok < Simd::W ? n - tok : Simd::W;
    const int64_t t_end = tok + m * (part + 1) / parts, row = hs * int64_t(sizeof(T));
    for (int64_t t = tok + m * part / parts; t < t_end; ++t) {
      const char* kp = reinterpret_cast<const char*>(k + t * k_stride);
      const char* vp = reinterpret_cast<const char*>(v + t * v_stride);
      for (int64_t b = 0; b < row; b += 64) Simd::prefetch(kp + b), Simd::prefetch(vp + b);
    }
  }
};

// o[g][c : c + CU·W] ← alpha[g]·o[g] + Σ_t p[g·W + t]·v_t for G rows and CU chunks of head_dim at
// once: G·CU independent accumulators in registers, each V row read once, in order.
template <DType KV, bool kScale, int G, int CU>
inline void pv_block(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                     int64_t hs, int64_t c) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  V acc[G][CU];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) acc[g][u] = scaled<kScale>(Simd::load(o + g * hs + c + u * W), alpha[g]);
  for (int t = 0; t < n; ++t)
    for (int u = 0; u < CU; ++u) {
      const V v = Simd::load_f32<KV>(vrow[t] + c + u * W);  // one conversion serves G rows
      const float* pt = p + t;  // row g's weight at pt[g·W]: constant offsets, no index arithmetic
      for (int g = 0; g < G; ++g) acc[g][u] = Simd::fma(Simd::set1(pt[g * W]), v, acc[g][u]);
    }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) Simd::store(o + g * hs + c + u * W, acc[g][u]);
}

// Few rows get several chunks per pass, so that ≥ 8 FMA chains hide the FMA latency.
template <DType KV, bool kScale, int G>
inline void pv_group(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                     int64_t hs) {
  constexpr int CU = G >= 8 ? 1 : 8 / G;
  int64_t c = 0;
  for (; c + CU * Simd::W <= hs; c += CU * Simd::W) pv_block<KV, kScale, G, CU>(o, p, alpha, vrow, n, hs, c);
  for (; c < hs; c += Simd::W) pv_block<KV, kScale, G, 1>(o, p, alpha, vrow, n, hs, c);
}

// bf16 V, head_dim a multiple of 2·W: a 2·W-dim block of an o row is kept as [even dims | odd dims],
// the order Simd::bf16_even/odd produce, and put back in order once at the end of the item.
template <bool kScale, int G, int CU>
inline void pv_block_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                           int64_t hs, int64_t c) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  V acc[G][2 * CU];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 2 * CU; ++u) acc[g][u] = scaled<kScale>(Simd::load(o + g * hs + c + u * W), alpha[g]);
  for (int t = 0; t < n; ++t)
    for (int u = 0; u < CU; ++u) {
      const Simd::VI x = Simd::load_raw(vrow[t] + c + 2 * u * W);
      const V even = Simd::bf16_even(x), odd = Simd::bf16_odd(x);
      const float* pt = p + t;  // row g's weight at pt[g·W]: constant offsets, no index arithmetic
      for (int g = 0; g < G; ++g) {
        const V pg = Simd::set1(pt[g * W]);
        acc[g][2 * u] = Simd::fma(pg, even, acc[g][2 * u]);
        acc[g][2 * u + 1] = Simd::fma(pg, odd, acc[g][2 * u + 1]);
      }
    }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 2 * CU; ++u) Simd::store(o + g * hs + c + u * W, acc[g][u]);
}

template <bool kScale, int G>
inline void pv_group_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                           int64_t hs) {
  constexpr int CU = G >= 4 ? 1 : 4 / G;  // ≥ 8 accumulator chains
  int64_t c = 0;
  for (; c + 2 * CU * Simd::W <= hs; c += 2 * CU * Simd::W) pv_block_split<kScale, G, CU>(o, p, alpha, vrow, n, hs, c);
  for (; c < hs; c += 2 * Simd::W) pv_block_split<kScale, G, 1>(o, p, alpha, vrow, n, hs, c);
}

// A row of the split form takes two accumulators (even and odd dims), so a group holds half as many
// rows as pv_rows' (AVX2: 4 rows, 8 of the 16 ymm registers; 8 rows there would spill to the stack).
template <bool kScale>
inline void pv_rows_split(float* o, const float* p, const float* alpha, const uint16_t* const* vrow, int n,
                          int64_t hs, int rows) {
  constexpr int W = Simd::W;
  int r = 0;
  if constexpr (Simd::kMaxGroup >= 16)
    for (; r + 8 <= rows; r += 8) pv_group_split<kScale, 8>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  for (; r + 4 <= rows; r += 4) pv_group_split<kScale, 4>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  if (rows - r >= 2) { pv_group_split<kScale, 2>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 2; }
  if (rows - r >= 1) pv_group_split<kScale, 1>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
}

inline void unsplit_rows(float* o, int64_t hs, int rows) {
  constexpr int W = Simd::W;
  float block[2 * W];
  for (int64_t i = 0; i < rows * hs; i += 2 * W) {
    for (int j = 0; j < 2 * W; ++j) block[j] = o[i + j];
    for (int j = 0; j < W; ++j) o[i + 2 * j] = block[j], o[i + 2 * j + 1] = block[W + j];
  }
}

template <DType KV, bool kScale>
inline void pv_rows(float* o, const float* p, const float* alpha, const KvElem<KV>* const* vrow, int n,
                    int64_t hs, int rows) {
  constexpr int W = Simd::W;
  int r = 0;
  if constexpr (Simd::kMaxGroup >= 16)
    for (; r + 16 <= rows; r += 16) pv_group<KV, kScale, 16>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  for (; r + 8 <= rows; r += 8) pv_group<KV, kScale, 8>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
  if (rows - r >= 4) { pv_group<KV, kScale, 4>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 4; }
  if (rows - r >= 2) { pv_group<KV, kScale, 2>(o + r * hs, p + r * W, alpha + r, vrow, n, hs); r += 2; }
  if (rows - r >= 1) pv_group<KV, kScale, 1>(o + r * hs, p + r * W, alpha + r, vrow, n, hs);
}

// Scores (unscaled q·k) of one fp32 query row against the W fp32 rows of a tile (in L1: the K tile
// converted, or fp32 rows already fetched). A chunk of q is loaded once for the W rows, and the W
// accumulator chains advance side by side, so the FMA latency is hidden; each dot product still sums
// its chunks in order.
TANDEM_ALWAYS_INLINE Simd::V tile_scores_f32(const float* q, const float* const* krow, int64_t hs) {
  Simd::V acc[Simd::W];
  for (int t = 0; t < Simd::W; ++t) acc[t] = Simd::zero();
  for (int64_t c = 0; c < hs; c += Simd::W) {
    const Simd::V qc = Simd::load(q + c);
    for (int t = 0; t < Simd::W; ++t) acc[t] = Simd::fma(Simd::load(krow[t] + c), qc, acc[t]);
  }
  return Simd::transpose_reduce(acc);
}

// The same against bf16 rows with pairwise bf16 dot products; q ≈ q_hi + q_lo keeps an fp32 query
// exact to ~2^-17 (a bf16 query has q_lo = 0 and skips that pass).
template <bool kHasLo>
TANDEM_ALWAYS_INLINE Simd::V tile_scores_dp(const uint16_t* q_hi, const uint16_t* q_lo, const uint16_t* const* krow,
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

  float m_run[kMaxItemRows], alpha[kMaxRows];
  alignas(64) float l_run[kMaxItemRows * W];  // per row, W lane-wise partial sums of l
  alignas(64) float p[kMaxRows * W];  // probabilities of the current tile, (rows, W)
  alignas(64) float k_f32[KV == DType::f32 ? 1 : W * kMaxHeadDim];  // K tile converted once
  for (int i = 0; i < all_rows; ++i) m_run[i] = -INFINITY;
  for (int i = 0; i < all_rows * W; ++i) l_run[i] = 0.0f;
  for (int64_t i = 0; i < all_rows * hs; ++i) o_acc[i] = 0.0f;

  // Whatever the layout, the reads should form a few long ascending runs: when the heads of a block
  // are adjacent (a block-major pool), walk block by block and head by head within it; otherwise
  // (each head's blocks adjacent), head by head over all the item's blocks. Segment s of that walk
  // is one (block, head): the tokens of one KV head in one block.
  const int64_t n_blk = it.blk_end - it.blk_begin, n_seg = n_blk * heads;
  const KVBlock* B0 = n_blk > 0 ? &P.blocks[it.blk_begin] : nullptr;
  const bool heads_inner = B0 && B0->k_stride_head == B0->n_tokens * B0->k_stride_token;
  SegmentWalk<T> walk{P.blocks + it.blk_begin, n_blk, heads, it.g, heads_inner};
  SegmentWalk<T> ahead = walk;  // kPrefetchTiles tiles ahead of `walk`, prefetching
  for (int i = 0; i < kPrefetchTiles; ++i) ahead.prefetch_part(hs, 0, 1), ahead.advance();

  for (int64_t seg = 0; seg < n_seg; ++seg, walk.next_segment()) {
    const int i0 = walk.head * rows;  // this head's first item row
    float* o_head = o_acc + i0 * hs;
    const int64_t n_tokens = walk.n_tokens();
    const T* krow[W];
    const T* vrow[W];
    const float* kfrow[W];
    for (int64_t t0 = 0; t0 < n_tokens; t0 += W) {
      const int n = int(n_tokens - t0 < W ? n_tokens - t0 : W);
      for (int t = 0; t < W; ++t) {  // lanes past n read token t0 again and are masked out
        const int64_t tok = t0 + (t < n ? t : 0);
        krow[t] = walk.k + tok * walk.k_stride;
        vrow[t] = walk.v + tok * walk.v_stride;
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
        if constexpr (kPrefetchTiles > 0) ahead.prefetch_part(hs, r, rows);
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
      if constexpr (kPrefetchTiles > 0) ahead.advance();
      // Phase 2: online softmax per row, p = 2^(s − m). m is a reference, not the exact running max:
      // it moves (and l, o are rescaled by α = 2^(m_old − m_new)) only when a score passes it by more
      // than kLazyMax, so p ≤ 2^kLazyMax and most tiles skip the rescale of o entirely.
      bool rescale = false;
      for (int r = 0; r < rows; ++r) {
        const int i = i0 + r;
        const V s = Simd::load(p + r * W);
        alpha[r] = 1.0f;
        if (Simd::any_greater(s, m_run[i] + kLazyMax)) {
          const float tile_max = Simd::reduce_max(s);
          const float m_new = m_run[i] > tile_max ? m_run[i] : tile_max;
          alpha[r] = std::exp2(m_run[i] - m_new);  // first tile: 0 × the zero state
          Simd::store(l_run + i * W, Simd::mul(Simd::load(l_run + i * W), Simd::set1(alpha[r])));
          m_run[i] = m_new;
          rescale = true;
        } else if (m_run[i] == -INFINITY) {  // every score −inf so far: nothing to weigh yet
          Simd::store(p + r * W, Simd::zero());
          continue;
        }
        const V pv = Simd::first_n(Simd::exp2(Simd::sub(s, Simd::set1(m_run[i]))), n, 0.0f);
        Simd::store(l_run + i * W, Simd::add(Simd::load(l_run + i * W), pv));
        Simd::store(p + r * W, pv);
      }
      // Phase 3: o ← α·o + p·V for all rows, each V row converted once.
      if constexpr (KV == DType::bf16) {
        if (split_v) {
          const uint16_t* const* vr = reinterpret_cast<const uint16_t* const*>(vrow);
          if (rescale) pv_rows_split<true>(o_head, p, alpha, vr, n, hs, rows);
          else pv_rows_split<false>(o_head, p, alpha, vr, n, hs, rows);
          continue;
        }
      }
      if (rescale) pv_rows<KV, true>(o_head, p, alpha, vrow, n, hs, rows);
      else pv_rows<KV, false>(o_head, p, alpha, vrow, n, hs, rows);
    }
  }
  if (split_v) unsplit_rows(o_acc, hs, all_rows);
  for (int i = 0; i < all_rows; ++i) m_out[i] = m_run[i], l_out[i] = Simd::reduce_add(Simd::load(l_run + i * W));
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
