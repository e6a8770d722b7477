// float32 products of expert blocks on CPUs with AVX-512 (and at the end, bf16 decode blocks
// on CPUs with AVX512-BF16: the same register tiles with bf16 operands widened as they are
// loaded and results rounded to bf16 as stored, and a forward on bf16 dot products):
//
//     forward          y[r, o] = sum_i x[r, i] * w[o, i]  (x·wᵀ: a block's rows through an
//                                                         expert's weight w [O, I])
//     weight gradient  c[m, n] = sum_k a[k, m] * b[k, n]  (aᵀ·b: a an output gradient's block of
//                                                         k rows, b the input's rows, c the
//                                                         weight's gradient)
//
// Forward: dot products along the contiguous I dim of x and w (w read as it lies, never
// packed), in register tiles of 4 rows of x by 6 rows of w (24 accumulators of 16 lanes), the
// sums reduced across lanes at the end of each chunk of 512 of I (a chunk of the tile's rows
// of w and x stays in L1 while every row tile of x passes over it). The threads split w's rows.
//
// Weight gradient:
// the few to few dozen rows k of a block (moe_ffn/_small_gemm.py says where and why: MKL's
// sgemm runs these at 170–200 GFLOP/s at 64 rows, a large product at 350–440); outer
// products in register tiles of 6 rows by 64 columns of c (24 accumulators of 16 lanes): for
// each row k, 6 values of a broadcast and 4 vectors of b's row, 24 FMAs; the tile's sums run
// over all k rows (from 16 rows, b's 64 columns of them copied where they stay in L1 and a's
// columns transposed, panels_range) and each element of c is stored once,
// never read (or read once and added to, accumulating). Large outputs from few rows are
// stored past the caches (streaming stores): the gradient is read next by the optimizer, and
// a store that first reads its line (to own it) doubles the memory traffic of a product that
// is mostly writing. The threads split c's rows.
//
// Built with the package's AVX2 flags; the code between push_options and pop_options is
// compiled for AVX-512 and runs only where moe_ffn_avx512_ready() says the CPU and OS allow
// (its AVX512-BF16 part where moe_ffn_avx512_bf16_ready() does).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "_entry_points.h"
#include "_team.h"

using moe_ffn_team::make_team;
using moe_ffn_team::on_team;
using moe_ffn_team::share;
using moe_ffn_team::Team;

namespace {

bool ready() {
  static const bool usable = moe_ffn_team::avx512_enabled();
  return usable;
}

using bf16_t = uint16_t;  // a bf16 value's bits

// TA, TB, TC: float, or bf16_t (bf16 operands widened exactly as they are loaded, bf16 results
// rounded once, to nearest even as torch rounds, as they are stored).
template <typename TA, typename TB, typename TC>
struct WeightGradOf {
  const TA* a;  // [k, m], rows lda apart
  int64_t lda;
  const TB* b;  // [k, n], rows ldb apart
  int64_t ldb;
  TC* c;  // [m, n], rows ldc apart
  int64_t ldc;
  int64_t k, m, n;
  bool accumulate, stream;
  // Where given, b's row r is b's row b_index[r] (b then the tokens' rows): gathered as b's
  // panels are packed. Likewise a's row r is a's row a_index[r], multiplied by a_scale[r]
  // where that is given too (float32 only: a routed layer's weighted output gradient).
  const int64_t* b_index = nullptr;
  const int64_t* a_index = nullptr;
  const float* a_scale = nullptr;
};
using WeightGrad = WeightGradOf<float, float, float>;

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

#include "_bf16x16.h"  // to_bf16
#include "_exp16.h"    // exp16, ExactRound, widened (SwiGLU in the bf16 forward)

// Loops over a register tile's accumulators (and other loops of a few steps known when compiled)
// are unrolled whole: then GCC keeps each accumulator in a register. Where it left such a loop
// rolled (a body too long for its own heuristics, an early exit) it kept the tile's accumulators
// in a stack array instead, zeroed before every tile and stored to after it, 24 zmm stores
// each way: 10-20 % of a short tile's time (a block of 32-64 rows through a weight gradient).
// Zen 4 EPYC (2026-12-07), builds alternated in one process, layer forward+backward (pair
// ratios' medians): see the bf16 tiles' notes (store_tile, outer_tile); the rest of the file's
// loops too, against those: fp32 T = 256 Mixtral 0.949×, fine-grained 0.917×, fine T = 2048
// 0.937×, Mixtral T = 16 0.976×; bf16 T = 16 Mixtral 0.866×, fine 0.931×, T = 256 level.
#define MOE_UNROLL _Pragma("GCC unroll 32")

namespace {

// ROWS rows of c from row r, VECS vectors of 16 columns from column q; with MASKED the last
// vector only its `last` lanes. The accumulators stay in registers only if nothing in the tile
// depends on run-time choices (GCC kept them on the stack, storing all 24 every step, when the
// store's mode and the mask were run-time values: 2.6× slower), hence the template flags.
// With A_ROWS, a's rows are c's rows (a [m, k], the product a·b, c's row i reading a[i·lda + s]
// at step s); without, a's rows are the steps (a [k, m], aᵀ·b, reading a[s·lda + i]).
inline float widen(float v) { return v; }
inline float widen(bf16_t v) { return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int{v} << 16))); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 widen16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
inline __m512 load16(const bf16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const bf16_t* p, __mmask16 lanes) { return widen16(_mm256_maskz_loadu_epi16(lanes, p)); }

// STREAM: `at` 64-byte aligned (float) or 32-byte aligned (bf16).
template <bool STREAM>
inline void store16(float* at, __m512 v) {
  if (STREAM) _mm512_stream_ps(at, v);
  else _mm512_storeu_ps(at, v);
}
template <bool STREAM>
inline void store16(bf16_t* at, __m512 v) {
  if (STREAM) _mm256_stream_si256(reinterpret_cast<__m256i*>(at), to_bf16(v));
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), to_bf16(v));
}
inline void store16(float* at, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(at, lanes, v); }
inline void store16(bf16_t* at, __m512 v, __mmask16 lanes) { _mm256_mask_storeu_epi16(at, lanes, to_bf16(v)); }

// The lines of a range of rows (each row `bytes` from `at`, rows ld apart, from memory),
// prefetched into L2 one per call of step(), which a tile's steps call: a panel's next rows
// come in spread over the products of this one, not in a burst that waits on memory.
struct RowLines {
  const char* at = nullptr;
  int64_t ld = 0, bytes = 0, offset = 0, rows = 0;
  const int64_t* index = nullptr;  // (where given, the rows are at + index[i]·ld, i = 0, 1, ...)
  void step() {
    if (rows == 0) return;
    _mm_prefetch((index ? at + *index * ld : at) + offset, _MM_HINT_T1);
    offset += 64;
    if (offset >= bytes) {
      offset = 0;
      if (index) ++index;
      else at += ld;
      --rows;
    }
  }
};

// With AHEAD, each step prefetches the tile's part of b's row AHEAD steps on into L2, running
// on into `after`'s rows (the part of b the next tile reads first, rows ldb apart) past the
// last step; with `lines`, each step prefetches one of their lines.
template <int ROWS, int VECS, bool MASKED, bool ACCUMULATE, bool STREAM, bool A_ROWS = false, int AHEAD = 0,
          typename TA, typename TB, typename TC>
void tile(const TA* a, int64_t lda, const TB* b, int64_t ldb, TC* c, int64_t ldc, int64_t k, __mmask16 last,
          RowLines* lines = nullptr, const TB* after = nullptr) {
  static_assert(!ACCUMULATE || sizeof(TC) == 4, "a bf16 result is rounded once, never added to");
  __m512 acc[ROWS][VECS];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < VECS; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k; ++s) {
    if (lines != nullptr) lines->step();
    if constexpr (AHEAD > 0) {
      const TB* ahead = s + AHEAD < k ? b + AHEAD * ldb : (after != nullptr ? after + (s + AHEAD - k) * ldb : nullptr);
      if (ahead != nullptr)
        for (int l = 0; l < VECS * 16 * int(sizeof(TB)); l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead) + l, _MM_HINT_T1);
    }
    __m512 b_s[VECS];
    MOE_UNROLL for (int j = 0; j < VECS; ++j)
      b_s[j] = MASKED && j + 1 == VECS ? load16(b + 16 * j, last) : load16(b + 16 * j);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512 a_i = _mm512_set1_ps(widen(A_ROWS ? a[i * lda] : a[i]));
      MOE_UNROLL for (int j = 0; j < VECS; ++j) acc[i][j] = _mm512_fmadd_ps(a_i, b_s[j], acc[i][j]);
    }
    a += A_ROWS ? 1 : lda;
    b += ldb;
  }
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < VECS; ++j) {
      TC* at = c + i * ldc + 16 * j;
      if (MASKED && j + 1 == VECS) {
        __m512 v = acc[i][j];
        if (ACCUMULATE) v = _mm512_add_ps(v, load16(at, last));
        store16(at, v, last);
      } else if (ACCUMULATE) {
        store16<false>(at, _mm512_add_ps(acc[i][j], load16(at)));
      } else {
        store16<STREAM>(at, acc[i][j]);
      }
    }
}

template <int ROWS, bool ACCUMULATE, bool STREAM, typename P>
void strip(const P& p, int64_t r) {
  const auto* a = p.a + r;
  auto* c = p.c + r * p.ldc;
  int64_t q = 0;
  for (; q + 64 <= p.n; q += 64)
    tile<ROWS, 4, false, ACCUMULATE, STREAM>(a, p.lda, p.b + q, p.ldb, c + q, p.ldc, p.k, 0xFFFF);
  const int64_t rest = p.n - q;
  if (rest == 0) return;
  const int64_t vecs = (rest + 15) / 16;
  const __mmask16 last = static_cast<__mmask16>((1u << (rest - (vecs - 1) * 16)) - 1);
  const auto* b = p.b + q;
  switch (vecs) {
    case 1: tile<ROWS, 1, true, ACCUMULATE, STREAM>(a, p.lda, b, p.ldb, c + q, p.ldc, p.k, last); break;
    case 2: tile<ROWS, 2, true, ACCUMULATE, STREAM>(a, p.lda, b, p.ldb, c + q, p.ldc, p.k, last); break;
    case 3: tile<ROWS, 3, true, ACCUMULATE, STREAM>(a, p.lda, b, p.ldb, c + q, p.ldc, p.k, last); break;
    default: tile<ROWS, 4, true, ACCUMULATE, STREAM>(a, p.lda, b, p.ldb, c + q, p.ldc, p.k, last); break;
  }
}

template <bool ACCUMULATE, bool STREAM, typename P>
void rows_range(const P& p, int64_t first, int64_t last) {
  int64_t r = first;
  for (; r + 6 <= last; r += 6) strip<6, ACCUMULATE, STREAM>(p, r);
  switch (last - r) {
    case 5: strip<5, ACCUMULATE, STREAM>(p, r); break;
    case 4: strip<4, ACCUMULATE, STREAM>(p, r); break;
    case 3: strip<3, ACCUMULATE, STREAM>(p, r); break;
    case 2: strip<2, ACCUMULATE, STREAM>(p, r); break;
    case 1: strip<1, ACCUMULATE, STREAM>(p, r); break;
    default: break;
  }
  if (STREAM) _mm_sfence();
}

// a's columns [first, last) over steps [0, steps) (a [steps, m], rows lda apart) transposed
// into at [last - first, steps] (each column's steps contiguous), 16×16 blocks in registers;
// with `index`, step s is a's row index[s], and with `scale` its values are multiplied by
// scale[s] (each product rounded once, as torch's float32 multiply rounds it).
inline void transpose_columns(const float* a, int64_t lda, int64_t steps, int64_t first, int64_t last, float* at,
                              const int64_t* index = nullptr, const float* scale = nullptr) {
  for (int64_t i0 = first; i0 < last; i0 += 16) {
    const int64_t ni = std::min<int64_t>(16, last - i0);
    const __mmask16 in_lanes = static_cast<__mmask16>(ni == 16 ? 0xFFFF : (1u << ni) - 1);
    for (int64_t s0 = 0; s0 < steps; s0 += 16) {
      const int64_t ns = std::min<int64_t>(16, steps - s0);
      __m512i r[16];
      for (int64_t s = 0; s < 16; ++s) {
        if (s >= ns) {
          r[s] = _mm512_setzero_si512();
          continue;
        }
        __m512 v = _mm512_maskz_loadu_ps(in_lanes, a + (index ? index[s0 + s] : s0 + s) * lda + i0);
        if (scale) v = _mm512_mul_ps(v, _mm512_set1_ps(scale[s0 + s]));
        r[s] = _mm512_castps_si512(v);
      }
      transpose16(r);
      const __mmask16 out_lanes = static_cast<__mmask16>(ns == 16 ? 0xFFFF : (1u << ns) - 1);
      for (int64_t j = 0; j < ni; ++j)
        _mm512_mask_storeu_ps(at + (i0 - first + j) * steps + s0, out_lanes, _mm512_castsi512_ps(r[j]));
    }
  }
}

// ---- product a·b (input gradients g·W) ---------------------------------------------------

template <typename TA, typename TB, typename TC>
struct MatmulOf {
  const TA* a;  // [m, k] (A_ROWS) or [k, m], rows lda apart
  int64_t lda;
  const TB* b;  // [k, n], rows ldb apart
  int64_t ldb;
  TC* c;  // [m, n], rows ldc apart
  int64_t ldc;
  int64_t m, k, n;
  // Where given (a [m, k] only, float32), row r of a is a's row a_index[r] (a then the tokens'
  // rows): gathered as the chunks' rows of a are copied into contiguous memory.
  const int64_t* a_index = nullptr;
};
using Matmul = MatmulOf<float, float, float>;

// The same register tiles as the weight gradient, the sums over k taken kMatmulDepth steps at
// a time (b's kMatmulDepth×64 panel, 32 KiB, stays in L1 while every row tile of a block of
// kMatmulRows rows of c passes over it; c's block, added to once per pass, stays in L2). With
// a's rows as c's rows (A_ROWS: an input gradient g·w), a block's rows of a over the chunk's
// steps are first copied into contiguous memory: g's rows, 4–28 KiB apart, fell into one or
// two L1 sets and pushed the panel out. 2-core Xeon (2026-12-05, GFLOP/s, the copy without →
// with, alternated runs): 7168×1024 at 32 / 64 rows 142–154 / 203–208 → 170–172 / 225–226,
// 1024×3584 at 64 203–209 → 211–213, 64 weights 1024×1024 at 32 153–156 → 161–164. Chunks of
// 64 steps (panel and a's part both in L1): 0.89–1.0×. With a's rows as the steps (a weight
// gradient aᵀ·b past panels_range's rows), the chunk's part of a's columns is transposed into
// such rows likewise: 64 weights at 256 rows 1024×1024 187–192 → 213–225, 1024×512 159–174 →
// 196–197 (torch's sgemm 226–272 there, which the layer keeps on Intel's CPUs; this runs in the
// layer on AMD's AVX-512 CPUs, sgemm_at_avx2_width, measured here as products alone).
constexpr int64_t kMatmulDepth = 128;
constexpr int64_t kMatmulRows = 96;

// A float32 panel of b (depth ≤ kMatmulDepth rows of 64 columns, rows ldb apart) copied into
// the calling thread's contiguous 32 KiB, from which every row tile of a pass reads it. Read in
// place, b's rows lie an expert weight's row apart (2–4 KiB for these shapes). Measured on the
// 2-core Xeon (2026-12-04; input gradients of 64 blocks in one call, against the panel read in
// place, interleaved, 13 pairs, the same sums bit for bit): fine-grained 32-row blocks through
// 1024×1024 / 1024×512 weights, 64 experts (weights from memory) 1.10 / 1.06×, one expert (in
// cache) 1.02 / 1.01×; Mixtral's 64-row blocks 1.04×; 128 rows 1.02×. Layer, fp32
// forward+backward fine-grained T = 256 1.026× (11 rounds), T = 16 / 2048 and Mixtral T = 256
// level (on Intel only small groups' input gradients run here, grouped.py).
// The panel this thread copies after this one comes into L2 while this one's row tiles run, one
// line a step (RowLines, matmul_panel): the copy had waited on memory with nothing to overlap,
// 128 rows 4 KiB apart, more pages than the hardware's streams follow. Prefetched during the
// copy (2-core Xeon, 2026-12-05; 64 experts' 32-row blocks in one call, old and new library in
// alternating processes): 1024×1024 142–150 → 151–162 GFLOP/s, 1024×512 146–161 → 166–192;
// layer fp32 forward+backward fine-grained T = 256 1.01–1.10× (3 pairs); there one line of each
// row per step inside the first row tiles ran 0.75× (the prefetches' misses held the fill
// buffers that the tiles' loads of a need), two panels ahead or into L3 level. Spread over all
// of the panel's row tiles instead of the copy, on the Zen 4 EPYC (2026-12-06; blocks of 64 or
// 8 experts' weights from memory in one call, alternated, 6–8 rounds, same bits, GFLOP/s):
// 32 rows 1024×1024 123 → 146, 1024×512 120 → 147, 1024×3584 126 → 163 (1.17–1.30×), 16 rows
// 1.14–1.26×, 64 rows 1.11–1.16×, 128 rows 1.06–1.15×, 8 rows 1.04–1.06×. Not measured on
// Intel's CPUs (where only small groups' input gradients run here).
// noipa: GCC 12 otherwise propagated the thread_local panel's address into constant-argument
// clones of the register tiles, each of which then fetched it with a __tls_get_addr call, a
// call around which its 24 accumulators went to the stack and back (zeroed, stored, reloaded)
// every tile. Zen 4 EPYC (2026-12-07), builds alternated in one process (pair ratios' median),
// layer fp32 forward+backward: fine-grained T = 256 0.971× (9 rounds of 3 layers), T = 2048
// 0.988× (3 of 2), Mixtral T = 256 0.986× (7 of 3), fine T = 16 level.
// (into `panel` where given, 64-byte aligned, depth × 64 floats; b's row s is its row
// index[s] where `index` is given)
__attribute__((noipa)) const float* pack_panel(const float* b, int64_t ldb, int64_t depth, float* panel = nullptr,
                                               const int64_t* index = nullptr) {
  alignas(64) static thread_local float own[kMatmulDepth * 64];
  if (panel == nullptr) panel = own;
  for (int64_t s = 0; s < depth; ++s) {
    const float* row = b + (index ? index[s] : s) * ldb;
    MOE_UNROLL for (int j = 0; j < 4; ++j) _mm512_store_ps(panel + s * 64 + 16 * j, _mm512_loadu_ps(row + 16 * j));
  }
  return panel;
}

// A panel of at most 6 rows of c (one row tile) reads b where it lies, its 64 columns of each
// row (4 lines, a row of b apart) in steps down the rows, and prefetches them kPanelAhead steps
// on into L2: on the Zen 4 EPYC (2026-12-06), float32 layer forward+backward at T = 16 (input
// gradients of 2–4-row blocks), weights out of the caches (three layers in turn, 7–9 rounds,
// same bits), against none: Mixtral 0.84–0.89×, fine-grained 0.88–0.94× (8 steps ahead
// 0.87 / 0.92×, 16 0.89 / 0.995×, 48 0.93 / 0.94×, 64 0.95 / 0.96×). Past the panel's last
// steps the prefetches run on into the rows the next panel reads first (matmul_pass's `next`),
// as the bf16 input gradients' direct tiles do, where the next panel's first 32 steps had waited
// on memory: per product, weights out of the caches (the four benchmark shapes, 5 rounds, same
// bits) 2 rows 1.18–1.25×, 4 rows 1.10–1.23×, 6 rows 1.04–1.20×; layer float32
// forward+backward T = 16 (9 rounds) Mixtral 0.97×, fine-grained 0.93× (2026-12-06).
constexpr int kPanelAhead = 32;

// The panel's rows of c in register tiles of 6 and a last one of the rest, each reading b (rows
// ldb apart) over `depth` steps; AHEAD as in tile.
template <bool A_ROWS, int VECS, bool MASKED, bool ACCUMULATE, int AHEAD, typename TA, typename TB, typename TC>
void panel_tiles(const TA* a, int64_t row_step, int64_t lda, const TB* b, int64_t ldb, TC* c, int64_t ldc,
                 int64_t rows, int64_t depth, __mmask16 last, RowLines* lines = nullptr, const TB* after = nullptr) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6)
    tile<6, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a + r * row_step, lda, b, ldb, c + r * ldc, ldc, depth, last,
                                                            lines, after);
  a += r * row_step;
  c += r * ldc;
  switch (rows - r) {
    case 5:
      tile<5, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a, lda, b, ldb, c, ldc, depth, last, lines, after);
      break;
    case 4:
      tile<4, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a, lda, b, ldb, c, ldc, depth, last, lines, after);
      break;
    case 3:
      tile<3, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a, lda, b, ldb, c, ldc, depth, last, lines, after);
      break;
    case 2:
      tile<2, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a, lda, b, ldb, c, ldc, depth, last, lines, after);
      break;
    case 1:
      tile<1, VECS, MASKED, ACCUMULATE, false, A_ROWS, AHEAD>(a, lda, b, ldb, c, ldc, depth, last, lines, after);
      break;
    default: break;
  }
}

template <bool A_ROWS, int VECS, bool MASKED, bool ACCUMULATE, typename P>
void matmul_panel(const P& p, int64_t r0, int64_t r1, int64_t s0, int64_t depth, int64_t q, __mmask16 last,
                  const float* next = nullptr) {
  const int64_t row_step = A_ROWS ? p.lda : 1;  // from one row of c to the next in a
  const auto* a = p.a + (A_ROWS ? r0 * p.lda + s0 : s0 * p.lda + r0);
  const auto* b = p.b + s0 * p.ldb + q;
  int64_t ldb = p.ldb;
  RowLines lines;  // (next's depth rows of 64 columns, while the row tiles run)
  if constexpr (VECS == 4 && !MASKED && std::is_same_v<std::decay_t<decltype(*p.b)>, float>) {
    if (r1 - r0 > 6) {  // more than one row tile reads the panel
      b = pack_panel(b, p.ldb, depth);
      ldb = 64;
      if (next != nullptr) lines = RowLines{reinterpret_cast<const char*>(next), p.ldb * 4, 64 * 4, 0, depth};
    }
  }
  auto* c = p.c + r0 * p.ldc + q;
  if (r1 - r0 <= 6 && ldb == p.ldb) {  // one row tile reading b in place: its rows kPanelAhead steps on into L2
    const std::decay_t<decltype(*p.b)>* after = nullptr;
    if constexpr (std::is_same_v<std::decay_t<decltype(*p.b)>, float>) after = next;
    panel_tiles<A_ROWS, VECS, MASKED, ACCUMULATE, kPanelAhead>(a, row_step, p.lda, b, ldb, c, p.ldc, r1 - r0, depth,
                                                               last, nullptr, after);
  }
  else
    panel_tiles<A_ROWS, VECS, MASKED, ACCUMULATE, 0>(a, row_step, p.lda, b, ldb, c, p.ldc, r1 - r0, depth, last, &lines);
}

// c's rows [r0, r1) and columns [first, last_column), steps [s0, s0 + depth) of the sums.
template <bool A_ROWS, bool ACCUMULATE, typename P>
void matmul_pass(const P& p, int64_t r0, int64_t r1, int64_t s0, int64_t depth, int64_t first,
                 int64_t last_column) {
  int64_t q = first;
  for (; q + 64 <= last_column; q += 64) {
    const float* next = nullptr;
    if constexpr (std::is_same_v<std::decay_t<decltype(*p.b)>, float>) {
      if (q + 128 <= last_column) next = p.b + s0 * p.ldb + q + 64;
      else if (s0 + depth < p.k) next = p.b + (s0 + depth) * p.ldb + first;
    }
    matmul_panel<A_ROWS, 4, false, ACCUMULATE>(p, r0, r1, s0, depth, q, 0xFFFF, next);
  }
  const int64_t rest = last_column - q;
  if (rest == 0) return;
  const int64_t vecs = (rest + 15) / 16;
  const __mmask16 lanes = static_cast<__mmask16>((1u << (rest - (vecs - 1) * 16)) - 1);
  switch (vecs) {
    case 1: matmul_panel<A_ROWS, 1, true, ACCUMULATE>(p, r0, r1, s0, depth, q, lanes); break;
    case 2: matmul_panel<A_ROWS, 2, true, ACCUMULATE>(p, r0, r1, s0, depth, q, lanes); break;
    case 3: matmul_panel<A_ROWS, 3, true, ACCUMULATE>(p, r0, r1, s0, depth, q, lanes); break;
    default: matmul_panel<A_ROWS, 4, true, ACCUMULATE>(p, r0, r1, s0, depth, q, lanes); break;
  }
}

// One row of c (a at its row `a`, c at its row `c`): all of k in one pass, panels of 256
// columns (16 accumulators) from column `first` while whole ones fit before `last_column`;
// returns the first column left. Each step reads 512 bytes of b's row where 64-column panels
// read 128: the walk down b's rows, a memory stream at b's row stride, carries four times the
// bytes per step. bf16 input gradients of one row (whole_sums), GB/s of weight read, 8 or 64
// weights one row each in one call (9 rounds), 64 → 256 columns: Mixtral's 7168×1024 29.7 →
// 55.2, 1024×3584 31.4 → 49.3, the fine-grained 1024×1024 29.4 → 40.5, 1024×512 34.6 → 51.1;
// 128 columns in between (37.5 / 47.0 / 35.7 / 46.0), 384 behind (its 24 accumulators spill).
// Each step prefetches the row kOneRowAhead steps on into L2: on the Zen 4 EPYC (2026-12-06),
// layer forward+backward at T = 1 with the weights out of the caches (three layers in turn, 9
// rounds, same bits), against none: bf16 Mixtral 0.85–0.90×, fine 0.92–0.96×, fp32 Mixtral
// 0.95× (8 rows ahead 0.92–0.93×, 32 level with 16, 64 0.87–0.97×; 4 rows into L1 0.96–0.98×).
constexpr int kOneRowAhead = 16;
template <bool A_ROWS, typename P>
int64_t one_row_panels(const P& p, const float* a, decltype(P::c) c, int64_t first, int64_t last_column) {
  for (; first + 256 <= last_column; first += 256)
    tile<1, 16, false, false, false, A_ROWS, kOneRowAhead>(a, p.lda, p.b + first, p.ldb, c + first, p.ldc, p.k,
                                                           0xFFFF);
  return first;
}

