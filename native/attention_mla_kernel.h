// One MLA decode work item (attention_mla.h): ≤ kMlaMaxRows query rows of one sequence over a range
// of its blocks, each row of the cache read once for all of them. Written once over `Simd`; each
// isa_mla_*.cpp includes it inside an anonymous namespace after its target pragma.
//
// Per tile of W tokens: (1) scores of every query row, in register blocks of RB rows × TB tokens
// (RB·TB = W accumulators, one transpose-reduce per block), over the K plane then the V plane;
// (2) the online softmax per row (log2 units, a lazily moved reference max, as attention_kernel.h);
// (3) o += p · value in blocks of G rows × CU column vectors, value = [K plane | V plane][:r].
// Columns past the last whole vector of a plane (widths that are not multiples of W) run scalar.

template <DType KV> using MlaElem = typename Elem<KV>::type;

// A score may pass the reference max by this much (log2 units) before it moves: p ≤ 2^8, far from
// fp32 overflow, and o is rescaled only a few times per item (attention_kernel.h's kLazyMax).
constexpr float kMlaLazyMax = 8.0f;

// Score blocks: TB tokens × RB rows, RB·TB = W accumulators (16 of AVX-512's 32 registers, 8 of
// AVX2's 16), so each loaded K vector serves RB rows and each q vector TB tokens.
constexpr int kMlaTB = Simd::W >= 4 ? 4 : 1;
constexpr int kMlaRB = Simd::W / kMlaTB;
// Output blocks: G rows × CU vectors of columns in registers (AVX-512: 8 × 2, AVX2: 4 × 2).
constexpr int kMlaG = Simd::W >= 16 ? 8 : 4;
constexpr int kMlaCU = 2;
// Tiles prefetched ahead of the one being computed. The rows' first reads otherwise wait on DRAM
// (a tile of 16 rows of 1152 bytes spans several 4 KiB pages, where the hardware prefetchers stop):
// without it the K loads were the hot spots of a 32K-token call, and one thread took 35 ms, with it
// 30 ms (a shared Sapphire Rapids machine; 2 as the per-head kernel's kPrefetchTiles).
constexpr int kMlaPrefetchTiles = 2;

// The prefetching walk: kMlaPrefetchTiles tiles ahead of the compute, across block boundaries.
template <class T> struct MlaAhead {
  const KVBlock* blocks;
  int64_t bi, end, tok = 0;
  void advance() {
    tok += Simd::W;
    while (bi < end && tok >= blocks[bi].n_tokens) ++bi, tok = 0;
  }
  // Part `part` of `parts` of the tile's rows, both planes, into L2.
  void prefetch(int64_t row_bytes, int part, int parts) const {
    if (bi >= end) return;
    const KVBlock& B = blocks[bi];
    const int64_t m = B.n_tokens - tok < Simd::W ? B.n_tokens - tok : Simd::W;
    const int64_t es = int64_t(sizeof(T));
    for (int64_t t = tok + m * part / parts; t < tok + m * (part + 1) / parts; ++t) {
      const char* kp = reinterpret_cast<const char*>(B.k_ptr) + t * B.k_stride_token * es;
      const char* vp = reinterpret_cast<const char*>(B.v_ptr) + t * B.v_stride_token * es;
      for (int64_t b = 0; b < row_bytes; b += 64) Simd::prefetch(kp + b), Simd::prefetch(vp + b);
    }
  }
};

