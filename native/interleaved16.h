// The 16-row interleaved copy of a Q4_0 / Q4_1 matrix (quant_blocks.h's Interleaved16), which one-token
// products read where the ISA has interleaved_rows (AVX-512): their row kernel spends most of a
// decode step unpacking each row's blocks one at a time, and the copy lets 16 rows share that work.
// The copy is owned by whoever holds the matrix's plan (a DecodeLayer) and costs the matrix's bytes
// again in RAM (1.2× for Q4_1, 1.33× for Q4_0: the scales become floats), so a process makes copies
// only up to kInterleavedBudget; the matrices past it keep the row kernel.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "quant_blocks.h"

namespace tandem {

// RAM for interleaved copies a process may hold: the memory target of a quantised model is 1.15 × its
// file + KV + 1 GiB, and a copy is extra heap, so the copies take at most half of that GiB. The
// built-in model's 30 layers take 80 MB; a 7B Q4_0 model's (~150 MB a layer) its first three.
constexpr int64_t kInterleavedBudget = int64_t(512) << 20;

inline std::atomic<int64_t>& interleaved_bytes() {
  static std::atomic<int64_t> held{0};
  return held;
}

class InterleavedCopy {
 public:
  // W (rows, k) of `type`, rows `row_bytes` apart. No copy (view() null) unless the type is Q4_0 or
  // Q4_1, there is a whole group of 16 rows and the budget has room.
  InterleavedCopy(const uint8_t* w, QType type, int64_t rows, int64_t k, int64_t row_bytes) {
    if ((type != QType::q4_0 && type != QType::q4_1) || rows < 16 || k % kQBlock) return;
    const int64_t groups = rows / 16, nb = k / kQBlock;
    const int64_t bytes = groups * nb * (256 + 2 * 16 * int64_t(sizeof(float)));
    if (interleaved_bytes().fetch_add(bytes) + bytes > kInterleavedBudget) {
      interleaved_bytes().fetch_sub(bytes);
      return;
    }
    bytes_ = bytes;
    pairs_.resize(size_t(groups * nb * 256));
    scale_.resize(size_t(groups * nb * 16));
    offset_.resize(size_t(groups * nb * 16));
    const int64_t block = qblock_bytes(int(type)), nibbles = type == QType::q4_1 ? 4 : 2;  // where they start: after d (and m)
    for (int64_t r = 0; r < groups * 16; ++r) {
      const int64_t g = r / 16, lane = r % 16;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + r * row_bytes + b * block;
        uint16_t h[2] = {0, 0};
        std::memcpy(h, blk, size_t(nibbles));
        const float d = f16_to_f32(h[0]);
        const int64_t at = (g * nb + b) * 16 + lane;
        scale_[size_t(at)] = d;
        offset_[size_t(at)] = type == QType::q4_1 ? f16_to_f32(h[1]) : -8.0f * d;  // Q4_0: (q − 8)·d
        const uint8_t* q = blk + nibbles;  // byte i: weight i (low nibble), weight i + 16 (high)
        auto weight = [q](int j) { return j < 16 ? q[j] & 0x0f : q[j - 16] >> 4; };
        uint8_t* out = pairs_.data() + (g * nb + b) * 256 + lane;
        for (int j = 0; j < 16; ++j) out[16 * j] = uint8_t(weight(2 * j) | weight(2 * j + 1) << 4);
      }
    }
    view_ = {pairs_.data(), scale_.data(), offset_.data(), groups};
  }
  InterleavedCopy(const InterleavedCopy&) = delete;
  InterleavedCopy& operator=(const InterleavedCopy&) = delete;
  ~InterleavedCopy() { interleaved_bytes().fetch_sub(bytes_); }

  const Interleaved16* view() const { return bytes_ ? &view_ : nullptr; }

 private:
  std::vector<uint8_t> pairs_;
  std::vector<float> scale_, offset_;
  Interleaved16 view_{};
  int64_t bytes_ = 0;
};

}  // namespace tandem