// c's rows [first_row, last_row) and columns [first, last_column).
// (with p.a_index, A_ROWS, every chunk's rows are copied: the tiles read the copy, or one row
// where it lies; where the scratch could not be had, a thread's own kMatmulRows × kMatmulDepth)
template <bool A_ROWS>
void matmul_range(const Matmul& p, int64_t first_row, int64_t last_row, int64_t first, int64_t last_column) {
  const auto a_row = [&](int64_t r) { return p.a + (p.a_index ? p.a_index[r] : r) * p.lda; };
  if (last_row - first_row == 1) {
    first = one_row_panels<A_ROWS>(p, A_ROWS ? a_row(first_row) : p.a + first_row, p.c + first_row * p.ldc, first,
                                   last_column);
    if (first == last_column) return;
  }
  for (int64_t r0 = first_row; r0 < last_row; r0 += kMatmulRows) {
    const int64_t r1 = std::min(last_row, r0 + kMatmulRows);
    for (int64_t s0 = 0; s0 < p.k; s0 += kMatmulDepth) {
      const int64_t depth = std::min(kMatmulDepth, p.k - s0);
      if (r1 - r0 > 6 || (A_ROWS && p.a_index)) {  // (see kMatmulDepth: the chunk's part of a as contiguous rows of c's rows)
        float* rows = static_cast<float*>(moe_ffn_team::thread_scratch(static_cast<size_t>((r1 - r0) * depth) * 4));
        if (rows == nullptr && A_ROWS && p.a_index) {
          alignas(64) static thread_local float own[kMatmulRows * kMatmulDepth];
          rows = own;
        }
        if (rows != nullptr) {
          if constexpr (A_ROWS) {
            for (int64_t r = r0; r < r1; ++r)
              for (int64_t s = 0; s < depth; s += 16) {
                const __mmask16 lanes = static_cast<__mmask16>(depth - s >= 16 ? 0xFFFF : (1u << (depth - s)) - 1);
                _mm512_mask_storeu_ps(rows + (r - r0) * depth + s, lanes,
                                      _mm512_maskz_loadu_ps(lanes, a_row(r) + s0 + s));
              }
          } else {
            transpose_columns(p.a + s0 * p.lda, p.lda, depth, r0, r1, rows);
          }
          // (k: the steps left from s0, which say where the next chunk's panel lies)
          const Matmul q{rows, depth, p.b + s0 * p.ldb, p.ldb, p.c + r0 * p.ldc, p.ldc, r1 - r0, p.k - s0, p.n};
          if (s0 == 0) matmul_pass<true, false>(q, 0, r1 - r0, 0, depth, first, last_column);
          else matmul_pass<true, true>(q, 0, r1 - r0, 0, depth, first, last_column);
          continue;
        }
      }
      if (s0 == 0) matmul_pass<A_ROWS, false>(p, r0, r1, s0, depth, first, last_column);
      else matmul_pass<A_ROWS, true>(p, r0, r1, s0, depth, first, last_column);
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------

template <typename T>  // float, or bf16_t (the AVX512-BF16 forward below)
struct LinearOf {
  const T* x;  // [rows, I], rows ldx apart
  int64_t ldx;
  const T* w;  // [O, I], rows ldw apart
  int64_t ldw;
  T* y;  // [rows, O], rows ldy apart
  int64_t ldy;
  int64_t rows, in_features;
  // Where given, row r of the block is x's row index[r] (x then the tokens' rows, not the
  // block's): the bf16 kernel gathers the rows as it packs them, the float32 tiles read them
  // where they lie.
  const int64_t* index = nullptr;
};
// The float32 forward takes I's elements `chunk` at a time: each tile's sums over a chunk
// reduced across lanes and stored, later chunks' added to them (the caller chooses: the sums
// differ with it; _small_gemm.avx512_forward_depth).
struct Linear : LinearOf<float> {
  int64_t chunk;
};

// Lane t of the result: the sum of v[t]'s 16 lanes, for 16 vectors at once (pairs of vectors
// added across their halves level by level: 45 instructions, where a reduction of each vector
// on its own takes about 8, 128 for 16); each sum a fixed tree: ((l0 + l2) + (l1 + l3)) within
// each 128-bit lane, then (lane 0 + lane 1) + (lane 2 + lane 3). For the ends of both
// forwards' dot-product tiles. bf16 (below), per product 1–16 rows: 1.00–1.08× (8–16 rows
// through I = 512 most); layer forward T = 1 / 16 / 64 (11 rounds): Mixtral 1.02 / 1.02 /
// 1.01×, fine 1.01 / 1.01 / 1.04×. float32 (linear_tile, 2-core Xeon, 2026-12-05, GFLOP/s):
// 1024×1024 at 32 / 64 rows 148–154 / 173–187 → 159–162 / 191–196, 7168×1024 at 32 / 64
// 170–171 / 193–197 → 175–176 / 198–208 (where each of the tile's 24 sums was reduced alone at
// the end of each 512-deep chunk, a fifth of the chunk's instructions).
inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 t[8], u[4], w[2];
  MOE_UNROLL for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  MOE_UNROLL for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of four vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  MOE_UNROLL for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// ROWS rows of x against COLS rows of w over I's elements [k0, k0 + depth); the last depth % 16
// through masked loads (MASKED); into y, or added to it (ADD: a later chunk). With next_rows,
// each step prefetches those rows of `next` at the same step into L2.
// (x: row i at x + i·ldx, or with `index` at x + index[i]·ldx)
template <int ROWS, int COLS, bool MASKED>
void linear_tile(const float* x, int64_t ldx, const int64_t* index, const float* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t depth, bool add, const float* next = nullptr, int next_rows = 0) {
  const float* x_i[ROWS];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i) x_i[i] = x + (index ? index[i] : i) * ldx;
  __m512 acc[ROWS][COLS];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t whole = depth & ~int64_t{15};
  for (int64_t k = 0; k < whole; k += 16) {
    __m512 w_k[COLS];
    MOE_UNROLL for (int j = 0; j < COLS; ++j) w_k[j] = _mm512_loadu_ps(w + j * ldw + k);
    for (int j = 0; j < next_rows; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * ldw + k), _MM_HINT_T1);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512 x_k = _mm512_loadu_ps(x_i[i] + k);
      MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  if (MASKED) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << (depth - whole)) - 1);
    __m512 w_k[COLS];
    MOE_UNROLL for (int j = 0; j < COLS; ++j) w_k[j] = _mm512_maskz_loadu_ps(lanes, w + j * ldw + whole);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512 x_k = _mm512_maskz_loadu_ps(lanes, x_i[i] + whole);
      MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  // two rows' sums at a time (sums16: row i's in lanes 0..COLS-1, row i+1's from lane 8), each
  // row's stored by one masked store
  static_assert(COLS <= 8, "two rows of sums to a vector");
  const __mmask8 cols = static_cast<__mmask8>((1u << COLS) - 1);
  MOE_UNROLL for (int i = 0; i < ROWS; i += 2) {
    const bool pair = i + 1 < ROWS;
    __m512 v[16];
    MOE_UNROLL for (int j = 0; j < 8; ++j) {
      v[j] = j < COLS ? acc[i][j] : _mm512_setzero_ps();
      v[8 + j] = j < COLS && pair ? acc[pair ? i + 1 : i][j] : _mm512_setzero_ps();
    }
    const __m512 sums = sums16(v);
    for (int h = 0; h < (pair ? 2 : 1); ++h) {
      __m256 row = h == 0 ? _mm512_castps512_ps256(sums) : _mm512_extractf32x8_ps(sums, 1);
      float* at = y + (i + h) * ldy;
      if (add) row = _mm256_add_ps(row, _mm256_maskz_loadu_ps(cols, at));
      _mm256_mask_storeu_ps(at, cols, row);
    }
  }
}

// `next`: the part of w this thread reads after this strip (next_rows rows of next_depth from
// `next`), prefetched into L2: for x of kSharedPrefetchRows rows or more a share before each row
// tile, for fewer by the first row tile, line by line as it reads its own rows; or none.
constexpr int64_t kSharedPrefetchRows = 8;
template <int COLS, bool MASKED>
void linear_strip(const Linear& p, int64_t o, int64_t k0, int64_t depth, const float* next = nullptr,
                  int64_t next_rows = 0, int64_t next_depth = 0) {
  const float* w = p.w + o * p.ldw + k0;
  const bool add = k0 > 0, shared = p.rows >= kSharedPrefetchRows;
  const int64_t row_lines = (next_depth + 15) / 16, lines = next != nullptr && shared ? next_rows * row_lines : 0;
  const int64_t tiles = p.rows / 4, share = tiles > 0 ? (lines + tiles - 1) / tiles : 0;
  int first_tile = next != nullptr && !shared ? static_cast<int>(next_rows) : 0;  // (the rows it prefetches)
  int64_t line = 0;
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4, first_tile = 0) {
    for (const int64_t end = std::min(lines, line + share); line < end; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(next + (line / row_lines) * p.ldw + (line % row_lines) * 16), _MM_HINT_T1);
    linear_tile<4, COLS, MASKED>(p.index ? p.x + k0 : p.x + r * p.ldx + k0, p.ldx, p.index ? p.index + r : nullptr, w,
                                 p.ldw, p.y + r * p.ldy + o, p.ldy, depth, add, next, first_tile);
  }
  const float* x = p.index ? p.x + k0 : p.x + r * p.ldx + k0;
  const int64_t* index = p.index ? p.index + r : nullptr;
  float* y = p.y + r * p.ldy + o;
  switch (p.rows - r) {
    case 3: linear_tile<3, COLS, MASKED>(x, p.ldx, index, w, p.ldw, y, p.ldy, depth, add, next, first_tile); break;
    case 2: linear_tile<2, COLS, MASKED>(x, p.ldx, index, w, p.ldw, y, p.ldy, depth, add, next, first_tile); break;
    case 1: linear_tile<1, COLS, MASKED>(x, p.ldx, index, w, p.ldw, y, p.ldy, depth, add, next, first_tile); break;
    default: break;
  }
}

template <bool MASKED>
void linear_strips(const Linear& p, int64_t first, int64_t last, int64_t k0, int64_t depth, const float* next = nullptr,
                   int64_t next_rows = 0, int64_t next_depth = 0) {
  int64_t o = first;
  for (; o + 6 <= last; o += 6) linear_strip<6, MASKED>(p, o, k0, depth, next, next_rows, next_depth);
  switch (last - o) {
    case 5: linear_strip<5, MASKED>(p, o, k0, depth); break;
    case 4: linear_strip<4, MASKED>(p, o, k0, depth); break;
    case 3: linear_strip<3, MASKED>(p, o, k0, depth); break;
    case 2: linear_strip<2, MASKED>(p, o, k0, depth); break;
    case 1: linear_strip<1, MASKED>(p, o, k0, depth); break;
    default: break;
  }
}

// w's rows [first, last), strips of 6 rows, each strip chunk by chunk of I (p.chunk elements).
// Where w's rows take one chunk (I ≤ p.chunk) and x has 8 rows or more, each strip prefetches
// the next into L2 while it runs. Measured with chunks of 512 on the 2-core Xeon (2026-12-05; 64
// experts' blocks through 1024×512, per block, the two in alternating processes, GFLOP/s):
// 8 / 16 / 32 / 64 rows 58–61 / 96–103 / 136–142 / 176–187 → 72–78 / 115–118 / 169–173 /
// 218–219. Not where rows take several chunks, whose 4–14 KiB rows the hardware's streams
// follow (7168×1024 at 32 rows 182–184 → 172–173, 1024×3584 at 16 rows 143–144 → 111–113).
// On the Zen 4 EPYC (2026-12-06) chunks of 4096 (I whole for the benchmark's shapes, and so
// the next strip prefetched) against 512, per product, the blocks of 64 or 8 experts' weights
// out of the caches (alternated, 6–8 rounds, GFLOP/s) at 32 rows: 1024×1024 103–111 →
// 123–148, 7168×1024 120–139 → 128–168, 1024×3584 136–141 → 170–172 (the chunks alone, no
// prefetch: 115 / 119 / 168), 1024×512 level; 8–40 rows 1.10–1.22× through I = 1024 or 3584;
// 1–4 rows level. The Xeon's chunks of 1024 had run 0.97× from memory (JOURNAL).
// Where x has fewer than 8 rows, each chunk of a strip prefetches the same chunk of the next
// strip, line by line (linear_strip): on the Zen 4 EPYC (2026-12-06), layer float32 forward
// with the weights out of the caches (three layers in turn, 9 rounds, same bits), against none:
// T = 1 Mixtral 0.93×, T = 16 (blocks of 2–4 rows) Mixtral 0.91×, fine-grained 0.85×.
void linear_range(const Linear& p, int64_t first, int64_t last) {
  const bool ahead = p.rows < kSharedPrefetchRows || p.in_features <= p.chunk;
  for (int64_t o = first; o < last; o += 6) {
    const int64_t o1 = std::min(last, o + 6);
    for (int64_t k0 = 0; k0 < p.in_features; k0 += p.chunk) {
      const int64_t depth = std::min(p.chunk, p.in_features - k0);
      const bool prefetch = ahead && o1 < last;
      const float* next = prefetch ? p.w + o1 * p.ldw + k0 : nullptr;
      const int64_t next_rows = prefetch ? std::min<int64_t>(6, last - o1) : 0, next_depth = prefetch ? depth : 0;
      if (depth % 16) linear_strips<true>(p, o, o1, k0, depth, next, next_rows, next_depth);
      else linear_strips<false>(p, o, o1, k0, depth, next, next_rows, next_depth);
    }
  }
}

// bf16 c = a·b (a [m, k], float32) for a few rows m: c's columns [first, last_column), every row, each
// tile's whole sum over k in its registers (a bf16 c is rounded once; no passes over k, whose
// partial sums would be added to c). With m ≤ 6 every element of b is read once; one row (a bf16
// input gradient of one token through its expert) in 256-column panels (one_row_panels).
template <typename P>
void whole_sums(const P& p, int64_t first, int64_t last_column) {
  if (p.m == 1 && (first = one_row_panels<true>(p, p.a, p.c, first, last_column)) == last_column) return;
  matmul_pass<true, false>(p, 0, p.m, 0, p.k, first, last_column);
}

// The weight gradient from kPanelLeast to kPanelMost rows k: c's rows [first, last) column
// panel by column panel, each panel of b (k rows of 64 columns) copied once into contiguous
// memory that every strip of c's rows passes over, and a's columns [first, last) transposed
// once into `at` (each of c's rows' k values contiguous): each element of c summed over all of
// k in its register tile and stored once. Where they lie, b's rows (the input's, 4–14 KiB
// apart) and a's (the output gradient's, 4–28 KiB apart) fall into one or two L1 sets, so
// rows_range read both from L2 at every step. The columns past the last whole panel as
// rows_range takes them. Returns false (nothing done) where the scratch could not be had.
// 2-core Xeon (2026-12-05; 8 weights in turn, GFLOP/s, rows_range → here,
// alternated runs): 7168×1024 at 16 / 32 / 64 / 96 rows 183–185 / 227–241 / 245–250 / 254–259
// → 207–220 / 265–275 / 293–296 / 275–289, 1024×3584 169–180 / 215–223 / 231–242 / 226–228 →
// 243–251 / 265–271 / 302–320 / 318–319; 64 weights at 32 rows 1024×1024 202–204 → 243–247,
// 1024×512 192–198 → 234–235; at 1–8 rows level.
// Past kMatmulDepth rows the panel (k·256 bytes) no longer fits L1, and each step of a tile
// reads its 256 bytes from L2 (24 FMAs a step, ~10 bytes a cycle of L2's 64) or L3: on the Zen 4
// EPYC (2026-12-07; one call for all blocks, E·rows = 16384 or 4096, median of 5, two runs,
// GFLOP/s) against the blocked product's passes of kMatmulDepth steps, which add each pass's
// sums to c: 64 weights 1024×1024 at 256 rows 164 / 171 → 201–203, 1024×512 164–181 →
// 186–201; 7168×1024 at 512 rows 170–181 → 197–200, 1024×3584 186–191 → 206–207; 1024×1024 at
// 1024 rows 162–196 → 208–211 (`at` whole in those runs). c's rows are taken kAtFloats / k at
// a time, so that `at` stays at most 4 MiB (each chunk packs b's panels again: k·64 copies
// against rows·k·64 FMAs): with 1 MiB the dense blocks' 2048-row products ran behind the
// blocked product (1024×4096 199 → 183 GFLOP/s), with 4 MiB and the next panel prefetched
// ahead of them (8192×1024 / 1024×4096 / 14336×1024 / 1024×7168, two runs each) 194–198 →
// 200–207 / 194–203 → 204–208 / 198 → 201–205 / 200–203 → 203–204. At 4096 rows 1024×1024
// 194–195 → 187–191, and at 8192 rows (126-row chunks, the panel 2 MiB, in L3) 190–203 →
// 168–184: to kPanelMost rows only.
constexpr int64_t kPanelLeast = 16;
constexpr int64_t kPanelMost = 2048;
constexpr int64_t kAtFloats = 1 << 20;
// c's rows [first, last), columns from q0, of aᵀ·b with b's row s at p.b_index[s] (and a's at
// p.a_index[s], times p.a_scale[s], where given): each
// element's sum over s in order by FMAs from zero (and added to c's old value where
// accumulating), as `tile` forms it, so the same bits as the panels or rows_range on gathered
// rows; for what those do not take with an index (few rows, narrow c, the columns past the
// last panel, or no scratch), a vector of 16 columns at a time.
template <bool ACCUMULATE>
void rows_by_index(const WeightGrad& p, int64_t first, int64_t last, int64_t q0) {
  for (int64_t r = first; r < last; ++r)
    for (int64_t q = q0; q < p.n; q += 16) {
      const __mmask16 lanes = static_cast<__mmask16>(p.n - q >= 16 ? 0xFFFF : (1u << (p.n - q)) - 1);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t s = 0; s < p.k; ++s) {
        float a_s = p.a[(p.a_index ? p.a_index[s] : s) * p.lda + r];
        if (p.a_scale) a_s *= p.a_scale[s];
        const float* b_s = p.b + (p.b_index ? p.b_index[s] : s) * p.ldb + q;
        acc = _mm512_fmadd_ps(_mm512_set1_ps(a_s), _mm512_maskz_loadu_ps(lanes, b_s), acc);
      }
      float* at = p.c + r * p.ldc + q;
      if (ACCUMULATE) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(lanes, at));
      _mm512_mask_storeu_ps(at, lanes, acc);
    }
}

// c's rows [r0, r1) over b's whole panels of 64 columns (see panels_range), `at` and the
// panel in the caller's scratch. While the row tiles run over a panel, they prefetch the next
// one into L2, a line a step: the next panel's rows lie a row of b apart (4–28 KiB, each on
// its own page), which the hardware's streams do not follow, and the packing had waited on
// each line; `then`: the first panel of the next chunk of rows, after the last.
template <bool ACCUMULATE, bool STREAM>
void panels_chunk(const WeightGrad& p, int64_t r0, int64_t r1, float* at, float* panel_at, bool then) {
  const int64_t count = r1 - r0;
  transpose_columns(p.a, p.lda, p.k, r0, r1, at, p.a_index, p.a_scale);
  const int64_t whole = p.n / 64 * 64;
  for (int64_t q = 0; q < whole; q += 64) {
    const float* panel = pack_panel(p.b + q, p.ldb, p.k, panel_at, p.b_index);
    const int64_t next = q + 64 < whole ? q + 64 : (then ? 0 : -1);
    RowLines lines;
    if (next >= 0) lines = RowLines{reinterpret_cast<const char*>(p.b + next), p.ldb * 4, 64 * 4, 0, p.k, p.b_index};
    const float* a = at;
    float* c = p.c + r0 * p.ldc + q;
    int64_t r = 0;
    for (; r + 6 <= count; r += 6)
      tile<6, 4, false, ACCUMULATE, STREAM, true>(a + r * p.k, p.k, panel, 64, c + r * p.ldc, p.ldc, p.k, 0xFFFF, &lines);
    a += r * p.k;
    c += r * p.ldc;
    switch (count - r) {
      case 5: tile<5, 4, false, ACCUMULATE, STREAM, true>(a, p.k, panel, 64, c, p.ldc, p.k, 0xFFFF, &lines); break;
      case 4: tile<4, 4, false, ACCUMULATE, STREAM, true>(a, p.k, panel, 64, c, p.ldc, p.k, 0xFFFF, &lines); break;
      case 3: tile<3, 4, false, ACCUMULATE, STREAM, true>(a, p.k, panel, 64, c, p.ldc, p.k, 0xFFFF, &lines); break;
      case 2: tile<2, 4, false, ACCUMULATE, STREAM, true>(a, p.k, panel, 64, c, p.ldc, p.k, 0xFFFF, &lines); break;
      case 1: tile<1, 4, false, ACCUMULATE, STREAM, true>(a, p.k, panel, 64, c, p.ldc, p.k, 0xFFFF, &lines); break;
      default: break;
    }
  }
}

template <bool ACCUMULATE, bool STREAM>
bool panels_range(const WeightGrad& p, int64_t first, int64_t last) {
  const int64_t chunk = std::max<int64_t>(6, kAtFloats / p.k / 6 * 6);
  const int64_t at_floats = (std::min(last - first, chunk) * p.k + 15) / 16 * 16;  // (the panel 64-byte aligned)
  float* at = static_cast<float*>(moe_ffn_team::thread_scratch(static_cast<size_t>(at_floats + p.k * 64) * sizeof(float)));
  if (at == nullptr) return false;
  float* const panel_at = at + at_floats;
  for (int64_t r0 = first; r0 < last; r0 += chunk)
    panels_chunk<ACCUMULATE, STREAM>(p, r0, std::min(last, r0 + chunk), at, panel_at, r0 + chunk < last);
  const int64_t whole = p.n / 64 * 64;
  if (STREAM) _mm_sfence();
  if (whole < p.n && (p.b_index != nullptr || p.a_index != nullptr)) {
    rows_by_index<ACCUMULATE>(p, first, last, whole);
  } else if (whole < p.n) {
    WeightGrad rest = p;
    rest.b += whole, rest.c += whole, rest.n -= whole;
    rows_range<ACCUMULATE, STREAM>(rest, first, last);
  }
  return true;
}

// ---- the router's products of a few bf16 tokens (float32 sums on one thread) ----------------
//
// The router multiplies bf16 tokens and weights in float32 (router.py). For a decode step's few
// tokens its GEMMs were mostly their setting up: a widened float32 copy of x and of W each call,
// whose fresh lines the other thread then fetched from this core's cache. Here each product of
// two bf16 values is formed exactly in float32 from the values as they lie and summed in
// float32 (fused multiply-adds: float32's own rounding, in this kernel's order), on the calling
// thread only.

// logits[t, e] = Σ_d x[t, d]·w[e, d]: four running sums of 16 lanes (d mod 64), added pairwise
// and reduced across lanes.
void router_logits_rows(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t ldw, float* logits, int64_t ldl,
                        int64_t tokens, int64_t experts, int64_t dim) {
  const int64_t whole = dim & ~int64_t{63};
  for (int64_t t = 0; t < tokens; ++t) {
    const bf16_t* xt = x + t * ldx;
    for (int64_t e = 0; e < experts; ++e) {
      const bf16_t* we = w + e * ldw;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t d = 0; d < whole; d += 64)
        MOE_UNROLL for (int j = 0; j < 4; ++j)
          acc[j] = _mm512_fmadd_ps(load16(xt + d + 16 * j), load16(we + d + 16 * j), acc[j]);
      for (int64_t d = whole, j = 0; d < dim; d += 16, ++j) {
        const __mmask16 lanes = static_cast<__mmask16>(dim - d >= 16 ? 0xFFFF : (1u << (dim - d)) - 1);
        acc[j] = _mm512_fmadd_ps(load16(xt + d, lanes), load16(we + d, lanes), acc[j]);
      }
      logits[t * ldl + e] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
  }
}

// out[i, c] = Σ_j g[i·gi + j·gj]·src[j, c] for i < rows, j < depth and c in [c0, c1) (bf16 src
// [depth, dim], rows lds apart), each sum in j's order rounded to bf16 once into out (rows ldo
// apart): the router's input gradient (i a token, j an expert: g·W) and its weight's (i an
// expert, j a token: gᵀ·x). Tiles of kRouterRows rows by 64 columns: each step j widens four
// vectors of src's row once for all the tile's rows (one row at a time had widened them for
// every row: 8 widenings to 8 multiply-adds).
constexpr int kRouterRows = 6;

void router_grad_tile(const float* g, int64_t gi, int64_t gj, const bf16_t* src, int64_t lds, bf16_t* out,
                      int64_t ldo, int64_t rows, int64_t depth, int64_t c, const __mmask16 (&lanes)[4]) {
  __m512 acc[kRouterRows][4];
  MOE_UNROLL for (int r = 0; r < kRouterRows; ++r)
    MOE_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* g_r[kRouterRows];  // (past `rows`: the last row's again, not stored)
  MOE_UNROLL for (int r = 0; r < kRouterRows; ++r) g_r[r] = g + std::min<int64_t>(r, rows - 1) * gi;
  for (int64_t j = 0; j < depth; ++j) {
    __m512 s[4];
    MOE_UNROLL for (int v = 0; v < 4; ++v) s[v] = load16(src + j * lds + c + 16 * v, lanes[v]);
    MOE_UNROLL for (int r = 0; r < kRouterRows; ++r) {
      const __m512 g_rj = _mm512_set1_ps(g_r[r][j * gj]);
      MOE_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(g_rj, s[v], acc[r][v]);
    }
  }
  MOE_UNROLL for (int r = 0; r < kRouterRows; ++r) {
    if (r >= rows) continue;
    MOE_UNROLL for (int v = 0; v < 4; ++v) store16(out + r * ldo + c + 16 * v, acc[r][v], lanes[v]);
  }
}

