// Prototype (a measurement, not a kernel of the engine): a Q4_1 matrix-vector product at one token
// with the engine's int16 activations, over weights re-laid 16 rows at a time. Per 32-weight block of
// 16 rows: pair j of every row's weights sits in one byte (two nibbles), so one 16-byte load widened
// to dwords carries pair j of all 16 rows, and one vpdpwssd multiplies it by the activations' pair j
// (a broadcast dword) into 16 int32 row sums; the block's 16 scales and offsets are two float
// vectors. The engine's kernel (native/quant_kernels.h) works one row's block at a time: ~25
// instructions of unpacking, f16 scales and broadcasts per 32 weights.
//   g++ -O3 -march=native -o q41 interleaved_q4_1.cpp && taskset -c 0 ./q41
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
static float h2f(uint16_t h) { return _cvtsh_ss(h); }
static uint16_t f2h(float f) { return _cvtss_sh(f, 0); }
int main() {
  const int R = 960, K = 576, NB = K / 32;
  std::mt19937 g(1);
  std::uniform_int_distribution<int> nib(0, 15);
  std::normal_distribution<float> nd(0, 1);
  // original Q4_1 blocks: d (f16), m (f16), 16 bytes (low nibble weight j, high nibble weight j+16)
  std::vector<uint8_t> W(size_t(R) * NB * 20);
  std::vector<float> ref_w(size_t(R) * K);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      uint8_t* blk = &W[(size_t(r) * NB + b) * 20];
      float d = 0.01f + 0.001f * (r % 7), m = -0.05f;
      uint16_t dh = f2h(d), mh = f2h(m);
      memcpy(blk, &dh, 2); memcpy(blk + 2, &mh, 2);
      d = h2f(dh); m = h2f(mh);
      for (int j = 0; j < 16; ++j) {
        int lo = nib(g), hi = nib(g);
        blk[4 + j] = uint8_t(lo | (hi << 4));
        ref_w[size_t(r) * K + b * 32 + j] = lo * d + m;
        ref_w[size_t(r) * K + b * 32 + j + 16] = hi * d + m;
      }
    }
  std::vector<float> x(K);
  for (auto& v : x) v = nd(g);
  // activations: int16 per block, ad, as = ad*sum(q)
  std::vector<int16_t> aq(K); std::vector<float> ad(NB), as(NB);
  for (int b = 0; b < NB; ++b) {
    float amax = 0; for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b*32+j]));
    float inv = 32767.f / amax; int s = 0;
    for (int j = 0; j < 32; ++j) { int v = (int)std::nearbyint(x[b*32+j]*inv); aq[b*32+j] = v; s += v; }
    ad[b] = amax / 32767.f; as[b] = ad[b] * s;
  }
  std::vector<double> ref(R);
  for (int r = 0; r < R; ++r) { double s = 0; for (int k = 0; k < K; ++k) s += double(ref_w[size_t(r)*K+k]) * x[k]; ref[r] = s; }
  // (b) repack: per group of 16 rows, per block: 16 pair-bytes x 16 rows = 256 B (pair j: byte = w[2j] | w[2j+1]<<4
  // in the original order weights j and j+16 share a byte; here pairs (2j, 2j+1)), then 16 d's and 16 m's as f32
  const int G = R / 16;
  std::vector<uint8_t> P(size_t(G) * NB * 256);
  std::vector<float> PD(size_t(G) * NB * 16), PM(size_t(G) * NB * 16);
  auto wq = [&](int r, int b, int j) { const uint8_t* blk = &W[(size_t(r) * NB + b) * 20]; return j < 16 ? blk[4+j] & 15 : blk[4+j-16] >> 4; };
  for (int gi = 0; gi < G; ++gi)
    for (int b = 0; b < NB; ++b) {
      uint8_t* p = &P[(size_t(gi) * NB + b) * 256];
      for (int j = 0; j < 16; ++j)
        for (int rr = 0; rr < 16; ++rr) p[j * 16 + rr] = uint8_t(wq(gi*16+rr, b, 2*j) | (wq(gi*16+rr, b, 2*j+1) << 4));
      for (int rr = 0; rr < 16; ++rr) {
        const uint8_t* blk = &W[(size_t(gi*16+rr) * NB + b) * 20];
        uint16_t dh, mh; memcpy(&dh, blk, 2); memcpy(&mh, blk+2, 2);
        PD[(size_t(gi)*NB+b)*16+rr] = h2f(dh); PM[(size_t(gi)*NB+b)*16+rr] = h2f(mh);
      }
    }
  std::vector<float> y(R);
  const uint8_t* Pb = P.data();
  auto run_b = [&]() {
    const __m512i lo4 = _mm512_set1_epi32(0x0f), hi4 = _mm512_set1_epi32(0xf0);
    for (int gi = 0; gi < G; ++gi) {
      __m512 acc = _mm512_setzero_ps(), off = _mm512_setzero_ps();
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = Pb + (size_t(gi) * NB + b) * 256;
        const int32_t* a32 = reinterpret_cast<const int32_t*>(&aq[b * 32]);  // pairs (a[2j], a[2j+1])
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 16; j += 2) {
          __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 16)));
          __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 16 + 16)));
          // dword lane: low word = low nibble, high word = high nibble
          d0 = _mm512_or_si512(_mm512_and_si512(d0, lo4), _mm512_slli_epi32(_mm512_and_si512(d0, hi4), 12));
          d1 = _mm512_or_si512(_mm512_and_si512(d1, lo4), _mm512_slli_epi32(_mm512_and_si512(d1, hi4), 12));
          s0 = _mm512_dpwssd_epi32(s0, d0, _mm512_set1_epi32(a32[j]));
          s1 = _mm512_dpwssd_epi32(s1, d1, _mm512_set1_epi32(a32[j + 1]));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        const __m512 dv = _mm512_loadu_ps(&PD[(size_t(gi)*NB+b)*16]), mv = _mm512_loadu_ps(&PM[(size_t(gi)*NB+b)*16]);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(dot, dv), _mm512_set1_ps(ad[b]), acc);
        off = _mm512_fmadd_ps(mv, _mm512_set1_ps(as[b]), off);
      }
      _mm512_storeu_ps(&y[gi * 16], _mm512_add_ps(acc, off));
    }
  };
  run_b();
  double err = 0, mx = 0; for (int r = 0; r < R; ++r) { err = std::max(err, std::fabs(y[r] - ref[r])); mx = std::max(mx, std::fabs(ref[r])); }
  printf("repacked: max err %.3g of %.3g\n", err, mx);
  const int N = 20000;
  {
    const int C = 200;  // 200 x 0.35 MB = 70 MB, cycled: every weight read once a pass
    std::vector<uint8_t> big(P.size() * C);
    for (int c = 0; c < C; ++c) memcpy(&big[P.size() * c], P.data(), P.size());
    const int passes = 20;
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < passes; ++it)
      for (int c = 0; c < C; ++c) { Pb = &big[P.size() * c]; run_b(); }
    auto t1 = std::chrono::steady_clock::now();
    Pb = P.data();
    printf("70 MB cycled: %.2f us a matrix (%.1f GB/s of nibbles)\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / (passes * C),
           P.size() * double(passes * C) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) { run_b(); asm volatile("" ::: "memory"); }
  auto t1 = std::chrono::steady_clock::now();
  printf("repacked 960x576 Q4_1, 1 token, 1 thread: %.2f us\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / N);
}
