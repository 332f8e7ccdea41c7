// Run-time choice of the ISA kernels, and the threading of each call (OpenMP).
//
// Attention: the work is cut into items (sequence, KV head, ≤ kMaxRows query rows, a range of
// blocks) so that every core streams KV even for one sequence; each item leaves a partial
// (o, m, l) and a final pass merges the partials of one (sequence, head) by their LSE.
// Experts: stage 1 (gate/up rows) and stage 2 (down rows) are each split into contiguous row
// ranges per thread, with the barrier of the parallel loop between them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#include "common.h"
#include "attention_split.h"
#include "convert.h"
#include "lse_merge.h"

#if defined(TANDEM_AMX_KERNELS)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem {
namespace {

#if defined(TANDEM_AMX_KERNELS)
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux's permission to use the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16+): without it the
// first tile instruction raises SIGILL. Asked once; the permission covers every thread.
bool amx_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

bool cpu_supports(const KernelTable* t) {
  if (t == &kTableScalar) return true;
#if defined(TANDEM_X86_KERNELS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (t == &kTableAvx2) return avx2;  // every AVX2 + FMA CPU also has F16C
  if (t == &kTableAvx512) return avx512;
#endif
#if defined(TANDEM_AVX512BF16_KERNELS)
  if (t == &kTableAvx512Bf16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#if defined(TANDEM_AMX_KERNELS)
  if (t == &kTableAmxBf16) return avx512 && __builtin_cpu_supports("avx512bf16") && amx_usable();
#endif
  return false;
}

// Best first.
const KernelTable* const kAllTables[] = {
#if defined(TANDEM_AMX_KERNELS)
    &kTableAmxBf16,
#endif
#if defined(TANDEM_AVX512BF16_KERNELS)
    &kTableAvx512Bf16,
#endif
#if defined(TANDEM_X86_KERNELS)
    &kTableAvx512, &kTableAvx2,
#endif
    &kTableScalar,
};

const KernelTable* find_table(const char* name) {
  for (const KernelTable* t : kAllTables)
    if (std::strcmp(t->name, name) == 0) return t;
  return nullptr;
}

const KernelTable* best_table() {
  // TANDEM_NATIVE_ISA pins an ISA (tests, benchmarks); an unusable value falls back to the best.
  if (const char* forced = std::getenv("TANDEM_NATIVE_ISA")) {
    const KernelTable* t = find_table(forced);
    if (t && cpu_supports(t)) return t;
  }
  for (const KernelTable* t : kAllTables)
    if (cpu_supports(t)) return t;
  return &kTableScalar;
}

std::atomic<const KernelTable*> g_table{nullptr};

int amx_min_tokens_from_env() {
  const char* env = std::getenv("TANDEM_AMX_MIN_TOKENS");
  const int n = env ? std::atoi(env) : 0;
  return n >= 1 ? n : kAmxMinTokensDefault;
}
std::atomic<int> g_amx_min_tokens{amx_min_tokens_from_env()};

int threads_or_default(int n) { return n > 0 ? n : default_threads(); }

template <class T> T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

const KernelTable& active_table() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (!t) {
    t = best_table();
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

bool select_isa(const char* name) {
  const KernelTable* t = std::strcmp(name, "auto") == 0 ? best_table() : find_table(name);
  if (!t || !cpu_supports(t)) return false;
  g_table.store(t, std::memory_order_release);
  return true;
}

int supported_isas(const char** names, int capacity) {
  int n = 0;
  for (const KernelTable* t : kAllTables)
    if (cpu_supports(t) && n < capacity) names[n++] = t->name;
  return n;
}

int amx_min_tokens() { return g_amx_min_tokens.load(std::memory_order_relaxed); }
void set_amx_min_tokens(int n) { g_amx_min_tokens.store(n >= 1 ? n : 1, std::memory_order_relaxed); }

int default_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void attention_decode(const AttentionProblem& P, int n_threads) {
  const KernelTable& K = active_table();
  const int nt = threads_or_default(n_threads);
  const int64_t hs = P.head_dim, group = P.n_heads / P.n_kv_heads, rows_per_head = group * P.T;
  const int64_t n_row_groups = (rows_per_head + kMaxRows - 1) / kMaxRows;
  const int64_t rows = (rows_per_head + n_row_groups - 1) / n_row_groups;  // per row group, ≤ kMaxRows
  // KV heads per item: as many as the item's query rows allow (see attention_kernel.h).
  const int64_t heads =
      std::max<int64_t>(1, std::min({P.n_kv_heads, kMaxItemRows / rows, kMaxItemElems / (rows * hs)}));
  const int64_t n_head_groups = (P.n_kv_heads + heads - 1) / heads;

  // Token ranges ("splits") per sequence, cut at block (piece) boundaries. Aim at ~4 items per thread so
  // that dynamic scheduling evens out, but keep each item long enough to amortise its setup.
  constexpr int64_t kMinSplitTokens = 128;
  int64_t total = 0;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t i = P.seq_offsets[b]; i < P.seq_offsets[b + 1]; ++i) total += P.blocks[i].n_tokens;
  const int64_t units = total * n_head_groups * n_row_groups;
  const int64_t split_tokens = std::max<int64_t>(kMinSplitTokens, units / (4 * int64_t(nt)) + 1);

  // Views longer than a split are cut into pieces (attention_split.h).
  static thread_local std::vector<KVBlock> pieces;
  static thread_local std::vector<int64_t> piece_offsets;
  const int64_t piece_tokens = (split_tokens + 63) / 64 * 64;
  cut_pieces(P.blocks, P.seq_offsets, P.B, piece_tokens, int64_t(dtype_size(P.kv_dtype)), pieces, piece_offsets);
  AttentionProblem Q = P;
  Q.blocks = pieces.data();
  Q.seq_offsets = piece_offsets.data();

  struct Group { int64_t b, g, g_end, row_begin, row_end, first_item, n_items; };
  static thread_local std::vector<AttentionItem> items;
  static thread_local std::vector<Group> groups;
  static thread_local std::vector<int64_t> splits;  // per sequence: block boundaries
  static thread_local std::vector<float> partial;
  items.clear(), groups.clear();
  for (int64_t b = 0; b < P.B; ++b) {
    split_sequence(Q.blocks, Q.seq_offsets[b], Q.seq_offsets[b + 1], split_tokens, splits);
    for (int64_t g = 0; g < P.n_kv_heads; g += heads)
      for (int64_t r0 = 0; r0 < rows_per_head; r0 += rows) {
        const int64_t g1 = std::min(P.n_kv_heads, g + heads), r1 = std::min(rows_per_head, r0 + rows);
        groups.push_back({b, g, g1, r0, r1, int64_t(items.size()), int64_t(splits.size()) - 1});
        for (size_t s = 0; s + 1 < splits.size(); ++s) items.push_back({b, g, g1, r0, r1, splits[s], splits[s + 1]});
      }
  }
  const int64_t stride = kMaxItemRows * (hs + 2);  // per item: o (rows × hs), m (rows), l (rows)
  float* part = scratch(partial, items.size() * size_t(stride));
  // The merge runs per output row (there may be a single group, e.g. one sequence): row_start[k] is
  // the first merge row of group k.
  static thread_local std::vector<int64_t> row_start;
  row_start.assign(1, 0);
  for (const Group& G : groups) row_start.push_back(row_start.back() + (G.g_end - G.g) * (G.row_end - G.row_begin));
  const int64_t n_items = int64_t(items.size()), n_merge = row_start.back();
  const AttentionItem* item_data = items.data();
  const Group* group_data = groups.data();
  const int64_t* starts = row_start.data();
  const int64_t n_groups = int64_t(groups.size());

#pragma omp parallel num_threads(nt) if (nt > 1 && n_items > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      float* o = part + i * stride;
      K.attention_item(Q, item_data[i], o, o + kMaxItemRows * hs, o + kMaxItemRows * hs + kMaxItemRows);
    }
    // Merge the items of each output row by their LSE (lse_merge.h).
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_merge; ++k) {
      const int64_t gi = std::upper_bound(starts, starts + n_groups + 1, k) - starts - 1;
      const Group& G = group_data[gi];
      const int64_t i = k - starts[gi], n_rows = G.row_end - G.row_begin;
      // Rows of one KV head are contiguous in out: (b, head g·group, t) flattened.
      const int64_t out_row = (G.b * P.n_heads + (G.g + i / n_rows) * group) * P.T + G.row_begin + i % n_rows;
      merge_partials(part + G.first_item * stride, G.n_items, stride, kMaxItemRows, hs, i, P.out + out_row * hs,
                     P.lse + out_row);
    }
  }
}