void router_grad_rows(const float* g, int64_t gi, int64_t gj, const bf16_t* src, int64_t lds, bf16_t* out,
                      int64_t ldo, int64_t rows, int64_t depth, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += 64) {
    __mmask16 lanes[4];
    MOE_UNROLL for (int v = 0; v < 4; ++v) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, c1 - c - 16 * v));
      lanes[v] = static_cast<__mmask16>((1u << n) - 1);
    }
    for (int64_t i = 0; i < rows; i += kRouterRows)
      router_grad_tile(g + i * gi, gi, gj, src, lds, out + i * ldo, ldo, std::min<int64_t>(kRouterRows, rows - i),
                       depth, c, lanes);
  }
}

void run_rows(const WeightGrad& p, int64_t first, int64_t last) {
  if (p.k >= kPanelLeast && p.k <= kPanelMost && p.n >= 128) {
    if (p.accumulate ? panels_range<true, false>(p, first, last)
        : p.stream   ? panels_range<false, true>(p, first, last)
                     : panels_range<false, false>(p, first, last))
      return;
  }
  if (p.b_index != nullptr || p.a_index != nullptr) {  // (rows_range reads the rows in place)
    if (p.accumulate) rows_by_index<true>(p, first, last, 0);
    else rows_by_index<false>(p, first, last, 0);
    return;
  }
  if (p.accumulate) rows_range<true, false>(p, first, last);
  else if (p.stream) rows_range<false, true>(p, first, last);
  else rows_range<false, false>(p, first, last);
}

}  // namespace

#pragma GCC pop_options

// 1 where the kernel runs on this CPU (AVX-512 F/BW/VL, enabled by the OS), else 0 (then the
// entry point returns -1).
extern "C" int moe_ffn_avx512_ready() { return ready() ? 1 : 0; }

extern "C" int moe_ffn_avx512_router_logits_pairs_bf16(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t ldw,
                                                       float* logits, int64_t ldl, int64_t tokens, int64_t experts,
                                                       int64_t dim, int threads, void* parallel, void* thread_num,
                                                       void* num_threads);

// The router's float32 logits [tokens, experts] (rows ldl apart) of bf16 x [tokens, dim] and w
// [experts, dim], on the calling thread: moe_ffn_avx512_router_logits_pairs_bf16's where it runs
// (an AVX512-BF16 CPU, dim even), else router_logits_rows'. Returns 0, or -1 where the CPU
// lacks AVX-512 (logits untouched).
extern "C" int moe_ffn_avx512_router_logits_bf16(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t ldw,
                                                 float* logits, int64_t ldl, int64_t tokens, int64_t experts,
                                                 int64_t dim) {
  if (!ready() || tokens < 0 || experts < 0 || dim < 0) return -1;
  // (on AVX512-BF16 CPUs the pair products' sums, one thread: the logits of any number of tokens
  // then come out the same, and at 16 tokens in a quarter of the time: E = 64, D = 1024, 65 →
  // 16 µs; level at one)
  if (experts > 0 && moe_ffn_avx512_router_logits_pairs_bf16(x, ldx, w, ldw, logits, ldl, tokens, experts, dim, 1,
                                                             nullptr, nullptr, nullptr) == 0)
    return 0;
  router_logits_rows(x, ldx, w, ldw, logits, ldl, tokens, experts, dim);
  return 0;
}

// Their gradients from float32 g [tokens, experts] (rows ldg apart): grad_x = g·w [tokens, dim]
// and grad_w = gᵀ·x [experts, dim], bf16 (router_grad_rows; a null one not made): the team's
// threads split the columns (64 at a time; one thread below 2^22 multiply-adds), which changes
// no sum. Returns 0, or -1 where the CPU lacks AVX-512 (nothing written).
extern "C" int moe_ffn_avx512_router_backward_bf16(const float* g, int64_t ldg, const bf16_t* x, int64_t ldx,
                                                   const bf16_t* w, int64_t ldw, bf16_t* grad_x, int64_t ldgx,
                                                   bf16_t* grad_w, int64_t ldgw, int64_t tokens, int64_t experts,
                                                   int64_t dim, int threads, void* parallel, void* thread_num,
                                                   void* num_threads) {
  if (!ready() || tokens < 0 || experts < 0 || dim < 0 || threads < 1) return -1;
  const int64_t team = tokens * experts * dim >= (int64_t{1} << 22) ? std::min<int64_t>(threads, (dim + 63) / 64) : 1;
  on_team(make_team(parallel, thread_num, num_threads), team, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(dim, 64, t, parts, &first, &last);
    if (first >= last) return;
    if (grad_x != nullptr) router_grad_rows(g, ldg, 1, w, ldw, grad_x, ldgx, tokens, experts, first, last);
    if (grad_w != nullptr) router_grad_rows(g, 1, ldg, x, ldx, grad_w, ldgw, experts, tokens, first, last);
  });
  return 0;
}

// c = aᵀ·b (c += aᵀ·b with `accumulate`) for float32 a [k, m], b [k, n], c [m, n] (row strides
// in elements, last dims contiguous); with `stream` (not accumulating) c's whole 64-byte lines
// are written with streaming stores. Threads and the runtime's entry points as in
// _small_gemm.cpp. Returns 0, or -1 for arguments it does not take (c untouched).
extern "C" int moe_ffn_avx512_weight_grad_f32(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                                              int64_t ldc, int64_t k, int64_t m, int64_t n, int accumulate,
                                              int stream, int threads, void* parallel, void* thread_num,
                                              void* num_threads) {
  if (!ready() || k < 0 || m < 0 || n < 0 || threads < 1 || (accumulate && stream)) return -1;
  const WeightGrad p{a, lda, b, ldb, c, ldc, k, m, n, accumulate != 0, stream != 0};
  // at least 24 rows of c a thread
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, m / 24));
  on_team(make_team(parallel, thread_num, num_threads), count, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(m, 6, t, parts, &first, &last);
    run_rows(p, first, last);
  });
  return 0;
}

// c = a·b for float32 a [m, k] (a_steps_are_rows 0), or c = aᵀ·b for a [k, m] (1), with b
// [k, n], c [m, n] (row strides in elements, last dims contiguous; k ≥ 1). The threads split
// c's columns where each gets 64 or more, else its rows. Returns 0, or -1 for arguments it
// does not take (c untouched).
extern "C" int moe_ffn_avx512_matmul_f32(const float* a, int64_t lda, int a_steps_are_rows, const float* b,
                                         int64_t ldb, float* c, int64_t ldc, int64_t m, int64_t k, int64_t n,
                                         int threads, void* parallel, void* thread_num, void* num_threads) {
  if (!ready() || m < 0 || k < 1 || n < 0 || threads < 1) return -1;
  const Matmul p{a, lda, b, ldb, c, ldc, m, k, n};
  const bool by_columns = n >= 64 * threads;
  const int64_t units = by_columns ? n : m, step = by_columns ? 64 : 6;
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, units / (by_columns ? 64 : 24)));
  on_team(make_team(parallel, thread_num, num_threads), count, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(units, step, t, parts, &first, &last);
    const int64_t r0 = by_columns ? 0 : first, r1 = by_columns ? m : last;
    const int64_t q0 = by_columns ? first : 0, q1 = by_columns ? last : n;
    if (a_steps_are_rows) matmul_range<false>(p, r0, r1, q0, q1);
    else matmul_range<true>(p, r0, r1, q0, q1);
  });
  return 0;
}

// y = x·wᵀ for float32 x [rows, I], w [O, I], y [rows, O] (row strides in elements, last dims
// contiguous); threads and the runtime's entry points as above. Returns 0, or -1 for arguments
// it does not take (y untouched).
extern "C" int moe_ffn_avx512_linear_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                                         int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                                         int64_t chunk, int threads, void* parallel, void* thread_num,
                                         void* num_threads) {
  if (!ready() || rows < 0 || out_features < 0 || in_features < 1 || chunk < 1 || threads < 1) return -1;
  const Linear p{{x, ldx, w, ldw, y, ldy, rows, in_features}, chunk};
  // at least 24 rows of w a thread
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, out_features / 24));
  on_team(make_team(parallel, thread_num, num_threads), count, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(out_features, 6, t, parts, &first, &last);
    linear_range(p, first, last);
  });
  return 0;
}

// The same product for a decode step's expert blocks in one parallel region: block i, the
// int64s blocks[4i .. 4i+3] = (expert, start, stop, unused; the table of _small_gemm.cpp's
// blocks entry points), computes y[start:stop] = x[start:stop]·w_eᵀ with expert e < experts's
// weight at w + e·w_expert (row stride ldw), each block's sums as moe_ffn_avx512_linear_f32
// forms them with chunks of CHUNK; each thread takes its share of every block's rows of w.
// Every block is checked before any is computed (-1: y untouched). Two entry points, chunks of
// 512 and of 4096 (_deep), both with the linear-blocks signature (moe_ffn_linear_blocks_f32's)
// that moe_ffn_routed_swiglu_blocks_f32 calls its projections by.
namespace {

// (index: see LinearOf; else x's rows are the blocks' rows)
int linear_blocks_f32(const float* x, int64_t ldx, const int64_t* index, const float* w, int64_t experts,
                      int64_t w_expert, int64_t ldw, float* y, int64_t ldy, const int64_t* blocks, int64_t count,
                      int64_t out_features, int64_t in_features, int64_t chunk, int threads, void* parallel,
                      void* thread_num, void* num_threads) {
  if (!ready() || count < 0 || out_features < 0 || in_features < 1 || threads < 1) return -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (b[0] < 0 || b[0] >= experts || b[1] < 0 || b[2] < b[1]) return -1;
  }
  const int64_t team_size = std::min<int64_t>(threads, std::max<int64_t>(1, out_features / 24));
  on_team(make_team(parallel, thread_num, num_threads), team_size, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(out_features, 6, t, parts, &first, &last);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = blocks[4 * i], start = blocks[4 * i + 1], stop = blocks[4 * i + 2];
      const Linear p{{index ? x : x + start * ldx, ldx, w + e * w_expert, ldw, y + start * ldy, ldy, stop - start,
                      in_features, index ? index + start : nullptr},
                     chunk};
      linear_range(p, first, last);
    }
  });
  return 0;
}

}  // namespace

extern "C" int moe_ffn_avx512_linear_blocks_f32(const float* x, int64_t ldx, const float* w, int64_t experts,
                                                int64_t w_expert, int64_t ldw, float* y, int64_t ldy,
                                                const int64_t* blocks, int64_t count, int64_t out_features,
                                                int64_t in_features, int threads, void* parallel, void* thread_num,
                                                void* num_threads) {
  return linear_blocks_f32(x, ldx, nullptr, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features, in_features,
                           512, threads, parallel, thread_num, num_threads);
}

extern "C" int moe_ffn_avx512_linear_blocks_f32_deep(const float* x, int64_t ldx, const float* w, int64_t experts,
                                                     int64_t w_expert, int64_t ldw, float* y, int64_t ldy,
                                                     const int64_t* blocks, int64_t count, int64_t out_features,
                                                     int64_t in_features, int threads, void* parallel,
                                                     void* thread_num, void* num_threads) {
  return linear_blocks_f32(x, ldx, nullptr, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features, in_features,
                           4096, threads, parallel, thread_num, num_threads);
}

// The float32 backward's products of a group's blocks in one parallel region each, every block
// as its single-block entry point above computes it (the same tiles, the same split of its
// work among the threads, so the same sums): the layer called those block by block from
// Python, ~20–60 µs a block outside the kernel (grouped.py, fine-grained T = 256: 256 calls a
// step). Table rows blocks[4i .. 4i+3] = (expert, start, stop, accumulate), all checked before
// anything is computed (-1: nothing written).

namespace {

bool float32_blocks_fit(const int64_t* blocks, int64_t count, int64_t experts, bool may_accumulate) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (b[0] < 0 || b[0] >= experts || b[1] < 0 || b[2] < b[1] || b[3] < 0 || b[3] > (may_accumulate ? 1 : 0))
      return false;
  }
  return true;
}

}  // namespace

namespace {

// (a_index: where given, a's row r of a block is a's row a_index[start + r])
int matmul_blocks_f32(const float* a, int64_t lda, const int64_t* a_index, const float* b, int64_t experts,
                      int64_t b_expert, int64_t ldb, float* c, int64_t ldc, const int64_t* blocks, int64_t count,
                      int64_t k, int64_t n, int threads, void* parallel, void* thread_num, void* num_threads) {
  if (!ready() || k < 1 || threads < 1 || n < 64 * threads || count < 0 || !float32_blocks_fit(blocks, count, experts, false))
    return -1;
  const int64_t team_size = std::min<int64_t>(threads, n / 64);
  on_team(make_team(parallel, thread_num, num_threads), team_size, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(n, 64, t, parts, &first, &last);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = blocks[4 * i], start = blocks[4 * i + 1], stop = blocks[4 * i + 2];
      Matmul p{a_index ? a : a + start * lda, lda, b + e * b_expert, ldb, c + start * ldc, ldc, stop - start, k, n};
      p.a_index = a_index ? a_index + start : nullptr;
      if (stop > start) matmul_range<true>(p, 0, stop - start, first, last);
    }
  });
  return 0;
}

}  // namespace

// Input gradients c[start:stop] = a[start:stop]·b_e for float32 a [rows, k], expert e's b_e
// [k, n] (at b + e·b_expert, rows ldb apart), c [rows, n]: moe_ffn_avx512_matmul_f32's product
// (a_steps_are_rows 0) block by block. Its threads split c's columns, so n must give each of
// `threads` 64 or more (else -1).
extern "C" int moe_ffn_avx512_matmul_blocks_f32(const float* a, int64_t lda, const float* b, int64_t experts,
                                                int64_t b_expert, int64_t ldb, float* c, int64_t ldc,
                                                const int64_t* blocks, int64_t count, int64_t k, int64_t n,
                                                int threads, void* parallel, void* thread_num, void* num_threads) {
  return matmul_blocks_f32(a, lda, nullptr, b, experts, b_expert, ldb, c, ldc, blocks, count, k, n, threads, parallel,
                           thread_num, num_threads);
}

// Weight gradients c_e = a[start:stop]ᵀ·b[start:stop] (c_e += with the block's accumulate
// flag) for float32 a [rows, m], b [rows, n] into expert e's c_e [m, n] (at c + e·c_expert, rows
// ldc apart), block by block as the single-block entry points compute them: blocks of at most
// `outer_rows` rows as moe_ffn_avx512_weight_grad_f32 (its streaming stores with `stream`, for
// blocks that do not accumulate), larger ones as moe_ffn_avx512_matmul_f32 with
// a_steps_are_rows (those may not accumulate, and n must give each thread 64 columns: else -1).
namespace {

// (b_index: where given, b's row r of a block is b's row b_index[start + r]; a_index, a_scale
// likewise for a (see WeightGradOf); with either every block takes the weight-gradient kernel:
// none past outer_rows, else -1)
int weight_grad_blocks_f32(const float* a, int64_t lda, const int64_t* a_index, const float* a_scale, const float* b,
                           int64_t ldb, const int64_t* b_index, float* c, int64_t experts, int64_t c_expert,
                           int64_t ldc, const int64_t* blocks, int64_t count, int64_t m, int64_t n,
                           int64_t outer_rows, int stream, int threads, void* parallel, void* thread_num,
                           void* num_threads) {
  if (!ready() || m < 0 || n < 0 || threads < 1 || count < 0 || !float32_blocks_fit(blocks, count, experts, true))
    return -1;
  int64_t team_size = std::max<int64_t>(1, m / 24);  // (the outer-product kernel's team)
  for (int64_t i = 0; i < count; ++i) {
    if (blocks[4 * i + 2] - blocks[4 * i + 1] <= outer_rows) continue;
    if (blocks[4 * i + 3] || n < 64 * threads || b_index != nullptr || a_index != nullptr) return -1;
    team_size = std::max<int64_t>(team_size, n / 64);
  }
  team_size = std::min<int64_t>(threads, team_size);
  on_team(make_team(parallel, thread_num, num_threads), team_size, [&](int64_t t, int64_t parts) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = blocks[4 * i], start = blocks[4 * i + 1], rows = blocks[4 * i + 2] - start;
      const bool accumulate = blocks[4 * i + 3] != 0;
      float* c_e = c + e * c_expert;
      int64_t first, last;
      if (rows <= outer_rows) {  // as moe_ffn_avx512_weight_grad_f32
        const int64_t own = std::min<int64_t>(parts, std::max<int64_t>(1, m / 24));
        if (t >= own) continue;
        share(m, 6, t, own, &first, &last);
        const WeightGrad p{a_index ? a : a + start * lda,
                           lda,
                           b_index ? b : b + start * ldb,
                           ldb,
                           c_e,
                           ldc,
                           rows,
                           m,
                           n,
                           accumulate,
                           stream != 0 && !accumulate,
                           b_index ? b_index + start : nullptr,
                           a_index ? a_index + start : nullptr,
                           a_index && a_scale ? a_scale + start : nullptr};
        run_rows(p, first, last);
      } else {  // as moe_ffn_avx512_matmul_f32, a_steps_are_rows
        const int64_t own = std::min<int64_t>(parts, n / 64);
        if (t >= own) continue;
        share(n, 64, t, own, &first, &last);
        const Matmul p{a + start * lda, lda, b + start * ldb, ldb, c_e, ldc, m, rows, n};
        matmul_range<false>(p, 0, m, first, last);
      }
    }
  });
  return 0;
}

}  // namespace

extern "C" int moe_ffn_avx512_weight_grad_blocks_f32(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                                                     int64_t experts, int64_t c_expert, int64_t ldc,
                                                     const int64_t* blocks, int64_t count, int64_t m, int64_t n,
                                                     int64_t outer_rows, int stream, int threads, void* parallel,
                                                     void* thread_num, void* num_threads) {
  return weight_grad_blocks_f32(a, lda, nullptr, nullptr, b, ldb, nullptr, c, experts, c_expert, ldc, blocks, count, m, n,
                                outer_rows, stream, threads, parallel, thread_num, num_threads);
}

// ---- bf16: a decode step's blocks (grouped.py's bf16 layers where the CPU has bf16 units) ----
//
// The int64 table blocks[4i .. 4i+3] = (expert, start, stop, accumulate) as above; every block is
// checked before any is computed (-1: nothing written). In the two entry points right below,
// bf16 operands are widened exactly and their products summed in float32 FMAs; in all of them
// each result is rounded to bf16 once, to nearest even.

namespace {

bool blocks_fit(const int64_t* blocks, int64_t count, int64_t experts) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (b[0] < 0 || b[0] >= experts || b[1] < 0 || b[2] < b[1] || b[3] != 0) return false;
  }
  return true;
}

// Whether the threads take whole blocks each (whole_blocks) rather than a share of every block:
// many blocks (first bounded to few rows each, see below). Then each block's weight is read by one thread, in order, where each
// thread had read its part of every weight (its rows of w, or for the input gradients its
// columns: part of every row, a stride apart), and each block's rows are packed once, where
// both threads had packed them. Zen 4 EPYC (2026-12-07), layer bf16, the two ways alternated
// in one process (11 rounds of 3 layers, ratios' medians taken apart for either way first,
// their geometric mean; the same bits): forward fine-grained T = 64 0.969×, T = 256 0.956×;
// forward+backward (forward and input gradients) T = 64 0.94–0.98×, T = 256 0.965–0.98×;
// level where the blocks are large (fine-grained T = 2048, 256 rows: 0.998 / 1.004×) and
// behind where they are few (Mixtral's 8 at T = 256: forward+backward 1.021×), hence the bounds.
// The builds alternated likewise: fine-grained T = 256 forward 0.960×, forward+backward 0.961×,
// T = 64 0.989 / 0.967×; T = 1 and 16 level; Mixtral level (its blocks are not taken whole).
// (The weight gradients' kernels gained nothing this way: level.) Blocks of more than 128 rows
// on average went as shares until the threads claimed their blocks (over_blocks); since then
// whole blocks at any size: layer bf16, alternated in one process (2–4 rounds), forward
// fine-grained T = 2048 0.939×, T = 4096 0.978×, T = 8192 0.992×; forward+backward T = 2048
// 0.979×, T = 4096 0.992×, T = 8192 level. Mixtral's 8 blocks taken whole (4 a thread): level
// (forward T = 256 0.992×, forward+backward 0.998×), so not.
constexpr int64_t kWholeBlocksPerThread = 8;

bool whole_blocks(int64_t count, int threads) { return threads >= 2 && count >= kWholeBlocksPerThread * threads; }

// The order in which the threads claim whole blocks: the longest first (a block's work counted
// as its rows), ties in the table's order.
std::vector<int64_t> longest_first(const int64_t* blocks, int64_t count) {
  auto rows = [&](int64_t i) { return blocks[4 * i + 2] - blocks[4 * i + 1]; };
  std::vector<int64_t> order(count);
  for (int64_t i = 0; i < count; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows(a) > rows(b); });
  return order;
}

// The bf16 entry points' common frame: checks the table (no block may accumulate), then on a
// team of at most `threads` (at least `least` units a thread) each thread takes its share
// [first, last) of `units` (in steps of `step`) and calls run(e, start, stop, first, last, next)
// for every block in turn (next: the following block's expert, -1 after the last). With
// `whole` (and whole_blocks), the threads instead claim whole blocks one at a time, the longest
// first, and call run(e, start, stop, 0, units, next) for each (next: the expert of the block
// `threads` places further on in that order, the one the thread is likely to claim next, for
// its prefetches; or -1). Claimed, not dealt out beforehand: a block's time is not its rows'
// count (dot tiles or outer products, tails, the weight's read from memory or L3, the other
// thread's minute), and blocks dealt out by rows plus 16 (longest first, each to the thread
// with the least so far) left one thread waiting at the end. Zen 4 EPYC (2026-12-07), layer
// bf16, the two alternated in one process (pair ratios' medians, 9–21 rounds; the same bits: a
// block is whole on one thread either way): forward fine-grained T = 128 0.934×, T = 256
// 0.978 / 0.986×, T = 64 0.993 / 1.018×; forward+backward T = 256 0.964 / 0.989×, T = 64 1.001×.
// -1 for a table it does not take, or where a call returned false.
template <typename Run>
int over_blocks(const int64_t* blocks, int64_t count, int64_t experts, int64_t units, int64_t step, int64_t least,
                int threads, void* parallel, void* thread_num, void* num_threads, Run run, bool whole = false) {
  if (count < 0 || !blocks_fit(blocks, count, experts)) return -1;
  int failed = 0;
  whole = whole && whole_blocks(count, threads);
  const int64_t team_size = whole ? threads : std::min<int64_t>(threads, std::max<int64_t>(1, units / least));
  const std::vector<int64_t> order = whole ? longest_first(blocks, count) : std::vector<int64_t>();
  int64_t claimed = 0;  // (whole blocks: the next place in `order` to claim)
  on_team(make_team(parallel, thread_num, num_threads), team_size, [&](int64_t t, int64_t parts) {
    if (whole) {
      for (int64_t k; (k = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED)) < count;) {
        const int64_t i = order[k], ahead = k + parts < count ? blocks[4 * order[k + parts]] : -1;
        if (!run(blocks[4 * i], blocks[4 * i + 1], blocks[4 * i + 2], 0, units, ahead))
          __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      }
      return;
    }
    int64_t first, last;
    share(units, step, t, parts, &first, &last);
    for (int64_t i = 0; i < count; ++i) {
      if (!run(blocks[4 * i], blocks[4 * i + 1], blocks[4 * i + 2], first, last, i + 1 < count ? blocks[4 * i + 4] : -1))
        __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
  });
  return failed ? -1 : 0;
}

}  // namespace

// Input gradients y[start:stop] = g[start:stop]·w_e for float32 g [rows, O] (the bf16 gradient's
// rows widened by the caller: each value is broadcast), bf16 w_e [O, I] (expert e's weight at
// w + e·w_expert, rows ldw apart) and y [rows, I]: the threads split y's columns (64 at a time),
// each taking its share of every block, each block's whole sum over O in registers.
extern "C" int moe_ffn_avx512_input_grad_blocks_bf16(const float* g, int64_t ldg, const bf16_t* w, int64_t experts,
                                                     int64_t w_expert, int64_t ldw, bf16_t* y, int64_t ldy,
                                                     const int64_t* blocks, int64_t count, int64_t out_features,
                                                     int64_t in_features, int threads, void* parallel,
                                                     void* thread_num, void* num_threads) {
  if (!ready() || out_features < 1 || in_features < 0 || threads < 1) return -1;
  return over_blocks(blocks, count, experts, in_features, 64, 64, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const MatmulOf<float, bf16_t, bf16_t> p{g + start * ldg, ldg, w + e * w_expert, ldw,
                                                               y + start * ldy, ldy, stop - start, out_features,
                                                               in_features};
                       whole_sums(p, first, last);
                       return true;
                     });
}

