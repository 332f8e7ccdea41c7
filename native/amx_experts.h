// Expert FFN (SwiGLU or its clamped, biased form: ExpertForm) on AMX tiles (Intel Sapphire Rapids and later), for experts with more tokens than
// the vector kernels (experts_kernel.h) handle at memory speed: there every token adds a VDPBF16PS per
// 64 bytes of weights. One TDPBF16PS multiplies 16 weight rows × 32 elements by 32 elements × up to 16
// tokens. On a Xeon server with AMX: 1.1–1.7× the vector tiles' GB/s at 12–16 tokens and 3.6× at
// 128, level at 5, slower at 8 and below; kAmxMinTokensDefault follows.
// Included inside the anonymous namespace of isa_amx.cpp, after simd_avx512.h and experts_kernel.h.
//
// Tile registers (one configuration per call, N = tokens per tile):
//   C(r, g) = tmm(2g + r): row block r × token group g, M rows × N fp32;
//   A(r)    = tmm(4 + r):  M weight rows × 32 elements (bf16), loaded in place from the expert;
//   B(g)    = tmm(6 + g):  32 elements × N tokens of activations as 16 pair rows: pair row p holds,
//                          per token, elements 2p and 2p + 1 (the layout TDPBF16PS multiplies).
// Stage 1 takes the gate and the up rows of one block as its two row blocks (so act(g, u) is formed
// from its own tiles, biases added to the stored results); stage 2 two consecutive blocks of down
// rows, the down biases added as each token's outputs are stored.
//
// Activations (xs, h) in that pair layout per group of N tokens: a group is N·K contiguous bf16, pair
// p of token t at 32-bit word p·N + t mod N of its group (amx_pair_column), so a tile step reads 16
// pair rows of 2N elements.

constexpr int kAmxMaxRows = 16;    // weight rows of an A tile (the plan's rows_per_unit; the tile's most,
                                   // and 8-row tiles are no faster)
static_assert(kAmxMaxRows % Simd::W == 0, "a C tile of M = kAmxMaxRows rows is whole vectors (amx_gate_up)");
constexpr int kAmxStep = 32;       // elements of K per tile step (64 bytes of bf16)
constexpr int kAmxMaxTokens = 16;  // columns of a C tile (64 bytes of fp32)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};
};

// C and A tiles of `rows` weight rows, B tiles of 16 pair rows; N tokens.
void load_tile_config(int rows, int n_tokens) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    const bool a = i == 4 || i == 5, b = i >= 6;
    cfg.rows[i] = uint8_t(b ? kAmxStep / 2 : rows);
    cfg.colsb[i] = uint16_t(a ? 2 * kAmxStep : 4 * n_tokens);
  }
  // ldtilecfg's asm names only the first 8 bytes as its input: make the whole struct visible.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// C(r, g) = A(r) · B(g) over K for R row blocks of M rows (a[r]: a block's first row, rows `stride`
