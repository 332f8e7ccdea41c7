// The portable path: "vectors" of one fp32 lane, so the same kernels run on any CPU.
// Included inside an anonymous namespace of a translation unit compiled for the baseline ISA.

struct Simd {
  static constexpr int W = 1;
  static constexpr int kMaxGroup = 8;
  static constexpr bool kDpbf16 = false;
  using V = float;
  using VI = uint32_t;  // two raw bf16 elements

  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V min(V a, V b) { return a < b ? a : b; }  // the second operand where either is NaN, as minps
  static V max(V a, V b) { return a > b ? a : b; }
  static V fma(V a, V b, V c) { return a * b + c; }  // std::fma is a slow libm call without FMA hardware
  static float lane0(V v) { return v; }
  static void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p);
#else
    (void)p;
#endif
  }
  // Some lane > x (NaN lanes are not).
  static bool any_greater(V a, float x) { return a > x; }
  static float reduce_add(V v) { return v; }
  static float reduce_max(V v) { return v; }
  template <DType D> static V load_f32(const typename Elem<D>::type* p) { return to_f32<D>(*p); }
  static V first_n(V v, int n, float fill) { return n > 0 ? v : fill; }
  static V exp2(V x) { return std::exp2(x); }
  static V transpose_reduce(const V* a) { return a[0]; }
  static void store_bf16(uint16_t* dst, V v) { *dst = f32_to_bf16(v); }
  // 2·W raw bf16 → their even elements and their odd elements as fp32 (exact: bf16 is the top
  // half of an fp32), without the shuffles of a widening conversion.
  static V bf16_even(VI x) { return bits_to_f32(x << 16); }
  static V bf16_odd(VI x) { return bits_to_f32(x & 0xffff0000u); }
  static VI load_raw(const uint16_t* p) { VI v; std::memcpy(&v, p, 4); return v; }
  static V dp(V acc, VI a, VI b) {
    acc += bits_to_f32(a << 16) * bits_to_f32(b << 16);
    return acc + bits_to_f32(a & 0xffff0000u) * bits_to_f32(b & 0xffff0000u);
  }
};