// Forward y[start:stop] = x[start:stop]·w_eᵀ for bf16 x [rows, I], w_e [O, I], y [rows, O] on
// AVX512-BF16's dot-product instruction (vdpbf16ps: 32 bf16 pairs' products into 16 float32
// sums; inputs and results of subnormal size flushed to zero, as oneDNN's AVX512-BF16 and AMX
// kernels flush them): register tiles of up to 4 rows of x by 6 rows of w, each tile's whole
// sum over I in its registers (no chunks: a bf16 y is rounded once), reduced across lanes at
// the end. The threads split w's rows, each taking its share of every block, or where the
// blocks are many take whole blocks each (whole_blocks).

namespace {

bool bf16_ready() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return ready() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));  // AVX512_BF16
  }();
  return usable;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "_swiglu16.h"  // swiglu16

namespace {

using LinearBf16 = LinearOf<bf16_t>;

inline __m512bh pairs(const bf16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pairs(const bf16_t* p, __mmask32 lanes) { return (__m512bh)_mm512_maskz_loadu_epi16(lanes, p); }

template <int ROWS, int COLS>
void dot_tile(const LinearBf16& p, const bf16_t* x, const bf16_t* w, bf16_t* y, const bf16_t* next, int next_rows,
              int next_step) {
  __m512 acc[ROWS][COLS];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t depth = p.in_features, whole = depth & ~int64_t{31};
  for (int64_t k = 0; k < whole; k += 32) {
    __m512bh w_k[COLS];
    MOE_UNROLL for (int j = 0; j < COLS; ++j) w_k[j] = pairs(w + j * p.ldw + k);
    for (int j = 0; j < next_rows; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(next + j * next_step * p.ldw + k), _MM_HINT_T1);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512bh x_k = pairs(x + i * p.ldx + k);
      MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x_k, w_k[j]);
    }
  }
  if (whole < depth) {
    const __mmask32 lanes = static_cast<__mmask32>((uint64_t{1} << (depth - whole)) - 1);
    __m512bh w_k[COLS];
    MOE_UNROLL for (int j = 0; j < COLS; ++j) w_k[j] = pairs(w + j * p.ldw + whole, lanes);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512bh x_k = pairs(x + i * p.ldx + whole, lanes);
      MOE_UNROLL for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x_k, w_k[j]);
    }
  }
  // The tile's ROWS·COLS sums across lanes, 16 at a time (sums16), rounded 16 at a time.
  constexpr int kSums = ROWS * COLS;
  alignas(64) bf16_t rounded[32];
  MOE_UNROLL for (int base = 0; base < kSums; base += 16) {
    __m512 v[16];
    MOE_UNROLL for (int t = 0; t < 16; ++t)
      v[t] = base + t < kSums ? acc[(base + t) / COLS][(base + t) % COLS] : _mm512_setzero_ps();
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + base), to_bf16(sums16(v)));
  }
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < COLS; ++j) y[i * p.ldy + j] = rounded[i * COLS + j];
}

// The strip's tiles prefetch the next strip's rows (`next_rows` of them) into L2, line by line
// as they read their own, the rows shared out among the tiles: tile t takes rows t, t + tiles,
// ... So the memory keeps streaming while the later tiles re-read this strip from L1; when the
// first tile alone prefetched them, blocks of 8 rows and more left it idle for those tiles. On
// the Zen 4 EPYC (2026-12-06), per product with the weights out of the caches (6 rounds, the
// same bits), 8 rows 1.10-1.30x, 12 rows 1.06-1.31x, 16 rows 1.08-1.30x, 4 rows (one tile)
// level; layer bf16 forward Mixtral T = 16 0.975x, T = 64 0.93x, fine-grained T = 128 0.92x.
template <int COLS>
void dot_strip(const LinearBf16& p, int64_t o, int next_rows) {
  const bf16_t* w = p.w + o * p.ldw;
  const bf16_t* next = w + COLS * p.ldw;
  const int tiles = static_cast<int>((p.rows + 3) / 4);
  // tile t prefetches the next strip's rows t, t + tiles, ...
  auto share = [&](int t) { return t < next_rows ? (next_rows - t + tiles - 1) / tiles : 0; };
  int64_t r = 0;
  int t = 0;
  for (; r + 4 <= p.rows; r += 4, ++t)
    dot_tile<4, COLS>(p, p.x + r * p.ldx, w, p.y + r * p.ldy + o, next + t * p.ldw, share(t), tiles);
  const bf16_t* x = p.x + r * p.ldx;
  bf16_t* y = p.y + r * p.ldy + o;
  const bf16_t* ahead = next + t * p.ldw;
  switch (p.rows - r) {
    case 3: dot_tile<3, COLS>(p, x, w, y, ahead, share(t), tiles); break;
    case 2: dot_tile<2, COLS>(p, x, w, y, ahead, share(t), tiles); break;
    case 1: dot_tile<1, COLS>(p, x, w, y, ahead, share(t), tiles); break;
    default: break;
  }
}

// One row of x: w's rows one after another (a single stream through the thread's rows, each
// prefetched 4 KiB ahead into L2), each row's sum over I in one accumulator, 16 rows' sums
// reduced together: the same sums as the tiles' (each lane's sum in the same order, the same
// reduction tree), the same bits. On the Zen 4 EPYC (2026-12-06), per product with the weights
// out of the caches (8 weights in turn, GB/s): 7168×1024 33.7 → 36.3, 1024×3584 36.2 → 37.5,
// 1024×1024 31.5 → 34.5, 1024×512 27.2 → 30.3 (2 / 8 KiB ahead: level / behind); layer bf16
// forward T = 1 (11 rounds): Mixtral 0.99×, fine-grained 0.94×. Tiles of 1 row by 8 or 12 rows
// of w, or prefetching the strip after next too: level.
void dot_one_row(const LinearBf16& p, int64_t first, int64_t last) {
  const int64_t depth = p.in_features, whole = depth & ~int64_t{31};
  const __mmask32 lanes = static_cast<__mmask32>((uint64_t{1} << (depth - whole)) - 1);
  alignas(64) bf16_t rounded[16];
  for (int64_t o0 = first; o0 < last; o0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, last - o0));
    __m512 v[16];
    MOE_UNROLL for (int t = 0; t < 16; ++t) {
      __m512 acc = _mm512_setzero_ps();
      if (t < n) {
        const bf16_t* w = p.w + (o0 + t) * p.ldw;
        for (int64_t k = 0; k < whole; k += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(w + k) + 4096, _MM_HINT_T1);
          acc = _mm512_dpbf16_ps(acc, pairs(p.x + k), pairs(w + k));
        }
        if (whole < depth) acc = _mm512_dpbf16_ps(acc, pairs(p.x + whole, lanes), pairs(w + whole, lanes));
      }
      v[t] = acc;
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), to_bf16(sums16(v)));
    for (int t = 0; t < n; ++t) p.y[o0 + t] = rounded[t];
  }
}

// w's rows [first, last) in strips of 6, each prefetching the next's rows of w (one row of x:
// dot_one_row). On the Zen 5 EPYC (2026-12-03), prefetching into L1: per product (GFLOP/s, 8 or
// 64 weights of the benchmark's shapes, two runs) 8 rows 167–285 → 232–330, 16 rows 260–353 →
// 367–480; 4 rows 109–190 → 122–202 and 1 row level or behind, and in the layer's forward from 2
// or 4 rows T = 16 read 0.95–0.98× (blocks of 2–4 rows): from 8 rows only then. On the Zen 4
// EPYC (2026-12-06) the decode forward read its weights at 20–23 GB/s where a plain sum reads
// 50: prefetching into L2 from one row on, layer bf16 forward with its weights out of the caches
// (three layers in turn, 7 rounds, same bits), T = 1 / 4 / 16: Mixtral 0.88 / – / 0.71×, fine
// 0.81 / 0.80 / 0.65×; into L1 from one row 1.03–1.05× (the prefetches' misses hold the L1 fill
// buffers the tile's own loads need); two to four strips ahead instead of one: level (0.87–0.91×
// and 0.78–0.82× at T = 1). Not re-measured on Zen 5.
void dot_range(const LinearBf16& p, int64_t first, int64_t last) {
  if (p.rows == 1) {
    dot_one_row(p, first, last);
    return;
  }
  auto ahead = [&](int64_t o) { return static_cast<int>(std::min<int64_t>(6, std::max<int64_t>(0, last - o))); };
  int64_t o = first;
  for (; o + 6 <= last; o += 6) dot_strip<6>(p, o, ahead(o + 6));
  switch (last - o) {
    case 5: dot_strip<5>(p, o, 0); break;
    case 4: dot_strip<4>(p, o, 0); break;
    case 3: dot_strip<3>(p, o, 0); break;
    case 2: dot_strip<2>(p, o, 0); break;
    case 1: dot_strip<1>(p, o, 0); break;
    default: break;
  }
}

// Blocks of more rows: yᵀ = w·xᵀ as outer products, so that each of w's bf16 pairs is one
// broadcast and the products of 16 rows of x come from one vector. x's rows are packed in
// groups of kGroupRows (pairs (x[r, 2p], x[r, 2p+1]) of the group's rows side by side for each
// p: a 32-bit transpose, into the thread's scratch); a register tile spans V groups of x's
// rows by 24 / V rows of w (24 accumulators), each tile's whole sum over I in its registers,
// then stored transposed through a small buffer. A block's groups (two or more: smaller blocks
// take the dot-product tiles) go into tiles of 3, then of 2 for the rest (3 + 2 + 2 where 3 + 1
// would leave a tile of 1: 24 broadcasts for 24 products ran at 0.6–0.75× the dot tiles' rate
// at 16 rows; tiles of 4 were no faster than two of 2). A block thus computes less than 16 rows
// it does not need; tiles of a fixed 32 rows computed up to 31 (33 rows ran at 0.70× the rate
// of 32, 48 at 0.8×). Every row tile of x passes over the thread's rows of w (from the caches:
// w is read from memory once).
constexpr int64_t kGroupRows = 16;

// 8 columns of 16 rows each (cols[j]: the column's rows 0–7 in the low 128 bits, 8–15 in the
// high) stored as rows: rows [0, n) of y, each row's first lanes of `mask` (columns). A 16-bit
// 8×8 transpose in each 128-bit half (three rounds of unpacks), then one masked store a row:
// the tiles stored their results one value at a time, each rounded on its own. Per product
// (GFLOP/s, 8 or 64 weights in turn, 9 rounds) 64 rows 449–693 → 476–710, 256 rows 643–852 →
// 662–868 (most through the fine-grained 1024×512: I = 512, the fewest products a store);
// layer forward (9 rounds) T = 256 fine 1.044×, Mixtral 1.039×, T = 2048 1.008 / 1.007×.
inline void store_rows8(const __m256i (&cols)[8], bf16_t* y, int64_t ldy, int64_t n, __mmask8 mask) {
  __m256i a[8], b[8];
  MOE_UNROLL for (int k = 0; k < 4; ++k) {  // a[2k]: rows 0–3 of columns 2k, 2k+1 interleaved; a[2k+1]: rows 4–7
    a[2 * k] = _mm256_unpacklo_epi16(cols[2 * k], cols[2 * k + 1]);
    a[2 * k + 1] = _mm256_unpackhi_epi16(cols[2 * k], cols[2 * k + 1]);
  }
  MOE_UNROLL for (int h = 0; h < 2; ++h) {  // b[4h..4h+3]: rows 4h + (0–1, 2–3) of columns 0–3, then of 4–7
    b[4 * h] = _mm256_unpacklo_epi32(a[h], a[h + 2]);
    b[4 * h + 1] = _mm256_unpackhi_epi32(a[h], a[h + 2]);
    b[4 * h + 2] = _mm256_unpacklo_epi32(a[h + 4], a[h + 6]);
    b[4 * h + 3] = _mm256_unpackhi_epi32(a[h + 4], a[h + 6]);
  }
  MOE_UNROLL for (int i = 0; i < 8; ++i) {  // row i: its 4 columns of b[4h + q] and of b[4h + 2 + q]
    const int h = i / 4, q = (i % 4) / 2;
    const __m256i row = i % 2 == 0 ? _mm256_unpacklo_epi64(b[4 * h + q], b[4 * h + 2 + q])
                                   : _mm256_unpackhi_epi64(b[4 * h + q], b[4 * h + 2 + q]);
    if (i < n) _mm_mask_storeu_epi16(y + i * ldy, mask, _mm256_castsi256_si128(row));
    if (i + 8 < n) _mm_mask_storeu_epi16(y + (i + 8) * ldy, mask, _mm256_extracti128_si256(row, 1));
  }
}

// next (or nullptr): the next tile's COLS rows of w, prefetched line by line as this tile runs
// (row j's line l at step 16·l + j): each tile reads its rows of w once, from memory where no
// earlier row tile of the block has (per product, 32 rows: 507–764 → 650–826 GFLOP/s; level
// from 256 rows, where every chunk of w passes through several row tiles from L2). Into L2, not
// L1: a whole tile ahead, the next tile's 24 KiB (I = 1024) beside this one's in a 32 KiB L1 had
// pushed out lines of both. Zen 4 EPYC (2026-12-07), layer bf16, the two alternated in one
// process (pair ratios' medians, 4–15 rounds, the same bits): forward fine-grained T = 256
// 0.977–0.986×, T = 2048 0.992×, Mixtral T = 256 0.985×, T = 64 and fine T = 128 level (their
// blocks mostly on the dot tiles); forward+backward fine T = 256 0.988×. Every loop
// over the accumulators unrolls whole (no break on the rows: a test inside), so that GCC keeps
// them in registers: with the rounding loop's early exit it kept them in a stack array, zeroed
// before every tile and stored after it (61-64 stack accesses in outer_tile<3, 8> and <2, 12>).
// Zen 4 EPYC (2026-12-07), the two builds alternated in one process (pair ratios' median), layer
// bf16 forward: Mixtral T = 256 0.947× (9 rounds of 3 layers), fine-grained T = 256 0.988× (15),
// T = 2048 0.978× (5 of 2).
template <int V, int COLS>
void outer_tile(const uint32_t* packed, int64_t group_words, int64_t pairs, const bf16_t* w, int64_t ldw, bf16_t* y,
                int64_t ldy, int64_t rows, const bf16_t* next) {
  __m512 acc[COLS][V];
  MOE_UNROLL for (int j = 0; j < COLS; ++j)
    MOE_UNROLL for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    if (next != nullptr && (q & 15) < COLS)
      _mm_prefetch(reinterpret_cast<const char*>(next + (q & 15) * ldw + (q >> 4) * 32), _MM_HINT_T1);
    __m512bh x_v[V];
    MOE_UNROLL for (int v = 0; v < V; ++v)
      x_v[v] = (__m512bh)_mm512_loadu_si512(packed + v * group_words + q * kGroupRows);
    MOE_UNROLL for (int j = 0; j < COLS; ++j) {
      uint32_t pair;
      __builtin_memcpy(&pair, w + j * ldw + 2 * q, 4);
      const __m512bh w_j = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      MOE_UNROLL for (int v = 0; v < V; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], w_j, x_v[v]);
    }
  }
  MOE_UNROLL for (int v = 0; v < V; ++v)
    MOE_UNROLL for (int j0 = 0; j0 < COLS; j0 += 8) {
      if (v * kGroupRows >= rows) continue;  // (not a break: the loops unroll whole)
      __m256i cols[8];  // column j0 + j of the group's 16 rows, rounded
      MOE_UNROLL for (int j = 0; j < 8; ++j) cols[j] = j0 + j < COLS ? to_bf16(acc[j0 + j][v]) : _mm256_setzero_si256();
      store_rows8(cols, y + v * kGroupRows * ldy + j0, ldy, std::min<int64_t>(kGroupRows, rows - v * kGroupRows),
                  static_cast<__mmask8>((1u << std::min(8, COLS - j0)) - 1));
    }
}

// Row r of the block's x (p.index: see LinearOf).
inline const bf16_t* x_row(const LinearBf16& p, int64_t r) { return p.x + (p.index ? p.index[r] : r) * p.ldx; }

// x's rows [r0, r0 + rows) (rows ≤ kGroupRows) packed as above, tail rows zero: 16 pairs of
// each row at a time, a 16×16 transpose of 32-bit lanes in registers, where a pair at a time
// (one 4-byte copy each) took 2.97 against 2.12 µs a group of 1024 features (alone, L2). Zen 4
// EPYC (2026-12-07), the two builds alternated in one process, layer bf16 forward (ratios'
// medians taken apart for either build first, their geometric mean; 11 rounds of 3 layers):
// fine-grained T = 256 0.989×, T = 2048 0.986× (5 of 2), Mixtral T = 256 level; the same bits.
void pack_rows(const LinearBf16& p, int64_t r0, int64_t rows, uint32_t* packed) {
  const int64_t pairs = p.in_features / 2;
  const bf16_t* x[kGroupRows];
  for (int64_t r = 0; r < rows; ++r) x[r] = x_row(p, r0 + r);
  for (int64_t q0 = 0; q0 < pairs; q0 += 16) {
    const int64_t n = std::min<int64_t>(16, pairs - q0);
    const __mmask16 lanes = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
    __m512i v[kGroupRows];
    for (int64_t r = 0; r < kGroupRows; ++r)
      v[r] = r < rows ? _mm512_maskz_loadu_epi32(lanes, x[r] + 2 * q0) : _mm512_setzero_si512();
    transpose16(v);
    for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(packed + (q0 + j) * kGroupRows, v[j]);
  }
}

// p with rows [r0, r0 + rows) of its x copied into `rows_at` [rows, in_features] (where p.index
// is given: the dot-product tiles read x's rows at a stride), for the rows' own product.
LinearBf16 rows_of(const LinearBf16& p, int64_t r0, int64_t rows, bf16_t* rows_at) {
  LinearBf16 q = p;
  q.rows = rows;
  q.y += r0 * p.ldy;
  if (p.index == nullptr) {
    q.x += r0 * p.ldx;
    return q;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(rows_at + r * p.in_features, x_row(p, r0 + r), 2 * p.in_features);
  q.x = rows_at;
  q.ldx = p.in_features;
  q.index = nullptr;
  return q;
}

// The last n (< 24 / V) of a strip's rows of w: one tile of exactly n.
template <int V, int COLS>
void outer_rest(const uint32_t* tile, int64_t pairs, const bf16_t* w, int64_t ldw, bf16_t* y, int64_t ldy,
                int64_t rows, int64_t n) {
  if (n == COLS) outer_tile<V, COLS>(tile, pairs * kGroupRows, pairs, w, ldw, y, ldy, rows, nullptr);
  else if constexpr (COLS > 1) outer_rest<V, COLS - 1>(tile, pairs, w, ldw, y, ldy, rows, n);
}

// w's rows [o, o1) against the row tile of V groups from group g (`rows` rows of y from
// g·kGroupRows): tiles of 24 / V rows of w, then one of the rest; each full tile prefetches the
// next one's rows where they are the thread's (before `end`), the one ending at `end` the rows
// at `after` (at least 24 / V of them, ldw apart; or nothing).
template <int V>
void outer_tiles(const uint32_t* packed, int64_t pairs, const LinearBf16& p, int64_t o, int64_t o1, int64_t g,
                 int64_t end, const bf16_t* after) {
  constexpr int kCols = 24 / V;
  const uint32_t* tile = packed + g * pairs * kGroupRows;
  const int64_t rows = std::min(V * kGroupRows, p.rows - g * kGroupRows);
  bf16_t* y = p.y + g * kGroupRows * p.ldy;
  for (; o + kCols <= o1; o += kCols)
    outer_tile<V, kCols>(tile, pairs * kGroupRows, pairs, p.w + o * p.ldw, p.ldw, y + o, p.ldy, rows,
                         o + 2 * kCols <= end ? p.w + (o + kCols) * p.ldw : o + kCols == end ? after : nullptr);
  if (o < o1) outer_rest<V, kCols - 1>(tile, pairs, p.w + o * p.ldw, p.ldw, y + o, p.ldy, rows, o1 - o);
}

// w's rows [first, last) for every row of the block (in_features even): all of x's groups
// packed first (the thread's scratch), then w's rows kChunkCols at a time (their pairs stay in
// L2 while every row tile passes over them: w read from memory once); false where the scratch
// could not be had.
constexpr int64_t kChunkCols = 48;  // a multiple of 24 / V (V = 2, 3)

// The groups of 16 rows a block of `rows` rows takes on the outer products (outer_groups); the
// rows past them go to the dot-product tiles instead, chunk by chunk over the same rows of w
// (in L2 from the group tiles): as a group of its own a short tail cost a whole group's
// products for those few rows (65 rows computed 80). Per product, GFLOP/s, Mixtral's 7168×1024 / the fine-grained 1024×512 (9
// rounds): 33 rows 591 → 696 / 551 → 615, 49 rows 652 → 788 / 569 → 699, 65 rows 722 → 792 /
// 640 → 675, 36 and 68 rows 1.06–1.22×, 44 rows (a tail of 12, a group still) level. A tail of
// up to 12 gained at 9 (57 rows: 753 → 846 / 644 → 744) but lost at 12 (705 → 663 through
// 1024×512): 8 kept. Layer forward (9 rounds) Mixtral T = 256 / 2048 1.028 / 1.015×, fine 1.065
// / 1.015× (T = 64 level: its blocks take the dot tiles whole); forward+backward T = 256 fine
// 1.057×, Mixtral level. Then on the Zen 4 EPYC (2026-12-07, the later tiles; 64 blocks, 5
// rounds, GFLOP/s group → dots, the four benchmark shapes) longer tails gained after 2 and 3
// groups, where a group of its own makes tiles of 2 (2 + 2 for 4 groups) and the tail on the
// dots leaves one tile of 3: 3 groups and a tail of 9–15 (57–63 rows) 328–398 → 377–429 in every
// shape; 2 groups and 9–11 (41–43 rows) 323–384 → 339–405 (43 through 1024×512 level), 12 (44)
// level or behind (1024×512 353 → 346); past 3 groups they lost from 12 (76 rows through
// 1024×512 379 → 375, 95 rows 405 → 392; 73 rows, a tail of 9, gained: 363 → 376). Layer bf16,
// 8 → these (pair ratios, 7–11 rounds): forward Mixtral T = 256 0.978×, fine-grained T = 448
// 0.970×, T = 256 level; forward+backward Mixtral T = 256 0.988×. Likewise 4 groups and a tail
// of up to 8 (64–72 rows, tiles of 2 + 2) go as 3 groups (one tile of 3) and 16–24 rows on the
// dots: 371–411 → 385–431 GFLOP/s in every shape (64 rows 1.02–1.06×); layer bf16 forward
// Mixtral T = 256 0.985×, fine-grained T = 512 0.982×, forward+backward Mixtral T = 256 0.991×.
constexpr int64_t kDotTail = 8;
inline int64_t outer_groups(int64_t rows) {
  const int64_t full = rows / kGroupRows, tail = rows % kGroupRows;
  if (full == 4 && tail <= kDotTail) return 3;  // (16 + tail rows on the dots)
  const int64_t most = full == 2 ? 11 : full == 3 ? kGroupRows - 1 : kDotTail;  // (a tail on the dots)
  return full >= 2 && tail > 0 && tail <= most ? full : (rows + kGroupRows - 1) / kGroupRows;
}

// A block's rows of x as the outer products read them (packed groups, and a short tail's rows
// for the dot-product tiles), made once per block by pack_block.
struct PackedRows {
  const uint32_t* packed = nullptr;
  int64_t pairs = 0, groups = 0;
  int64_t tail = 0;              // rows after the groups, on the dot tiles (0: none)
  const bf16_t* tail_x = nullptr;  // their x, rows tail_ldx apart
  int64_t tail_ldx = 0;
};

// p's rows packed into the thread's scratch, with `extra_bytes` of it left after them (64-byte
// aligned, at *extra where asked); false where the scratch could not be had.
bool pack_block(const LinearBf16& p, PackedRows* out, size_t extra_bytes = 0, void** extra = nullptr) {
  const int64_t groups = outer_groups(p.rows), tail = std::max<int64_t>(0, p.rows - groups * kGroupRows);
  const int64_t pairs = p.in_features / 2;
  const int64_t packed_words = pairs * kGroupRows * groups;  // (then the tail's gathered rows, where p.index is)
  const int64_t tail_words = p.index ? (tail * p.in_features + 1) / 2 : 0;
  const size_t packed_bytes = (sizeof(uint32_t) * (packed_words + tail_words) + 63) / 64 * 64;
  auto* packed = static_cast<uint32_t*>(moe_ffn_team::thread_scratch(packed_bytes + extra_bytes));
  if (packed == nullptr) return false;
  for (int64_t g = 0; g < groups; ++g)
    pack_rows(p, g * kGroupRows, std::min(kGroupRows, p.rows - g * kGroupRows), packed + g * pairs * kGroupRows);
  // the tail's rows, for the dot-product tiles
  const LinearBf16 rest =
      rows_of(p, std::min(p.rows, groups * kGroupRows), tail, reinterpret_cast<bf16_t*>(packed + packed_words));
  *out = PackedRows{packed, pairs, groups, tail, rest.x, rest.ldx};
  if (extra) *extra = reinterpret_cast<char*>(packed) + packed_bytes;
  return true;
}

// w's rows [o0, o1) for every row of the block (`rows` of p's x, p's w and y): every row tile
// over them, the tail on the dot tiles; `end` and `after` as in outer_tiles.
void outer_chunk(const PackedRows& rows, const LinearBf16& p, int64_t o0, int64_t o1, int64_t end,
                 const bf16_t* after = nullptr) {
  const int64_t groups = rows.groups;
  const int64_t twos = (3 - groups % 3) % 3;  // tiles of 2 groups after those of 3: 0, 2 or 1
  int64_t g = 0;
  for (; g < groups - 2 * twos; g += 3) outer_tiles<3>(rows.packed, rows.pairs, p, o0, o1, g, end, after);
  for (; g < groups; g += 2) outer_tiles<2>(rows.packed, rows.pairs, p, o0, o1, g, end, after);
  if (rows.tail > 0) {
    LinearBf16 rest = p;
    rest.x = rows.tail_x;
    rest.ldx = rows.tail_ldx;
    rest.index = nullptr;
    rest.rows = rows.tail;
    rest.y = p.y + groups * kGroupRows * p.ldy;
    dot_range(rest, o0, o1);
  }
}

bool outer_range(const LinearBf16& p, int64_t first, int64_t last) {
  PackedRows rows;
  if (!pack_block(p, &rows)) return false;
  for (int64_t o0 = first; o0 < last; o0 += kChunkCols) outer_chunk(rows, p, o0, std::min(last, o0 + kChunkCols), last);
  return true;
}

// Blocks of up to kDotMaxRows rows take the dot-product tiles, larger ones (with an even I) the
// outer products. 16 until the dot tiles shared the next strip's prefetches (dot_strip); then,
// on the Zen 4 EPYC (2026-12-06, per product, weights out of the caches, 6 rounds, GFLOP/s on
// the four benchmark shapes) the dot tiles beat the outer products at 17 rows 1.15-1.50x, 20
// rows 1.18-1.51x, 24 rows 1.03-1.28x, and were mixed at 28 (0.86-1.22x) and behind at 32-40
// (0.85-1.04x). Layer bf16 forward, against 16 (same process, 7 rounds): Mixtral T = 64 0.79x,
// fine-grained T = 128 0.89x, T = 256 level. 24 until, after the outer products' later changes
// (whole blocks claimed, their tiles' L2 prefetch), the Zen 4 EPYC (2026-12-07, per product,
// 64 blocks alternated in one process, 5 rounds, GFLOP/s outer → dots) had the dot tiles ahead
// from 25 to 29 rows in all four benchmark shapes: 1024×1024 (8 weights, in L3) 311–363 →
// 389–400, 1024×512 (64 weights, from memory) 291–337 → 331–339, 7168×1024 314–364 → 382–395,
// 1024×3584 317–368 → 393–413 (a block of 25–31 rows computes 32 on the outer products); at 30
// and 31 rows 1024×512 fell behind (348 / 357 → 336), the others still gained (1.00–1.05x).
// Layer bf16 forward, 24 → 29 (pair ratios, 9–15 rounds): fine-grained T = 192 0.952x, T = 256
// 0.970x, Mixtral T = 128 0.972x; forward+backward fine-grained T = 256 0.990x; 29 → 31 level.
// Not measured on Zen 5 or Intel's CPUs.
constexpr int64_t kDotMaxRows = 29;
static_assert(kDotMaxRows >= kGroupRows, "the outer products take blocks of two groups or more");

// Whether the block goes to the dot-product tiles (the outer products need an even I).
inline bool on_dot_tiles(const LinearBf16& p) { return p.rows <= kDotMaxRows || p.in_features % 2; }

// ---- bf16 input gradients y = g·w of blocks past a few rows ----------------------------------
//
// The sum runs over w's rows, so w is the operand that goes in pairs: kGradDepth rows of w over
// the thread's columns at a time are interleaved two rows by two (pairs (w[o, c], w[o + 1, c])
// in column order: unpacklo/hi, then put in order) into the thread's scratch, in panels of
// kGradPanel columns, 32 KiB each, which stay in L1 while every row tile of g passes over them: 6 rows of g by the
// panel's 64 columns (24 accumulators), each of g's pairs (g[r, o], g[r, o + 1]) one broadcast
// straight from g's row. The partial sums of a row tile are carried from depth chunk to depth
// chunk in a float32 buffer (the thread's scratch too) and rounded to bf16 once, after the
// last. w is read once; g's rows once per panel.
constexpr int64_t kGradPanel = 64;
constexpr int64_t kGradDepth = 256;  // rows of w per chunk (even)
// Blocks of at most kShallowRows rows whose chunk of w would pack more than kShallowBytes per
// thread take chunks of half the depth: few rows spend little time on each panel, and the packing
// of a panel past L2's size runs ahead of it. Only Mixtral's down projection (a thread's 1792
// columns: 917 KiB a chunk) among the benchmark's shapes; per product, GFLOP/s: 8 rows 170 →
// 204, 16 rows 309 → 352, 32 rows 502 → 518 (64 rows level, 128 rows 753 → 738 with rows to 128:
// hence 32). Layer forward+backward, Mixtral (9 rounds) T = 16 / 32 / 64 / 128 1.009 / 1.012 /
// 1.019 / 1.010×.
constexpr int64_t kShallowRows = 32;
constexpr int64_t kShallowBytes = 512 << 10;
constexpr int64_t kPackAhead = 8;    // pairs of w's rows prefetched ahead while packing

// The operands as MatmulOf's: a = g [rows, O] (m = rows), b = w [O, I] (k = O, even), c = y.
using InputGradBf16 = MatmulOf<bf16_t, bf16_t, bf16_t>;

// src's rows [r0, r0 + depth) by columns [first, last) as pairs of rows (an odd depth's last row
// paired with zeros), in panels of `width` columns (a multiple of 32; the last panel's columns
// past `last` zero) `panel_words` apart: panel i holds [p·width + c] = (src[r0 + 2p, q + c],
// src[r0 + 2p + 1, q + c]) for q = first + i·width. Each row is read across the whole range at
// once (a panel at a time read 128 bytes of each row, 2 KiB apart, and spent more time than the
// products: perf, 32-row blocks), the rows kPackAhead pairs on prefetched (src comes from memory)
// into L2 (see RowLines).
// With `index`, src's row r is its row index[r] (the tokens' rows, gathered as they are packed).
void pack_pairs(const bf16_t* src, int64_t ld, int64_t r0, int64_t depth, int64_t first, int64_t last, int64_t width,
                int64_t panel_words, uint32_t* panels, const int64_t* index = nullptr) {
  const __m512i lower = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i upper = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t pairs = (depth + 1) / 2, end = first + (last - first + width - 1) / width * width;
  auto row = [&](int64_t r) { return src + (index ? index[r] : r) * ld; };
  for (int64_t pr = 0; pr < pairs; ++pr) {
    const bool has_odd = 2 * pr + 1 < depth;
    const bf16_t* even = row(r0 + 2 * pr);
    const bf16_t* odd = has_odd ? row(r0 + 2 * pr + 1) : even;
    if (2 * (pr + kPackAhead) + 1 < depth) {
      const bf16_t* even_ahead = row(r0 + 2 * (pr + kPackAhead));
      const bf16_t* odd_ahead = row(r0 + 2 * (pr + kPackAhead) + 1);
      for (int64_t q = first; q < last; q += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(even_ahead + q), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(odd_ahead + q), _MM_HINT_T1);
      }
    }
    for (int64_t q = first; q < end; q += 32) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, last - q));
      const __mmask32 lanes = static_cast<__mmask32>(n == 32 ? ~uint64_t{0} : (uint64_t{1} << n) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(lanes, even + q);
      const __m512i b = has_odd ? _mm512_maskz_loadu_epi16(lanes, odd + q) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      uint32_t* out = panels + (q - first) / width * panel_words + pr * width + (q - first) % width;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi32(lo, lower, hi));
      _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi32(lo, upper, hi));
    }
  }
}

