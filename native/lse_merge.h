// The exact merge of the per-item partial results of one query row, shared by the per-head
// attention dispatch (dispatch.cpp) and the MLA one (mla_dispatch.cpp).
//
// A work item covers a range of a sequence's keys and leaves, per query row i of up to `cap` rows,
// an unnormalised output o (width floats), its running maximum m and its denominator l, both in
// the log2 domain of the kernels (scores pre-multiplied by log2 e):
//
//   item base + [i·width, (i+1)·width)   o   Σ_k 2^(s_k − m) · v_k
//   item base + cap·width + i            m   max_k s_k, −inf when the item had no key for the row
//   item base + cap·width + cap + i      l   Σ_k 2^(s_k − m)
//
// Items of one row lie `stride` floats apart. The merge over items s with M = max_s m_s:
//
//   out = Σ_s o_s·2^(m_s − M) / Σ_s l_s·2^(m_s − M),   lse = ln 2 · (M + log2 Σ_s l_s·2^(m_s − M))
//
// the natural-log LSE that engine/kernels/lse.py merges further. A row no item saw gets out = 0 and
// lse = −inf: weight zero in any later merge.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tandem {

inline void merge_partials(const float* first_item, int64_t n_items, int64_t stride, int64_t cap, int64_t width,
                           int64_t i, float* out, float* lse) {
  const int64_t m_at = cap * width + i, l_at = cap * width + cap + i;
  float m_max = -INFINITY;
  for (int64_t s = 0; s < n_items; ++s) m_max = std::max(m_max, first_item[s * stride + m_at]);
  for (int64_t d = 0; d < width; ++d) out[d] = 0.0f;
  if (m_max == -INFINITY) {
    *lse = -INFINITY;
    return;
  }
  float l_sum = 0.0f;
  for (int64_t s = 0; s < n_items; ++s) {
    const float* o = first_item + s * stride;
    const float m = o[m_at];
    if (m == -INFINITY) continue;
    const float w = std::exp2(m - m_max);
    l_sum += o[l_at] * w;
    for (int64_t d = 0; d < width; ++d) out[d] += o[i * width + d] * w;
  }
  const float inv = 1.0f / l_sum;
  for (int64_t d = 0; d < width; ++d) out[d] *= inv;
  *lse = float(0.6931471805599453 * (double(m_max) + std::log2(double(l_sum))));  // ln 2 · log2(·)
}

}  // namespace tandem