void expert_ffn(const ExpertProblem& P, int n_threads) {
  const KernelTable& K = active_table();
  const int nt = threads_or_default(n_threads);
  const ExpertTiling T = K.expert_tiling(P);
  const int64_t n_pad = T.n_pad;
  const size_t es = dtype_size(K.expert_activation_dtype(P));
  static thread_local std::vector<char> buffer;
  // xs (n_pad × H elements) then h (n_pad × I), tile-interleaved, 64-byte aligned.
  const size_t xs_bytes = (size_t(n_pad * P.hidden) * es + 63) / 64 * 64;
  char* base = scratch(buffer, xs_bytes + size_t(n_pad * P.inter) * es + 64);
  char* xs = base + (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  char* h = xs + xs_bytes;
  const int64_t unit = T.rows_per_unit;
  const int64_t n1 = P.inter / unit, n2 = P.hidden / unit;

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_pad; ++t) K.expert_prepare_x(P, xs, T, t, t + 1);
    // One contiguous run of units per thread, in one call: the kernels read a run in blocks of tiles,
    // a K chunk at a time (see experts_kernel.h).
#pragma omp for schedule(static)
    for (int i = 0; i < nt; ++i) {
      const int64_t b = n1 * i / nt, e = n1 * (i + 1) / nt;
      if (e > b) K.expert_gate_up(P, xs, h, T, b * unit, e * unit);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < nt; ++i) {
      const int64_t b = n2 * i / nt, e = n2 * (i + 1) / nt;
      if (e > b) K.expert_down(P, h, T, b * unit, e * unit);
    }
  }
}

// STREAM-style references measured with the same threads: read (sum of words) and copy.
double stream_read(const void* data, size_t n_bytes, int n_threads) {
  const int nt = threads_or_default(n_threads);
  const uint64_t* p = static_cast<const uint64_t*>(data);
  const int64_t words = int64_t(n_bytes / 8);
  uint64_t total = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < words; ++i) total += p[i];
  return double(total);
}

void stream_copy(void* dst, const void* src, size_t n_bytes, int n_threads) {
  const int nt = threads_or_default(n_threads);
  const size_t chunk = (n_bytes / size_t(nt) + 4095) / 4096 * 4096;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int i = 0; i < nt; ++i) {
    const size_t begin = std::min(n_bytes, size_t(i) * chunk), end = std::min(n_bytes, begin + chunk);
    if (end > begin) std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  }
}

}  // namespace tandem