// 32 float32 values (lo, then hi) rounded to bf16 as to_bf16 rounds them, stored at `at`. The
// instruction (vcvtne2ps2bf16, one for 32 values where to_bf16 takes seven steps for 16) rounds
// to nearest even as to_bf16 does, except that it quiets a NaN keeping its sign and payload
// (torch's rounding: 0x7FC0) and flushes subnormals to zero (torch keeps them): where any lane
// is either, to_bf16 takes all 32. (The sums of vdpbf16ps are never subnormal, it flushes them
// itself, so in the packed weight gradient the fallback is NaN's. Per product, 8 or 64 weights
// of the benchmark's shapes (9 rounds), GFLOP/s to_bf16 → this: 16 rows 267–483 → 390–595,
// 32 rows 588–664 → 668–760, 64 rows 676–780 → 718–846, 128 rows 802–830 → 825–868.)
constexpr int kNanOrSubnormal = 0x01 | 0x80 | 0x20;  // vfpclassps: quiet NaN, signalling NaN, subnormal
template <bool STREAM>
inline void store32(bf16_t* at, __m512 lo, __m512 hi) {
  __m512i bits;
  if (_mm512_fpclass_ps_mask(lo, kNanOrSubnormal) | _mm512_fpclass_ps_mask(hi, kNanOrSubnormal))
    bits = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
  else
    bits = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  if (STREAM) _mm512_stream_si512(reinterpret_cast<__m512i*>(at), bits);
  else _mm512_storeu_si512(at, bits);
}

// A tile's float32 sums [rows][kGradPanel] (from memory) rounded into c's rows (ldc apart) and
// first `cols` columns: whole lines 32 at a time (store32), part lines 16 at a time (store16).
// Out of line, for a tile's rarer cases (a NaN among its sums, the last part-full panel; see
// store_tile).
template <bool STREAM>
__attribute__((noinline)) void tile_stores(const float* sums, int rows, bf16_t* c, int64_t ldc, int64_t cols) {
  for (int i = 0; i < rows; ++i) {
    const float* row = sums + i * kGradPanel;
    if (cols == kGradPanel) {
      MOE_UNROLL for (int j = 0; j < 4; j += 2)
        store32<STREAM>(c + i * ldc + 16 * j, _mm512_load_ps(row + 16 * j), _mm512_load_ps(row + 16 * j + 16));
      continue;
    }
    MOE_UNROLL for (int j = 0; j < 4; ++j) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * j));
      if (n == 16) store16<STREAM>(c + i * ldc + 16 * j, _mm512_load_ps(row + 16 * j));
      else if (n > 0) store16(c + i * ldc + 16 * j, _mm512_load_ps(row + 16 * j), static_cast<__mmask16>((1u << n) - 1));
    }
  }
}

// A register tile of ROWS rows × kGradPanel float32 sums rounded to bf16 into c (rows ldc apart,
// its first `cols` columns; STREAM: whole lines past the caches): a whole panel without a NaN or
// subnormal among the sums 32 sums an instruction, anything else out of line (tile_stores), the
// same bits either way. Why out of line: with store32's and store16's fallbacks inlined in the
// tiles, GCC 12 kept their accumulators in a stack array, zeroed before every tile and spilled
// after it (62 stack accesses in wgrad_tile<6>, ~12 % of its samples at Mixtral's 64-row
// blocks, where a tile runs 32 pair steps; grad_tile<6> likewise). On the Zen 4 EPYC
// (2026-12-07), the two builds alternated in one process (9 rounds of 3 layers, pair ratios'
// median), layer bf16 forward+backward with the weight gradients' tiles changed: Mixtral T =
// 256 0.970×, fine-grained T = 256 0.931×; with the input gradients' (grad_tile) too, against
// the same start: 0.950× / 0.917×.
// FINITE: the caller knows every sum finite (finite_sums), so none is NaN (nor subnormal: the
// products' instruction flushes those), and the whole panel goes by the instruction unchecked.
template <int ROWS, bool STREAM, bool FINITE = false>
inline void store_tile(const __m512 (&acc)[ROWS][4], bf16_t* c, int64_t ldc, int64_t cols) {
  if (cols == kGradPanel) {
    __mmask16 odd = 0;
    if (!FINITE)
      MOE_UNROLL for (int i = 0; i < ROWS; ++i)
        MOE_UNROLL for (int j = 0; j < 4; ++j) odd |= _mm512_fpclass_ps_mask(acc[i][j], kNanOrSubnormal);
    if (odd == 0) {
      MOE_UNROLL for (int i = 0; i < ROWS; ++i)
        MOE_UNROLL for (int j = 0; j < 4; j += 2) {
          const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(acc[i][j + 1], acc[i][j]);
          if (STREAM) _mm512_stream_si512(reinterpret_cast<__m512i*>(c + i * ldc + 16 * j), bits);
          else _mm512_storeu_si512(c + i * ldc + 16 * j, bits);
        }
      return;
    }
  }
  alignas(64) float sums[ROWS][kGradPanel];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j) _mm512_store_ps(sums[i] + 16 * j, acc[i][j]);
  tile_stores<STREAM>(&sums[0][0], ROWS, c, ldc, cols);
}


// ROWS rows of g from r over one chunk [o0, o0 + depth) of the panel; `sums` [rows][kGradPanel]
// float32 carried between chunks (FIRST: not read; LAST: the results rounded into y's columns
// [q, q + cols) instead of written back).
template <int ROWS, bool FIRST, bool LAST>
void grad_tile(const InputGradBf16& p, const uint32_t* panel, int64_t r, int64_t o0, int64_t depth, int64_t q,
               int64_t cols, float* sums, RowLines& ahead) {
  __m512 acc[ROWS][4];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j)
      acc[i][j] = FIRST ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r + i) * kGradPanel + 16 * j);
  const bf16_t* g = p.a + r * p.lda + o0;
  for (int64_t pr = 0; pr < depth / 2; ++pr) {
    ahead.step();
    __m512bh w_p[4];
    MOE_UNROLL for (int j = 0; j < 4; ++j) w_p[j] = (__m512bh)_mm512_loadu_si512(panel + pr * kGradPanel + 16 * j);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      uint32_t pair;
      __builtin_memcpy(&pair, g + i * p.lda + 2 * pr, 4);
      const __m512bh g_i = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], g_i, w_p[j]);
    }
  }
  if constexpr (LAST) {
    store_tile<ROWS, false>(acc, p.c + r * p.ldc + q, p.ldc, cols);
  } else {
    MOE_UNROLL for (int i = 0; i < ROWS; ++i)
      MOE_UNROLL for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + (r + i) * kGradPanel + 16 * j, acc[i][j]);
  }
}

template <bool FIRST, bool LAST>
void grad_rows(const InputGradBf16& p, const uint32_t* panel, int64_t o0, int64_t depth, int64_t q, int64_t cols,
               float* sums, RowLines& ahead) {
  int64_t r = 0;
  for (; r + 6 <= p.m; r += 6) grad_tile<6, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead);
  switch (p.m - r) {
    case 5: grad_tile<5, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead); break;
    case 4: grad_tile<4, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead); break;
    case 3: grad_tile<3, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead); break;
    case 2: grad_tile<2, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead); break;
    case 1: grad_tile<1, FIRST, LAST>(p, panel, r, o0, depth, q, cols, sums, ahead); break;
    default: break;
  }
}

// The next chunk's rows of w (or the next block's first chunk), one line per pair step of the tiles
// (RowLines), come in while this chunk's products run, where they came in only as the next chunk
// was packed (per product, one call for all experts: 16 rows 249–327 → 268–431 GFLOP/s, 32 rows
// 380–467 → 468–607, 64 rows 501–635 → 584–751; Zen 5 EPYC, into L1). Both these and pack_pairs'
// prefetch into L2: on the Zen 4 EPYC (2026-12-06), layer bf16 forward+backward with the weights
// out of the caches (three layers in turn, 11 rounds, same bits), T = 16 Mixtral 0.83×, fine 0.86×
// against prefetches into L1 (T = 256 1.00 / 0.92×, T = 1 level: its 1-row blocks take the widening
// kernel); the L1 prefetches' misses held the fill buffers the packing's own loads need. Not
// re-measured on Zen 5.

// Blocks of at most kDirectRows rows read w where it lies instead: the products of so few rows
// of g take less time than packing w's pairs did. A tile of all the block's rows by 64 columns
// walks down a chunk of kGradDepth rows of w, forming each pair of rows' pairs in registers
// (unpacklo/hi: columns 0-3, 8-11, ... and 4-7, 12-15, ... of each 32, put in order only when
// rounded), the sums carried from chunk to chunk in float32 as grad_tile carries them: the same
// pair products in the same order, the same bits. Each step prefetches the rows kDirectAhead
// pairs on into L2, running on into the next strip's (or chunk's, or next block's) first rows.
// On the Zen 4 EPYC (2026-12-06), per product with the weights out of the caches (the four
// benchmark shapes, 5-7 rounds, same bits), against the packed panels: 2 rows 1.23-1.63x, 3
// rows 1.31-1.35x, 4 rows 1.22-1.57x, 5 rows 1.26-1.40x, 6 rows 1.24-1.36x (2-6 rows: 24-27
// GB/s of weight, where the packing read 12-18). 8 pairs ahead ran 0.73-0.93x of 16, 32 pairs
// 1.00-1.14x of 16, 48-96 level with 32. Blocks of 7-12 rows as two tiles per strip (the
// second re-reading it), chunks of 64-256 rows: 8 rows 0.92-1.16x, 10-12 rows 0.74-0.90x the
// packed panels, hence 6. Layer bf16 forward+backward T = 16 (blocks of 1-8 rows; 9 rounds,
// same bits, two runs): Mixtral 0.92x, fine-grained 0.92-0.94x. Not measured on Zen 5.
constexpr int64_t kDirectRows = 6;
constexpr int64_t kDirectAhead = 32;

// Where a strip's prefetches run on to past its last row, for kernels that walk w [k, ...] in
// strips of 64 columns within chunks of `chunk` rows: the next strip's rows of this chunk, the
// next chunk's first strip, or the next block's weight (next_w; nothing after the last block),
// and how many rows of it.
template <typename T>
struct RunOn {
  const T* at;
  int64_t rows;
};
template <typename T>
inline RunOn<T> run_on(const T* w, int64_t ldw, int64_t k, int64_t o0, int64_t depth, int64_t chunk, int64_t q,
                       int64_t first, bool last_strip, const T* next_w) {
  if (!last_strip) return {w + o0 * ldw + q + 64, depth};
  if (o0 + depth < k) return {w + (o0 + depth) * ldw + first, std::min(chunk, k - o0 - depth)};
  if (next_w != nullptr) return {next_w + first, std::min(chunk, k)};
  return {nullptr, 0};
}

// few_gradients_tile without the weight gradient (WG false) is the direct tile; with it, see
// "input and weight gradients of blocks of 2-6 rows" below.
template <int ROWS, bool FIRST, bool LAST, bool STREAM, bool WG>
void few_gradients_tile(const InputGradBf16& p, const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, bf16_t* c,
                        int64_t ldc, int64_t o0, int64_t depth, int64_t q, int64_t cols, float* sums,
                        const bf16_t* after, int64_t after_pairs) {
  constexpr int kPairs = (ROWS + 1) / 2;
  const int64_t n0 = std::min<int64_t>(32, cols), n1 = std::max<int64_t>(0, std::min<int64_t>(32, cols - 32));
  const __mmask32 m0 = static_cast<__mmask32>(n0 == 32 ? ~uint64_t{0} : (uint64_t{1} << n0) - 1);
  const __mmask32 m1 = static_cast<__mmask32>(n1 == 32 ? ~uint64_t{0} : (uint64_t{1} << n1) - 1);
  // b's rows widened (ROWS < 4) or their pairs (ROWS ≥ 4, kPairs × 64 words, as pack_pairs
  // lays out one panel for the weight gradient's packed kernel)
  alignas(64) float b_part[WG ? ROWS * 64 : 1];
  if constexpr (WG) {
    if constexpr (ROWS < 4) {
      MOE_UNROLL for (int s = 0; s < ROWS; ++s)
        MOE_UNROLL for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_maskz_loadu_epi16(h ? m1 : m0, b + s * ldb + q + 32 * h);
          _mm512_store_ps(b_part + s * 64 + 32 * h, widen16(_mm512_castsi512_si256(v)));
          _mm512_store_ps(b_part + s * 64 + 32 * h + 16, widen16(_mm512_extracti64x4_epi64(v, 1)));
        }
    } else {
      pack_pairs(b, ldb, 0, ROWS, q, q + cols, 64, 0, reinterpret_cast<uint32_t*>(b_part));
    }
  }
  __m512 acc[ROWS][4];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j)
      acc[i][j] = FIRST ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * 64 + 16 * j);
  const int lines = cols > 32 ? 2 : 1;
  const bf16_t* g = p.a + o0;
  const bf16_t* a_o = WG ? a + o0 : nullptr;  // (the weight gradient's a: g, or other rows)
  const int64_t pairs = depth / 2, ld2 = 2 * p.ldb;
  const bf16_t* even = p.b + o0 * p.ldb + q;
  bf16_t* c_row = WG ? c + o0 * ldc + q : nullptr;
  for (int64_t pr = 0; pr < pairs; ++pr, even += ld2) {
    const int64_t s = pr + kDirectAhead;
    const bf16_t* ahead = s < pairs                ? even + kDirectAhead * ld2
                          : s - pairs < after_pairs ? after + (s - pairs) * ld2
                                                    : nullptr;
    if (ahead != nullptr)
      for (int l = 0; l < lines; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * l), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + p.ldb + 32 * l), _MM_HINT_T1);
      }
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, even), b0 = _mm512_maskz_loadu_epi16(m0, even + p.ldb);
    const __m512i a1 = _mm512_maskz_loadu_epi16(m1, even + 32), b1 = _mm512_maskz_loadu_epi16(m1, even + p.ldb + 32);
    const __m512bh w_p[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                             (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      uint32_t pair;
      __builtin_memcpy(&pair, g + i * p.lda + 2 * pr, 4);
      const __m512bh g_i = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], g_i, w_p[j]);
    }
    // c's rows o0 + 2pr and o0 + 2pr + 1 over the strip
    if constexpr (WG) for (int t = 0; t < 2; ++t, c_row += ldc) {
      const int64_t o = 2 * pr + t;  // (within the chunk: a's column o0 + o)
      __m512 v[4];
      if constexpr (ROWS < 4) {
        MOE_UNROLL for (int j = 0; j < 4; ++j) v[j] = _mm512_setzero_ps();
        MOE_UNROLL for (int r = 0; r < ROWS; ++r) {
          const __m512 a_r = _mm512_set1_ps(widen(a_o[r * lda + o]));
          MOE_UNROLL for (int j = 0; j < 4; ++j)
            v[j] = _mm512_fmadd_ps(a_r, _mm512_load_ps(b_part + r * 64 + 16 * j), v[j]);
        }
      } else {
        MOE_UNROLL for (int j = 0; j < 4; ++j) v[j] = _mm512_setzero_ps();
        MOE_UNROLL for (int pp = 0; pp < kPairs; ++pp) {
          uint32_t pair = a_o[2 * pp * lda + o];
          if (2 * pp + 1 < ROWS) pair |= static_cast<uint32_t>(a_o[(2 * pp + 1) * lda + o]) << 16;
          const __m512bh a_pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          const auto* b_pairs = reinterpret_cast<const uint32_t*>(b_part) + pp * 64;
          MOE_UNROLL for (int j = 0; j < 4; ++j)
            v[j] = _mm512_dpbf16_ps(v[j], a_pp, (__m512bh)_mm512_load_si512(b_pairs + 16 * j));
        }
      }
      if (cols == 64) {
        store32<STREAM>(c_row, v[0], v[1]);
        store32<STREAM>(c_row + 32, v[2], v[3]);
      } else {
        MOE_UNROLL for (int j = 0; j < 4; ++j) {
          const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * j));
          if (n == 16) store16<false>(c_row + 16 * j, v[j]);
          else if (n > 0) store16(c_row + 16 * j, v[j], static_cast<__mmask16>((1u << n) - 1));
        }
      }
    }
  }
  if (!LAST) {
    MOE_UNROLL for (int i = 0; i < ROWS; ++i)
      MOE_UNROLL for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + i * 64 + 16 * j, acc[i][j]);
    return;
  }
  const __m512i lower = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i upper = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
    bf16_t* y = p.c + i * p.ldc + q;
    MOE_UNROLL for (int h = 0; h < 2; ++h) {
      const __m512 ordered[2] = {_mm512_permutex2var_ps(acc[i][2 * h], lower, acc[i][2 * h + 1]),
                                 _mm512_permutex2var_ps(acc[i][2 * h], upper, acc[i][2 * h + 1])};
      MOE_UNROLL for (int j = 0; j < 2; ++j) {
        const int64_t c0 = 32 * h + 16 * j, n = std::max<int64_t>(0, std::min<int64_t>(16, cols - c0));
        if (n == 16) store16<false>(y + c0, ordered[j]);
        else if (n > 0) store16(y + c0, ordered[j], static_cast<__mmask16>((1u << n) - 1));
      }
    }
  }
}

template <int ROWS, bool STREAM, bool WG>
bool few_gradients_rows(const InputGradBf16& p, const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, bf16_t* c,
                        int64_t ldc, int64_t first, int64_t last, const bf16_t* next_w) {
  const int64_t strips = (last - first + 63) / 64;
  auto* sums = static_cast<float*>(moe_ffn_team::thread_scratch(sizeof(float) * ROWS * 64 * strips));
  if (sums == nullptr) return false;
  for (int64_t o0 = 0; o0 < p.k; o0 += kGradDepth) {
    const int64_t depth = std::min(kGradDepth, p.k - o0);
    const bool first_chunk = o0 == 0, last_chunk = o0 + depth == p.k;
    for (int64_t i = 0; i < strips; ++i) {
      const int64_t q = first + 64 * i, cols = std::min<int64_t>(64, last - q);
      const RunOn<bf16_t> on = run_on(p.b, p.ldb, p.k, o0, depth, kGradDepth, q, first, i + 1 == strips, next_w);
      const bf16_t* after = on.at;
      const int64_t after_pairs = on.rows / 2;
      float* strip_sums = sums + i * ROWS * 64;
      if (first_chunk && last_chunk)
        few_gradients_tile<ROWS, true, true, STREAM, WG>(p, a, lda, b, ldb, c, ldc, o0, depth, q, cols, strip_sums, after,
                                                 after_pairs);
      else if (first_chunk)
        few_gradients_tile<ROWS, true, false, STREAM, WG>(p, a, lda, b, ldb, c, ldc, o0, depth, q, cols, strip_sums, after,
                                                 after_pairs);
      else if (last_chunk)
        few_gradients_tile<ROWS, false, true, STREAM, WG>(p, a, lda, b, ldb, c, ldc, o0, depth, q, cols, strip_sums, after,
                                                 after_pairs);
      else
        few_gradients_tile<ROWS, false, false, STREAM, WG>(p, a, lda, b, ldb, c, ldc, o0, depth, q, cols, strip_sums, after,
                                                 after_pairs);
    }
  }
  if (STREAM && WG) _mm_sfence();
  return true;
}


