// Shared declarations of Tandem's native CPU kernels: problem descriptions passed from Python as
// raw pointers, shapes and strides, and the table of per-ISA kernels chosen at run time.
//
// No torch here on purpose: the Python wrappers (engine/kernels/attention_cpu.py, experts_cpu.py)
// validate dtypes, devices and shapes, then hand over data pointers as integers.
#pragma once

#include <cstddef>
#include <cstdint>

// x86 kernels (AVX2, AVX-512) are compiled with per-file target pragmas, which GCC and Clang know;
// elsewhere only the portable path exists.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define TANDEM_X86_KERNELS 1
#endif
// AVX512_BF16 intrinsics need GCC ≥ 10 or Clang ≥ 9; older compilers build the other paths.
#if defined(TANDEM_X86_KERNELS) && ((defined(__clang__) && __clang_major__ >= 9) || \
                                    (!defined(__clang__) && __GNUC__ >= 10))
#define TANDEM_AVX512BF16_KERNELS 1
#endif
// AMX tile intrinsics need GCC ≥ 11 or Clang ≥ 12 (and an assembler that knows the tmm registers);
// the tiles' OS permission request is Linux's arch_prctl.
#if defined(TANDEM_AVX512BF16_KERNELS) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TANDEM_AMX_KERNELS 1
#endif

// Hot helpers that must inline into their (target-pragma) callers; GCC otherwise leaves some out of line.
#if defined(__GNUC__) || defined(__clang__)
#define TANDEM_ALWAYS_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define TANDEM_ALWAYS_INLINE __forceinline
#else
#define TANDEM_ALWAYS_INLINE inline
#endif

