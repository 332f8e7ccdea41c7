// The K-quant decoders (layouts in kquant_blocks.h): a 256-weight super-block read as kKSub sub-blocks
// of 32, each against the activations' own 32-block. Included by quant_kernels.h after the vector
// operations (quant_vectors.h) and the Decode template.

template <> struct Decode<QType::q4_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    int sc, m;
    kscale_min(b + kQ4kScales, j, sc, m);
    s = load_half(b) * float(sc), c = -(load_half(b + 2) * float(m));
    // sub-blocks 2p and 2p+1 share 32 bytes: the low nibbles, then the high ones
    return widen_u8(field(load_bytes(b + kQ4kQs + 32 * (j >> 1)), 4 * (j & 1), 0x0f));
  }
};

template <> struct Decode<QType::q5_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    int sc, m;
    kscale_min(b + kQ5kScales, j, sc, m);
    s = load_half(b) * float(sc), c = -(load_half(b + 2) * float(m));
    const Bytes low = field(load_bytes(b + kQ5kQs + 32 * (j >> 1)), 4 * (j & 1), 0x0f);
    return widen_u8(or_high(low, field(load_bytes(b + kQ5kQh), j, 1)));  // bit j of qh[l]: the fifth bit
  }
};

template <> struct Decode<QType::q6_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = false;  // (q − 32)·sc is folded into the int16 weight
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    const int h = j >> 2, p = j & 3;  // 128-weight half, sub-block within it
    s = load_half(b + kQ6kD), c = 0.0f;
    const Bytes low = field(load_bytes(b + kQ6kQl + 64 * h + 32 * (p & 1)), p >= 2 ? 4 : 0, 0x0f);
    const Bytes top = field(load_bytes(b + kQ6kQh + 32 * h), 2 * p, 3);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + kQ6kSc + 2 * j);
    return centre_scale(widen_u8(or_high(low, top)), 32, sc[0], sc[1]);
  }
};