// y's columns [first, last) of a block of at most kDirectRows rows; false where the scratch
// could not be had.
bool direct_range(const InputGradBf16& p, int64_t first, int64_t last, const bf16_t* next_w) {
  static_assert(kDirectRows == 6, "one register tile of all the block's rows");
  switch (p.m) {
    case 6: return few_gradients_rows<6, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    case 5: return few_gradients_rows<5, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    case 4: return few_gradients_rows<4, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    case 3: return few_gradients_rows<3, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    case 2: return few_gradients_rows<2, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    case 1: return few_gradients_rows<1, false, false>(p, nullptr, 0, nullptr, 0, nullptr, 0, first, last, next_w);
    default: return false;
  }
}

// y's columns [first, last); false where the scratch could not be had.
bool grad_range(const InputGradBf16& p, int64_t first, int64_t last, const bf16_t* next_w) {
  if (p.m <= kDirectRows) return direct_range(p, first, last, next_w);
  const bool shallow = p.m <= kShallowRows && (last - first) * kGradDepth * 2 > kShallowBytes;
  const int64_t chunk = shallow ? kGradDepth / 2 : kGradDepth;
  const int64_t panel_words = chunk / 2 * kGradPanel, panels = (last - first + kGradPanel - 1) / kGradPanel;
  auto* scratch = static_cast<uint32_t*>(moe_ffn_team::thread_scratch(
      sizeof(uint32_t) * panel_words * panels + sizeof(float) * p.m * kGradPanel * panels));
  if (scratch == nullptr) return false;
  float* sums = reinterpret_cast<float*>(scratch + panel_words * panels);  // [panel][rows][kGradPanel]
  for (int64_t o0 = 0; o0 < p.k; o0 += chunk) {
    const int64_t depth = std::min(chunk, p.k - o0);
    const bool first_chunk = o0 == 0, last_chunk = o0 + depth == p.k;
    pack_pairs(p.b, p.ldb, o0, depth, first, last, kGradPanel, panel_words, scratch);
    RowLines ahead;  // the next chunk's rows (the next block's first), while this one's products run
    const bf16_t* next = last_chunk ? next_w : p.b + (o0 + depth) * p.ldb;
    if (next != nullptr) {
      ahead.at = reinterpret_cast<const char*>(next + first);
      ahead.ld = p.ldb * static_cast<int64_t>(sizeof(bf16_t));
      ahead.bytes = (last - first) * static_cast<int64_t>(sizeof(bf16_t));
      ahead.rows = std::min(chunk, last_chunk ? p.k : p.k - o0 - depth);
    }
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t q = first + i * kGradPanel, cols = std::min(kGradPanel, last - q);
      const uint32_t* panel = scratch + i * panel_words;
      float* panel_sums = sums + i * p.m * kGradPanel;
      if (first_chunk && last_chunk) grad_rows<true, true>(p, panel, o0, depth, q, cols, panel_sums, ahead);
      else if (first_chunk) grad_rows<true, false>(p, panel, o0, depth, q, cols, panel_sums, ahead);
      else if (last_chunk) grad_rows<false, true>(p, panel, o0, depth, q, cols, panel_sums, ahead);
      else grad_rows<false, false>(p, panel, o0, depth, q, cols, panel_sums, ahead);
    }
  }
  return true;
}

// ---- bf16 weight gradients of a few rows (below BF16_WEIGHT_GRAD_PACKED_FROM_ROWS) -----------
//
// c = aᵀ·b for float32 a [k, m] (the caller widens its few rows once) and bf16 b [k, n] (widened
// as loaded): register tiles of 6 rows of c by 64 columns, a's values broadcast, k products each
// (no pairs: k is 1 to 3), each result rounded to bf16 once as stored. Whole lines of c go 32
// results an instruction (store32), where to_bf16 took seven steps for 16: with a step or two of
// products per result the rounding was most of the work. (These products are plain float32
// FMAs: subnormal results do arise, and store32 rounds them as torch does.)
template <int ROWS, bool STREAM>
void few_tile(const float* a, int64_t lda, const bf16_t* b, int64_t ldb, bf16_t* c, int64_t ldc, int64_t k) {
  __m512 acc[ROWS][4];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k; ++s) {
    __m512 b_s[4];
    MOE_UNROLL for (int j = 0; j < 4; ++j) b_s[j] = load16(b + s * ldb + 16 * j);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512 a_i = _mm512_set1_ps(a[s * lda + i]);
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(a_i, b_s[j], acc[i][j]);
    }
  }
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; j += 2) store32<STREAM>(c + i * ldc + 16 * j, acc[i][j], acc[i][j + 1]);
}

template <bool STREAM>
void few_rows_range(const WeightGradOf<float, bf16_t, bf16_t>& p, int64_t first, int64_t last) {
  const int64_t whole = p.n / 64 * 64;
  for (int64_t r = first; r < last; r += 6) {
    const int64_t rows = std::min<int64_t>(6, last - r);
    for (int64_t q = 0; q < whole; q += 64) {
      const float* a = p.a + r;
      const bf16_t* b = p.b + q;
      bf16_t* c = p.c + r * p.ldc + q;
      switch (rows) {
        case 6: few_tile<6, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
        case 5: few_tile<5, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
        case 4: few_tile<4, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
        case 3: few_tile<3, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
        case 2: few_tile<2, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
        default: few_tile<1, STREAM>(a, p.lda, b, p.ldb, c, p.ldc, p.k); break;
      }
    }
  }
  if (whole < p.n) {  // the last columns (fewer than 64): the float32 kernel's masked tiles
    WeightGradOf<float, bf16_t, bf16_t> rest = p;
    rest.b += whole;
    rest.c += whole;
    rest.n = p.n - whole;
    rows_range<false, false>(rest, first, last);
  }
  if (STREAM) _mm_sfence();
}

// ---- bf16 weight gradients c = aᵀ·b of blocks past a few rows ------------------------------
//
// The sum runs over the block's rows, so both operands go in pairs of rows (pack_pairs): b's
// rows over all of its columns, in panels of kGradPanel columns (each panel's pairs one run),
// and a's over the thread's columns of a (its rows of c), one panel. Register tiles of 6 rows
// of c by a panel's 64 columns (24 accumulators), each of a's pairs one broadcast, each tile's
// whole sum over the rows in its registers (a bf16 c is rounded once), stored once (STREAM:
// past the caches). a's pairs for the thread stay in L1/L2, b's panels in L2 while the thread's
// rows of c pass over them row strip by row strip.
using WeightGradBf16 = WeightGradOf<bf16_t, bf16_t, bf16_t>;

template <int ROWS, bool STREAM, bool FINITE>
void wgrad_tile(const uint32_t* a_pairs, int64_t a_width, const uint32_t* panel, int64_t pairs, bf16_t* c,
                int64_t ldc, int64_t cols) {
  __m512 acc[ROWS][4];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < pairs; ++pr) {
    __m512bh b_p[4];
    MOE_UNROLL for (int j = 0; j < 4; ++j) b_p[j] = (__m512bh)_mm512_loadu_si512(panel + pr * kGradPanel + 16 * j);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512bh a_i = (__m512bh)_mm512_set1_epi32(static_cast<int>(a_pairs[pr * a_width + i]));
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a_i, b_p[j]);
    }
  }
  store_tile<ROWS, STREAM, FINITE>(acc, c, ldc, cols);
}

template <bool STREAM, bool FINITE>
void wgrad_strip(const uint32_t* a_pairs, int64_t a_width, int64_t rows, const uint32_t* panels, int64_t panel_words,
                 int64_t pairs, const WeightGradBf16& p, int64_t r) {
  for (int64_t q = 0; q < p.n; q += kGradPanel) {
    const uint32_t* panel = panels + q / kGradPanel * panel_words;
    bf16_t* c = p.c + r * p.ldc + q;
    const int64_t cols = std::min(kGradPanel, p.n - q);
    switch (rows) {
      case 6: wgrad_tile<6, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      case 5: wgrad_tile<5, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      case 4: wgrad_tile<4, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      case 3: wgrad_tile<3, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      case 2: wgrad_tile<2, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      case 1: wgrad_tile<1, STREAM, FINITE>(a_pairs, a_width, panel, pairs, c, p.ldc, cols); break;
      default: break;
    }
  }
}

// Whether every sum of up to `terms` products of bf16 values among `words` (count 32-bit words,
// two values each: both operands' packed pairs) stays finite: no value NaN or infinite, and
// terms·m² ≤ 2^120 for the largest magnitude m (every partial sum then within 2^121, far below
// float32's 2^128 whatever the rounding). Then no sum of theirs is NaN, and store_tile may skip
// its check: the same bits. One pass over the packed operands, ~0.3 % of a 32-row block's time.
// Zen 4 EPYC (2026-12-07), weight gradients alone (64 experts' blocks in one call, weights
// written past the caches, 11 rounds, GFLOP/s with the check → without): 1024×1024 at 32 rows
// 362 → 399, 1024×512 at 32 rows 343 → 372, 64 rows 382 → 399, Mixtral's 7168×1024 /
// 1024×3584 at 64 rows 384 / 378 → 402 / 395, 256 rows 403 → 415: a 32-row block's tile sums
// 16 pairs, and its 24 checks were a tenth of its vector work. Layer bf16 forward+backward,
// alternated in one process (pair ratios' medians, 3-9 rounds): fine-grained T = 256 0.980×,
// T = 2048 0.990×, Mixtral T = 256 0.975×.
bool finite_sums(const uint32_t* words, int64_t count, int64_t terms) {
  __m512i most = _mm512_setzero_si512();
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    most = _mm512_max_epu16(most, _mm512_and_si512(_mm512_loadu_si512(words + i), magnitude));
  if (i < count)
    most = _mm512_max_epu16(most, _mm512_and_si512(_mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (count - i)) - 1), words + i), magnitude));
  const __m256i half = _mm256_max_epu16(_mm512_castsi512_si256(most), _mm512_extracti64x4_epi64(most, 1));
  __m128i q = _mm_max_epu16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 8));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 4));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 2));
  const uint32_t bits = static_cast<uint32_t>(_mm_extract_epi16(q, 0));
  if (bits >= 0x7F80u) return false;  // an infinity or NaN
  float m;
  const uint32_t wide = bits << 16;
  std::memcpy(&m, &wide, 4);
  return static_cast<double>(m) * m * static_cast<double>(terms) <= 0x1p120;
}

// c's rows [first, last), every column; false where the scratch could not be had.
bool wgrad_range(const WeightGradBf16& p, int64_t first, int64_t last) {
  const int64_t pairs = (p.k + 1) / 2, a_width = (last - first + 31) / 32 * 32;
  const int64_t panel_words = pairs * kGradPanel, panels = (p.n + kGradPanel - 1) / kGradPanel;
  auto* scratch = static_cast<uint32_t*>(moe_ffn_team::thread_scratch(sizeof(uint32_t) * (pairs * a_width + panel_words * panels)));
  if (scratch == nullptr) return false;
  uint32_t* b_panels = scratch + pairs * a_width;
  pack_pairs(p.a, p.lda, 0, p.k, first, last, a_width, 0, scratch);
  pack_pairs(p.b, p.ldb, 0, p.k, 0, p.n, kGradPanel, panel_words, b_panels, p.b_index);
  const bool finite = finite_sums(scratch, pairs * a_width + panel_words * panels, p.k);
  for (int64_t r = first; r < last; r += 6) {
    const int64_t rows = std::min<int64_t>(6, last - r);
    const uint32_t* a_pairs = scratch + (r - first);
    if (p.stream && finite) wgrad_strip<true, true>(a_pairs, a_width, rows, b_panels, panel_words, pairs, p, r);
    else if (p.stream) wgrad_strip<true, false>(a_pairs, a_width, rows, b_panels, panel_words, pairs, p, r);
    else if (finite) wgrad_strip<false, true>(a_pairs, a_width, rows, b_panels, panel_words, pairs, p, r);
    else wgrad_strip<false, false>(a_pairs, a_width, rows, b_panels, panel_words, pairs, p, r);
  }
  return true;
}

// ---- input and weight gradients of blocks of 2-6 rows in one pass (bf16) ---------------------
//
// For a block of m = 2..6 rows through w [O, I]: y = g·w (the input gradient, as the direct
// tiles form it) and c = aᵀ·b (the weight gradient, as few_tile forms it below 4 rows and
// wgrad_tile from 4; a: g, or other rows) over y's columns [first, last), walking down w's rows
// in strips of 64 columns as the direct tiles do (few_gradients_tile with WG, above): each pair
// of w's rows read once, and c's same two rows of the same columns written right after, so that
// the weight's reads and the gradient's (streamed) writes share the memory's time instead of
// taking it in turn (one_row_gradients does this for blocks of one row). The same operations on
// each value as those kernels, in the same order: the same bits. b's rows of the strip are
// widened (m < 4) or paired in column order (m ≥ 4) once per strip and chunk, into `b_part`
// (L1). On the Zen 4 EPYC (2026-12-06), one call for all blocks against the two calls, the
// weights and gradients out of the caches (the four benchmark shapes' w1 and w2, 7 rounds,
// alternated, same bits): 2 rows 0.54-0.63x, 4 rows 0.76-0.80x, 6 rows 0.72-0.84x of the time
// (2 rows: 35 GB/s read and written together, where the input gradient alone read ~26 and the
// weight gradient alone wrote ~21-26).
template <bool STREAM>
bool few_gradients(const InputGradBf16& p, const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, bf16_t* c,
                   int64_t ldc, int64_t first, int64_t last, const bf16_t* next_w) {
  switch (p.m) {
    case 6: return few_gradients_rows<6, STREAM, true>(p, a, lda, b, ldb, c, ldc, first, last, next_w);
    case 5: return few_gradients_rows<5, STREAM, true>(p, a, lda, b, ldb, c, ldc, first, last, next_w);
    case 4: return few_gradients_rows<4, STREAM, true>(p, a, lda, b, ldb, c, ldc, first, last, next_w);
    case 3: return few_gradients_rows<3, STREAM, true>(p, a, lda, b, ldb, c, ldc, first, last, next_w);
    case 2: return few_gradients_rows<2, STREAM, true>(p, a, lda, b, ldb, c, ldc, first, last, next_w);
    default: return false;
  }
}

// float32 blocks of 2-6 rows likewise (AMD's AVX-512 CPUs, where the float32 blocks kernels
// take every block: see one_row_gradients): y = g·w as matmul_range forms it for so few rows
// (one tile reading w in place, the sums over O in passes of kMatmulDepth rows, each pass's
// sums added to y's) and c = aᵀ·b as rows_range's tiles form it (each result's FMAs over the
// block's rows from zero), down w's rows in strips of 64 columns, c's row of the strip written
// right after w's is read; the same bits. Prefetches kPanelAhead rows ahead, running on into the
// next strip's (or pass's, or block's) first rows. Its stores loop to 4 vectors with a test,
// not to the strip's `vecs`: a run-time bound indexing the accumulators kept them in memory (97
// stack accesses in the 4-row tile, 30 now; Zen 4 EPYC, 2026-12-07, builds alternated in one
// process, 15 rounds of 3 layers: layer float32 forward+backward Mixtral T = 16 0.968×, the
// fine-grained shape's T = 16 level).
template <int ROWS, bool STREAM>
void few_gradients_f32_tile(const Matmul& ig, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                            int64_t ldc, int64_t s0, int64_t depth, int64_t q, int64_t cols, const float* after,
                            int64_t after_rows) {
  const int vecs = static_cast<int>((cols + 15) / 16);
  const int64_t tail = cols - 16 * (vecs - 1);  // (1 to 16 columns in the last vector)
  const __mmask16 last = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
  auto lanes = [&](int j) -> __mmask16 { return j + 1 < vecs ? 0xFFFF : (j + 1 == vecs ? last : 0); };
  alignas(64) float b_part[ROWS * 64];
  MOE_UNROLL for (int r = 0; r < ROWS; ++r)
    MOE_UNROLL for (int j = 0; j < 4; ++j)
      _mm512_store_ps(b_part + r * 64 + 16 * j, _mm512_maskz_loadu_ps(lanes(j), b + r * ldb + q + 16 * j));
  __m512 acc[ROWS][4];
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* w = ig.b + s0 * ig.ldb + q;
  float* c_row = c + s0 * ldc + q;
  for (int64_t s = 0; s < depth; ++s, w += ig.ldb, c_row += ldc) {
    const int64_t t = s + kPanelAhead;
    const float* ahead = t < depth                ? w + kPanelAhead * ig.ldb
                         : t - depth < after_rows ? after + (t - depth) * ig.ldb
                                                  : nullptr;
    if (ahead != nullptr)
      for (int l = 0; l < vecs; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * l), _MM_HINT_T1);
    __m512 w_s[4];
    MOE_UNROLL for (int j = 0; j < 4; ++j) w_s[j] = _mm512_maskz_loadu_ps(lanes(j), w + 16 * j);
    MOE_UNROLL for (int i = 0; i < ROWS; ++i) {
      const __m512 g_i = _mm512_set1_ps(ig.a[i * ig.lda + s0 + s]);
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(g_i, w_s[j], acc[i][j]);
    }
    __m512 v[4];
    MOE_UNROLL for (int j = 0; j < 4; ++j) v[j] = _mm512_setzero_ps();
    MOE_UNROLL for (int r = 0; r < ROWS; ++r) {
      const __m512 a_r = _mm512_set1_ps(a[r * lda + s0 + s]);
      MOE_UNROLL for (int j = 0; j < 4; ++j)
        v[j] = _mm512_fmadd_ps(a_r, _mm512_load_ps(b_part + r * 64 + 16 * j), v[j]);
    }
    MOE_UNROLL for (int j = 0; j < 4; ++j) {  // (to 4 with a test, not to vecs: see MOE_UNROLL)
      if (j >= vecs) continue;
      if (j + 1 < vecs || last == 0xFFFF) store16<STREAM>(c_row + 16 * j, v[j]);
      else store16(c_row + 16 * j, v[j], last);
    }
  }
  MOE_UNROLL for (int i = 0; i < ROWS; ++i)
    MOE_UNROLL for (int j = 0; j < 4; ++j) {
      if (j >= vecs) continue;
      float* at = ig.c + i * ig.ldc + q + 16 * j;
      const __mmask16 m = lanes(j);
      __m512 y = acc[i][j];
      if (s0 > 0) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, at));
      _mm512_mask_storeu_ps(at, m, y);
    }
}

template <int ROWS, bool STREAM>
void few_gradients_f32_rows(const Matmul& ig, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                            int64_t ldc, int64_t first, int64_t last, const float* next_w) {
  const int64_t strips = (last - first + 63) / 64;
  for (int64_t s0 = 0; s0 < ig.k; s0 += kMatmulDepth) {
    const int64_t depth = std::min(kMatmulDepth, ig.k - s0);
    for (int64_t i = 0; i < strips; ++i) {
      const int64_t q = first + 64 * i, cols = std::min<int64_t>(64, last - q);
      const RunOn<float> on = run_on(ig.b, ig.ldb, ig.k, s0, depth, kMatmulDepth, q, first, i + 1 == strips, next_w);
      few_gradients_f32_tile<ROWS, STREAM>(ig, a, lda, b, ldb, c, ldc, s0, depth, q, cols, on.at, on.rows);
    }
  }
  if (STREAM) _mm_sfence();
}

template <bool STREAM>
bool few_gradients_f32(const Matmul& ig, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                       int64_t ldc, int64_t first, int64_t last, const float* next_w) {
  switch (ig.m) {
    case 6: few_gradients_f32_rows<6, STREAM>(ig, a, lda, b, ldb, c, ldc, first, last, next_w); return true;
    case 5: few_gradients_f32_rows<5, STREAM>(ig, a, lda, b, ldb, c, ldc, first, last, next_w); return true;
    case 4: few_gradients_f32_rows<4, STREAM>(ig, a, lda, b, ldb, c, ldc, first, last, next_w); return true;
    case 3: few_gradients_f32_rows<3, STREAM>(ig, a, lda, b, ldb, c, ldc, first, last, next_w); return true;
    case 2: few_gradients_f32_rows<2, STREAM>(ig, a, lda, b, ldb, c, ldc, first, last, next_w); return true;
    default: return false;
  }
}

// ---- input and weight gradients of one-row blocks in one pass --------------------------------
//
// For a block of one row through w [O, I]: y = g·w (the input gradient, as whole_sums /
// matmul_range form it) and c = aᵀ·b (the weight gradient, as few_rows_range / run_rows form
// it: c[o, i] = a[o]·b[i], rounded once), both over y's columns [first, last). Each of w's rows
// is read once and c's row of the same columns written right after it, so the weight's reads
// and the gradient's (streamed) writes share the memory's time instead of taking it in turn: on
// the Zen 4 EPYC the bf16 input gradient read w at ~37 GB/s and the weight gradient wrote at
// ~26, one after the other. Panels of 256 columns as one_row_panels (16 accumulators, w's row
// kOneRowAhead steps ahead into L2), b's part of the panel widened once into `b_wide` (L1);
// the columns past the last whole panel as those kernels take them. The same operations on
// each value as those, in the same order: the same bits. T: bf16_t (bf16 w, b, y, c; the
// float32 instantiation uses no AVX512-BF16 instruction) or float.
template <bool STREAM>
inline void store_two(bf16_t* at, __m512 lo, __m512 hi) { store32<STREAM>(at, lo, hi); }
template <bool STREAM>
inline void store_two(float* at, __m512 lo, __m512 hi) {
  store16<STREAM>(at, lo);
  store16<STREAM>(at + 16, hi);
}

template <typename T, bool STREAM>
void one_row_gradients(const MatmulOf<float, T, T>& ig, const float* a, const T* b, T* c, int64_t ldc, int64_t first,
                       int64_t last) {
  alignas(64) float b_wide[256];
  const int64_t O = ig.k;
  int64_t q = first;
  for (; q + 256 <= last; q += 256) {
    MOE_UNROLL for (int j = 0; j < 16; ++j) _mm512_store_ps(b_wide + 16 * j, load16(b + q + 16 * j));
    __m512 acc[16];
    MOE_UNROLL for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    const T* w = ig.b + q;
    T* c_o = c + q;
    for (int64_t o = 0; o < O; ++o, w += ig.ldb, c_o += ldc) {
      if (o + kOneRowAhead < O)
        for (int l = 0; l < 256 * int(sizeof(T)); l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + kOneRowAhead * ig.ldb) + l, _MM_HINT_T1);
      const __m512 g_o = _mm512_set1_ps(ig.a[o]);
      MOE_UNROLL for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(g_o, load16(w + 16 * j), acc[j]);
      const __m512 a_o = _mm512_set1_ps(a[o]);
      MOE_UNROLL for (int j = 0; j < 16; j += 2)
        store_two<STREAM>(c_o + 16 * j, _mm512_fmadd_ps(a_o, _mm512_load_ps(b_wide + 16 * j), _mm512_setzero_ps()),
                          _mm512_fmadd_ps(a_o, _mm512_load_ps(b_wide + 16 * j + 16), _mm512_setzero_ps()));
    }
    MOE_UNROLL for (int j = 0; j < 16; ++j) store16<false>(ig.c + q + 16 * j, acc[j]);
  }
  if (q < last) {
    // (c = aᵀ·b with a [1, O], b [1, last - q]: every row of c over these columns)
    const WeightGradOf<float, T, T> rest{a, O, b + q, 0, c + q, ldc, 1, O, last - q, false, STREAM};
    if constexpr (std::is_same_v<T, float>) {  // (float32 y: its sums over O in passes, as matmul_range takes them)
      matmul_range<true>(ig, 0, 1, q, last);
      rows_range<false, STREAM>(rest, 0, O);
    } else {
      matmul_pass<true, false>(ig, 0, 1, 0, O, q, last);
      few_rows_range<STREAM>(rest, 0, O);
    }
  } else if (STREAM) {
    _mm_sfence();
  }
}

// ---- SwiGLU's first projection with its activation (bf16) -----------------------------------
//
// h = x·w1ᵀ for w1 = gate | up [2F, I] (the gate's F rows first) and a = silu(h[:, :F])·h[:, F:]
// in one pass over w1: the forward's tiles (dot_range, outer_chunk: the same sums, the same
// bits of h) take a chunk of the gate's features and then the same features of up, and the
// activation runs on those columns of h while they are still in L1 (swiglu16: a as
// moe_ffn_amx_swiglu_bf16 rounds it from this h, bit for bit), where a pass of its own read
// all of h back from memory. h is written where the caller keeps it (backward), else to the
// thread's scratch, a chunk's columns at a time. The last tile over the gate's chunk prefetches
// up's first rows, up's last the next chunk's gate rows (outer_tiles' `after`), so the tiles
// stream w as the plain forward's do. Zen 4 EPYC (2026-12-07), layer bf16, with and without
// (grouped._swiglu_forward_kernel) alternated in one process (pair ratios' medians, 4-15
// rounds of 2-3 layers; the same bits): forward fine-grained T = 16 / 64 / 256 / 2048 0.998 /
// 0.996 / 0.984-0.989 / 0.991×, Mixtral T = 64 / 256 / 2048 0.974 / 0.989 / 0.963×;
// forward+backward level (fine T = 256 0.998-1.016×, T = 2048 1.018×, Mixtral T = 256 /
// 2048 1.005 / 1.004×: h is written for the backward either way). The activation itself costs
// what it saves there: ~0.4 ms of 64 experts' 32-row blocks (1024×1024, 11 ms), swiglu16's
// steps or _amx.cpp's GateTable gathers alike (measured both), ~40 cycles a 16-lane step.
constexpr int64_t kSwigluChunk = 48;  // features a chunk (a multiple of 24 / V, V = 2, 3; of 16)

