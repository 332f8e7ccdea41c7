// How a decode attention call's KV is cut into work items, shared by the per-head dispatch
// (dispatch.cpp) and the MLA one (mla_dispatch.cpp): every thread streams KV even for one sequence.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace tandem {

// Views longer than piece_tokens are cut into pieces (a piece is the same view with its pointers
// moved along the token strides), so that one long view per sequence still spreads over every
// thread. blocks[seq_offsets[b], seq_offsets[b + 1]) are sequence b's views; es: bytes per element.
// → pieces, and piece_offsets (B + 1) delimiting each sequence's pieces.
inline void cut_pieces(const KVBlock* blocks, const int64_t* seq_offsets, int64_t B, int64_t piece_tokens,
                       int64_t es, std::vector<KVBlock>& pieces, std::vector<int64_t>& piece_offsets) {
  pieces.clear(), piece_offsets.assign(1, 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = seq_offsets[b]; i < seq_offsets[b + 1]; ++i) {
      const KVBlock& V = blocks[i];
      for (int64_t t0 = 0; t0 < V.n_tokens; t0 += piece_tokens) {
        KVBlock piece = V;
        piece.k_ptr += t0 * V.k_stride_token * es;
        piece.v_ptr += t0 * V.v_stride_token * es;
        piece.n_tokens = std::min(piece_tokens, V.n_tokens - t0);
        pieces.push_back(piece);
      }
    }
    piece_offsets.push_back(int64_t(pieces.size()));
  }
}

// One sequence's token ranges ("splits"), cut at piece boundaries once a range holds split_tokens:
// → splits, the boundaries from `begin` to `end` (pieces [begin, end)); a sequence without pieces
// still gets one (empty) range.
inline void split_sequence(const KVBlock* pieces, int64_t begin, int64_t end, int64_t split_tokens,
                           std::vector<int64_t>& splits) {
  splits.assign(1, begin);
  int64_t acc = 0;
  for (int64_t i = begin; i < end; ++i) {
    acc += pieces[i].n_tokens;
    if (acc >= split_tokens && i + 1 < end) splits.push_back(i + 1), acc = 0;
  }
  splits.push_back(end);
}

}  // namespace tandem