// acc[ri·TB + j] += q[ri] · x[j] over columns [0, nc) of a plane: q rows `qs` elements apart. bf16
// rows are widened to fp32 and FMA'd rather than VDPBF16PS'd: on a Sapphire Rapids core the widening
// path measured 10–20% faster here (397–457 against 474–514 ns of CPU time per cached row, 16 heads), the
// widening of each K vector shared by RB query rows.
template <DType KV>
TANDEM_ALWAYS_INLINE void mla_score_plane(Simd::V* acc, const float* q, int64_t qs, const MlaElem<KV>* const* x,
                                          int64_t nc) {
  using V = Simd::V;
  constexpr int W = Simd::W, TB = kMlaTB, RB = kMlaRB;
  for (int64_t c = 0; c < nc; c += W) {
    V k[TB];
    for (int j = 0; j < TB; ++j) k[j] = Simd::load_f32<KV>(x[j] + c);
    for (int ri = 0; ri < RB; ++ri) {
      const V qv = Simd::load(q + ri * qs + c);
      for (int j = 0; j < TB; ++j) acc[ri * TB + j] = Simd::fma(qv, k[j], acc[ri * TB + j]);
    }
  }
}

// Scores (unscaled q · row) of rows [0, rows_pad) against the W tokens of a tile → s (rows_pad, W).
// The prefetch of the tile `ahead` is spread over the row groups.
template <DType KV>
void mla_tile_scores(float* s, const float* q, int rows_pad, int64_t w,
                     int64_t wv, const MlaElem<KV>* const* krow, const MlaElem<KV>* const* vrow,
                     const MlaAhead<MlaElem<KV>>& ahead) {
  constexpr int W = Simd::W, TB = kMlaTB, RB = kMlaRB;
  const int64_t D = 2 * w;
  alignas(64) float sums[W];
  for (int rg = 0; rg < rows_pad; rg += RB) {
    ahead.prefetch(w * int64_t(sizeof(MlaElem<KV>)), rg / RB, rows_pad / RB);
    const float* qr = q + rg * D;
    for (int tg = 0; tg < W; tg += TB) {
      Simd::V acc[W];
      for (int i = 0; i < W; ++i) acc[i] = Simd::zero();
      mla_score_plane<KV>(acc, qr, D, krow + tg, wv);
      mla_score_plane<KV>(acc, qr + w, D, vrow + tg, wv);
      Simd::store(sums, Simd::transpose_reduce(acc));  // lane ri·TB + j: row rg + ri, token tg + j
      for (int ri = 0; ri < RB; ++ri)
        for (int j = 0; j < TB; ++j) {
          float x = sums[ri * TB + j];
          for (int64_t c = wv; c < w; ++c)  // scalar tail of each plane
            x += qr[ri * D + c] * to_f32<KV>(krow[tg + j][c]) + qr[ri * D + w + c] * to_f32<KV>(vrow[tg + j][c]);
          s[(rg + ri) * W + tg + j] = x;
        }
    }
  }
}

// o[g][oc + u·W …] ← alpha[g]·o[g] + Σ_t p[g·W + t] · src_t[c + u·W …] for G rows, CU column vectors:
// each value vector converted once for G rows.
template <DType KV, bool kScale, int G, int CU>
TANDEM_ALWAYS_INLINE void mla_pv_block(float* o, int64_t r, const float* p, const float* alpha,
                                       const MlaElem<KV>* const* src, int n, int64_t c, int64_t oc) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  V acc[G][CU];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) {
      acc[g][u] = Simd::load(o + g * r + oc + u * W);
      if constexpr (kScale) acc[g][u] = Simd::mul(acc[g][u], Simd::set1(alpha[g]));
    }
  for (int t = 0; t < n; ++t)
    for (int u = 0; u < CU; ++u) {
      const V v = Simd::load_f32<KV>(src[t] + c + u * W);
      for (int g = 0; g < G; ++g) acc[g][u] = Simd::fma(Simd::set1(p[g * W + t]), v, acc[g][u]);
    }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < CU; ++u) Simd::store(o + g * r + oc + u * W, acc[g][u]);
}