// a's rows [0, rows) and columns [0, n) from the columns of h's gate and up halves at `gate` and
// `up` (rows ldh apart).
void swiglu_rows(const bf16_t* gate, const bf16_t* up, int64_t ldh, bf16_t* a, int64_t lda, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < n; f += 16) {
      const __mmask16 lanes = n - f >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - f)) - 1);
      const __m512 g = widened(_mm256_maskz_loadu_epi16(lanes, gate + r * ldh + f));
      const __m512 u = widened(_mm256_maskz_loadu_epi16(lanes, up + r * ldh + f));
      _mm256_mask_storeu_epi16(a + r * lda + f, lanes, swiglu16(g, u));
    }
}

// Features [first, last) of one block: p's w is the expert's w1 (gate rows from 0, up rows from
// `features`), p's y its rows of h (ldy apart; null: not kept), a [rows, features] (lda apart).
bool swiglu_block(const LinearBf16& p, int64_t features, bf16_t* a, int64_t lda, int64_t first, int64_t last) {
  const bool dots = on_dot_tiles(p);
  // where h is not kept: a chunk's columns of both halves in scratch, rows 2·chunk apart
  const int64_t chunk = dots ? last - first : kSwigluChunk;
  const size_t h_bytes = p.y ? 0 : sizeof(bf16_t) * p.rows * 2 * chunk;
  LinearBf16 q = p;  // the block over one chunk's rows of w (from row 0) into its columns of h
  PackedRows rows;
  void* extra = nullptr;
  if (dots) {
    // (x's rows gathered first where p.index is: the dot tiles read rows at a stride)
    const size_t x_bytes = p.index ? (sizeof(bf16_t) * p.rows * p.in_features + 63) / 64 * 64 : 0;
    char* scratch = static_cast<char*>(moe_ffn_team::thread_scratch(x_bytes + h_bytes));
    if (scratch == nullptr) return false;
    q = rows_of(p, 0, p.rows, reinterpret_cast<bf16_t*>(scratch));
    extra = scratch + x_bytes;
  } else if (!pack_block(p, &rows, h_bytes, &extra)) {
    return false;
  }
  bf16_t* h_chunk = static_cast<bf16_t*>(extra);
  const int64_t ldh = p.y ? p.ldy : 2 * chunk;
  q.ldy = ldh;
  for (int64_t f0 = first; f0 < last; f0 += chunk) {
    const int64_t n = std::min(chunk, last - f0);
    bf16_t* gate = p.y ? p.y + f0 : h_chunk;
    bf16_t* up = p.y ? p.y + features + f0 : h_chunk + chunk;
    const bf16_t* gate_w = p.w + f0 * p.ldw;
    const bf16_t* up_w = p.w + (features + f0) * p.ldw;
    const bf16_t* next_w = f0 + n < last ? p.w + (f0 + n) * p.ldw : nullptr;  // the next chunk's gate rows
    q.w = gate_w;
    q.y = gate;
    if (dots) dot_range(q, 0, n);
    else outer_chunk(rows, q, 0, n, n, up_w);
    q.w = up_w;
    q.y = up;
    if (dots) dot_range(q, 0, n);
    else outer_chunk(rows, q, 0, n, n, next_w);
    swiglu_rows(gate, up, ldh, a + f0, lda, p.rows, n);
  }
  return true;
}

// ---- the router's logits of bf16 tokens past a few (float32 sums of the pair products) -------
//
// logits[t, e] = Σ_d x[t, d]·w[e, d] for bf16 x [tokens, D] and w [E, D] (D even), float32
// out: w packed once as pairs (w[e, 2q], w[e, 2q + 1]) in expert order, E rounded up to 16
// (`pack_router`: [D/2, E16] words, zeros past E), then tiles of ROWS tokens by NE·16 experts,
// each token's pair (x[t, 2q], x[t, 2q + 1]) broadcast straight from its row. vdpbf16ps forms
// both products of a pair exactly and adds them to the running float32 sum (inputs and results
// of subnormal size flushed to zero, as on AMX's tiles, whose `_amx.linear_float32` makes these
// logits on AMX CPUs). In place of a float32 GEMM on a widened copy of x (router.py).
void pack_router(const bf16_t* w, int64_t ldw, int64_t experts, int64_t e16, int64_t pairs, uint32_t* packed) {
  for (int64_t e0 = 0; e0 < e16; e0 += 16)  // 16 experts' 16 pairs at a time, a 16×16 transpose of words
    for (int64_t q0 = 0; q0 < pairs; q0 += 16) {
      const int64_t n = std::min<int64_t>(16, pairs - q0);
      const __mmask16 lanes = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      __m512i v[16];
      for (int64_t e = 0; e < 16; ++e)
        v[e] = e0 + e < experts ? _mm512_maskz_loadu_epi32(lanes, w + (e0 + e) * ldw + 2 * q0) : _mm512_setzero_si512();
      transpose16(v);
      for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(packed + (q0 + j) * e16 + e0, v[j]);
    }
}

// Tokens [0, rows) (rows ≤ ROWS; past them the last token's row is read again, not stored) by
// the packed columns [0, NE·16) from `packed` (rows e16 words apart), `lanes` of the last 16
// stored.
template <int ROWS, int NE>
void router_tile(const bf16_t* x, int64_t ldx, int64_t rows, const uint32_t* packed, int64_t e16, int64_t pairs,
                 float* out, int64_t ldo, __mmask16 last_lanes) {
  __m512 acc[ROWS][NE];
  MOE_UNROLL for (int r = 0; r < ROWS; ++r)
    MOE_UNROLL for (int v = 0; v < NE; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint32_t* xr[ROWS];
  MOE_UNROLL for (int r = 0; r < ROWS; ++r)
    xr[r] = reinterpret_cast<const uint32_t*>(x + std::min<int64_t>(r, rows - 1) * ldx);
  for (int64_t q = 0; q < pairs; ++q) {
    __m512bh w_q[NE];
    MOE_UNROLL for (int v = 0; v < NE; ++v) w_q[v] = (__m512bh)_mm512_loadu_si512(packed + q * e16 + 16 * v);
    MOE_UNROLL for (int r = 0; r < ROWS; ++r) {
      uint32_t pair;
      __builtin_memcpy(&pair, xr[r] + q, 4);
      const __m512bh x_q = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      MOE_UNROLL for (int v = 0; v < NE; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x_q, w_q[v]);
    }
  }
  MOE_UNROLL for (int r = 0; r < ROWS; ++r) {
    if (r >= rows) continue;
    MOE_UNROLL for (int v = 0; v < NE; ++v)
      _mm512_mask_storeu_ps(out + r * ldo + 16 * v, v == NE - 1 ? last_lanes : __mmask16(0xFFFF), acc[r][v]);
  }
}

// Tokens [first, last) by experts [e0, e0 + 16·NE ∧ experts): tiles of 24 / NE tokens.
template <int NE>
void router_rows(const bf16_t* x, int64_t ldx, const uint32_t* packed, int64_t e16, int64_t pairs, float* logits,
                 int64_t ldl, int64_t experts, int64_t e0, int64_t first, int64_t last) {
  constexpr int kRows = NE == 1 ? 16 : 24 / NE;
  const int64_t n = std::min<int64_t>(16, experts - e0 - 16 * (NE - 1));
  const __mmask16 lanes = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  for (int64_t t = first; t < last; t += kRows)
    router_tile<kRows, NE>(x + t * ldx, ldx, std::min<int64_t>(kRows, last - t), packed + e0, e16, pairs,
                           logits + t * ldl + e0, ldl, lanes);
}

}  // namespace

#pragma GCC pop_options

// 1 where the bf16 forward below runs (AVX-512 F/BW/VL and AVX512_BF16, enabled by the OS).
extern "C" int moe_ffn_avx512_bf16_ready() { return bf16_ready() ? 1 : 0; }

// The router's float32 logits [tokens, experts] (rows ldl apart) of bf16 x [tokens, dim] (rows
// ldx apart) and w [experts, dim] (ldw), dim even, on the pair products above: w packed on the
// calling thread, then the team's threads take tokens in turn (a single thread below 2^22
// multiply-adds). Returns 0, or -1 (logits untouched) where the CPU lacks AVX512_BF16, dim is odd
// or the packing's memory could not be had.
extern "C" int moe_ffn_avx512_router_logits_pairs_bf16(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t ldw,
                                                       float* logits, int64_t ldl, int64_t tokens, int64_t experts,
                                                       int64_t dim, int threads, void* parallel, void* thread_num,
                                                       void* num_threads) {
  if (!bf16_ready() || tokens < 0 || experts < 1 || dim < 2 || dim % 2 || threads < 1) return -1;
  const int64_t e16 = (experts + 15) / 16 * 16, pairs = dim / 2;
  auto* packed = static_cast<uint32_t*>(moe_ffn_team::thread_scratch(sizeof(uint32_t) * pairs * e16));
  if (packed == nullptr) return -1;
  pack_router(w, ldw, experts, e16, pairs, packed);
  const int64_t team = tokens * e16 * dim >= (int64_t{1} << 22) ? threads : 1;
  on_team(make_team(parallel, thread_num, num_threads), team, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(tokens, 8, t, parts, &first, &last);
    for (int64_t e0 = 0; e0 < experts; e0 += 64) {
      switch (std::min<int64_t>(4, (experts - e0 + 15) / 16)) {
        case 4: router_rows<4>(x, ldx, packed, e16, pairs, logits, ldl, experts, e0, first, last); break;
        case 3: router_rows<3>(x, ldx, packed, e16, pairs, logits, ldl, experts, e0, first, last); break;
        case 2: router_rows<2>(x, ldx, packed, e16, pairs, logits, ldl, experts, e0, first, last); break;
        default: router_rows<1>(x, ldx, packed, e16, pairs, logits, ldl, experts, e0, first, last);
      }
    }
  });
  return 0;
}

// The blocks' forward products (table and checks as the bf16 entry points above); -1 where the
// CPU lacks AVX512_BF16.
namespace {

// Whether every row n of the blocks (from 0) has index[n] in [0, tokens): the entry points that
// read the tokens' rows by index check this before anything is written.
bool rows_within(const int64_t* blocks, int64_t count, const int64_t* index, int64_t tokens) {
  for (int64_t i = 0; i < count; ++i) {
    if (blocks[4 * i + 1] < 0) return false;
    for (int64_t n = blocks[4 * i + 1]; n < blocks[4 * i + 2]; ++n)
      if (index[n] < 0 || index[n] >= tokens) return false;
  }
  return true;
}

// The bf16 forward's blocks (index: see LinearOf; else x's rows are the blocks' rows).
int linear_blocks_bf16(const bf16_t* x, int64_t ldx, const int64_t* index, const bf16_t* w, int64_t experts,
                       int64_t w_expert, int64_t ldw, bf16_t* y, int64_t ldy, const int64_t* blocks, int64_t count,
                       int64_t out_features, int64_t in_features, int threads, void* parallel, void* thread_num,
                       void* num_threads) {
  if (!bf16_ready() || out_features < 0 || in_features < 1 || threads < 1) return -1;
  return over_blocks(blocks, count, experts, out_features, 6, 24, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const LinearBf16 p{index ? x : x + start * ldx, ldx, w + e * w_expert, ldw, y + start * ldy,
                                          ldy, stop - start, in_features, index ? index + start : nullptr};
                       if (on_dot_tiles(p)) {
                         // (gathered first where p.index is: the dot tiles read rows at a stride)
                         void* rows_at = p.index ? moe_ffn_team::thread_scratch(2 * p.rows * in_features) : nullptr;
                         if (p.index && rows_at == nullptr) return false;
                         dot_range(rows_of(p, 0, p.rows, static_cast<bf16_t*>(rows_at)), first, last);
                         return true;
                       }
                       return outer_range(p, first, last);
                     }, /*whole=*/true);
}

}  // namespace

extern "C" int moe_ffn_avx512_linear_blocks_bf16(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t experts,
                                                 int64_t w_expert, int64_t ldw, bf16_t* y, int64_t ldy,
                                                 const int64_t* blocks, int64_t count, int64_t out_features,
                                                 int64_t in_features, int threads, void* parallel, void* thread_num,
                                                 void* num_threads) {
  return linear_blocks_bf16(x, ldx, nullptr, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features,
                            in_features, threads, parallel, thread_num, num_threads);
}

// The same with the blocks' rows taken from the tokens' rows: row n of the blocks is x's row
// index[n] (x [tokens, I]), gathered as the tiles pack them, where a gather beforehand wrote a
// [rows, I] copy for them to read back. -1 (nothing written) where an index of a block's rows
// lies outside [0, tokens), or as above.
extern "C" int moe_ffn_avx512_linear_rows_bf16(const bf16_t* x, int64_t ldx, int64_t tokens, const int64_t* index,
                                               const bf16_t* w, int64_t experts, int64_t w_expert, int64_t ldw,
                                               bf16_t* y, int64_t ldy, const int64_t* blocks, int64_t count,
                                               int64_t out_features, int64_t in_features, int threads,
                                               void* parallel, void* thread_num, void* num_threads) {
  if (!rows_within(blocks, count, index, tokens)) return -1;
  return linear_blocks_bf16(x, ldx, index, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features,
                            in_features, threads, parallel, thread_num, num_threads);
}

// SwiGLU's first projection with its activation, block by block (swiglu_block):
// h[start:stop] = x[start:stop]·w_eᵀ for w_e = gate | up [2F, I] (w + e·w_expert, rows ldw
// apart; h [rows, 2F], ldh apart, or null: not written) and a[start:stop] = silu(gate)·up
// [rows, F] (lda apart), with x's rows by index where `index` is given (row n of the blocks is
// x's row index[n], x [tokens, I]; null: x's rows are the blocks'). The table as the bf16 entry
// points above; -1 (nothing written) where the CPU lacks AVX512_BF16, an index lies outside
// [0, tokens), or the table does not fit.
extern "C" int moe_ffn_avx512_swiglu_forward_blocks_bf16(const bf16_t* x, int64_t ldx, int64_t tokens,
                                                         const int64_t* index, const bf16_t* w, int64_t experts,
                                                         int64_t w_expert, int64_t ldw, bf16_t* h, int64_t ldh,
                                                         bf16_t* a, int64_t lda, const int64_t* blocks, int64_t count,
                                                         int64_t features, int64_t in_features, int threads,
                                                         void* parallel, void* thread_num, void* num_threads) {
  if (!bf16_ready() || features < 1 || in_features < 1 || threads < 1 || a == nullptr) return -1;
  if (index && !rows_within(blocks, count, index, tokens)) return -1;
  return over_blocks(blocks, count, experts, features, kSwigluChunk, kSwigluChunk, threads, parallel, thread_num,
                     num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const LinearBf16 p{index ? x : x + start * ldx, ldx, w + e * w_expert, ldw,
                                          h ? h + start * ldh : nullptr, ldh, stop - start, in_features,
                                          index ? index + start : nullptr};
                       return swiglu_block(p, features, a + start * lda, lda, first, last);
                     }, /*whole=*/true);
}

extern "C" int moe_ffn_amx_swiglu_bf16(const uint16_t* h, int64_t ldh, uint16_t* a, int64_t lda, int64_t rows,
                                       int64_t features, int threads, void* parallel, void* thread_num,
                                       void* num_threads);
extern "C" int moe_ffn_slot_sum_rows(void* out, int out_bf16, int64_t ldo, int64_t out_rows, const int64_t* token,
                                     const void* src, int src_bf16, int64_t lds, const float* weight, int64_t rows,
                                     int64_t cols, int64_t* index, int threads, void* parallel, void* thread_num,
                                     void* num_threads);

// A routed SwiGLU layer's bf16 forward over decode-sized blocks in one call, on the bf16 dot
// products above: the rows x[token[n]] gathered into xg [rows, dim], h = xg·w1_eᵀ ([rows, 2F],
// gate | up; moe_ffn_avx512_linear_blocks_bf16), a = silu(gate)·up ([rows, F];
// moe_ffn_amx_swiglu_bf16, AVX-512 only), y = a·w2_eᵀ ([rows, dim]), and each token's bf16 row
// of out [tokens, dim] = Σ weight[n]·y[n] over its rows rounded once (moe_ffn_slot_sum_rows:
// every row written, zeros for a token without rows; `index` its int64 workspace of tokens + 1
// + rows). w1 [E, 2F, dim], w2 [E, dim, F] (experts w1_expert / w2_expert elements apart, rows
// ldw1 / ldw2); xg, h, a, y contiguous. The calls grouped.py's decode path makes one by one (the
// gather, linear_blocks, swiglu, linear_blocks, the scatter-add into float32 zeros and the
// rounding, which the slot sum forms alike), on the same buffers in the same order: the same
// bits, one crossing from Python instead of five. Returns 0, or -1 where a token is outside [0,
// tokens) (nothing written) or a step declines (out untouched; xg, h, a, y may hold anything).
extern "C" int moe_ffn_avx512_routed_swiglu_blocks_bf16(const bf16_t* x, int64_t ldx, int64_t tokens,
                                                        const int64_t* token, const float* weight, const bf16_t* w1,
                                                        int64_t w1_expert, int64_t ldw1, const bf16_t* w2,
                                                        int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim,
                                                        int64_t features, const int64_t* blocks, int64_t count,
                                                        int64_t rows, bf16_t* xg, bf16_t* h, bf16_t* a, bf16_t* y,
                                                        bf16_t* out, int64_t* index, int threads, void* parallel,
                                                        void* thread_num, void* num_threads) {
  if (rows < 1 || tokens < 1 || dim < 1 || features < 1 || threads < 1) return -1;
  for (int64_t n = 0; n < rows; ++n)
    if (token[n] < 0 || token[n] >= tokens) return -1;
  for (int64_t n = 0; n < rows; ++n) std::memcpy(xg + n * dim, x + token[n] * ldx, sizeof(bf16_t) * dim);
  const int64_t width = 2 * features;
  if (moe_ffn_avx512_linear_blocks_bf16(xg, dim, w1, experts, w1_expert, ldw1, h, width, blocks, count, width, dim,
                                        threads, parallel, thread_num, num_threads) != 0 ||
      moe_ffn_amx_swiglu_bf16(h, width, a, features, rows, features, threads, parallel, thread_num, num_threads) != 0 ||
      moe_ffn_avx512_linear_blocks_bf16(a, features, w2, experts, w2_expert, ldw2, y, dim, blocks, count, dim, features,
                                        threads, parallel, thread_num, num_threads) != 0)
    return -1;
  return moe_ffn_slot_sum_rows(out, 1, dim, tokens, token, y, 1, dim, weight, rows, dim, index, threads, parallel,
                               thread_num, num_threads);
}

// Input gradients y[start:stop] = g[start:stop]·w_e for bf16 g [rows, O], w_e [O, I] (O even),
// y [rows, I] on bf16 pair products over packed panels of w (see InputGradBf16; table and
// checks as above): the threads split y's columns (kGradPanel at a time), each taking its
// share of every block, or take whole blocks each (whole_blocks). -1 where the CPU lacks
// AVX512_BF16, O is odd, or a thread's scratch could not be had (then y may be partly written).
extern "C" int moe_ffn_avx512_input_grad_blocks_bf16_packed(const bf16_t* g, int64_t ldg, const bf16_t* w,
                                                            int64_t experts, int64_t w_expert, int64_t ldw, bf16_t* y,
                                                            int64_t ldy, const int64_t* blocks, int64_t count,
                                                            int64_t out_features, int64_t in_features, int threads,
                                                            void* parallel, void* thread_num, void* num_threads) {
  if (!bf16_ready() || out_features < 2 || out_features % 2 || in_features < 0 || threads < 1) return -1;
  return over_blocks(blocks, count, experts, in_features, kGradPanel, kGradPanel, threads, parallel, thread_num,
                     num_threads, [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t next) {
                       const InputGradBf16 p{g + start * ldg, ldg, w + e * w_expert, ldw, y + start * ldy, ldy,
                                             stop - start, out_features, in_features};
                       return p.m == 0 || first >= last || grad_range(p, first, last, next < 0 ? nullptr : w + next * w_expert);
                     },
                     // whole blocks where a chunk of all the columns' panels stays within
                     // kShallowBytes (the fine-grained 1024 columns: 512 KiB)
                     /*whole=*/in_features * kGradDepth * 2 <= kShallowBytes);
}

// Weight gradients c_e = a[start:stop]ᵀ·b[start:stop] for bf16 a [rows, m], b [rows, n] into
// expert e's bf16 gradient c_e [m, n] on bf16 pair products over packed pairs of rows (see
// WeightGradBf16; table, checks, `stream` and c's layout as moe_ffn_avx512_weight_grad_blocks_bf16):
// the threads split c's rows (6 at a time), each taking its share of every block. -1 where the
// CPU lacks AVX512_BF16 or a thread's scratch could not be had (then c may be partly written).
extern "C" int moe_ffn_avx512_weight_grad_blocks_bf16_packed(const bf16_t* a, int64_t lda, const bf16_t* b,
                                                             int64_t ldb, bf16_t* c, int64_t experts,
                                                             int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                                             int64_t count, int64_t m, int64_t n, int stream,
                                                             int threads, void* parallel, void* thread_num,
                                                             void* num_threads) {
  if (!bf16_ready() || m < 0 || n < 0 || threads < 1) return -1;
  return over_blocks(blocks, count, experts, m, 6, 24, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const WeightGradBf16 p{a + start * lda, lda, b + start * ldb, ldb, c + e * c_expert, ldc,
                                              stop - start, m, n, false, stream != 0};
                       return first >= last || n == 0 || wgrad_range(p, first, last);
                     });
}

// The same with b's rows taken from the tokens' rows: row r of the blocks is b's row
// b_index[r] (b [tokens, n]), gathered as b's panels are packed, where a gather beforehand
// wrote a [rows, n] copy for them to read back. -1 (nothing written) where an index of a
// block's rows lies outside [0, tokens), or as above.
extern "C" int moe_ffn_avx512_weight_grad_rows_bf16_packed(const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb,
                                                           int64_t tokens, const int64_t* b_index, bf16_t* c,
                                                           int64_t experts, int64_t c_expert, int64_t ldc,
                                                           const int64_t* blocks, int64_t count, int64_t m, int64_t n,
                                                           int stream, int threads, void* parallel, void* thread_num,
                                                           void* num_threads) {
  if (!bf16_ready() || m < 0 || n < 0 || threads < 1) return -1;
  if (!rows_within(blocks, count, b_index, tokens)) return -1;
  return over_blocks(blocks, count, experts, m, 6, 24, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const WeightGradBf16 p{a + start * lda, lda,        b,     ldb,   c + e * c_expert,
                                              ldc,             stop - start, m,   n,     false,
                                              stream != 0,     b_index + start};
                       return first >= last || n == 0 || wgrad_range(p, first, last);
                     });
}

// The float32 weight gradients above (moe_ffn_avx512_weight_grad_blocks_f32) with the blocks'
// rows read from the tokens' rows by index (the same sums, bit for bit), where a gather
// beforehand wrote [rows, ·] copies for them to read back: b's row r of the blocks is b's row
// b_index[r] (b [b_tokens, n]), gathered as the panels are packed; a's row r is a's row
// a_index[r] (a [a_tokens, m]) times a_scale[r] (where given; each product rounded once),
// gathered as a's columns are transposed. Either index may be null, not both. -1 (nothing
// written) where an index of a block's rows lies outside its tokens or a block has more than
// outer_rows rows.
extern "C" int moe_ffn_avx512_weight_grad_rows_f32(const float* a, int64_t lda, int64_t a_tokens, const int64_t* a_index,
                                                   const float* a_scale, const float* b, int64_t ldb, int64_t b_tokens,
                                                   const int64_t* b_index, float* c, int64_t experts, int64_t c_expert,
                                                   int64_t ldc, const int64_t* blocks, int64_t count, int64_t m,
                                                   int64_t n, int64_t outer_rows, int stream, int threads,
                                                   void* parallel, void* thread_num, void* num_threads) {
  if ((a_index == nullptr && b_index == nullptr) || count < 0) return -1;
  if ((a_index && !rows_within(blocks, count, a_index, a_tokens)) || (b_index && !rows_within(blocks, count, b_index, b_tokens)))
    return -1;
  return weight_grad_blocks_f32(a, lda, a_index, a_scale, b, ldb, b_index, c, experts, c_expert, ldc, blocks, count, m, n,
                                outer_rows, stream, threads, parallel, thread_num, num_threads);
}

// The float32 input gradients above (moe_ffn_avx512_matmul_blocks_f32) with row r of the
// blocks' a read as a's row a_index[r] (a [tokens, k], the tokens' rows: a routed layer's
// output gradient), gathered as the chunks' rows are copied (the same sums, bit for bit), where
// a gather beforehand wrote a [rows, k] copy. -1 (nothing written) where an index of a block's
// rows lies outside [0, tokens).
extern "C" int moe_ffn_avx512_matmul_rows_f32(const float* a, int64_t lda, int64_t tokens, const int64_t* a_index,
                                              const float* b, int64_t experts, int64_t b_expert, int64_t ldb, float* c,
                                              int64_t ldc, const int64_t* blocks, int64_t count, int64_t k, int64_t n,
                                              int threads, void* parallel, void* thread_num, void* num_threads) {
  if (a_index == nullptr || count < 0 || !rows_within(blocks, count, a_index, tokens)) return -1;
  return matmul_blocks_f32(a, lda, a_index, b, experts, b_expert, ldb, c, ldc, blocks, count, k, n, threads, parallel,
                           thread_num, num_threads);
}

