// The MLA decode kernels' ISA (the per-head kernels' choice) and the threading of each call (OpenMP).
//
// Work items are (sequence, ≤ kMlaMaxRows query rows, a range of blocks): every thread streams rows
// even for one sequence, and all of a sequence's heads read each row once per item. Each item leaves
// a partial (o, m, l) per query row; a final pass merges the partials of a row by their LSE, as the
// per-head kernel's dispatch does. Heads are not split across threads while they fit one item:
// that would read each row once per thread instead of once. Measured (benchmarks/mla_cpu_decode.py,
// 32K bf16 rows, an idle 2-thread Sapphire Rapids machine): 16 heads split by tokens over 2 threads
// 5.5–5.8 ms; 8 heads on one thread, what a split by heads would leave each thread, 7.0 ms.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#include "attention_mla.h"
#include "attention_split.h"
#include "convert.h"
#include "lse_merge.h"

namespace tandem {

const MlaKernelTable& active_mla_table() {
  const char* isa = active_table().name;
#if defined(TANDEM_X86_KERNELS)
  if (std::strcmp(isa, "amx-bf16") == 0 || std::strcmp(isa, "avx512bf16") == 0 || std::strcmp(isa, "avx512") == 0)
    return kMlaTableAvx512;
  if (std::strcmp(isa, "avx2") == 0) return kMlaTableAvx2;
#endif
  return kMlaTableScalar;
}

void attention_mla_decode(const MlaProblem& P, int n_threads) {
  const MlaKernelTable& K = active_mla_table();
  const int nt = n_threads > 0 ? n_threads : default_threads();
  const int64_t D = 2 * P.width, r = P.value_dim, rows_total = P.n_heads * P.T;
  const int64_t n_row_groups = (rows_total + kMlaMaxRows - 1) / kMlaMaxRows;
  const int64_t rows = (rows_total + n_row_groups - 1) / n_row_groups;  // per row group, ≤ kMlaMaxRows

  // The queries as fp32 (B, nh·T, D), contiguous: what every item reads (a few hundred KB at most).
  static thread_local std::vector<float> qf_buf;
  if (qf_buf.size() < size_t(P.B * rows_total * D)) qf_buf.resize(size_t(P.B * rows_total * D));
  float* qf = qf_buf.data();
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t h = 0; h < P.n_heads; ++h)
      for (int64_t t = 0; t < P.T; ++t) {
        const int64_t src = b * P.q_stride_b + h * P.q_stride_h + t * P.q_stride_t;
        float* dst = qf + ((b * P.n_heads + h) * P.T + t) * D;
        for (int64_t c = 0; c < D; ++c) dst[c] = load_as_f32(P.q, P.q_dtype, src + c);
      }

  // Token ranges ("splits") per sequence, cut at block (piece) boundaries: ~4 items per thread so that
  // dynamic scheduling evens out, each long enough to amortise its setup (the queries' copy).
  constexpr int64_t kMinSplitTokens = 256;
  int64_t total = 0;
  for (int64_t i = P.seq_offsets[0]; i < P.seq_offsets[P.B]; ++i) total += P.blocks[i].n_tokens;
  const int64_t split_tokens = std::max<int64_t>(kMinSplitTokens, total * n_row_groups / (4 * int64_t(nt)) + 1);
  const int64_t piece_tokens = (split_tokens + 63) / 64 * 64;

  // Views longer than a split are cut into pieces (attention_split.h).
  static thread_local std::vector<KVBlock> pieces;
  static thread_local std::vector<int64_t> piece_offsets;
  cut_pieces(P.blocks, P.seq_offsets, P.B, piece_tokens, int64_t(dtype_size(P.kv_dtype)), pieces, piece_offsets);
  MlaProblem Q = P;
  Q.blocks = pieces.data();

  struct Group { int64_t b, row_begin, row_end, first_item, n_items; };
  static thread_local std::vector<MlaItem> items;
  static thread_local std::vector<Group> groups;
  static thread_local std::vector<int64_t> splits;
  static thread_local std::vector<float> partial;
  items.clear(), groups.clear();
  for (int64_t b = 0; b < P.B; ++b) {
    split_sequence(pieces.data(), piece_offsets[b], piece_offsets[b + 1], split_tokens, splits);
    for (int64_t r0 = 0; r0 < rows_total; r0 += rows) {
      const int64_t r1 = std::min(rows_total, r0 + rows);
      groups.push_back({b, r0, r1, int64_t(items.size()), int64_t(splits.size()) - 1});
      for (size_t s = 0; s + 1 < splits.size(); ++s) items.push_back({b, r0, r1, splits[s], splits[s + 1]});
    }
  }
  const int64_t stride = rows * (r + 2);  // per item: o (rows × r), m (rows), l (rows)
  if (partial.size() < items.size() * size_t(stride)) partial.resize(items.size() * size_t(stride));
  float* part = partial.data();
  const int64_t n_items = int64_t(items.size()), n_groups = int64_t(groups.size());
  const MlaItem* item_data = items.data();
  const Group* group_data = groups.data();

#pragma omp parallel num_threads(nt) if (nt > 1 && n_items > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      float* o = part + i * stride;
      K.item(Q, qf, item_data[i], o, o + rows * r, o + rows * r + rows);
    }
    // Merge the items of each output row by their LSE (lse_merge.h).
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_groups * rows; ++k) {
      const Group& G = group_data[k / rows];
      const int64_t i = k % rows;
      if (G.row_begin + i >= G.row_end) continue;  // the last group may hold fewer rows
      const int64_t out_row = G.b * rows_total + G.row_begin + i;  // (b, head, t) flattened
      merge_partials(part + G.first_item * stride, G.n_items, stride, rows, r, i, P.out + out_row * r, P.lse + out_row);
    }
  }
}

}  // namespace tandem