// G rows over nc value columns of one plane (src columns from 0, o columns from oc).
template <DType KV, bool kScale, int G>
void mla_pv_rows(float* o, int64_t r, const float* p, const float* alpha, const MlaElem<KV>* const* src, int n,
                 int64_t nc, int64_t oc) {
  constexpr int W = Simd::W;
  const int64_t ncv = nc / W * W;
  int64_t c = 0;
  for (; c + kMlaCU * W <= ncv; c += kMlaCU * W) mla_pv_block<KV, kScale, G, kMlaCU>(o, r, p, alpha, src, n, c, oc + c);
  for (; c < ncv; c += W) mla_pv_block<KV, kScale, G, 1>(o, r, p, alpha, src, n, c, oc + c);
  for (; c < nc; ++c)  // scalar tail
    for (int g = 0; g < G; ++g) {
      float x = o[g * r + oc + c];
      if constexpr (kScale) x *= alpha[g];
      for (int t = 0; t < n; ++t) x += p[g * W + t] * to_f32<KV>(src[t][c]);
      o[g * r + oc + c] = x;
    }
}

template <DType KV, bool kScale>
void mla_pv(float* o, int64_t r, const float* p, const float* alpha, const MlaElem<KV>* const* src, int n,
            int64_t nc, int64_t oc, int rows) {
  constexpr int W = Simd::W;
  int g = 0;
  for (; g + kMlaG <= rows; g += kMlaG) mla_pv_rows<KV, kScale, kMlaG>(o + g * r, r, p + g * W, alpha + g, src, n, nc, oc);
  if constexpr (kMlaG > 4)
    if (rows - g >= 4) mla_pv_rows<KV, kScale, 4>(o + g * r, r, p + g * W, alpha + g, src, n, nc, oc), g += 4;
  if (rows - g >= 2) mla_pv_rows<KV, kScale, 2>(o + g * r, r, p + g * W, alpha + g, src, n, nc, oc), g += 2;
  if (rows - g >= 1) mla_pv_rows<KV, kScale, 1>(o + g * r, r, p + g * W, alpha + g, src, n, nc, oc);
}