// elements apart) and G token groups (b[g]), stored to c + (g·R + r)·M·N (M × N fp32, row-major).
// next_block: elements from a row to the same row of the block this thread reads next.
// Prefetching into L2 (not L1: the rows of a gate/up block sit 4 KiB apart, in one L1 set):
// - first_block (a thread's first block of the call): its own rows, kWeightPrefetchBytes ahead of
//   each row's reads, across the end of a row into the next block;
// - every block: the next block's rows, one row after another, spread over this block's steps.
//   The tile loads read R·M rows side by side (32 streams of 64 bytes a step); prefetching the next
//   block row by row hands DRAM long sequential runs instead. Without it these tiles read 104 GB/s
//   of weights from L2 at 5 tokens and 78 at 8, but from DRAM only 56 and 51.
template <int R, int G>
void amx_tiles(const uint16_t* const* a, int M, int64_t stride, int64_t next_block, bool first_block,
               const uint16_t* const* b, int N, int64_t K, float* c) {
  _tile_zero(0);
  if constexpr (R == 2) _tile_zero(1);
  if constexpr (G == 2) _tile_zero(2);
  if constexpr (R == 2 && G == 2) _tile_zero(3);
  const int64_t a_bytes = 2 * stride, b_bytes = 4 * N;  // bytes between tile rows
  constexpr int64_t ahead = kWeightPrefetchBytes / 2;   // elements
  // The next block's lines (64 bytes, kAmxStep elements), row-major over its R·M rows, R·M a step.
  const int64_t lines_per_row = K / kAmxStep;
  int64_t next_row = 0, next_col = 0;  // the next line to prefetch: row (r·M + i) and line in it
  for (int64_t k = 0; k < K; k += kAmxStep) {
    if (first_block) {
      const int64_t kp = k + ahead, pf = kp < K ? kp : kp / K * next_block + kp % K;
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < M; ++i) Simd::prefetch(a[r] + i * stride + pf);
    }
    for (int n = 0; n < R * M && next_row < R * M; ++n) {
      const int r = int(next_row) / M, i = int(next_row) % M;
      Simd::prefetch(a[r] + next_block + i * stride + next_col * kAmxStep);
      if (++next_col == lines_per_row) next_col = 0, ++next_row;
    }
    _tile_loadd(6, b[0] + k * N, b_bytes);  // pair rows k/2 … k/2 + 15, 2N elements each
    if constexpr (G == 2) _tile_loadd(7, b[1] + k * N, b_bytes);
    _tile_loadd(4, a[0] + k, a_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G == 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, a[1] + k, a_bytes);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (G == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t cs = int64_t(M) * N;  // floats per C tile
  _tile_stored(0, c, b_bytes);
  if constexpr (R == 2) _tile_stored(1, c + cs, b_bytes);
  if constexpr (G == 2) _tile_stored(2, c + R * cs, b_bytes);
  if constexpr (R == 2 && G == 2) _tile_stored(3, c + 3 * cs, b_bytes);
}

// The tiles' plan for n ≥ amx_min_tokens() tokens with bf16 weights and activations: groups of at
// most 16 tokens, as even as they come (20 tokens: 2 × 10), so padding is under one token per group.
ExpertTiling amx_tiling(const ExpertProblem& P) {
  const int64_t n = P.n_tokens;
  if (expert_activation_dtype(P) != DType::bf16 || n < amx_min_tokens()) return expert_tiling(P);
  const int64_t groups = (n + kAmxMaxTokens - 1) / kAmxMaxTokens, N = (n + groups - 1) / groups;
  // A row is read from DRAM once per call and re-read from L2 per further pass of two groups.
  return {int(N), true, groups * N, kAmxMaxRows, 8 + 2 * ((groups + 1) / 2 - 1), int(N)};
}

// Pair (element 2p, 2p + 1) of token t's row at 32-bit word p·N of its group's column (t mod N).
inline uint32_t* amx_pair_column(void* act, int64_t t, int64_t K, int64_t N) {
  return static_cast<uint32_t*>(act) + t / N * N * K / 2 + t % N;
}

inline uint32_t bf16_pair(float lo, float hi) { return uint32_t(f32_to_bf16(lo)) | uint32_t(f32_to_bf16(hi)) << 16; }

void amx_prepare_x(const ExpertProblem& P, void* xs, const ExpertTiling& T, int64_t t_begin, int64_t t_end) {
  const int64_t H = P.hidden, N = T.tokens_per_tile;
  for (int64_t t = t_begin; t < t_end; ++t) {
    uint32_t* col = amx_pair_column(xs, t, H, N);
    const char* src = static_cast<const char*>(P.x) + t * P.x_stride * int64_t(dtype_size(P.x_dtype));
    if (t >= P.n_tokens) {
      for (int64_t p = 0; p < H / 2; ++p) col[p * N] = 0;
    } else if (P.x_dtype == DType::bf16) {  // a pair of bf16 is one 32-bit word already
      for (int64_t p = 0; p < H / 2; ++p) std::memcpy(col + p * N, src + 4 * p, 4);
    } else {
      for (int64_t p = 0; p < H / 2; ++p)
        col[p * N] = bf16_pair(load_as_f32(src, P.x_dtype, 2 * p), load_as_f32(src, P.x_dtype, 2 * p + 1));
    }
  }
}

// Rows [j0, j1) of h (whole tiles): h[t][j] = act(gate_j · x_t + bg_j, up_j · x_t + bu_j), as bf16 pairs.
void amx_gate_up(const ExpertProblem& P, const void* xs, void* h, const ExpertTiling& T, int64_t j0, int64_t j1) {
  const int N = T.tokens_per_tile, M = int(T.rows_per_unit);
  const int64_t H = P.hidden, I = P.inter, S = P.gate_up_stride, groups = T.n_pad / N, cs = int64_t(M) * N;
  const uint16_t* gu = static_cast<const uint16_t*>(P.gate_up);
  const uint16_t* x = static_cast<const uint16_t*>(xs);
  alignas(64) float c[4 * kAmxMaxRows * kAmxMaxTokens];
  load_tile_config(M, N);
  for (int64_t jb = j0; jb < j1; jb += M) {
    const uint16_t* a[2] = {gu + jb * S, gu + (I + jb) * S};  // gate rows, up rows
    for (int64_t g0 = 0; g0 < groups; g0 += 2) {  // a pass: two groups while the block's rows are in L2
      const uint16_t* b[2] = {x + g0 * N * H, x + std::min(g0 + 1, groups - 1) * N * H};
      const int G = groups - g0 >= 2 ? 2 : 1;
      const bool first = jb == j0 && g0 == 0;
      if (G == 2) amx_tiles<2, 2>(a, M, S, M * S, first, b, N, H, c);
      else amx_tiles<2, 1>(a, M, S, M * S, first, b, N, H, c);
      for (int g = 0; g < G; ++g) {
        float* gate = c + 2 * g * cs;  // (M rows, N tokens); up follows it
        if (P.form.gate_up_bias)  // every column, padding tokens' too: their h is never stored in y
          for (int r = 0; r < M; ++r) {
            const float bg = load_as_f32(P.form.gate_up_bias, P.form.bias_dtype, jb + r);
            const float bu = load_as_f32(P.form.gate_up_bias, P.form.bias_dtype, I + jb + r);
            for (int n = 0; n < N; ++n) gate[r * N + n] += bg, gate[cs + r * N + n] += bu;
          }
        for (int64_t i = 0; i < cs; i += Simd::W)  // cs = 16·N: whole vectors
          Simd::store(gate + i, expert_act(P.form, Simd::load(gate + i), Simd::load(gate + cs + i)));
        // Column n of the pass's group: rows jb … jb + M − 1 as M/2 pairs, N words apart.
        uint32_t* col = amx_pair_column(h, (g0 + g) * N, I, N) + jb / 2 * N;
        for (int r = 0; r < M; r += 2)
          for (int n = 0; n < N; ++n) col[r / 2 * N + n] = bf16_pair(gate[r * N + n], gate[(r + 1) * N + n]);
      }
    }
  }
  _tile_release();
}

// Rows [r0, r1) of y (whole tiles, two at a time): y[t][r] = down_r · h_t, in y's dtype.
void amx_down(const ExpertProblem& P, const void* h, const ExpertTiling& T, int64_t r0, int64_t r1) {
  const int N = T.tokens_per_tile, M = int(T.rows_per_unit);
  const int64_t I = P.inter, S = P.down_stride, groups = T.n_pad / N, cs = int64_t(M) * N;
  const uint16_t* dn = static_cast<const uint16_t*>(P.down);
  const uint16_t* hb = static_cast<const uint16_t*>(h);
  alignas(64) float c[4 * kAmxMaxRows * kAmxMaxTokens];
  alignas(64) float run[kAmxMaxRows];  // one token's outputs of one tile
  alignas(64) float bias[2 * kAmxMaxRows];  // the down biases of a pass's rows, fp32
  const void* down_bias = P.form.down_bias;
  load_tile_config(M, N);
  for (int64_t rb = r0; rb < r1; rb += 2 * M) {
    const int R = rb + 2 * M <= r1 ? 2 : 1;
    const uint16_t* a[2] = {dn + rb * S, dn + (rb + M) * S};
    if (down_bias)
      for (int i = 0; i < R * M; ++i) bias[i] = load_as_f32(down_bias, P.form.bias_dtype, rb + i);
    for (int64_t g0 = 0; g0 < groups; g0 += 2) {
      const uint16_t* b[2] = {hb + g0 * N * I, hb + std::min(g0 + 1, groups - 1) * N * I};
      const int G = groups - g0 >= 2 ? 2 : 1;
      const int64_t next = 2 * M * S;
      const bool first = rb == r0 && g0 == 0;
      if (R == 2 && G == 2) amx_tiles<2, 2>(a, M, S, next, first, b, N, I, c);
      else if (R == 2) amx_tiles<2, 1>(a, M, S, next, first, b, N, I, c);
      else if (G == 2) amx_tiles<1, 2>(a, M, S, next, first, b, N, I, c);
      else amx_tiles<1, 1>(a, M, S, next, first, b, N, I, c);
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) {
          const float* tile = c + (g * R + r) * cs;
          for (int n = 0; n < N; ++n) {
            const int64_t t = (g0 + g) * N + n;
            if (t >= P.n_tokens) break;
            for (int i = 0; i < M; ++i) run[i] = tile[i * N + n];
            if (down_bias)
              for (int i = 0; i < M; ++i) run[i] += bias[r * M + i];
            store_run(P.y, P.y_dtype, t * P.y_stride + rb + r * M, run, M);
          }
        }
    }
  }
  _tile_release();
}

// The table's entries: the tiles where the plan says so, the vector kernels otherwise.
void amx_or_vector_prepare_x(const ExpertProblem& P, void* xs, const ExpertTiling& T, int64_t t_begin,
                             int64_t t_end) {
  if (T.matrix_tiles) amx_prepare_x(P, xs, T, t_begin, t_end);
  else expert_prepare_x(P, xs, T, t_begin, t_end);
}

void amx_or_vector_gate_up(const ExpertProblem& P, const void* xs, void* h, const ExpertTiling& T, int64_t b,
                           int64_t e) {
  if (T.matrix_tiles) amx_gate_up(P, xs, h, T, b, e);
  else expert_gate_up(P, xs, h, T, b, e);
}

void amx_or_vector_down(const ExpertProblem& P, const void* h, const ExpertTiling& T, int64_t b, int64_t e) {
  if (T.matrix_tiles) amx_down(P, h, T, b, e);
  else expert_down(P, h, T, b, e);
}