// The float32 forward's blocks (moe_ffn_avx512_linear_blocks_f32 / _deep, chunks of `chunk`)
// with row r of the blocks read as x's row index[r] (x [tokens, I], the tokens' rows), where a
// gather beforehand wrote a [rows, I] copy for the tiles to read: the same sums, bit for bit.
// -1 (nothing written) where an index of a block's rows lies outside [0, tokens).
extern "C" int moe_ffn_avx512_linear_rows_f32(const float* x, int64_t ldx, int64_t tokens, const int64_t* index,
                                              const float* w, int64_t experts, int64_t w_expert, int64_t ldw, float* y,
                                              int64_t ldy, const int64_t* blocks, int64_t count, int64_t out_features,
                                              int64_t in_features, int64_t chunk, int threads, void* parallel,
                                              void* thread_num, void* num_threads) {
  if (index == nullptr || count < 0 || chunk < 1 || !rows_within(blocks, count, index, tokens)) return -1;
  return linear_blocks_f32(x, ldx, index, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features, in_features,
                           chunk, threads, parallel, thread_num, num_threads);
}

// Weight gradients c_e = a[start:stop]ᵀ·b[start:stop] for float32 a [rows, m] (widened by the
// caller, as above), bf16 b [rows, n] into expert e's bf16 gradient c_e [m, n] (at c +
// e·c_expert, rows ldc apart), written over (no block may accumulate); with `stream` c's whole
// 64-byte lines go past the caches (c and ldc·2 multiples of 64 bytes). The threads split c's
// rows, each taking its share of every block (few_rows_range: blocks of a few rows). -1 where
// the CPU lacks AVX512_BF16.
extern "C" int moe_ffn_avx512_weight_grad_blocks_bf16(const float* a, int64_t lda, const bf16_t* b, int64_t ldb,
                                                      bf16_t* c, int64_t experts, int64_t c_expert, int64_t ldc,
                                                      const int64_t* blocks, int64_t count, int64_t m, int64_t n,
                                                      int stream, int threads, void* parallel, void* thread_num,
                                                      void* num_threads) {
  if (!bf16_ready() || m < 0 || n < 0 || threads < 1) return -1;
  return over_blocks(blocks, count, experts, m, 6, 24, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t) {
                       const WeightGradOf<float, bf16_t, bf16_t> p{a + start * lda, lda, b + start * ldb, ldb,
                                                                   c + e * c_expert, ldc, stop - start, m, n, false,
                                                                   stream != 0};
                       if (stream) few_rows_range<true>(p, first, last);
                       else few_rows_range<false>(p, first, last);
                       return true;
                     });
}

// Input and weight gradients of one-row blocks through the same weight in one pass
// (one_row_gradients): for each block (e, r, r + 1), y[r] = g[r]·w_e and c_e = a[r]ᵀ·b[r], for
// float32 g, a [rows, O] (for bf16 the caller widens them; they may be the same rows), b [rows,
// I], w_e [O, I] (at w + e·w_expert, rows ldw apart), y [rows, I], c_e [O, I] (at c + e·c_expert,
// rows ldc apart, written over; with `stream` its whole lines past the caches: c and ldc
// multiples of 64 bytes), all bf16 (_bf16) or all float32 (_f32). The threads split the columns
// I (64 at a time), each taking its share of every block. -1 where the CPU lacks AVX512_BF16
// (both: the code lies in that part) or a block is not one row (nothing written).
template <typename T>
int one_row_gradients_blocks(const float* g, int64_t ldg, const float* a, int64_t lda, const T* b, int64_t ldb,
                             const T* w, int64_t experts, int64_t w_expert, int64_t ldw, T* y, int64_t ldy, T* c,
                             int64_t c_expert, int64_t ldc, const int64_t* blocks, int64_t count, int64_t out_features,
                             int64_t in_features, int stream, int threads, void* parallel, void* thread_num,
                             void* num_threads) {
  if (!bf16_ready() || out_features < 1 || in_features < 0 || threads < 1) return -1;
  for (int64_t i = 0; i < count; ++i)
    if (blocks[4 * i + 2] - blocks[4 * i + 1] != 1) return -1;
  return over_blocks(blocks, count, experts, in_features, 64, 64, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t, int64_t first, int64_t last, int64_t) {
                       if (first >= last) return true;
                       const MatmulOf<float, T, T> ig{g + start * ldg, ldg, w + e * w_expert, ldw, y + start * ldy, ldy,
                                                      1, out_features, in_features};
                       if (stream) one_row_gradients<T, true>(ig, a + start * lda, b + start * ldb, c + e * c_expert, ldc, first, last);
                       else one_row_gradients<T, false>(ig, a + start * lda, b + start * ldb, c + e * c_expert, ldc, first, last);
                       return true;
                     });
}

extern "C" int moe_ffn_avx512_one_row_gradients_bf16(const float* g, int64_t ldg, const float* a, int64_t lda,
                                                     const bf16_t* b, int64_t ldb, const bf16_t* w, int64_t experts,
                                                     int64_t w_expert, int64_t ldw, bf16_t* y, int64_t ldy, bf16_t* c,
                                                     int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                                     int64_t count, int64_t out_features, int64_t in_features,
                                                     int stream, int threads, void* parallel, void* thread_num,
                                                     void* num_threads) {
  return one_row_gradients_blocks(g, ldg, a, lda, b, ldb, w, experts, w_expert, ldw, y, ldy, c, c_expert, ldc, blocks,
                                  count, out_features, in_features, stream, threads, parallel, thread_num, num_threads);
}

extern "C" int moe_ffn_avx512_one_row_gradients_f32(const float* g, int64_t ldg, const float* a, int64_t lda,
                                                    const float* b, int64_t ldb, const float* w, int64_t experts,
                                                    int64_t w_expert, int64_t ldw, float* y, int64_t ldy, float* c,
                                                    int64_t c_expert, int64_t ldc, const int64_t* blocks, int64_t count,
                                                    int64_t out_features, int64_t in_features, int stream, int threads,
                                                    void* parallel, void* thread_num, void* num_threads) {
  return one_row_gradients_blocks(g, ldg, a, lda, b, ldb, w, experts, w_expert, ldw, y, ldy, c, c_expert, ldc, blocks,
                                  count, out_features, in_features, stream, threads, parallel, thread_num, num_threads);
}

// Input and weight gradients of blocks of 2 to 6 rows through the same weight in one pass
// (few_gradients; the entry points below): for each block (e, start, stop), y[start:stop] = g[start:stop]·w_e and c_e =
// a[start:stop]ᵀ·b[start:stop], all bf16: g, a [rows, O] (O even; may be the same rows), b
// [rows, I], w_e [O, I] (at w + e·w_expert, rows ldw apart), y [rows, I], c_e [O, I] (at c +
// e·c_expert, rows ldc apart, written over; with `stream` its whole lines past the caches: c
// and ldc multiples of 64 bytes). The same bits as moe_ffn_avx512_input_grad_blocks_bf16_packed
// and the bf16 weight gradient's entry points (widening below 4 rows, packed pairs from 4) on
// these blocks. The threads split the columns I (64 at a time). -1 where the CPU lacks
// AVX512_BF16, O is odd or a block is not of 2 to 6 rows (nothing written).
template <typename T>
int few_row_gradients_blocks(const T* g, int64_t ldg, const T* a, int64_t lda, const T* b, int64_t ldb, const T* w,
                             int64_t experts, int64_t w_expert, int64_t ldw, T* y, int64_t ldy, T* c, int64_t c_expert,
                             int64_t ldc, const int64_t* blocks, int64_t count, int64_t out_features,
                             int64_t in_features, int stream, int threads, void* parallel, void* thread_num,
                             void* num_threads) {
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  const bool fits = kBf16 ? out_features >= 2 && out_features % 2 == 0 && in_features >= 0
                          : out_features >= 1 && in_features >= 64 * threads;
  if (!bf16_ready() || !fits || threads < 1) return -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t rows = blocks[4 * i + 2] - blocks[4 * i + 1];
    if (rows < 2 || rows > 6) return -1;
  }
  return over_blocks(blocks, count, experts, in_features, 64, 64, threads, parallel, thread_num, num_threads,
                     [&](int64_t e, int64_t start, int64_t stop, int64_t first, int64_t last, int64_t next) {
                       if (first >= last) return true;
                       const MatmulOf<T, T, T> p{g + start * ldg, ldg, w + e * w_expert, ldw, y + start * ldy, ldy,
                                                 stop - start, out_features, in_features};
                       const T* next_w = next < 0 ? nullptr : w + next * w_expert;
                       const T *a_rows = a + start * lda, *b_rows = b + start * ldb;
                       T* c_e = c + e * c_expert;
                       if constexpr (kBf16) {
                         if (stream) return few_gradients<true>(p, a_rows, lda, b_rows, ldb, c_e, ldc, first, last,
                                                                next_w);
                         return few_gradients<false>(p, a_rows, lda, b_rows, ldb, c_e, ldc, first, last, next_w);
                       } else {
                         if (stream) return few_gradients_f32<true>(p, a_rows, lda, b_rows, ldb, c_e, ldc, first, last,
                                                                    next_w);
                         return few_gradients_f32<false>(p, a_rows, lda, b_rows, ldb, c_e, ldc, first, last, next_w);
                       }
                     });
}

extern "C" int moe_ffn_avx512_few_row_gradients_bf16(const bf16_t* g, int64_t ldg, const bf16_t* a, int64_t lda,
                                                     const bf16_t* b, int64_t ldb, const bf16_t* w, int64_t experts,
                                                     int64_t w_expert, int64_t ldw, bf16_t* y, int64_t ldy, bf16_t* c,
                                                     int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                                     int64_t count, int64_t out_features, int64_t in_features,
                                                     int stream, int threads, void* parallel, void* thread_num,
                                                     void* num_threads) {
  return few_row_gradients_blocks(g, ldg, a, lda, b, ldb, w, experts, w_expert, ldw, y, ldy, c, c_expert, ldc, blocks,
                                  count, out_features, in_features, stream, threads, parallel, thread_num, num_threads);
}

// The float32 blocks of 2 to 6 rows likewise (few_gradients_f32): g, a [rows, O] (may be the
// same rows), b [rows, I], w_e, y, c_e as above, all float32; the same bits as the float32
// blocks kernels' input and weight gradients on these blocks. -1 where the CPU lacks
// AVX512_BF16 (the code lies in that part), I is below 64 a thread or a block is not of 2 to 6
// rows (nothing written).
extern "C" int moe_ffn_avx512_few_row_gradients_f32(const float* g, int64_t ldg, const float* a, int64_t lda,
                                                    const float* b, int64_t ldb, const float* w, int64_t experts,
                                                    int64_t w_expert, int64_t ldw, float* y, int64_t ldy, float* c,
                                                    int64_t c_expert, int64_t ldc, const int64_t* blocks, int64_t count,
                                                    int64_t out_features, int64_t in_features, int stream, int threads,
                                                    void* parallel, void* thread_num, void* num_threads) {
  return few_row_gradients_blocks(g, ldg, a, lda, b, ldb, w, experts, w_expert, ldw, y, ldy, c, c_expert, ldc, blocks,
                                  count, out_features, in_features, stream, threads, parallel, thread_num, num_threads);
}

extern "C" int moe_ffn_amx_swiglu_backward_bf16(const uint16_t* h, int64_t ldh, const uint16_t* da, int64_t ldda,
                                                const float* weight, uint16_t* a, int64_t lda, uint16_t* dh,
                                                int64_t lddh, float* dweight, int64_t rows, int64_t features,
                                                int threads, void* parallel, void* thread_num, void* num_threads);
extern "C" int moe_ffn_swiglu_f32(const float* h, int64_t ldh, float* a, int64_t lda, int64_t rows, int64_t features,
                                  int round_bf16, int threads, void* parallel, void* thread_num, void* num_threads);
extern "C" int moe_ffn_swiglu_backward_f32(const float* h, int64_t ldh, const float* da, int64_t ldda,
                                           const float* weight, float* a, int64_t lda, float* dh, int64_t lddh,
                                           float* dweight, int64_t rows, int64_t features, int round_bf16,
                                           int threads, void* parallel, void* thread_num, void* num_threads);

namespace {

// The rows of the one-row blocks of a table (widened: float32 copies of their bf16 rows, what
// the one-row gradients read), bf16 [rows, cols] (ld apart) into float32 (ldd apart).
void widen_block_rows(const bf16_t* src, int64_t ld, float* dst, int64_t ldd, const int64_t* blocks, int64_t count,
                      int64_t cols) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = blocks[4 * i + 1];
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t bits = uint32_t{src[r * ld + c]} << 16;
      std::memcpy(dst + r * ldd + c, &bits, sizeof bits);
    }
  }
}

constexpr int64_t kOneCallBackwardMaxRows = 64;  // (= ONE_CALL_BACKWARD_MAX_ROWS in _small_gemm.py)

// A routed SwiGLU layer's backward over one group of small blocks (each its own expert) in one
// call, on the AVX512-BF16 CPUs' kernels (bf16: CPUs without AMX): g = the output gradient's rows
// g_out[token[n]] gathered, a = silu(gate)·up of h, gw = g scaled by weight[n] (bf16: by
// bf16(weight[n]), each product rounded to bf16, scale_rows_bf16), da = g·w2_e and w2's
// gradient gwᵀ·a in one pass over w2 (one-row blocks: one_row_gradients_blocks, bf16 g and gw
// widened first; blocks of 2 to 6 rows, float32 2 to 4: few_row_gradients_blocks; larger ones
// to kOneCallBackwardMaxRows: the input gradients' blocks entry point, bf16 on packed panels),
// dh and dweight [rows] (float32) from h and da scaled by weight (the SwiGLU backward pass; it
// makes a where no block takes one pass), the larger blocks' w2 gradient (the weight gradients'
// blocks entry point: bf16 packed pairs; float32 with the caller's outer_rows), the rows
// x[token[n]] gathered, dx = dh·w1_e and w1's gradient dhᵀ·x likewise, and grad_x's rows = Σ
// dx[n] over each token's rows (moe_ffn_slot_sum_rows: every row written, zeros for a token
// without rows; bf16 rounded once).
// The calls grouped._ffn_backward makes one by one for such a group here, on the same buffers
// in the same order: the same bits, one crossing from Python instead of up to twenty calls and
// the Python around them. w1 [E, 2F, dim], w2 [E, dim, F] (experts w1_expert / w2_expert
// elements apart, rows ldw1 / ldw2), their gradients alike (written over for each expert with
// rows; with stream1 / stream2 past the caches, as the weight gradients' entry points take
// `stream`), grad_x [tokens, dim] contiguous, dim even. Scratch: rows_d [4, rows, dim] (g, gw,
// the gathered x, dx) and rows_h [rows, 4F] (a, da, dh) in T, and for bf16 wide_d float32 [2,
// rows, dim] and wide_h [rows, 2F] (g, gw and dh widened; null where no block has one row);
// `index` int64 [tokens + 1 + rows]. Returns 0, or -1 where a token is outside [0, tokens), a
// block does not fit, or a step declines (the gradients may then hold part of the result: the
// caller computes them again).
template <typename T>
int routed_swiglu_backward_small(const T* g_out, int64_t ldg_out, const T* x, int64_t ldx, int64_t tokens,
                                 const int64_t* token, const float* weight, const T* h, int64_t ldh, const T* w1,
                                 int64_t w1_expert, int64_t ldw1, const T* w2, int64_t w2_expert, int64_t ldw2,
                                 int64_t experts, int64_t dim, int64_t features, const int64_t* blocks, int64_t count,
                                 int64_t rows, T* grad_w1, int64_t gw1_expert, int64_t ldgw1, T* grad_w2,
                                 int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2, float* dweight,
                                 T* grad_x, T* rows_d, T* rows_h, float* wide_d, float* wide_h, int64_t outer_rows,
                                 int64_t* index, int threads, void* parallel, void* thread_num, void* num_threads) {
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  constexpr int64_t kFewMost = kBf16 ? 6 : 4;
  if (!bf16_ready() || rows < 1 || tokens < 1 || dim < 2 || dim % 2 || features < 1 || count < 1 || threads < 1)
    return -1;
  for (int64_t n = 0; n < rows; ++n)
    if (token[n] < 0 || token[n] >= tokens) return -1;
  // the table split as the loop splits it: blocks of one row and a few (one pass over the
  // weight for both gradients, grouped._one_pass_gradients), and larger ones (the input and
  // weight gradients' blocks entry points, grouped._input_grad_blocks / _weight_grad_blocks:
  // bf16 packed, float32 as the float32 blocks entry points take them, outer_rows theirs)
  std::vector<int64_t> tables[3];
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = blocks[4 * i + 2] - blocks[4 * i + 1];
    if (n < 1 || n > kOneCallBackwardMaxRows || blocks[4 * i + 3] != 0) return -1;
    std::vector<int64_t>& table = tables[n == 1 ? 0 : n <= kFewMost ? 1 : 2];
    table.insert(table.end(), blocks + 4 * i, blocks + 4 * i + 4);
  }
  const int64_t *one = tables[0].data(), *few = tables[1].data(), *big = tables[2].data();
  const int64_t ones = int64_t(tables[0].size()) / 4, fews = int64_t(tables[1].size()) / 4;
  const int64_t bigs = int64_t(tables[2].size()) / 4;
  if (kBf16 && ones && (wide_d == nullptr || wide_h == nullptr)) return -1;
  const int64_t width = 2 * features, rd = rows * dim;
  T *g = rows_d, *gw = rows_d + rd, *xg = rows_d + 2 * rd, *dx = rows_d + 3 * rd;
  T *a = rows_h, *da = rows_h + rows * features, *dh = rows_h + 2 * rows * features;
  for (int64_t n = 0; n < rows; ++n) std::memcpy(g + n * dim, g_out + token[n] * ldg_out, sizeof(T) * dim);
  // a made first where a one-pass block needs it with da (else by the SwiGLU backward pass, as
  // the loop makes it)
  const bool one_pass = ones + fews > 0;
  if (one_pass) {
    const int status = kBf16 ? moe_ffn_amx_swiglu_bf16(reinterpret_cast<const uint16_t*>(h), ldh,
                                                       reinterpret_cast<uint16_t*>(a), features, rows, features,
                                                       threads, parallel, thread_num, num_threads)
                             : moe_ffn_swiglu_f32(reinterpret_cast<const float*>(h), ldh, reinterpret_cast<float*>(a),
                                                  features, rows, features, 0, threads, parallel, thread_num,
                                                  num_threads);
    if (status != 0) return -1;
  }
  if constexpr (kBf16) {
    scale_rows_bf16(g, dim, gw, dim, weight, rows, dim);
  } else {
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < dim; ++c) gw[n * dim + c] = g[n * dim + c] * weight[n];
  }
  // the one-row blocks' g and a as one_row_gradients_blocks reads them (float32)
  const auto wide = [&](const T* src, int64_t ld, float* dst) -> const float* {
    if constexpr (kBf16) {
      widen_block_rows(src, ld, dst, ld, one, ones, ld);
      return dst;
    } else {
      return src;
    }
  };
  // the down projection: da = g·w2_e, w2's gradient gwᵀ·a
  if (ones) {
    const float *g32 = wide(g, dim, wide_d), *gw32 = wide(gw, dim, wide_d + rd);
    if (one_row_gradients_blocks(g32, dim, gw32, dim, a, features, w2, experts, w2_expert, ldw2, da, features, grad_w2,
                                 gw2_expert, ldgw2, one, ones, dim, features, stream2, threads, parallel, thread_num,
                                 num_threads) != 0)
      return -1;
  }
  if (fews && few_row_gradients_blocks(g, dim, gw, dim, a, features, w2, experts, w2_expert, ldw2, da, features,
                                       grad_w2, gw2_expert, ldgw2, few, fews, dim, features, stream2, threads, parallel,
                                       thread_num, num_threads) != 0)
    return -1;
  // the larger blocks' products, as the loop's blocks calls make them
  const auto input_grads = [&](const T* src, int64_t ld, const T* w, int64_t w_expert, int64_t ldw, T* y, int64_t ldy,
                               int64_t out_features, int64_t in_features) {
    if (bigs == 0) return 0;
    if constexpr (kBf16)
      return moe_ffn_avx512_input_grad_blocks_bf16_packed(src, ld, w, experts, w_expert, ldw, y, ldy, big, bigs,
                                                          out_features, in_features, threads, parallel, thread_num,
                                                          num_threads);
    else
      return moe_ffn_avx512_matmul_blocks_f32(src, ld, w, experts, w_expert, ldw, y, ldy, big, bigs, out_features,
                                              in_features, threads, parallel, thread_num, num_threads);
  };
  const auto weight_grads = [&](const T* a_rows, int64_t lda, const T* b_rows, int64_t ldb, T* c, int64_t c_expert,
                                int64_t ldc, int64_t m, int64_t n, int stream) {
    if (bigs == 0) return 0;
    if constexpr (kBf16)
      return moe_ffn_avx512_weight_grad_blocks_bf16_packed(a_rows, lda, b_rows, ldb, c, experts, c_expert, ldc, big,
                                                           bigs, m, n, stream, threads, parallel, thread_num,
                                                           num_threads);
    else
      return moe_ffn_avx512_weight_grad_blocks_f32(a_rows, lda, b_rows, ldb, c, experts, c_expert, ldc, big, bigs, m,
                                                   n, outer_rows, stream, threads, parallel, thread_num, num_threads);
  };
  if (input_grads(g, dim, w2, w2_expert, ldw2, da, features, dim, features) != 0) return -1;
  {
    const int status =
        kBf16 ? moe_ffn_amx_swiglu_backward_bf16(reinterpret_cast<const uint16_t*>(h), ldh,
                                                 reinterpret_cast<const uint16_t*>(da), features, weight,
                                                 one_pass ? nullptr : reinterpret_cast<uint16_t*>(a), features,
                                                 reinterpret_cast<uint16_t*>(dh), width, dweight, rows, features,
                                                 threads, parallel, thread_num, num_threads)
              : moe_ffn_swiglu_backward_f32(reinterpret_cast<const float*>(h), ldh,
                                            reinterpret_cast<const float*>(da), features, weight,
                                            one_pass ? nullptr : reinterpret_cast<float*>(a), features,
                                            reinterpret_cast<float*>(dh), width, dweight, rows, features, 0, threads,
                                            parallel, thread_num, num_threads);
    if (status != 0) return -1;
  }
  if (weight_grads(gw, dim, a, features, grad_w2, gw2_expert, ldgw2, dim, features, stream2) != 0) return -1;
  // the up projection: dx = dh·w1_e, w1's gradient dhᵀ·x[token]
  for (int64_t n = 0; n < rows; ++n) std::memcpy(xg + n * dim, x + token[n] * ldx, sizeof(T) * dim);
  if (ones) {
    const float* dh32 = wide(dh, width, wide_h);
    if (one_row_gradients_blocks(dh32, width, dh32, width, xg, dim, w1, experts, w1_expert, ldw1, dx, dim, grad_w1,
                                 gw1_expert, ldgw1, one, ones, width, dim, stream1, threads, parallel, thread_num,
                                 num_threads) != 0)
      return -1;
  }
  if (fews && few_row_gradients_blocks(dh, width, dh, width, xg, dim, w1, experts, w1_expert, ldw1, dx, dim, grad_w1,
                                       gw1_expert, ldgw1, few, fews, width, dim, stream1, threads, parallel, thread_num,
                                       num_threads) != 0)
    return -1;
  if (weight_grads(dh, width, xg, dim, grad_w1, gw1_expert, ldgw1, width, dim, stream1) != 0 ||
      input_grads(dh, width, w1, w1_expert, ldw1, dx, dim, width, dim) != 0)
    return -1;
  return moe_ffn_slot_sum_rows(grad_x, kBf16, dim, tokens, token, dx, kBf16, dim, nullptr, rows, dim, index, threads,
                               parallel, thread_num, num_threads);
}

}  // namespace

// The bf16 and float32 instances of routed_swiglu_backward_small (above).
extern "C" int moe_ffn_avx512_routed_swiglu_backward_blocks_bf16(
    const bf16_t* g_out, int64_t ldg_out, const bf16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const bf16_t* h, int64_t ldh, const bf16_t* w1, int64_t w1_expert, int64_t ldw1,
    const bf16_t* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, bf16_t* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    bf16_t* grad_w2, int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2, float* dweight, bf16_t* grad_x,
    bf16_t* rows_d, bf16_t* rows_h, float* wide_d, float* wide_h, int64_t outer_rows, int64_t* index, int threads,
    void* parallel, void* thread_num, void* num_threads) {
  return routed_swiglu_backward_small(g_out, ldg_out, x, ldx, tokens, token, weight, h, ldh, w1, w1_expert, ldw1, w2,
                                      w2_expert, ldw2, experts, dim, features, blocks, count, rows, grad_w1, gw1_expert,
                                      ldgw1, grad_w2, gw2_expert, ldgw2, stream1, stream2, dweight, grad_x, rows_d,
                                      rows_h, wide_d, wide_h, outer_rows, index, threads, parallel, thread_num,
                                      num_threads);
}

extern "C" int moe_ffn_avx512_routed_swiglu_backward_blocks_f32(
    const float* g_out, int64_t ldg_out, const float* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const float* h, int64_t ldh, const float* w1, int64_t w1_expert, int64_t ldw1,
    const float* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, float* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    float* grad_w2, int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2, float* dweight, float* grad_x,
    float* rows_d, float* rows_h, float* wide_d, float* wide_h, int64_t outer_rows, int64_t* index, int threads,
    void* parallel, void* thread_num, void* num_threads) {
  return routed_swiglu_backward_small(g_out, ldg_out, x, ldx, tokens, token, weight, h, ldh, w1, w1_expert, ldw1, w2,
                                      w2_expert, ldw2, experts, dim, features, blocks, count, rows, grad_w1, gw1_expert,
                                      ldgw1, grad_w2, gw2_expert, ldgw2, stream1, stream2, dweight, grad_x, rows_d,
                                      rows_h, wide_d, wide_h, outer_rows, index, threads, parallel, thread_num,
                                      num_threads);
}