template <DType KV>
void mla_item_kv(const MlaProblem& P, const float* qf, const MlaItem& it, float* o_acc, float* m_out, float* l_out) {
  using T = MlaElem<KV>;
  using V = Simd::V;
  constexpr int W = Simd::W;
  const int64_t w = P.width, D = 2 * w, r = P.value_dim;
  const int rows = int(it.row_end - it.row_begin);
  const int rows_pad = (rows + kMlaRB - 1) / kMlaRB * kMlaRB;  // score blocks of RB rows; pad rows are 0
  const int64_t wv = w / W * W;  // vector columns per plane
  const int64_t ra = r < w ? r : w, rb = r - ra;  // value columns from the K plane, then the V plane
  const float log2_scale = P.scale * 1.4426950408889634f;  // scores in log2 units: 2^x is cheaper than e^x

  // (rows_pad, D) fp32 queries, the pad rows 0.
  static thread_local std::vector<float> q_buf;
  if (q_buf.size() < size_t(rows_pad * D)) q_buf.resize(size_t(rows_pad * D));
  float* q = q_buf.data();
  const float* q_src = qf + (it.b * P.n_heads * P.T + it.row_begin) * D;
  for (int64_t i = 0; i < rows_pad * D; ++i) q[i] = i < rows * D ? q_src[i] : 0.0f;

  float m_run[kMlaMaxRows], alpha[kMlaMaxRows];
  alignas(64) float l_run[kMlaMaxRows * W];  // per row, W lane-wise partial sums of l
  alignas(64) float p[kMlaMaxRows * W];      // (rows_pad, W): scores, then probabilities of the tile
  for (int i = 0; i < rows; ++i) m_run[i] = -INFINITY;
  for (int i = 0; i < rows * W; ++i) l_run[i] = 0.0f;
  for (int64_t i = 0; i < rows * r; ++i) o_acc[i] = 0.0f;

  MlaAhead<T> ahead{P.blocks, it.blk_begin, it.blk_end};
  while (ahead.bi < ahead.end && P.blocks[ahead.bi].n_tokens == 0) ++ahead.bi;
  for (int i = 0; i < kMlaPrefetchTiles; ++i) ahead.prefetch(w * int64_t(sizeof(T)), 0, 1), ahead.advance();
  for (int64_t bi = it.blk_begin; bi < it.blk_end; ++bi) {
    const KVBlock& B = P.blocks[bi];
    const T* kb = reinterpret_cast<const T*>(B.k_ptr);
    const T* vb = reinterpret_cast<const T*>(B.v_ptr);
    for (int64_t t0 = 0; t0 < B.n_tokens; t0 += W) {
      const int n = int(B.n_tokens - t0 < W ? B.n_tokens - t0 : W);
      const T* krow[W];
      const T* vrow[W];
      for (int t = 0; t < W; ++t) {  // lanes past n read token t0 again and are masked out
        const int64_t tok = t0 + (t < n ? t : 0);
        krow[t] = kb + tok * B.k_stride_token;
        vrow[t] = vb + tok * B.v_stride_token;
      }
      // Phase 1: every row's scores of the tile, in log2 units.
      mla_tile_scores<KV>(p, q, rows_pad, w, wv, krow, vrow, ahead);
      ahead.advance();
      // Phase 2: online softmax per row, p = 2^(s − m); m moves (and l, o are rescaled by
      // α = 2^(m_old − m_new)) only when a score passes it by more than kMlaLazyMax.
      bool rescale = false;
      for (int i = 0; i < rows; ++i) {
        const V s = Simd::first_n(Simd::mul(Simd::load(p + i * W), Simd::set1(log2_scale)), n, -INFINITY);
        alpha[i] = 1.0f;
        if (Simd::any_greater(s, m_run[i] + kMlaLazyMax)) {
          const float tile_max = Simd::reduce_max(s);
          const float m_new = m_run[i] > tile_max ? m_run[i] : tile_max;
          alpha[i] = std::exp2(m_run[i] - m_new);  // first tile: 0 × the zero state
          Simd::store(l_run + i * W, Simd::mul(Simd::load(l_run + i * W), Simd::set1(alpha[i])));
          m_run[i] = m_new;
          rescale = true;
        } else if (m_run[i] == -INFINITY) {  // every score −inf so far: nothing to weigh yet
          Simd::store(p + i * W, Simd::zero());
          continue;
        }
        const V pv = Simd::first_n(Simd::exp2(Simd::sub(s, Simd::set1(m_run[i]))), n, 0.0f);
        Simd::store(l_run + i * W, Simd::add(Simd::load(l_run + i * W), pv));
        Simd::store(p + i * W, pv);
      }
      // Phase 3: o ← α·o + p · [K plane | V plane][:r] for all rows.
      if (rescale) {
        mla_pv<KV, true>(o_acc, r, p, alpha, krow, n, ra, 0, rows);
        if (rb) mla_pv<KV, true>(o_acc, r, p, alpha, vrow, n, rb, ra, rows);
      } else {
        mla_pv<KV, false>(o_acc, r, p, alpha, krow, n, ra, 0, rows);
        if (rb) mla_pv<KV, false>(o_acc, r, p, alpha, vrow, n, rb, ra, rows);
      }
    }
  }
  for (int i = 0; i < rows; ++i) m_out[i] = m_run[i], l_out[i] = Simd::reduce_add(Simd::load(l_run + i * W));
}

void mla_item(const MlaProblem& P, const float* qf, const MlaItem& it, float* o, float* m, float* l) {
  switch (P.kv_dtype) {
    case DType::f32: return mla_item_kv<DType::f32>(P, qf, it, o, m, l);
    case DType::bf16: return mla_item_kv<DType::bf16>(P, qf, it, o, m, l);
    default: return mla_item_kv<DType::f16>(P, qf, it, o, m, l);
  }
}