namespace tandem {

// Element types, numbered as the Python wrappers number them.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// One KV block of one sequence: K and V views of shape (n_kv_heads, n_tokens, head_dim), unit
// stride along head_dim, any stride (in elements) along heads and tokens. Mirrors one row of the
// int64 table that KVBlockTable builds in Python.
struct KVBlock {
  int64_t k_ptr, v_ptr, n_tokens;
  int64_t k_stride_head, k_stride_token;
  int64_t v_stride_head, v_stride_token;
};
static_assert(sizeof(KVBlock) == 7 * sizeof(int64_t), "KVBlock must match the Python table row");

// Decode attention of B sequences, T queries each, over their blocks. Every query attends to every
// token of its sequence's blocks (no mask: the blocks hold only the past).
struct AttentionProblem {
  const void* q;             // (B, n_heads, T, head_dim) with the strides below, unit stride on head_dim
  DType q_dtype;
  int64_t B, T, n_heads, head_dim;
  int64_t q_stride_b, q_stride_h, q_stride_t;  // elements
  const KVBlock* blocks;     // all sequences' blocks, sequence b's at [seq_offsets[b], seq_offsets[b+1])
  const int64_t* seq_offsets;
  int64_t n_kv_heads;
  DType kv_dtype;
  float scale;               // softmax scale on q·k (natural units)
  float* out;                // (B, n_heads, T, head_dim) fp32, contiguous
  float* lse;                // (B, n_heads, T) fp32, contiguous: natural-log sum of exp(scale·q·k)
};

// Query rows of one (sequence, KV head g): row r is query head g·group + r / T at query t = r % T,
// so rows of one KV head are contiguous in `out`. A work item covers rows [row_begin, row_end)
// (≤ kMaxRows) of KV heads [g, g_end) over a contiguous range of the sequence's blocks: its item
// rows are (head, row) in that order, ≤ kMaxItemRows of them and ≤ kMaxItemElems query elements.
constexpr int kMaxRows = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxItemRows = 64;
constexpr int kMaxItemElems = 8192;

struct AttentionItem {
  int64_t b, g, g_end, row_begin, row_end, blk_begin, blk_end;
};

// An item's partial result per item row: m = running max of the scores in log2 units,
// l = Σ 2^(s − m), o = Σ 2^(s − m) · v (unnormalised, head_dim floats). Rows are contiguous.
using AttentionItemFn = void (*)(const AttentionProblem&, const AttentionItem&, float* o, float* m, float* l);

// How an expert forms its intermediate h from g = gate·x (+ bias) and u = up·x (+ bias), per element.
enum class ExpertAct : int32_t {
  swiglu = 0,          // silu(g)·u
  clamped_swiglu = 1,  // gpt-oss: g = min(g, limit), u = clamp(u, ±limit), (u + 1)·g·σ(alpha·g)
};

// An expert's form beyond its weights: the activation and optional biases, added to the fp32
// accumulators before the activation (gate, up) and before the output is stored (down).
struct ExpertForm {
  ExpertAct act = ExpertAct::swiglu;
  float alpha = 1.702f, limit = 7.0f;  // clamped_swiglu only (gpt-oss's published config)
  DType bias_dtype = DType::f32;
  const void* gate_up_bias = nullptr;  // (2·inter,) gate half first, or null: none
  const void* down_bias = nullptr;     // (hidden,), or null: none
};

// Expert FFN: y = down · act(gate·x, up·x), gate_up (2I, H) gate rows first, down (H, I); `form`
// names the activation and the biases (default: plain SwiGLU, no biases).
struct ExpertProblem {
  const void* x;  // (n_tokens, hidden), row stride x_stride, unit stride along hidden
  DType x_dtype;
  int64_t n_tokens, hidden, inter, x_stride;
  const void* gate_up;  // (2·inter, hidden), row stride gate_up_stride
  const void* down;     // (hidden, inter), row stride down_stride
  DType w_dtype;
  int64_t gate_up_stride, down_stride;
  void* y;  // (n_tokens, hidden), row stride y_stride
  DType y_dtype;
  int64_t y_stride;
  ExpertForm form{};
};

// One MoE layer's routed experts on the CPU: out (N, H) fp32 = Σ over (token, expert) pairs of
// weight · expert(x[token]). The pairs are grouped by expert: expert j's n_pairs follow expert
// j − 1's in `tokens` (rows of x, in [0, N)) and `weights`. Every expert has the same shapes and
// weight dtype.
struct MoeExpert {
  int64_t gate_up_ptr, down_ptr;  // (2·inter, hidden) and (hidden, inter), unit stride along a row
  int64_t gate_up_stride, down_stride;  // row strides in elements
  int64_t n_pairs;
};
static_assert(sizeof(MoeExpert) == 5 * sizeof(int64_t), "MoeExpert must match the Python table row");

struct MoeProblem {
  const void* x;  // (n_rows, hidden), row stride x_stride, unit stride along hidden
  DType x_dtype;
  int64_t n_rows, hidden, inter, x_stride;
  DType w_dtype;
  const MoeExpert* experts;
  int64_t n_experts;
  const int64_t* tokens;  // (Σ n_pairs,)
  const float* weights;   // (Σ n_pairs,)
  float* out;             // (n_rows, hidden), row stride out_stride: every row is written
  int64_t out_stride;
  ExpertForm form{};  // every expert's activation and bias dtype (its bias pointers are unused)
  const int64_t* biases = nullptr;  // (n_experts, 2) or null: expert j's gate_up and down bias addresses (0: none)
};

// How an expert's tokens are cut into tiles, chosen per problem by the kernel table (see
// expert_tiling): the kernels and both dispatchers (expert_ffn, moe_ffn) read the same plan.
struct ExpertTiling {
  int tokens_per_tile;   // tokens per tile (matrix tiles: the tile's columns, ≤ 16)
  bool matrix_tiles;     // AMX tiles (isa_amx.cpp) rather than vector tiles (experts_kernel.h)
  int64_t n_pad;         // tokens padded to whole tiles
  int64_t rows_per_unit; // weight rows per scheduling unit: one tile's rows
  int64_t row_cost;      // work of one weight row, for balancing threads across experts (moe_ffn)
  int last_tile_tokens;  // tokens of the last group's tiles: tokens_per_tile, or fewer (vector tiles
                         // at 5 and 6 tokens: a 4-token group and a 1- or 2-token one; experts_kernel.h)
};

// The kernels of one instruction set. Threading lives in dispatch.cpp; these run one piece of work
// on the calling thread. Expert activations (x converted, then h = silu(g)⊙u) are padded to
// T.n_pad tokens, stored as `expert_activation_dtype`, in the layout of the tiling (see
// experts_kernel.h and amx_experts.h): the kernels own that layout, dispatch only sizes it
// (n_pad × H, n_pad × I).
struct KernelTable {
  const char* name;
  AttentionItemFn attention_item;
  DType (*expert_activation_dtype)(const ExpertProblem&);
  ExpertTiling (*expert_tiling)(const ExpertProblem&);  // for P.n_tokens tokens
  void (*expert_prepare_x)(const ExpertProblem&, void* xs, const ExpertTiling&, int64_t t_begin, int64_t t_end);
  // Rows [row_begin, row_end) of h (stage 1) or of y (stage 2); whole units of the tiling.
  void (*expert_gate_up)(const ExpertProblem&, const void* xs, void* h, const ExpertTiling&, int64_t row_begin,
                         int64_t row_end);
  void (*expert_down)(const ExpertProblem&, const void* h, const ExpertTiling&, int64_t row_begin, int64_t row_end);
};

// Weight rows per expert tile for `lanes`-wide vectors and `tokens` tokens per tile: ≤ 4, so that the
// rows split finely over threads (Qwen3-30B-A3B's I = 768 gives 192 units of work).
constexpr int expert_tile_rows(int lanes, int tokens) { return lanes / tokens < 4 ? lanes / tokens : 4; }

// Tokens per tile for an expert applied to n tokens (never more than the vector's lanes). 2…8
// tokens: 4 (2 and 3 padded to 4, 7 to 8), the 4 rows × 4 tokens tile, and for 5…8 a second group over
// each weight chunk while it is in L1 (experts_kernel.h, dot_groups): of 4 tokens, or of 1 or 2 at 5
// and 6 tokens (expert_tiling, ExpertTiling::last_tile_tokens). 2 rows × 8 tokens for 5…8
// does the same dot products per weight byte but measured 5–11% slower there (Zen 4,
// AVX512_BF16, H = 2048, I = 768). Above 8: whichever of 4 and 8 pads less (9…12 → 4, 13…16 → 8,
// 17…20 → 4, …); at equal padding 2 × 8 tiles measured 3–10% faster (16, 24, 32 tokens). More
// tokens go through in groups (the kernels loop over them; later groups read the rows from L2).
// 1 row × 16 tokens measured slower (a weight vector per 16 activation loads). 2 tokens are padded to
// a 4-token tile rather than run as a row-at-a-time 2-token tile, whose 2 dot products per weight
// vector sit on 4 dependency chains while the padded tile reads the same bytes: 73.2 against 57.6
// GB/s of weights on a Xeon server with AMX, 19.1–19.3 against 14.9 on one Zen 4 thread.
inline int expert_tile_tokens(int64_t n, int lanes) {
  int tpt;
  if (n <= 1) tpt = 1;
  else if (n <= 8 || (n + 3) / 4 * 4 < (n + 7) / 8 * 8) tpt = 4;
  else tpt = 8;
  return tpt < lanes ? tpt : lanes;
}

// Tokens per expert from which AMX tiles beat the vector tiles: on a Xeon server with AMX the vector
// tiles are faster at 8 tokens (3 of 4 comparisons), AMX at 12 and 16 (all).
constexpr int kAmxMinTokensDefault = 9;

// Defined by the ISA translation units (only those compiled for this target exist).
extern const KernelTable kTableScalar;
#if defined(TANDEM_X86_KERNELS)
extern const KernelTable kTableAvx2;
extern const KernelTable kTableAvx512;
#endif
#if defined(TANDEM_AVX512BF16_KERNELS)
extern const KernelTable kTableAvx512Bf16;
#endif
#if defined(TANDEM_AMX_KERNELS)
extern const KernelTable kTableAmxBf16;
#endif

// dispatch.cpp
const KernelTable& active_table();
bool select_isa(const char* name);  // "auto" or one of supported_isas(); false if unsupported here
int supported_isas(const char** names, int capacity);
int default_threads();
void attention_decode(const AttentionProblem& p, int n_threads);
void expert_ffn(const ExpertProblem& p, int n_threads);
void moe_ffn(const MoeProblem& p, int n_threads);  // moe_dispatch.cpp
// Fewest tokens per expert that the AMX tiles take (amx_experts.h); fewer go to the vector tiles.
// Default kAmxMinTokensDefault, or TANDEM_AMX_MIN_TOKENS; settable for benchmarks and tests.
int amx_min_tokens();
void set_amx_min_tokens(int n);
double stream_read(const void* data, size_t n_bytes, int n_threads);
void stream_copy(void* dst, const void* src, size_t n_bytes, int n_threads);

}  // namespace tandem
