// The products of one expert's block of rows on x86 CPUs with AVX2 and FMA, float32:
//
//     forward         y[r, o] = sum_i x[r, i] * w[o, i] (+ b[o])    (x·wᵀ)
//     input gradient  y[r, i] = sum_o g[r, o] * w[o, i]             (g·w)
//     weight gradient c[m, n] = sum_r a[r, m] * b[r, n]             (aᵀ·b)
//
// for the rows r of a block and an expert's weight w [O, I] with contiguous rows; the forward
// also for bfloat16 tensors (summed in float32, see moe_ffn_linear_bf16), the input gradient
// also through bfloat16 weights (moe_ffn_input_grad_bf16w), the packed product also into a
// bfloat16 c (moe_ffn_product_bf16c) and from a bfloat16 B (moe_ffn_product_bf16b); and SwiGLU's
// elementwise work around them. Built at install time as an optional extension
// (pyproject.toml) and called through ctypes by moe_ffn/_small_gemm.py, which says when each
// part is used and why (measured numbers there). No Python or torch API here: plain pointers
// and strides in, the results written where the caller says.
//
// forward, a few rows (up to 64): dot products along the contiguous I dim of x and w, in
// register tiles of up to 4 rows of x by 3 rows of w (12 accumulators of 8 lanes); a tile
// reuses its 3 rows of w from L1 for every 4 rows of x, so w is streamed from memory once per
// call and never packed. bf16 weights against 1–7 rows of x: w's rows read one after another
// instead (linear_rows); against 16–64 rows, each strip of w widened to float32 once into L1
// (linear_strip_widened). The threads split the rows of w.
//
// input gradient, a few rows (up to 64): sums of rows of w scaled by g, in register tiles of
// up to 4 rows of g by 24 columns of w. w is walked in chunks of consecutive rows, and every
// row tile of g passes over a chunk's 24-column panel, adding into y, which stays in L2. From
// 24 rows of g the chunk is first packed (read row after row) so that a panel's rows are
// adjacent (see grad_range). The threads split the columns of w.
//
// packed product (weight gradients; forward and input gradient past 64 rows): c = A·B in
// register tiles of 6 rows by 16 columns of c; B is packed into 16-column panels (transposed
// 8 by 8 where its columns are w's rows) and A into 6-row tiles. Weight gradients and products
// whose B packs into a few MiB: B packed once, the threads split the rows of c, each tile's
// whole sum at once, each element of c stored once (large ones past the caches, bfloat16 c
// in tiles of 3 rows by 32 columns so that a row's sums fill a line: line_tile);
// others: sums in passes of 256 steps, the threads split the columns of c. See Product and
// thin_product.
//
// SwiGLU: a = silu(gate)·up, and its gradient with the routing weight's, in one pass over
// the rows each (see Swiglu).
//
// Threads: the caller passes the entry points of the OpenMP runtime torch runs its own
// parallel loops on (GOMP_parallel, omp_get_thread_num, omp_get_num_threads of the libgomp
// loaded with torch), and each product runs as one parallel region of torch's team. Why not
// threads of our own: torch's OpenMP threads keep spinning for a while after each parallel op,
// and threads started beside them share the cores with that spinning (measured in the layer:
// the forward 1.2–1.7× slower than torch's kernels, where the same kernel on torch's team is
// faster). Null entry points: the caller's thread does all of it.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "_bf16.h"
#include "_entry_points.h"
#include "_team.h"

// `#pragma GCC unroll 32` before a loop of a few compile-time steps: unrolled whole, so that GCC
// keeps a register tile's accumulators in registers rather than in a stack array stored to and
// reloaded around the tile (what it did in the AVX-512 kernels, _avx512.cpp's MOE_UNROLL).
// Measured only with torch at AVX2 on the Zen 4 EPYC (2026-12-07, ATEN_CPU_CAPABILITY=avx2,
// library built both ways and alternated in one process, layer forward+backward, pair ratios'
// medians): fine-grained bf16 T = 256 0.946×, T = 2048 0.989×, float32 T = 256 0.986×, Mixtral
// float32 T = 256 0.991×, bf16 T = 16 0.993×; not measured on an AVX2-only CPU.

using moe_ffn_team::each_block;
using moe_ffn_team::each_block_shared;
using moe_ffn_team::on_team;
using moe_ffn_team::share;
using moe_ffn_team::Team;

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes below n set (a mask for the last, partial vector of a row).
inline __m256i first_lanes(int64_t n) {
  alignas(32) int32_t lanes[8];
#pragma GCC unroll 32
  for (int i = 0; i < 8; ++i) lanes[i] = i < n ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}

// ---- forward: y = x·wᵀ (+ b) ----------------------------------------------------------------

// Eight weights as float32 lanes: float32 as they are; bfloat16 (its bits, uint16_t) widened,
// exactly: a bf16 is the top half of the float32 with the same value.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// One weight as a float32: the same, a value at a time.
inline float widen(float value) { return value; }
using moe_ffn_bf16::widen;
// The last n < 8 weights of a row, zeros past them (nothing read past the row's end).
inline __m256 load_tail(const float* w, int64_t n, __m256i mask) {
  (void)n;
  return _mm256_maskload_ps(w, mask);
}
inline __m256 load_tail(const uint16_t* w, int64_t n, __m256i) {
  alignas(32) uint32_t bits[8] = {};
  for (int64_t i = 0; i < n; ++i) bits[i] = uint32_t{w[i]} << 16;
  return _mm256_load_ps(reinterpret_cast<const float*>(bits));
}

// A float32 sum as a bfloat16 (its bits), as torch rounds it (_bf16.h).
using moe_ffn_bf16::round_to_bf16;
inline void store(float* y, float value) { *y = value; }
inline void store(uint16_t* y, float value) { *y = round_to_bf16(value); }

// W: float (float32 weights) or uint16_t (bfloat16 weights, read as they are); Y: float, or
// uint16_t (each float32 sum rounded to bfloat16 as it is stored).
template <typename W, typename Y>
struct Linear {
  const float* x;
  int64_t ldx;
  const W* w;
  int64_t ldw;
  const float* b;  // nullptr: no bias
  Y* y;
  int64_t ldy;
  int64_t rows, in_features;
};

// ROWS rows of x against COLS rows of w; the last I % 8 elements of each row come in through
// loads that read zeros past the end.
template <int ROWS, int COLS, typename W, typename Y>
void linear_tile(const Linear<W, Y>& p, const float* x, const W* w, Y* y, const float* b, __m256i tail_mask) {
  __m256 acc[ROWS][COLS];
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t whole = p.in_features & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 w_k[COLS];
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) w_k[j] = load8(w + j * p.ldw + k);
#pragma GCC unroll 32
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_loadu_ps(x + i * p.ldx + k);
#pragma GCC unroll 32
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  if (whole < p.in_features) {
    __m256 w_k[COLS];
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) w_k[j] = load_tail(w + j * p.ldw + whole, p.in_features - whole, tail_mask);
#pragma GCC unroll 32
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_maskload_ps(x + i * p.ldx + whole, tail_mask);
#pragma GCC unroll 32
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) store(y + i * p.ldy + j, horizontal_sum(acc[i][j]) + (b ? b[j] : 0.0f));
}

// A strip of w is read from memory while the first row tile passes over it, and from L1 for
// the others; with two or more row tiles, the next strip's rows are prefetched into L1 a share
// before each tile, so that its reads overlap this strip's products. Where the two strips fit
// in L1 (3 rows of up to kStripPrefetchBytes): GFLOP/s without / with (64 fine-grained or 8
// Mixtral experts' weights in turn, 9 interleaved rounds, 2-core EPYC), float32, at 8 / 16 /
// 32 / 64 rows: fine 1024×1024 36 / 36, 46 / 55, 63 / 82, 84 / 86; 1024×512 28 / 38, 37 / 49,
// 53 / 70, 78 / 94; Mixtral 7168×1024 36 / 40, 57 / 68, 77 / 85, 91 / 99; bf16 weights, fine
// 1024×1024 44 / 60, 62 / 80, 82 / 97, 94 / 105, Mixtral 7168×1024 at 16 / 64 rows 65 / 83, 92
// / 102. Longer strips (Mixtral's 1024×3584 in float32, 43 KiB) lost with it: 44 / 40, 65 / 58
// at 8 / 16 rows (into L2 instead: 46 / 42, 69 / 63). (The last strip's prefetches may reach
// past w's rows: a prefetch never faults, and the CPU drops one to an unmapped address.)
constexpr int64_t kStripPrefetchBytes = 12 << 10;
template <int COLS, typename W, typename Y>
void linear_strip(const Linear<W, Y>& p, int64_t o, __m256i tail_mask) {
  const W* w = p.w + o * p.ldw;
  const float* b = p.b ? p.b + o : nullptr;
  int64_t r = 0;
  const int64_t row_bytes = p.in_features * int64_t{sizeof(W)}, tiles = p.rows / 4;
  const bool prefetch = tiles >= 2 && COLS * row_bytes <= kStripPrefetchBytes;
  const int64_t lines = (row_bytes + 63) / 64, per_tile = prefetch ? (COLS * lines + tiles - 1) / tiles : 0;
  int64_t next = 0;
  for (; r + 4 <= p.rows; r += 4) {
    for (int64_t n = 0; n < per_tile && next < COLS * lines; ++n, ++next) {
      const int64_t row = next / lines, line = next % lines;
      _mm_prefetch(reinterpret_cast<const char*>(w + (COLS + row) * p.ldw) + 64 * line, _MM_HINT_T0);
    }
    linear_tile<4, COLS>(p, p.x + r * p.ldx, w, p.y + r * p.ldy + o, b, tail_mask);
  }
  const float* x = p.x + r * p.ldx;
  Y* y = p.y + r * p.ldy + o;
  switch (p.rows - r) {
    case 3: linear_tile<3, COLS>(p, x, w, y, b, tail_mask); break;
    case 2: linear_tile<2, COLS>(p, x, w, y, b, tail_mask); break;
    case 1: linear_tile<1, COLS>(p, x, w, y, b, tail_mask); break;
    default: break;
  }
}

// A few rows of x against bf16 weights (a decode step's blocks): w's rows [first, last) read
// one after another, each line prefetched kRowPrefetchBytes ahead, every row of x against each
// row of w, SETS accumulators a row of x (8·SETS weights a step; the last whole vectors into
// the first, the masked tail into the second). Used for one row, and for blocks of up to
// kRowsMax rows whose rows of x fit in kRowsBytes (L1, beside the stream of w: x is read
// again for every row of w). The strips of 3 rows (linear_strip: three rows of w side by
// side) read bf16 weights at 6–9 GB/s for 1–7 rows of x, where a plain read ran at 12–16
// (which part of them holds the read back was not pinned down). 2-core EPYC, the benchmark's
// expert weights (8 Mixtral or 64 fine-grained experts' in turn): one row, 2 Mixtral experts'
// projections (44 MB of bf16, 40 interleaved rounds) 5.12 → 3.71 ms, 8 of the fine-grained
// shape's 3.58 → 2.24 (without the prefetch 3.96 / 2.49). 2–7 rows (every expert's block in
// one linear_blocks call, 11 interleaved rounds, GB/s strips → rows): 7168×1024 6.6–8.8 →
// 9.0–11.7, 1024×1024 5.6–8.5 → 8.1–13.0, 1024×512 4.2–6.8 → 7.5–12.6; 1024×3584 level at 2
// rows (11.1–12.4 / 11.6–12.8), behind from 7 with x past L1 (9.1 / 7.8), as at 8 rows on
// every weight (7.9–8.5 / 7.0–8.3: there the strips' two full row tiles prefetch). float32
// weights keep the strips: the rows-one-after-another read was 1.08–1.20× slower on Mixtral's
// for one row, and 0.8–1.0× at 2–4 rows.
constexpr int64_t kRowPrefetchBytes = 1024;
constexpr int64_t kRowsMax = 7;
constexpr int64_t kRowsBytes = 28 << 10;

template <int ROWS, typename Y>
void linear_rows(const Linear<uint16_t, Y>& p, int64_t first, int64_t last, __m256i tail_mask) {
  constexpr int SETS = ROWS <= 2 ? 4 : ROWS <= 4 ? 2 : 1;
  constexpr int TAIL = SETS > 1 ? 1 : 0;
  const int64_t I = p.in_features, body = I / (8 * SETS) * (8 * SETS), whole = I & ~int64_t{7};
  const float* x = p.x;
  const int64_t ldx = p.ldx;
  for (int64_t o = first; o < last; ++o) {
    const uint16_t* w = p.w + o * p.ldw;
    __m256 acc[ROWS][SETS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int s = 0; s < SETS; ++s) acc[r][s] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 8 * SETS) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kRowPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int s = 0; s < SETS; ++s) {
        const __m256 w_k = load8(w + k + 8 * s);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) acc[r][s] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k + 8 * s), w_k, acc[r][s]);
      }
    }
    for (; k < whole; k += 8) {
      const __m256 w_k = load8(w + k);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), w_k, acc[r][0]);
    }
    if (whole < I) {
      const __m256 w_k = load_tail(w + whole, I - whole, tail_mask);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r)
        acc[r][TAIL] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * ldx + whole, tail_mask), w_k, acc[r][TAIL]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      __m256 sum = acc[r][0];
      if constexpr (SETS == 4) sum = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
      if constexpr (SETS == 2) sum = _mm256_add_ps(acc[r][0], acc[r][1]);
      store(p.y + r * p.ldy + o, horizontal_sum(sum) + (p.b ? p.b[o] : 0.0f));
    }
  }
}

// The same for 1–2 rows of x whose rows are whole steps of 32 weights (the usual widths):
// 16 weights widened by one load and two unpacks with zeros (their bits to the top of each
// 32-bit lane) where load8 takes two widening loads and two shifts. The unpacks give weights
// 0–3 and 8–11 of the 16 in one vector, 4–7 and 12–15 in the other, so x is read from a copy
// in that order (`xp`, the middle two quarters of every 16 swapped), and each lane keeps the
// sum it has in linear_rows: the two sets of a 16 share an accumulator pair, lanes 0–3 of
// both in one, 4–7 in the other, and the sets' sums are added across their halves in
// linear_rows's order ((set 0 + set 1) + (set 2 + set 3), then horizontal_sum's). The same
// sums in the same order. Reading w, GB/s linear_rows → unpacked (8 Mixtral or 64 fine-grained
// experts' weights in turn, every block in one linear_blocks call, 15 interleaved rounds, Zen 1
// EPYC, 2026-12-06): one row 1024×1024 / 1024×512 15.8 / 12.6 → 17.3 / 13.1, Mixtral 7168×1024
// / 1024×3584 15.9 / 14.7 → 16.6 / 14.5; two rows 14.7 / 14.0 → 15.2 / 14.7; at 3–4 rows (two
// sets) 0.92–0.98×, so not there. Layer bf16 forward (61 / 21 rounds, same bits): T = 1 fine
// 0.987× the time, Mixtral 0.980×; fine T = 16 0.977×.
constexpr int64_t kRowsUnpackedFloats = kRowsBytes / int64_t{sizeof(float)};

template <int ROWS, typename Y>
void linear_rows_unpacked(const Linear<uint16_t, Y>& p, int64_t first, int64_t last) {
  static_assert(ROWS == 1 || ROWS == 2, "linear_rows's four sets");
  constexpr int SETS = 4, PAIRS = SETS / 2;
  const int64_t I = p.in_features;
  alignas(32) float xp[kRowsUnpackedFloats];
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r)
    for (int64_t k = 0; k < I; k += 16) {
      const float* from = p.x + r * p.ldx + k;
      float* to = xp + r * I + k;
      _mm_store_ps(to, _mm_loadu_ps(from));
      _mm_store_ps(to + 4, _mm_loadu_ps(from + 8));
      _mm_store_ps(to + 8, _mm_loadu_ps(from + 4));
      _mm_store_ps(to + 12, _mm_loadu_ps(from + 12));
    }
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t o = first; o < last; ++o) {
    const uint16_t* w = p.w + o * p.ldw;
    __m256 lo[ROWS][PAIRS], hi[ROWS][PAIRS];  // lanes 0–3 / 4–7 of sets 2h and 2h + 1
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < PAIRS; ++h) lo[r][h] = hi[r][h] = _mm256_setzero_ps();
    for (int64_t k = 0; k < I; k += 8 * SETS) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kRowPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < PAIRS; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16 * h));
        const __m256 w_lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
        const __m256 w_hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
          const float* x = xp + r * I + k + 16 * h;
          lo[r][h] = _mm256_fmadd_ps(_mm256_load_ps(x), w_lo, lo[r][h]);
          hi[r][h] = _mm256_fmadd_ps(_mm256_load_ps(x + 8), w_hi, hi[r][h]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      // (set 0 + set 1) + (set 2 + set 3) per half: lanes 0–3 from lo, 4–7 from hi
      __m128 s_lo = _mm_add_ps(_mm256_castps256_ps128(lo[r][0]), _mm256_extractf128_ps(lo[r][0], 1));
      __m128 s_hi = _mm_add_ps(_mm256_castps256_ps128(hi[r][0]), _mm256_extractf128_ps(hi[r][0], 1));
      s_lo = _mm_add_ps(s_lo, _mm_add_ps(_mm256_castps256_ps128(lo[r][1]), _mm256_extractf128_ps(lo[r][1], 1)));
      s_hi = _mm_add_ps(s_hi, _mm_add_ps(_mm256_castps256_ps128(hi[r][1]), _mm256_extractf128_ps(hi[r][1], 1)));
      // horizontal_sum's steps on the halves' sums as they are (rebuilding its 256-bit input
      // for it cost the 1024×512 weight's one-row reads 4 % of their GB/s)
      __m128 s = _mm_add_ps(s_lo, s_hi);
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      store(p.y + r * p.ldy + o, _mm_cvtss_f32(s) + (p.b ? p.b[o] : 0.0f));
    }
  }
}

// bf16 weights against kWidenRows or more rows of x: each strip's rows widened to float32 once,
// into a buffer on the stack (L1), and the strip's tiles run on it as on float32 weights, where
// the strips above widen them again for every tile of 4 rows of x (load8: a widening load and a
// shift per 8 weights for every 4 FMAs' worth of a row). Rows longer than kWidenChunk are
// widened kWidenChunk steps at a time, every tile's sums kept in memory between the chunks
// (`keep`, exact), from kWidenLongRows rows. The next chunk's bf16 rows are prefetched into L1
// across the tiles, as the strips above do. The same sums in the same order as linear_tile's.
// GFLOP/s strips → widened (every expert's block in one linear_blocks call, 64 fine-grained or
// 8 Mixtral experts' weights in turn, 9–11 interleaved rounds, Zen 1 EPYC, 2026-12-06): fine
// 1024×1024 / 1024×512 at 8 rows 40.5 / 34.4 → 35.8 / 35.1 (so from 16), 12 rows level, 16
// rows 45.7 / 43.4 → 49.3 / 47.2, 32 rows 51.5 / 48.1 → 59.8 / 57.1, 64 rows 52.6 / 47.3 → 63
// / 61; Mixtral 7168×1024 at 16 / 32 / 64 rows 47.4 → 49.4, 50.8 → 58.2, 52.1 → 64.0; its
// 1024×3584 (chunks of 1024) at 16 / 24 / 28 / 32 / 64 rows 52.2 → 48.8, 54.3 → 54.2, 53.4 →
// 55.8, 52.6 → 55.5, 51.9 → 60.1 (the chunks' first and last passes compiled apart: 1.02–1.07×
// the same code with run-time flags). Layer bf16 forward T = 256 (7 / 5 rounds, same bits):
// fine 0.862× the time, Mixtral 0.890×.
constexpr int64_t kWidenRows = 16;
constexpr int64_t kWidenChunk = 1024;       // steps per widened chunk (a multiple of 8)
constexpr int64_t kWidenKeepRows = 64;      // rows of x whose sums `keep` holds between chunks
constexpr int64_t kWidenLongRows = 28;      // rows from which rows longer than a chunk are widened

inline void widen_row(const uint16_t* w, int64_t n, float* dst) {
  const int64_t whole = n & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) _mm256_storeu_ps(dst + k, load8(w + k));
  for (int64_t k = whole; k < n; ++k) dst[k] = widen(w[k]);
}

// ROWS rows of x against COLS widened rows of w (`strip`, rows kWidenChunk apart) over steps
// [k0, k0 + n): the sums start from zero (FIRST) or from `keep`, and go back into `keep`, or
// (LAST, the chunk that holds the tail of fewer than 8 steps) across their lanes into y.
template <int ROWS, int COLS, bool FIRST, bool LAST, typename Y>
void linear_tile_chunk(const float* x, int64_t ldx, const float* strip, int64_t k0, int64_t n, float* keep, Y* y,
                       int64_t ldy, const float* b, __m256i tail_mask) {
  __m256 acc[ROWS][COLS];
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) acc[i][j] = FIRST ? _mm256_setzero_ps() : _mm256_load_ps(keep + 8 * (i * COLS + j));
  const int64_t whole = n & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 w_k[COLS];
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) w_k[j] = _mm256_load_ps(strip + j * kWidenChunk + k);
#pragma GCC unroll 32
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_loadu_ps(x + i * ldx + k0 + k);
#pragma GCC unroll 32
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  if (whole < n) {
    __m256 w_k[COLS];
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) w_k[j] = _mm256_maskload_ps(strip + j * kWidenChunk + whole, tail_mask);
#pragma GCC unroll 32
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_maskload_ps(x + i * ldx + k0 + whole, tail_mask);
#pragma GCC unroll 32
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < COLS; ++j) {
      if constexpr (LAST) store(y + i * ldy + j, horizontal_sum(acc[i][j]) + (b ? b[j] : 0.0f));
      else _mm256_store_ps(keep + 8 * (i * COLS + j), acc[i][j]);
    }
}

template <int COLS, bool FIRST, bool LAST, typename Y>
void linear_chunk_widened(const Linear<uint16_t, Y>& p, const uint16_t* w, int64_t k0, int64_t n, float* strip,
                          float* keep, const float* b, Y* y, __m256i tail_mask) {
#pragma GCC unroll 32
  for (int j = 0; j < COLS; ++j) widen_row(w + j * p.ldw + k0, n, strip + j * kWidenChunk);
  // the next chunk to widen: this strip's next one, or the next strip's first
  const int64_t I = p.in_features, tiles = p.rows / 4;
  const uint16_t* next_w = LAST ? w + COLS * p.ldw : w + k0 + n;
  const int64_t lines = (std::min(kWidenChunk, LAST ? I : I - k0 - n) * int64_t{sizeof(uint16_t)} + 63) / 64;
  const int64_t per_tile = tiles > 0 ? (COLS * lines + tiles - 1) / tiles : 0;
  int64_t r = 0, ahead = 0;
  for (; r + 4 <= p.rows; r += 4) {
    for (int64_t m = 0; m < per_tile && ahead < COLS * lines; ++m, ++ahead)
      _mm_prefetch(reinterpret_cast<const char*>(next_w + ahead / lines * p.ldw) + 64 * (ahead % lines), _MM_HINT_T0);
    linear_tile_chunk<4, COLS, FIRST, LAST>(p.x + r * p.ldx, p.ldx, strip, k0, n, keep + r * COLS * 8, y + r * p.ldy,
                                            p.ldy, b, tail_mask);
  }
  const float* x = p.x + r * p.ldx;
  float* kept = keep + r * COLS * 8;
  Y* y_r = y + r * p.ldy;
  switch (p.rows - r) {
    case 3: linear_tile_chunk<3, COLS, FIRST, LAST>(x, p.ldx, strip, k0, n, kept, y_r, p.ldy, b, tail_mask); break;
    case 2: linear_tile_chunk<2, COLS, FIRST, LAST>(x, p.ldx, strip, k0, n, kept, y_r, p.ldy, b, tail_mask); break;
    case 1: linear_tile_chunk<1, COLS, FIRST, LAST>(x, p.ldx, strip, k0, n, kept, y_r, p.ldy, b, tail_mask); break;
    default: break;
  }
}

template <int COLS, typename Y>
void linear_strip_widened(const Linear<uint16_t, Y>& p, int64_t o, __m256i tail_mask) {
  alignas(32) float strip[3 * kWidenChunk];
  alignas(32) float keep[kWidenKeepRows * 3 * 8];
  const int64_t I = p.in_features;
  const uint16_t* w = p.w + o * p.ldw;
  const float* b = p.b ? p.b + o : nullptr;
  Y* y = p.y + o;
  if (I <= kWidenChunk) return linear_chunk_widened<COLS, true, true>(p, w, 0, I, strip, keep, b, y, tail_mask);
  linear_chunk_widened<COLS, true, false>(p, w, 0, kWidenChunk, strip, keep, b, y, tail_mask);
  int64_t k0 = kWidenChunk;
  for (; I - k0 > kWidenChunk; k0 += kWidenChunk)
    linear_chunk_widened<COLS, false, false>(p, w, k0, kWidenChunk, strip, keep, b, y, tail_mask);
  linear_chunk_widened<COLS, false, true>(p, w, k0, I - k0, strip, keep, b, y, tail_mask);
}

// Rows [first, last) of w: bf16 weights against a few rows of x row after row (above; 1–2
// rows unpacked), against 16 or more in strips of 3 rows widened once (above), else in strips
// of 3 rows.
template <typename W, typename Y>
void linear_range(const Linear<W, Y>& p, int64_t first, int64_t last) {
  const __m256i tail_mask = first_lanes(p.in_features % 8);
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (p.rows == 1 || (p.rows <= kRowsMax && p.rows * p.in_features * int64_t{sizeof(float)} <= kRowsBytes)) {
      if (p.rows <= 2 && p.in_features % 32 == 0 && p.rows * p.in_features <= kRowsUnpackedFloats) {
        return p.rows == 1 ? linear_rows_unpacked<1>(p, first, last) : linear_rows_unpacked<2>(p, first, last);
      }
      switch (p.rows) {
        case 1: return linear_rows<1>(p, first, last, tail_mask);
        case 2: return linear_rows<2>(p, first, last, tail_mask);
        case 3: return linear_rows<3>(p, first, last, tail_mask);
        case 4: return linear_rows<4>(p, first, last, tail_mask);
        case 5: return linear_rows<5>(p, first, last, tail_mask);
        case 6: return linear_rows<6>(p, first, last, tail_mask);
        case 7: return linear_rows<7>(p, first, last, tail_mask);
        default: break;
      }
    }
  }
  int64_t o = first;
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (p.in_features <= kWidenChunk ? p.rows >= kWidenRows : kWidenLongRows <= p.rows && p.rows <= kWidenKeepRows) {
      for (; o + 3 <= last; o += 3) linear_strip_widened<3>(p, o, tail_mask);
      if (last - o == 2) linear_strip_widened<2>(p, o, tail_mask);
      if (last - o == 1) linear_strip_widened<1>(p, o, tail_mask);
      return;
    }
  }
  for (; o + 3 <= last; o += 3) linear_strip<3>(p, o, tail_mask);
  if (last - o == 2) linear_strip<2>(p, o, tail_mask);
  if (last - o == 1) linear_strip<1>(p, o, tail_mask);
}

// float32 x and w of up to 256 rows of x: the products in place (below, linear_in_place) from
// kInPlaceLongRows rows where w's rows are too long for the strips to prefetch (more than
// kStripPrefetchBytes / 3 bytes: Mixtral's 1024×3584), else from kInPlaceShortRows rows (past 120
// until 2026-12-06, when a last panel of up to 8 rows went to half tiles, and those lost to the
// strips; see linear_in_place: at 64–120 rows the two now run level, 0.96–1.08× the time, in
// place ahead at 64 and 100 rows). GFLOP/s strips / in place (64 fine-grained or 8 Mixtral
// experts' weights in turn, 7 interleaved rounds, 2-core EPYC, the half tiles then). Long rows
// (Mixtral's 1024×3584) at 8 / 12 / 16 / 20 / 24 / 32 / 40 / 48 / 64 rows: 43 / 44, 53 / 59, 62 /
// 80, 66 / 64, 74 / 80, 80 / 94, 84 / 89, 89 / 101, 88 / 98; at 72 / 100 / 112 / 128 rows 92 /
// 96, 88 / 87, 84 / 102, 98 / 106. Short rows at 72 / 88 / 100 / 112 / 120 / 128 rows: fine
// 1024×1024 97 / 81, 98 / 82, 101 / 87, 95 / 96, 90 / 84, 97 / 102; 1024×512 100 / 81, 102 / 85,
// 103 / 85, 100 / 82, 95 / 83, 99 / 97; Mixtral 7168×1024 101 / 88 (72), 85 / 80 (100), 93 / 95
// (112), 98 / 110 (128). Up to 256 rows since it was ahead of the packed product and of oneDNN
// there too (5 rounds, GFLOP/s packed or oneDNN / in place, at 192 / 256 rows): fine 1024×1024 76
// / 85, 90 / 101, 1024×512 94 / 91, 95 / 98 (at 384 level: 101 / 102, 107 / 102); Mixtral
// 7168×1024 100 / 106, 106 / 99, 1024×3584 99 / 107, 90 / 101.
constexpr int64_t kInPlaceRows[2] = {12, 256};
constexpr int64_t kInPlaceLongRows = kInPlaceRows[0];
constexpr int64_t kInPlaceShortRows = 16;
int linear_in_place(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b, float* y, int64_t ldy,
                    int64_t rows, int64_t out_features, int64_t in_features, int64_t threads, const Team& team);

template <typename W, typename Y>
int linear(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, Y* y, int64_t ldy,
           int64_t rows, int64_t out_features, int64_t in_features, int threads, const Team& team) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  if (rows == 0 || out_features == 0) return 0;
  // At least 24 rows of w (8 strips) per thread.
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, out_features / 24));
  if constexpr (std::is_same_v<W, float> && std::is_same_v<Y, float>) {
    // (to kInPlaceRows[1], the callers' limit: _small_gemm.py's IN_PLACE_MAX_ROWS)
    const bool strips_prefetch = 3 * in_features * int64_t{sizeof(float)} <= kStripPrefetchBytes;
    if (strips_prefetch ? rows >= kInPlaceShortRows : rows >= kInPlaceLongRows)
      return linear_in_place(x, ldx, w, ldw, b, y, ldy, rows, out_features, in_features, count, team);
  }
  const Linear<W, Y> p{x, ldx, w, ldw, b, y, ldy, rows, in_features};
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(out_features, 3, t, n, &first, &last);
    linear_range(p, first, last);
  });
  return 0;
}

// ---- input gradient: y = g·w ----------------------------------------------------------------

// W: float (float32 weights) or uint16_t (bfloat16 weights, widened as they are loaded).
template <typename W>
struct InputGrad {
  const float* g;
  int64_t ldg;
  const W* w;
  int64_t ldw;
  float* y;
  int64_t ldy;
  int64_t rows, in_features;
};

// Rows of w per pass over y. Input gradients through the fine-grained shape's 1024×1024 weight,
// 64 experts' weights in turn, GFLOP/s at 1 / 8 / 32 rows of g: chunks of 64 rows 3.3 / 15.7 /
// 48.6, of 8 rows 4.2 / 22.0 / 43.5, of 16 rows 6.3 / 29.4 / 42.2 (one run each; torch's
// kernels read 4.8–6.5 / 17–26 / 42–60 in the same three runs).
constexpr int64_t kChunk = 16;

// One row of g's step: a_v += g[i, o] · w[o, 8v : 8v + 8] for the tile's VECS vectors.
template <int VECS>
inline __attribute__((always_inline)) void fma_row(__m256 g_io, __m256 w0, __m256 w1, __m256 w2, __m256& a0,
                                                   __m256& a1, __m256& a2) {
  a0 = _mm256_fmadd_ps(g_io, w0, a0);
  if constexpr (VECS > 1) a1 = _mm256_fmadd_ps(g_io, w1, a1);
  if constexpr (VECS > 2) a2 = _mm256_fmadd_ps(g_io, w2, a2);
}

// ROWS (≤ 4) rows of g by VECS (≤ 3) vectors of 8 columns (the last one masked when MASKED),
// over rows [o0, o0 + count) of w, added into y (written when `fresh`: the first chunk).
// The accumulators are named variables, not an array: GCC 12 kept a [4][3] array of them in
// memory and stored all twelve on every step of this loop (it does not for linear_tile's).
// w: float or uint16_t (bf16 bits, see load8), its last vector's `tail` lanes read when MASKED.
template <int ROWS, int VECS, bool MASKED, typename W, typename WT>
void grad_tile(const InputGrad<W>& p, const float* g, int64_t ldg, int64_t c, float* y, int64_t count, bool fresh,
               __m256i mask, int64_t tail, const WT* w, int64_t ldw) {
  static_assert(1 <= ROWS && ROWS <= 4 && 1 <= VECS && VECS <= 3, "tile");
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
  const float *g0 = g, *g1 = g0 + ldg, *g2 = g1 + ldg, *g3 = g2 + ldg;
  auto load = [mask](const float* at, bool partial) {
    return partial ? _mm256_maskload_ps(at, mask) : _mm256_loadu_ps(at);
  };
  auto load_w = [mask, tail](const WT* at, bool partial) { return partial ? load_tail(at, tail, mask) : load8(at); };
  for (int64_t o = 0; o < count; ++o, w += ldw) {
    const __m256 w0 = load_w(w, MASKED && VECS == 1);
    const __m256 w1 = VECS > 1 ? load_w(w + 8, MASKED && VECS == 2) : z;
    const __m256 w2 = VECS > 2 ? load_w(w + 16, MASKED) : z;
    fma_row<VECS>(_mm256_broadcast_ss(g0 + o), w0, w1, w2, a00, a01, a02);
    if constexpr (ROWS > 1) fma_row<VECS>(_mm256_broadcast_ss(g1 + o), w0, w1, w2, a10, a11, a12);
    if constexpr (ROWS > 2) fma_row<VECS>(_mm256_broadcast_ss(g2 + o), w0, w1, w2, a20, a21, a22);
    if constexpr (ROWS > 3) fma_row<VECS>(_mm256_broadcast_ss(g3 + o), w0, w1, w2, a30, a31, a32);
  }
  const __m256 acc[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 32
    for (int v = 0; v < VECS; ++v) {
      float* at = y + i * p.ldy + c + 8 * v;
      const bool partial = MASKED && v == VECS - 1;
      const __m256 sum = fresh ? acc[i][v] : _mm256_add_ps(acc[i][v], load(at, partial));
      if (partial) _mm256_maskstore_ps(at, mask, sum);
      else _mm256_storeu_ps(at, sum);
    }
}

// w: the panel's first row at its first column, ldw apart (w itself, or a packed copy); g:
// the chunk's first step of g's first row, ldg apart (g itself, or a copy).
// `before()` runs before each row tile (the packed path's prefetches, see grad_range).
template <int VECS, bool MASKED, typename W, typename WT, typename Before>
void grad_panel(const InputGrad<W>& p, const float* g, int64_t ldg, int64_t c, int64_t count, bool fresh,
                __m256i mask, int64_t tail, const WT* w, int64_t ldw, Before&& before) {
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4)
    before(), grad_tile<4, VECS, MASKED>(p, g + r * ldg, ldg, c, p.y + r * p.ldy, count, fresh, mask, tail, w, ldw);
  const float* g_r = g + r * ldg;
  float* y = p.y + r * p.ldy;
  if (r < p.rows) before();
  switch (p.rows - r) {
    case 3: grad_tile<3, VECS, MASKED>(p, g_r, ldg, c, y, count, fresh, mask, tail, w, ldw); break;
    case 2: grad_tile<2, VECS, MASKED>(p, g_r, ldg, c, y, count, fresh, mask, tail, w, ldw); break;
    case 1: grad_tile<1, VECS, MASKED>(p, g_r, ldg, c, y, count, fresh, mask, tail, w, ldw); break;
    default: break;
  }
}

constexpr int64_t kPackRows = 24;     // rows of g from which w is packed
constexpr int64_t kPackedChunk = 64;  // rows of w per pass over y when packed

// Columns [first, last) of y (first a multiple of 8), all rows of w. From kPackRows rows of g,
// each chunk of w's rows is first copied, row after row (read in memory order), into panels
// of consecutive rows, and g's part of the chunk into rows `chunk` floats apart: read in
// place, a panel's rows (and g's) lie a row length apart, which for a power-of-two length
// puts them all in one L1 set, evicting each other while the row tiles pass over them.
template <typename W>
void grad_range(const InputGrad<W>& p, int64_t out_features, int64_t first, int64_t last) {
  const int64_t tail = (last - first) % 8;
  const __m256i mask = first_lanes(tail);
  const bool pack = p.rows >= kPackRows;
  const int64_t chunk = pack ? kPackedChunk : kChunk;
  const int64_t width = last - first, padded = (width + 7) / 8 * 8;
  std::vector<float> packed(pack ? chunk * padded : 0), g_chunk(pack ? chunk * p.rows : 0);
  for (int64_t o0 = 0; o0 < out_features; o0 += chunk) {
    const int64_t count = std::min(chunk, out_features - o0);
    const bool fresh = o0 == 0;
    if (pack)  // g's part for this chunk (see above)
      for (int64_t r = 0; r < p.rows; ++r)
        std::copy(p.g + r * p.ldg + o0, p.g + r * p.ldg + o0 + count, g_chunk.data() + r * chunk);
    // panel q of width wq starts at column c (relative to first); packed at chunk·c, rows wq apart
    if (pack) {  // (bf16 weights widened to float32 on the way)
      for (int64_t o = 0; o < count; ++o) {
        const W* src = p.w + (o0 + o) * p.ldw + first;
        int64_t c = 0;
        for (; c + 24 <= width; c += 24)
#pragma GCC unroll 32
          for (int v = 0; v < 3; ++v) _mm256_storeu_ps(packed.data() + chunk * c + o * 24 + 8 * v, load8(src + c + 8 * v));
        for (; c + 8 <= width; c += 8) _mm256_storeu_ps(packed.data() + chunk * c + o * 8, load8(src + c));
        if (c < width) _mm256_storeu_ps(packed.data() + chunk * c + o * 8, load_tail(src + c, tail, mask));
      }
    }
    using three = std::integral_constant<int, 3>;
    using one = std::integral_constant<int, 1>;
    // packed: the next chunk's rows of w prefetched while this chunk is multiplied, where its
    // packing waited on memory with nothing to overlap. GFLOP/s without / with (a share of the
    // rows before each panel; 64 fine-grained or 8 Mixtral experts' weights in turn, 7
    // interleaved rounds, 2-core EPYC of 2026-12-02), at 32 / 64 rows of g: fine 1024×1024 56 /
    // 64, 78 / 82; 1024×512 52 / 58, 76 / 80; Mixtral 7168×1024 64 / 72, 86 / 91; 1024×3584 69 /
    // 72, 89 / 90 (into L2 instead: +0–8 %). The share is now a few lines before each row tile:
    // a share of rows before each panel put up to 80 prefetches in a row, more misses than the
    // core keeps in flight, and the product waited on them. On a Zen 1 EPYC (2026-12-05, 11
    // interleaved rounds in one process): 1024×1024 / 1024×512 at 32 rows 49.5 → 53.2 / 46.6 →
    // 53.1 GFLOP/s, Mixtral's at 64 rows level; into L2 (_MM_HINT_T1) level with L1.
    const int64_t next = o0 + chunk, next_count = pack ? std::max<int64_t>(0, std::min(chunk, out_features - next)) : 0;
    const int64_t row_lines = (width * int64_t{sizeof(W)} + 63) / 64;
    const int64_t panels = width / 24 + (width % 24) / 8 + (width % 8 != 0);
    const int64_t tiles = panels * ((p.rows + 3) / 4);
    const int64_t per_tile = (next_count * row_lines + tiles - 1) / tiles;
    int64_t fetch_row = 0, fetch_line = 0;
    auto prefetch_share = [&]() {
      for (int64_t n = 0; n < per_tile && fetch_row < next_count; ++n) {
        const char* row = reinterpret_cast<const char*>(p.w + (next + fetch_row) * p.ldw + first);
        _mm_prefetch(row + 64 * fetch_line, _MM_HINT_T0);
        if (++fetch_line == row_lines) fetch_line = 0, ++fetch_row;
      }
    };
    auto nothing = []() {};
    auto run = [&](auto vecs, auto masked, int64_t c) {
      constexpr int VECS = decltype(vecs)::value;
      constexpr bool MASKED = decltype(masked)::value;
      if (pack)
        grad_panel<VECS, MASKED>(p, g_chunk.data(), chunk, first + c, count, fresh, mask, tail,
                                 packed.data() + chunk * c, 8 * VECS, prefetch_share);
      else
        grad_panel<VECS, MASKED>(p, p.g + o0, p.ldg, first + c, count, fresh, mask, tail, p.w + o0 * p.ldw + first + c,
                                 p.ldw, nothing);
    };
    int64_t c = 0;
    for (; c + 24 <= width; c += 24) run(three{}, std::false_type{}, c);
    for (; c + 8 <= width; c += 8) run(one{}, std::false_type{}, c);
    if (c < width) run(one{}, std::true_type{}, c);
  }
}

// A few rows of g (decode): the product is a read of w, and the split below reads each
// thread's half of every row in 96-byte pieces, 16 rows at a time. Here the threads split w's
// rows instead, reading them 8 at a time side by side, whole, into sums of their own (y for the
// first part, scratch memory for the other), added into y at the end. Reading w, GB/s (the
// benchmark's four expert weights, 64 or 8 in turn, best of 2×7 interleaved rounds, 2-core
// AVX2 EPYC; a plain read of memory ran at ~18.7), column split → row split, float32 / bf16
// weights: 2 rows 9.5–16.2 → 10.6–21.5 / 7.2–10.4 → 7.9–12.4, 4 rows 7.8–14.7 → 9.1–17.2 /
// 5.8–7.5 → 7.6–9.9, 6 rows 7.7–12.5 → 9.5–14.6 / 5.3–6.4 → 5.7–8.8; at 8 rows the row split
// was behind in 5 of 8. fp32 forward+backward, interleaved A/B (11 rounds): fine-grained T=1
// 13.9 → 12.4 ms, Mixtral T=4 59.9 → 56.9, T=16 85.5 → 81.7; bf16 fine-grained T=16 135.0 →
// 119.2, Mixtral T=16 114.3 → 95.5. (One-row blocks of a layer's groups come here through
// moe_ffn_input_grad_blocks_f32; alone, input_grad leaves one row to torch's two half
// products, grouped.py's _SPLIT_INNER_MAX_ROWS, about as fast.)
constexpr int64_t kSplitRowsMax = 6;  // rows of g up to which w's rows are split

constexpr int64_t kSplitBlock = 8;  // rows of w per pass over y's rows

// Where split_long (through bf16 weights from 3 rows of g, float32 ones from 5; rows a multiple
// of 4 KiB apart: bf16 at 6 only), w's rows go in blocks of kSplitLongBlock instead, each block
// a column strip at a time (8·V columns, their ROWS·V sums in registers down all the block's
// rows: y read and written once a block, not once every 8 rows), each step prefetching the
// strip's row kSplitAhead rows on (past the block's end: its first rows' next line, where the
// strips after this one read). The same sums in the same order. Why: at 3–6 rows the blocks
// of 8 read and wrote y's rows every 8 rows of w, and read w's 8 rows side by side at 4–13
// GB/s. Input gradients, ms, blocks of 8 → these (8 Mixtral or fine-grained experts' blocks in
// one input_grad_blocks call, weights on huge pages, 11 interleaved rounds in one process,
// same bits, 2-core Zen 1 EPYC, 2026-12-06), bf16 weights at 3 / 4 / 5 / 6 rows: 7168×1024
// 9.09 → 7.57, 11.42 → 8.59, 15.62 → 10.46, 19.39 → 11.70; 1024×3584 4.02 → 3.83, 4.97 → 4.49,
// 6.44 → 4.97, 8.21 → 6.12; 1024×1024 1.78 → 1.54, 2.09 → 1.82, 2.79 → 2.08, 3.34 → 2.34;
// 1024×512 1.27 → 1.14, 1.46 → 1.38, 1.79 → 1.30, 2.13 → 1.30; float32 at 5 / 6 rows 1024×3584
// 7.13 → 5.94, 8.80 → 6.60, 1024×512 2.22 → 1.91, 2.54 → 1.95. Not taken: float32 at 3–4 rows
// (0.97–1.14×) and 1–2 rows (1.2–1.9×); rows 4 KiB apart (float32 1024 or bf16 2048 columns),
// whose strip's lines all fall in one L1 set, where the prefetched lines evict each other:
// bf16 at 3–5 rows 1.02–1.29×, float32 1.04–1.18× at 5 rows of 1024×1024. Whole parts as one
// block (no y traffic at all): 1.0–1.5× (a strip down 3584 rows of 7168×1024 leaves the caches
// before the next strip reads its lines' other halves); blocks of 64 / 128 level with 256 but
// for 1024×3584 (1.1× without the wrapped prefetch); 16 / 48 / 64 rows ahead level or behind;
// without the prefetch 1.1–3.0×. Layer forward+backward, interleaved A/B (21 rounds, same
// bits): bf16 T = 16 Mixtral 52.5 → 50.2 ms, fine-grained 43.3 → 42.1; float32 T = 16 0.99×;
// T = 1 and fine-grained T = 256 (no blocks of 3–6 rows) level (1.02×, 1.01×).
constexpr int64_t kSplitLongBlock = 256;
constexpr int64_t kSplitAhead = 32;
template <typename W>
bool split_long(int rows, int64_t ldw) {
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  if (ldw * int64_t{sizeof(W)} % 4096 != 0) return rows >= (kBf16 ? 3 : 5);
  return kBf16 && rows >= 6;
}

// y[r, c : c + 8·V] (+)= sum over j < count of g[r, o + j] · w[o + j, c : c + 8·V] for ROWS (≤ 6)
// rows of g (the last vector's first `tail` lanes when MASKED; y read unless `first`). Each
// step's broadcast of g[r, o + j] serves V products, and the ROWS·V sums are independent
// chains (with one vector, ROWS chains of one step each waited on the FMA's latency at 1–4
// rows); the same sums in the same order for any V. Reading w, GB/s V = 1 → V = 4 (1–2 rows)
// or 2 (3–6) (64 fine-grained or 8 Mixtral experts' weights in turn, every block in one
// input_grad_blocks call, 11 interleaved rounds in one process, Zen 1 EPYC, 2026-12-05), 4
// rows: bf16 1024×1024 8.0 → 8.4, 7168×1024 7.9 → 9.0, 1024×3584 8.9 → 10.0; float32 15.1 →
// 18.5, 17.1 → 18.7, 18.4 → 20.6; 2 rows float32 1024×1024 20.5 → 22.4, 7168×1024 21.7 → 23.4,
// 1024×512 level (2-row bf16 blocks take split_line: level; on V = 4 instead 0.94–1.21× the
// time). Layer forward+backward (21 rounds): bf16 Mixtral T=16 0.968×, fine 0.985×; float32
// Mixtral T=16 level.
// bf16 w with V even: 16 weights widened by one load and two unpacks with zeros (their bits
// to the top of each 32-bit lane) where load8 takes two widening loads and two shifts (on Zen
// 1 the shifts share one pipe with the FMAs' neighbours). The unpacks give columns 0–3 and 8–11
// in one vector, 4–7 and 12–15 in the other (per 128-bit half), so the sums keep that order in
// their registers: y is read and stored in 16-byte quarters (kPairs). Each column's sum is the
// same, in the same order. Reading w, GB/s load8 → unpacks (8 Mixtral or 64 fine-grained
// experts' weights in turn, every block in one input_grad_blocks call, 15–21 interleaved
// rounds, two runs, Zen 1 EPYC, bf16-valued g): 1024×512 / 1024×1024 at 3 rows 7.4–7.8 /
// 8.9–9.3 → 8.6 / 10.9–11.1, at 4 rows 6.7–6.9 / 7.6–8.0 → 7.3 / 8.3–9.0; 3584×1024 /
// 7168×1024 at 4 rows 9.3–9.5 / 8.2–8.4 → 10.6–10.7 / 9.1, at 6 rows 6.1 / 4.9 → 6.5 / 5.3.
// (1–2 rows of bf16 w mostly take split_line; unpacks there: mixed, not kept.)
template <int ROWS, int V, bool MASKED, bool AHEAD = false, typename W>
inline void split_vector(const InputGrad<W>& p, int64_t o, int64_t count, int64_t c, float* y, int64_t ldy,
                         bool first, __m256i mask, int64_t tail) {
  static_assert(1 <= ROWS && ROWS <= kSplitRowsMax && 1 <= V && V <= 4 && ROWS * V <= 12, "tile");
  auto partial = [](int v) { return MASKED && v == V - 1; };
  constexpr bool kPairs = std::is_same_v<W, uint16_t> && V % 2 == 0 && !MASKED;
  // where sum vector v of row r lives in y: 8 columns from `at`, or (kPairs) 4 from `at` and 4
  // from `at` + 8 (the unpacks' order, see below)
  auto place = [&](int r, int v) { return y + r * ldy + c + (kPairs ? 16 * (v / 2) + 4 * (v % 2) : 8 * v); };
  __m256 acc[ROWS][V];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const float* at = place(r, v);
      if (first) acc[r][v] = _mm256_setzero_ps();
      else if (kPairs) acc[r][v] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(at)), _mm_loadu_ps(at + 8), 1);
      else acc[r][v] = partial(v) ? _mm256_maskload_ps(at, mask) : _mm256_loadu_ps(at);
    }
  const W* w = p.w + o * p.ldw + c;
  const float* g = p.g + o;
  for (int64_t j = 0; j < count; ++j, w += p.ldw, ++g) {
    if constexpr (AHEAD) {  // (a long block, see kSplitLongBlock)
      const char* at = j + kSplitAhead < count ? reinterpret_cast<const char*>(w + kSplitAhead * p.ldw)
                                               : reinterpret_cast<const char*>(w + (kSplitAhead - count) * p.ldw) + 64;
      _mm_prefetch(at, _MM_HINT_T0);
    }
    __m256 w_j[V];
    if constexpr (kPairs) {
#pragma GCC unroll 2
      for (int h = 0; h < V / 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * h));
        w_j[2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
        w_j[2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
      }
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) w_j[v] = partial(v) ? load_tail(w + 8 * v, tail, mask) : load8(w + 8 * v);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 g_rj = _mm256_broadcast_ss(g + r * p.ldg);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(g_rj, w_j[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      float* at = place(r, v);
      if constexpr (kPairs) {
        _mm_storeu_ps(at, _mm256_castps256_ps128(acc[r][v]));
        _mm_storeu_ps(at + 8, _mm256_extractf128_ps(acc[r][v], 1));
      } else if (partial(v)) {
        _mm256_maskstore_ps(at, mask, acc[r][v]);
      } else {
        _mm256_storeu_ps(at, acc[r][v]);
      }
    }
}

// y[r, c : c + 32] (+)= g[r, o] · w[o, c : c + 32] for ROWS (≤ 2) rows of g (y read unless
// `first`): a whole line of a bf16 row of w (two of a float32 one) a step.
template <int ROWS, typename W>
inline void split_line(const InputGrad<W>& p, int64_t o, int64_t c, float* y, int64_t ldy, bool first) {
  __m256 acc[ROWS][4];
  __m256 g_o[ROWS];
#pragma GCC unroll 2
  for (int r = 0; r < ROWS; ++r) {
    g_o[r] = _mm256_broadcast_ss(p.g + r * p.ldg + o);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + c + 8 * v);
  }
  const W* w = p.w + o * p.ldw + c;
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m256 w_v = load8(w + 8 * v);
#pragma GCC unroll 2
    for (int r = 0; r < ROWS; ++r) acc[r][v] = _mm256_fmadd_ps(g_o[r], w_v, acc[r][v]);
  }
#pragma GCC unroll 2
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + r * ldy + c + 8 * v, acc[r][v]);
}

// y[r, :] (+)= sum over o in [o0, o1) of g[r, o] · w[o, :] for ROWS rows of g: w's rows in
// blocks of kSplitBlock, each block's rows read side by side, 8 columns at a time (where
// split_long, blocks of kSplitLongBlock, each a column strip at a time: see there); or, through
// bf16 weights for 1–2 rows of g whose rows of y fit in kLineRowsBytes, w's rows one after
// another, a line at a time (split_line; y stays in L1). The same sums in the same order
// either way. Reading w, GB/s blocks of 8 → lines (every expert's block in one
// input_grad_blocks call, 8 Mixtral or 64 fine-grained experts' bf16 weights in turn, 15
// interleaved rounds, two runs, 2-core AVX2 EPYC), 1 / 2 rows: 7168×1024 9.7–10.5 → 14.2–14.6,
// 9.9–10.4 → 11.8–12.8; 1024×1024 8.8–10.6 → 12.8–14.7, 9.1–10.3 → 10.3–12.5; 1024×512 6.3–8.1 →
// 10.3–13.6, 7.1–8.3 → 10.3–12.4; a one-token step's 8 fine-grained / 2 Mixtral one-row blocks
// 1.27–1.47× (60 rounds). Rows of y past 8 KiB (Mixtral's 1024×3584 at 14 KiB a row: 0.83–0.91×
// at one row) and float32 weights (0.84–1.30×) keep the blocks of 8. Layer bf16 forward+backward,
// interleaved A/B (31 and 41 rounds): Mixtral T=1 1.03 / 1.04×, T=16 1.03 / 1.00×; fine-grained
// T=16 1.03 / 1.08×, T=1 0.97 / 0.95× (against the products' 1.27–1.47× there: layer A/Bs at
// T=1 moved by ±10 % on this machine for unchanged kernels, see profiling/JOURNAL.md).
constexpr int64_t kLineRowsBytes = 8 << 10;
template <int ROWS, typename W>
void split_rows(const InputGrad<W>& p, int64_t o0, int64_t o1, float* y, int64_t ldy, bool fresh) {
  const int64_t n = p.in_features, whole = n / 8 * 8;
  const __m256i mask = first_lanes(n - whole);
  if constexpr (ROWS <= 2 && std::is_same_v<W, uint16_t>) {
    if (ROWS * n * int64_t{sizeof(float)} <= kLineRowsBytes) {
      const int64_t lines = n / 32 * 32;
      for (int64_t o = o0; o < o1; ++o) {
        const bool first = fresh && o == o0;
        for (int64_t c = 0; c < lines; c += 32) split_line<ROWS>(p, o, c, y, ldy, first);
        for (int64_t c = lines; c < whole; c += 8) split_vector<ROWS, 1, false>(p, o, 1, c, y, ldy, first, mask, 0);
        if (whole < n) split_vector<ROWS, 1, true>(p, o, 1, whole, y, ldy, first, mask, n - whole);
      }
      return;
    }
  }
  auto blocks = [&](auto ahead) {
    constexpr bool AHEAD = decltype(ahead)::value;
    const int64_t block = AHEAD ? kSplitLongBlock : kSplitBlock;
    for (int64_t o = o0; o < o1; o += block) {
      const int64_t count = std::min(block, o1 - o);
      const bool first = fresh && o == o0;
      constexpr int V = ROWS <= 2 ? 4 : 2;  // (ROWS·V ≤ 12 sums, V vectors of w, one broadcast: ≤ 16 registers)
      int64_t c = 0;
      for (; c + 8 * V <= whole; c += 8 * V) split_vector<ROWS, V, false, AHEAD>(p, o, count, c, y, ldy, first, mask, 0);
      for (; c < whole; c += 8) split_vector<ROWS, 1, false, AHEAD>(p, o, count, c, y, ldy, first, mask, 0);
      if (whole < n) split_vector<ROWS, 1, true, AHEAD>(p, o, count, whole, y, ldy, first, mask, n - whole);
    }
  };
  if (split_long<W>(ROWS, p.ldw)) blocks(std::true_type{});
  else blocks(std::false_type{});
}

template <typename W>
void split_rows_any(const InputGrad<W>& p, int64_t o0, int64_t o1, float* y, int64_t ldy) {
  switch (p.rows) {
    case 1: split_rows<1>(p, o0, o1, y, ldy, true); break;
    case 2: split_rows<2>(p, o0, o1, y, ldy, true); break;
    case 3: split_rows<3>(p, o0, o1, y, ldy, true); break;
    case 4: split_rows<4>(p, o0, o1, y, ldy, true); break;
    case 5: split_rows<5>(p, o0, o1, y, ldy, true); break;
    default: split_rows<6>(p, o0, o1, y, ldy, true); break;  // (kSplitRowsMax)
  }
}

// w's rows in kSplitParts parts whatever the number of threads (each part's sums formed
// alone, then added in part order), so that the result does not depend on the threads either.
constexpr int64_t kSplitParts = 2;

// -1 where the scratch memory could not be had.
template <typename W>
int input_grad_split_rows(const InputGrad<W>& p, int64_t out_features, int threads, const Team& team) {
  const int64_t per = p.rows * p.in_features;  // floats of one part's sums
  float* sums = static_cast<float*>(moe_ffn_team::thread_scratch(sizeof(float) * per * (kSplitParts - 1)));
  if (!sums) return -1;
  on_team(team, std::min<int64_t>(threads, kSplitParts), [&](int64_t t, int64_t n) {
    for (int64_t part = t; part < kSplitParts; part += n) {
      int64_t o0, o1;
      share(out_features, kSplitBlock, part, kSplitParts, &o0, &o1);
      float* y = part == 0 ? p.y : sums + (part - 1) * per;
      const int64_t ldy = part == 0 ? p.ldy : p.in_features;
      if (o0 < o1) split_rows_any(p, o0, o1, y, ldy);
      else for (int64_t r = 0; r < p.rows; ++r) std::fill(y + r * ldy, y + r * ldy + p.in_features, 0.0f);
    }
  });
  for (int64_t part = 1; part < kSplitParts; ++part)
    for (int64_t r = 0; r < p.rows; ++r) {
      float* y = p.y + r * p.ldy;
      const float* s = sums + (part - 1) * per + r * p.in_features;
      for (int64_t i = 0; i < p.in_features; ++i) y[i] += s[i];
    }
  return 0;
}

template <typename W>
int input_grad(const float* g, int64_t ldg, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t rows,
               int64_t out_features, int64_t in_features, int threads, const Team& team) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  if (rows == 0 || in_features == 0) return 0;
  if (out_features == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * ldy, y + r * ldy + in_features, 0.0f);
    return 0;
  }
  const InputGrad<W> p{g, ldg, w, ldw, y, ldy, rows, in_features};
  if (rows <= kSplitRowsMax) return input_grad_split_rows(p, out_features, threads, team);
  // At least 48 columns (6 vectors) per thread.
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, in_features / 48));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(in_features, 8, t, n, &first, &last);
    if (first < last) grad_range(p, out_features, first, last);
  });
  return 0;
}

// ---- packed products: c = A·B in 6×16 register tiles -----------------------------------------

// c[i, j] (+)= sum_s A(s, i) · B(s, j) (+ bias[j]), for c [m, n] with rows ldc apart, where
// A(s, i) = a[s · a_step + i · a_row] and B(s, j) = b[s · b_step + j · b_col], each with one
// unit stride: a weight gradient reads A from the output gradient's rows [k, m] (a_row 1) and
// B from the input's rows [k, n] (b_col 1); the forward reads A from x [m, k] (a_step 1) and B
// from w [n, k] (b_step 1); the input gradient A from g [m, k] and B from w [k, n].
struct Product {
  const float* a;
  int64_t a_step, a_row;
  const float* b;
  int64_t b_step, b_col;
  const uint16_t* b16;  // instead of b: B's values as bfloat16 bits, widened while packing
  const float* bias;  // [n], added once where c is written (not accumulated); or null
  float* c;
  uint16_t* c16;  // instead of c: bfloat16 bits, each float32 sum rounded once (one pass, no bias)
  int64_t ldc;
  int64_t k, m, n;
};

constexpr int64_t kTileRows = 6;    // rows of c per register tile
constexpr int64_t kPanel = 16;      // columns of c per register tile (two vectors)
constexpr int64_t kDepth = 256;     // steps s per pass (longer sums add passes over c)
constexpr int64_t kBlockRows = 48;  // rows of c whose slice of A is packed at a time with B packed once,
constexpr int64_t kOneBlock = 192;  // else this many (all of c's rows up to this many: one block)
constexpr int64_t kPackOnce = 1 << 17;  // B packed once per pass where a thread's part fits (floats)
constexpr int64_t kGroup = 8;  // else panels of B packed at a time (rows of B read 8·16 floats at once)

// One step of one row of a tile: c0 += a·b0, c1 += a·b1 (16 columns).
inline __attribute__((always_inline)) void tile_row(const float* a, __m256 b0, __m256 b1, __m256& c0, __m256& c1) {
  const __m256 a_i = _mm256_broadcast_ss(a);
  c0 = _mm256_fmadd_ps(a_i, b0, c0);
  c1 = _mm256_fmadd_ps(a_i, b1, c1);
}

// ROWS (≤ 6) rows of c by 16 columns, summed over `depth` steps: a_pack holds the steps' 6
// values of A one after another (6 floats a step), b_pack the 16 values of B (16 a step).
// The accumulators are named variables (see grad_tile for why). Stored into c, added to it
// when `add`, plus bias (16 values, or null); the last columns masked by `mask0`/`mask1` when
// `partial`.
// Eight float32 sums as bfloat16 bits, rounded as round_to_bf16 does (nearest even, NaN as
// the quiet NaN 0x7FC0).
inline __m256i round8_bits(__m256 v) {  // (in the low half of each 32-bit lane)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m128i round8_to_bf16(__m256 v) {
  const __m256i r = round8_bits(v);
  const __m256i halves = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..r3 r0..r3 | r4..r7 r4..r7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08));  // r0..r7
}
// Sixteen float32 sums (v0, then v1) as bfloat16 bits, rounded as round8_to_bf16 rounds: one
// pack and one 32-byte store where two eights took two of each. bf16 weight gradients written
// by the row split (thin_product), two 16-byte stores → one 32-byte store, ms (8 outputs in turn,
// best of 2×7 rounds): 7168×1024 from 1 / 64 rows 3.01 / 12.27 → 1.96 / 8.71, 1024×3584 1.40 /
// 6.27 → 0.72 / 4.45, 1024×1024 0.44 / 1.79 → 0.33 / 1.33.
inline __m256i round16_to_bf16(__m256 v0, __m256 v1) {
  const __m256i both = _mm256_packus_epi32(round8_bits(v0), round8_bits(v1));  // per lane: 4 of v0, 4 of v1
  return _mm256_permute4x64_epi64(both, 0xD8);  // v0's 8, then v1's 8
}
// line_tile's rounding (round_line): a sum's bits + 0x8000 rounds it half up, and their top
// 16 bits are its nearest-even bf16 except on a tie to even (bottom 16 bits exactly 0x8000, top
// ones even), which is where the bottom 17 bits of the sum read 0x10000 and one less is right:
// 4 instructions for 8 sums (add, and, compare, add; round8_bits takes 5, and 2 more for its
// NaN blend), the same bits as round8_bits for every float32 but a NaN.
struct LineRounding {
  __m256i half, low17, tie;  // 0x8000, 0x1FFFF, 0x10000 in each 32-bit lane
};
inline __m256i nearest_even_top(__m256 sums, const LineRounding& k) {
  const __m256i up = _mm256_add_epi32(_mm256_castps_si256(sums), k.half);
  return _mm256_add_epi32(up, _mm256_cmpeq_epi32(_mm256_and_si256(up, k.low17), k.tie));  // (-1 on a tie to even)
}
// Sixteen sums from `even` (columns 0, 2, …, 14) and `odd` (1, 3, …, 15): each 32-bit lane of
// the two holds a column pair, so one shift and one blend put the sixteen bf16 in column order
// (round16_to_bf16: two shifts, a pack and a permute). NaNs not set (see round_line).
inline __m256i round16_pairs(__m256 even, __m256 odd, const LineRounding& k) {
  return _mm256_blend_epi16(_mm256_srli_epi32(nearest_even_top(even, k), 16), nearest_even_top(odd, k), 0xAA);
}
// bits (round16_pairs' of even, odd) with 0x7FC0 where the sum is NaN.
inline __m256i quiet_nans(__m256i bits, __m256 even, __m256 odd) {
  const __m256i nan = _mm256_blend_epi16(_mm256_castps_si256(_mm256_cmp_ps(even, even, _CMP_UNORD_Q)),
                                         _mm256_castps_si256(_mm256_cmp_ps(odd, odd, _CMP_UNORD_Q)), 0xAA);
  return _mm256_blendv_epi8(bits, _mm256_set1_epi16(0x7FC0), nan);
}

// One row of line_tile: 32 float32 sums (s0, s1: columns 0–15 as round16_pairs takes them; s2,
// s3: 16–31) rounded to bf16 as round8_to_bf16 rounds and streamed into `line`; NaNs, rare,
// found by two compares for the row and set only in a row that has one. The same bits as
// round8_to_bf16 for every float32 (checked on all 2^32; the tests run every rounding case).
// Why: on the 2-core Zen 1 EPYC (128-bit units, two µops a 256-bit instruction, shifts on one
// pipe) a bf16 weight gradient from a few rows is mostly its rounding. GB/s of bf16 written, 64
// fine-grained or 8 Mixtral experts' gradients in turn (8 / 64 / 8 a call at 1 / 2 / 4 rows),
// bf16-valued rows, 15–41 interleaved rounds, round16_to_bf16 → this: fine-grained 1024×512 /
// 1024×1024 at 1 row 9.0 / 9.5 → 9.8 / 10.8, at 2 rows 8.4 / 8.4 → 9.3 / 9.4; Mixtral 3584×1024
// / 7168×1024 at 4 rows 6.8 / 6.6 → 7.4 / 7.3. (Top 16 bits taken unrounded, not exact: 14–17
// at 1 row, the bound here. Rounded half up with a branch to an exact path on ties: 1.25× on
// float32-valued rows, 0.75× on bf16-valued ones, whose products tie often: 1.8 % of the
// products of two randn rows rounded to bf16, 29 % of the lines of 32 hold one.)
// FINITE: the caller found every operand of the sums finite (finite_operands), so no sum is a
// NaN and the row's NaN screen is left out (see there).
template <bool FINITE = false>
inline void round_line(__m256 s0, __m256 s1, __m256 s2, __m256 s3, const LineRounding& k, __m256i* line) {
  __m256i low = round16_pairs(s0, s1, k), high = round16_pairs(s2, s3, k);
  if constexpr (!FINITE) {
    const __m256 nans = _mm256_or_ps(_mm256_cmp_ps(s0, s1, _CMP_UNORD_Q), _mm256_cmp_ps(s2, s3, _CMP_UNORD_Q));
    if (__builtin_expect(!_mm256_testz_ps(nans, nans), 0)) {  // (whole-lane masks: their sign bits)
      low = quiet_nans(low, s0, s1);
      high = quiet_nans(high, s2, s3);
    }
  }
  _mm256_stream_si256(line, low);
  _mm256_stream_si256(line + 1, high);
}

// Whether the n floats from `values` are all finite (no infinity, no NaN): a weight gradient's
// operands, screened once so that its lines of sums need no NaN screen each. A sum of products
// of finite operands formed by FMAs from +0 is never a NaN: a product of two finite values is
// an exact real, so each step is a finite value rounded (finite or ±infinity on overflow) or,
// once the sum is ±infinity, that infinity again; and nearest_even_top rounds ±infinity and
// values rounding past the largest bf16 to ±infinity as round8_to_bf16 does. Why: the screen
// per line of 32 sums (two compares, an or and a test feeding a branch) held the bf16 weight
// gradient back by more than its instruction count. ms, screened per line → per operands (8
// Mixtral experts' gradients in one weight_grad_blocks call, bf16-valued operands, 15
// interleaved rounds, the same bits, Zen 1 EPYC, 2026-12-06), 7168×1024 at 1 / 2 / 4 / 5 rows
// 9.76 → 7.87, 11.32 → 9.67, 13.32 → 11.37, 15.32 → 13.81; 1024×3584 5.01 → 4.04, 5.63 → 4.66,
// 6.82 → 6.11, 7.69 → 7.06. Layer bf16 forward+backward, builds alternated in one process (same
// bits): Mixtral T = 1 / 16 / 256 0.954× / 0.945× / 0.966× the time (41 / 21 / 7 rounds),
// fine-grained 0.962× / 0.955× / 0.988× (41 / 31 / 9).
inline bool finite_operands(const float* values, int64_t n) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256i special = _mm256_setzero_si256();  // lanes whose exponent bits are all set: ±inf, NaN
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent));
  }
  bool finite = _mm256_testz_si256(special, special);
  for (; i < n && finite; ++i) finite = std::isfinite(values[i]);
  return finite;
}

// The first `lanes` of eight sums into c: float32 as they are (masked), bfloat16 rounded.
inline void store_sums(float* at, __m256 sum, int64_t lanes, __m256i mask) {
  if (lanes == 8) _mm256_storeu_ps(at, sum);
  else _mm256_maskstore_ps(at, mask, sum);
}
inline void store_sums(uint16_t* at, __m256 sum, int64_t lanes, __m256i) {
  const __m128i bits = round8_to_bf16(sum);
  if (lanes == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), bits);
    return;
  }
  alignas(16) uint16_t part[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(part), bits);
  std::copy(part, part + lanes, at);
}

// C: float, or uint16_t (bfloat16 bits: stored, never added to; no bias).
template <int ROWS, bool STREAM = false, typename C>
void product_tile(const float* a_pack, const float* b_pack, int64_t depth, C* c, int64_t ldc, bool add,
                  const float* bias, bool partial, int64_t tail, __m256i mask0, __m256i mask1) {
  static_assert(1 <= ROWS && ROWS <= 6, "tile");
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t s = 0; s < depth; ++s, a_pack += kTileRows, b_pack += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(b_pack), b1 = _mm256_loadu_ps(b_pack + 8);
    tile_row(a_pack, b0, b1, c00, c01);
    if constexpr (ROWS > 1) tile_row(a_pack + 1, b0, b1, c10, c11);
    if constexpr (ROWS > 2) tile_row(a_pack + 2, b0, b1, c20, c21);
    if constexpr (ROWS > 3) tile_row(a_pack + 3, b0, b1, c30, c31);
    if constexpr (ROWS > 4) tile_row(a_pack + 4, b0, b1, c40, c41);
    if constexpr (ROWS > 5) tile_row(a_pack + 5, b0, b1, c50, c51);
  }
  const __m256 acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  __m256 shift[2] = {z, z};
  if (bias)
#pragma GCC unroll 32
    for (int v = 0; v < 2; ++v)
      shift[v] = partial ? _mm256_maskload_ps(bias + 8 * v, v == 0 ? mask0 : mask1) : _mm256_loadu_ps(bias + 8 * v);
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i) {
    C* row = c + i * ldc;
    if constexpr (std::is_same_v<C, uint16_t>) {
      static_assert(!STREAM, "bf16 sums are stored, not streamed (see thin_product)");
      if (!partial && !bias) {  // the row's 16 sums rounded and stored together (see round16_to_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), round16_to_bf16(acc[i][0], acc[i][1]));
        continue;
      }
    }
#pragma GCC unroll 32
    for (int v = 0; v < 2; ++v) {
      C* at = row + 8 * v;
      const __m256i mask = v == 0 ? mask0 : mask1;
      const int64_t lanes = partial ? std::clamp<int64_t>(tail - 8 * v, 0, 8) : 8;
      __m256 sum = bias ? _mm256_add_ps(acc[i][v], shift[v]) : acc[i][v];
      if constexpr (std::is_same_v<C, float>) {
        if constexpr (STREAM) {
          if (lanes == 8) {  // (the caller checked the alignment, and that nothing is added)
            _mm256_stream_ps(at, sum);
            continue;
          }
        }
        if (add) sum = _mm256_add_ps(sum, lanes == 8 ? _mm256_loadu_ps(at) : _mm256_maskload_ps(at, mask));
      }
      store_sums(at, sum, lanes, mask);
    }
  }
}

// bf16 c stored past the caches (weight gradients of at least kStreamFloats elements, see
// thin_product): ROWS (≤ 3) rows of c by 32 columns (the panels at b0_pack and b1_pack, side by
// side), so that a row's 32 rounded sums fill one 64-byte line, written by two 32-byte
// streaming stores back to back (c's lines 64-byte aligned: the caller checked). a_pack: the
// tile's packed A at the group's first row (kTileRows floats a step); each panel packed with
// its even columns first (see pack_b's `pairs`), for round_line.
template <int ROWS, bool FINITE>
void line_tile(const float* a_pack, const float* b0_pack, const float* b1_pack, int64_t depth, uint16_t* c,
               int64_t ldc) {
  static_assert(1 <= ROWS && ROWS <= 3, "tile");
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z, c23 = z;
  for (int64_t s = 0; s < depth; ++s, a_pack += kTileRows, b0_pack += kPanel, b1_pack += kPanel) {
    __m256 b0 = _mm256_loadu_ps(b0_pack), b1 = _mm256_loadu_ps(b0_pack + 8);
    tile_row(a_pack, b0, b1, c00, c01);
    if constexpr (ROWS > 1) tile_row(a_pack + 1, b0, b1, c10, c11);
    if constexpr (ROWS > 2) tile_row(a_pack + 2, b0, b1, c20, c21);
    b0 = _mm256_loadu_ps(b1_pack), b1 = _mm256_loadu_ps(b1_pack + 8);
    tile_row(a_pack, b0, b1, c02, c03);
    if constexpr (ROWS > 1) tile_row(a_pack + 1, b0, b1, c12, c13);
    if constexpr (ROWS > 2) tile_row(a_pack + 2, b0, b1, c22, c23);
  }
  const __m256 acc[3][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
  LineRounding k{_mm256_set1_epi32(0x8000), _mm256_set1_epi32(0x1FFFF), _mm256_set1_epi32(0x10000)};
  // (opaque: GCC 12 otherwise rebuilt the constants from general registers for every row)
  __asm__("" : "+x"(k.half), "+x"(k.low17), "+x"(k.tie));
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i)
    round_line<FINITE>(acc[i][0], acc[i][1], acc[i][2], acc[i][3], k, reinterpret_cast<__m256i*>(c + i * ldc));
}

// `rows` (0–3) rows of c by line_tile (0: nothing); `finite`: the tile's packed operands are
// (finite_operands).
template <bool FINITE>
inline void line_rows(int64_t rows, const float* a_pack, const float* b0_pack, const float* b1_pack, int64_t depth,
                      uint16_t* c, int64_t ldc) {
  switch (rows) {
    case 3: line_tile<3, FINITE>(a_pack, b0_pack, b1_pack, depth, c, ldc); break;
    case 2: line_tile<2, FINITE>(a_pack, b0_pack, b1_pack, depth, c, ldc); break;
    case 1: line_tile<1, FINITE>(a_pack, b0_pack, b1_pack, depth, c, ldc); break;
    default: break;
  }
}
inline void line_rows(bool finite, int64_t rows, const float* a_pack, const float* b0_pack, const float* b1_pack,
                      int64_t depth, uint16_t* c, int64_t ldc) {
  if (finite) line_rows<true>(rows, a_pack, b0_pack, b1_pack, depth, c, ldc);
  else line_rows<false>(rows, a_pack, b0_pack, b1_pack, depth, c, ldc);
}

// The eight rows r[0..7] as eight columns.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 32
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 32
  for (int h = 0; h < 8; h += 4) {
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 32
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Panels [q0, q1) of B (16 columns each) over steps [s0, s0 + depth), panel after panel in dst
// (depth·16 floats each): the 16 values of a step adjacent, zeros past n. Read in place, B's
// rows (or columns) lie a row length apart, a power of two for these shapes, which puts a
// panel's rows in one L1 set; packed, a panel passes under every tile of A from L1.

// B: float, or uint16_t (bfloat16 bits, widened exactly as they are loaded). Panels below
// `pairs` (B's steps rows only) hold each step's 16 values as its 8 even columns, then its 8
// odd ones (line_tile's order).
template <typename B>
void pack_b(const Product& p, const B* b, int64_t q0, int64_t q1, int64_t s0, int64_t depth, float* dst,
            int64_t pairs) {
  const int64_t last_col = std::min(p.n, q1 * kPanel);
  if (p.b_col == 1) {  // B's steps are rows: each step's part of a row read in one sweep
    for (int64_t s = 0; s < depth; ++s) {
      const B* src = b + (s0 + s) * p.b_step;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t col = q * kPanel;
        float* at = dst + (q - q0) * depth * kPanel + s * kPanel;
        if (q < pairs) {  // (lanes 0 2 8 10 | 4 6 12 14 of the shuffle, its 64-bit pairs reordered)
          const __m256 low = load8(src + col), high = load8(src + col + 8);
          const __m256 even = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0));
          const __m256 odd = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1));
          _mm256_storeu_ps(at, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
          _mm256_storeu_ps(at + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
        } else if (col + kPanel <= last_col) {
          _mm256_storeu_ps(at, load8(src + col));
          _mm256_storeu_ps(at + 8, load8(src + col + 8));
        } else {
          for (int64_t j = 0; j < kPanel; ++j) at[j] = col + j < last_col ? widen(src[col + j]) : 0.0f;
        }
      }
    }
    return;
  }
  // B's columns are rows of b (w [n, k]): transposed, 8 steps by 8 columns at a time
  for (int64_t q = q0; q < q1; ++q, dst += depth * kPanel) {
    const int64_t col = q * kPanel, width = std::min(kPanel, p.n - col);
    const int64_t whole = width == kPanel ? depth / 8 * 8 : 0;
    for (int64_t s = 0; s < whole; s += 8)
      for (int64_t h = 0; h < kPanel; h += 8) {
        __m256 r[8];
#pragma GCC unroll 32
        for (int j = 0; j < 8; ++j) r[j] = load8(b + (col + h + j) * p.b_col + s0 + s);
        transpose8(r);
#pragma GCC unroll 32
        for (int t = 0; t < 8; ++t) _mm256_storeu_ps(dst + (s + t) * kPanel + h, r[t]);
      }
    for (int64_t j = 0; j < kPanel; ++j) {
      const B* src = b + (col + j) * p.b_col + s0;
      for (int64_t s = whole; s < depth; ++s) dst[s * kPanel + j] = j < width ? widen(src[s]) : 0.0f;
    }
  }
}

void pack_b(const Product& p, int64_t q0, int64_t q1, int64_t s0, int64_t depth, float* dst, int64_t pairs = 0) {
  if (p.b16) pack_b(p, p.b16, q0, q1, s0, depth, dst, pairs);
  else pack_b(p, p.b, q0, q1, s0, depth, dst, pairs);
}

// Rows [row, row + count) of c (count ≤ 6) of A over steps [s0, s0 + depth) into a tile: the
// 6 values of a step adjacent (zeros past count).
void pack_a(const Product& p, int64_t row, int64_t count, int64_t s0, int64_t depth, float* dst) {
  if (p.a_row == 1) {  // A's steps are rows (an output gradient's rows)
    for (int64_t s = 0; s < depth; ++s) {
      const float* src = p.a + (s0 + s) * p.a_step + row;
      for (int64_t i = 0; i < kTileRows; ++i) dst[s * kTileRows + i] = i < count ? src[i] : 0.0f;
    }
    return;
  }
  for (int64_t i = 0; i < kTileRows; ++i) {  // A's rows are rows of a (x or g [m, k])
    const float* src = p.a + (row + i) * p.a_row + s0;
    for (int64_t s = 0; s < depth; ++s) dst[s * kTileRows + i] = i < count ? src[s] : 0.0f;
  }
}

// Panels [q0, q1) of c (16 columns each) over steps [s0, s0 + depth), rows [m0, m1) of c, in
// blocks of `block_rows` rows: a block's slice of A is packed into tiles of 6 rows, and each
// panel of B passes under the block's tiles. `once`: every panel of B is packed before the
// first block (into b_pack, depth·16 floats a panel), for c of many rows (a weight gradient);
// else B is packed as the tiles come to it, kGroup panels at a time, once per block.
void product_range(const Product& p, int64_t q0, int64_t q1, int64_t m0, int64_t m1, int64_t s0, int64_t depth,
                   bool add, int64_t block_rows, bool once, float* b_pack, float* a_pack) {
  const int64_t full = p.n / kPanel, tail = p.n - full * kPanel;
  if (once) pack_b(p, q0, q1, s0, depth, b_pack);
  const __m256i mask0 = first_lanes(std::min<int64_t>(tail, 8)), mask1 = first_lanes(std::max<int64_t>(tail - 8, 0));
  const bool with_bias = p.bias && !add;
  for (int64_t r0 = m0; r0 < m1; r0 += block_rows) {
    const int64_t rows = std::min(block_rows, m1 - r0);
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t row = r0 + t * kTileRows;
      pack_a(p, row, std::min(kTileRows, r0 + rows - row), s0, depth, a_pack + t * depth * kTileRows);
    }
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t packed_from = once ? q0 : q0 + (q - q0) / kGroup * kGroup;
      if (!once && q == packed_from) pack_b(p, q, std::min(q + kGroup, q1), s0, depth, b_pack);
      const float* b_q = b_pack + (q - packed_from) * depth * kPanel;
      const bool partial = q == full;
      const float* bias = with_bias ? p.bias + q * kPanel : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t row = r0 + t * kTileRows, count = std::min(kTileRows, r0 + rows - row);
        const float* a_t = a_pack + t * depth * kTileRows;
        auto tile = [&](auto* c) {
          switch (count) {
            case 6: product_tile<6>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
            case 5: product_tile<5>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
            case 4: product_tile<4>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
            case 3: product_tile<3>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
            case 2: product_tile<2>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
            default: product_tile<1>(a_t, b_q, depth, c, p.ldc, add, bias, partial, tail, mask0, mask1); break;
          }
        };
        const int64_t at = row * p.ldc + q * kPanel;
        if (p.c16) tile(p.c16 + at);
        else tile(p.c + at);
      }
    }
  }
}

// Weight gradients (A's and B's steps are rows, k ≤ kThinDepth, c of more than kOneBlock rows):
// from a few rows such a product is mostly the writing of c, and the order c is written in
// sets its speed. Here the threads each take a range of c's rows, and each tile of 6 rows goes
// across all of c's columns before the next, so each thread writes c row after row; the
// column split above writes a 48-row block panel by panel, i.e. 48 interleaved streams of
// lines, more than the prefetchers follow, and each store that first reads its line waits on
// memory. B is packed once, by the calling thread, for both threads; large outputs are stored
// past the caches (kStreamFloats). Per product on the 2-core AVX2 EPYC (the benchmark's four
// expert weights, 8 outputs in turn, 11 rounds, ms, column split / row split / row split with
// streaming stores / torch.mm): 7168×1024 from 1 row 8.67 / 2.86 / 1.71–5.30 / 3.78, 4 rows
// 8.06 / 2.93 / 2.36 / 9.08, 16 rows 8.94 / 3.84 / 3.78 / 8.94, 64 rows 12.8 / 9.2 / 9.9 / 13.4;
// 1024×1024 from 1 row 1.17 / 0.37 / 0.30 / 0.50, 32 rows 1.32 / 0.81 / 0.80 / 0.92; 1024×512
// from 4 rows 0.55 / 0.30 / 0.20 / 0.31. From 128 to 512 rows the row split with streaming
// stores was level with or ahead of both (7168×1024 at 512 rows: 82.6 / 60.2 against MKL's 69.5
// and 82.6 accumulating); at 2048 rows the packed B (2048·n floats) no longer stays in cache
// and it fell behind (1024×3584: 445 against 151 ms), hence kThinDepth.
constexpr int64_t kThinDepth = 512;
// Forward products and input gradients of kThinMinRows rows or more (the packed product's, all
// past the unpacked kernels' 64) take the row split too where B packed whole stays within
// kThinPackFloats (the fine-grained shape's weights, not Mixtral's): each 6-row tile then runs
// its whole sum at once against B packed once for the call, where the column split packed B
// anew for each pass of 256 steps and read and wrote c once a pass. fp32, interleaved A/B in one
// process: fine-grained forward T = 1024 / 2048 (blocks of ~128 / ~256 rows) 292.3 → 232.9 /
// 575.3 → 479.0 ms, forward+backward T = 512 / 1024 / 2048 469.1 → 449.8 / 1174.4 → 1153.0 /
// 1759.7 → 1641.6 (7–11 rounds); bf16 forward+backward T = 2048 1812.6 → 1577.8 (5); Mixtral
// (B of 3.7–7.3 M floats, not taken) level.
constexpr int64_t kThinMinRows = 65;
constexpr int64_t kThinPackFloats = int64_t{1} << 20;
// Outputs of at least this many floats are stored with streaming stores where c is 32-byte
// aligned: the optimizer reads a gradient next, and a store that first reads its line doubles
// the traffic of a product that is mostly writing.
constexpr int64_t kStreamFloats = int64_t{1} << 19;

// The panels of a bf16 c written a line at a time (line_tile, see thin_share): its pairs of
// whole panels where c is large and its lines aligned, else none. B's panels below this are
// packed for round_line (pack_b's `pairs`).
int64_t line_panels(const Product& p) {
  const bool lines = p.c16 && p.b_col == 1 && p.m * p.n >= kStreamFloats &&
                     reinterpret_cast<uintptr_t>(p.c16) % 64 == 0 && p.ldc % 32 == 0;
  return lines ? p.n / kPanel / 2 * 2 : 0;
}

template <bool STREAM, typename C>
void thin_rows(const Product& p, C* c, int64_t r0, int64_t r1, bool add, const float* b_pack, float* a_pack) {
  const int64_t panels = (p.n + kPanel - 1) / kPanel, full = p.n / kPanel, tail = p.n - full * kPanel;
  const __m256i mask0 = first_lanes(std::min<int64_t>(tail, 8)), mask1 = first_lanes(std::max<int64_t>(tail - 8, 0));
  constexpr bool kLines = STREAM && std::is_same_v<C, uint16_t>;
  const bool b_finite = kLines && finite_operands(b_pack, panels * p.k * kPanel);
  for (int64_t row = r0; row < r1; row += kTileRows) {
    const int64_t count = std::min(kTileRows, r1 - row);
    pack_a(p, row, count, 0, p.k, a_pack);
    C* c_row = c + row * p.ldc;
    int64_t q = 0;
    if constexpr (kLines) {  // whole lines (line_tile), then the rest stored
      const bool finite = b_finite && finite_operands(a_pack, p.k * kTileRows);
      const int64_t upper = std::min<int64_t>(count, 3);  // the tile's rows in two groups of up to 3
      for (; q + 2 <= full; q += 2) {
        const float *b0 = b_pack + q * p.k * kPanel, *b1 = b0 + p.k * kPanel;
        line_rows(finite, upper, a_pack, b0, b1, p.k, c_row + q * kPanel, p.ldc);
        line_rows(finite, count - upper, a_pack + 3, b0, b1, p.k, c_row + 3 * p.ldc + q * kPanel, p.ldc);
      }
    }
    constexpr bool kStreamTiles = STREAM && std::is_same_v<C, float>;
    for (; q < panels; ++q) {
      const float* b_q = b_pack + q * p.k * kPanel;
      const bool partial = q == full;
      const float* bias = p.bias && !add ? p.bias + q * kPanel : nullptr;
      C* at = c_row + q * kPanel;
      switch (count) {
        case 6: product_tile<6, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
        case 5: product_tile<5, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
        case 4: product_tile<4, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
        case 3: product_tile<3, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
        case 2: product_tile<2, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
        default: product_tile<1, kStreamTiles>(a_pack, b_q, p.k, at, p.ldc, add, bias, partial, tail, mask0, mask1); break;
      }
    }
  }
  if (STREAM) _mm_sfence();
}

// Rows [r0, r1) of c in the row split against B packed whole at b_pack (a_pack: room for one
// tile's A): streamed where c is large (kStreamFloats) and its lines aligned, else stored.
void thin_share(const Product& p, bool accumulate, int64_t r0, int64_t r1, const float* b_pack, float* a_pack) {
  if (r0 >= r1) return;
  // A float32 tile row's 16 sums are a whole 64-byte line. A bf16 tile row's 32 bytes are half
  // of one: streamed so, its other half from the next panel, they ran 1.1–2.1× slower than
  // plain stores (7168×1024 from 1 / 64 rows: 1.96 / 8.71 ms plain, 3.49 / 14.48 streamed; the
  // layer's bf16 forward+backward 6–21 % slower). So bf16 c is streamed a whole line at a time,
  // 32 columns (two panels) by 3 rows (line_tile), where its lines are 64-byte aligned; the
  // same sums. bf16 weight gradients, plain → whole lines streamed (8 Mixtral or 64
  // fine-grained experts' gradients in turn, written before, 11 interleaved rounds, GB/s of
  // bf16 written, 2-core AVX2 EPYC): 7168×1024 from 1 / 2 / 4 / 8 / 16 / 64 rows 5.9 → 14.3,
  // 6.2 → 12.7, 3.6 → 5.8, 3.3 → 4.4, 2.6 → 3.1, 1.0 → 1.1; 1024×3584 6.0 → 9.2, 5.5 → 7.9, 4.9
  // → 6.7, 4.0 → 4.8, 2.9 → 3.2, 1.0 → 1.2; 1024×1024 and 1024×512 1.31–1.84× at 1–8 rows,
  // 1.01–1.21× at 16–64. The layer's bf16 forward+backward, interleaved A/B: Mixtral T=1 18.50
  // → 15.43 ms (41 rounds), T=16 68.07 → 57.80 (15), T=256 level; fine-grained T=1 16.10 →
  // 14.66, T=16 76.21 → 59.28, T=256 317.70 → 310.36.
  const bool stream = !accumulate && !p.c16 && p.m * p.n >= kStreamFloats &&
                      reinterpret_cast<uintptr_t>(p.c) % 32 == 0 && p.ldc % 8 == 0;
  const bool stream16 = line_panels(p) > 0;  // (a bf16 c)
  if (stream16) thin_rows<true>(p, p.c16, r0, r1, false, b_pack, a_pack);
  else if (p.c16) thin_rows<false>(p, p.c16, r0, r1, false, b_pack, a_pack);
  else if (stream) thin_rows<true>(p, p.c, r0, r1, false, b_pack, a_pack);
  else thin_rows<false>(p, p.c, r0, r1, accumulate, b_pack, a_pack);
}

// c = A·B (+ bias) or c += A·B in the row split (see above); -1 where the scratch memory could
// not be had.
int thin_product(const Product& p, bool accumulate, int threads, const Team& team) {
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, p.m / 12));  // (two tiles a thread)
  const int64_t b_floats = p.k * panels * kPanel, a_floats = p.k * kTileRows;
  float* scratch = static_cast<float*>(moe_ffn_team::thread_scratch(sizeof(float) * (b_floats + count * a_floats)));
  if (!scratch) return -1;
  on_team(team, std::min<int64_t>(count, panels), [&](int64_t t, int64_t parts) {  // B packed by both threads
    int64_t q0, q1;
    share(panels, 1, t, parts, &q0, &q1);
    if (q0 < q1) pack_b(p, q0, q1, 0, p.k, scratch + q0 * p.k * kPanel, line_panels(p));
  });
  on_team(team, count, [&](int64_t t, int64_t parts) {
    int64_t r0, r1;
    share(p.m, kTileRows, t, parts, &r0, &r1);
    thin_share(p, accumulate, r0, r1, scratch, scratch + b_floats + t * a_floats);
  });
  return 0;
}

// c = A·B (+ bias), or c += A·B with `accumulate`, on the team: in the row split (thin_product)
// where it was measured ahead, else the threads split c's columns.
int product(const Product& p, bool accumulate, int threads, const Team& team) {
  if (p.k < 0 || p.m < 0 || p.n < 0 || threads < 1 || (accumulate && p.bias)) return -1;
  if ((p.a_step != 1 && p.a_row != 1) || (p.b_step != 1 && p.b_col != 1)) return -1;
  // the row split (thin_product) takes weight gradients of many rows, and those deeper than one
  // pass of the column split whatever their rows (all in one pass, as a bf16 c needs; float32
  // and bf16 c then get the same sums)
  const int64_t b_floats = p.k * ((p.n + kPanel - 1) / kPanel) * kPanel;
  const bool thin = (p.a_row == 1 && p.b_col == 1 && !p.bias && !p.b16 && p.k <= kThinDepth &&
                     (p.m > kOneBlock || p.k > kDepth)) ||
                    (!p.c16 && p.m >= kThinMinRows && b_floats <= kThinPackFloats);
  if (p.c16 && (accumulate || p.bias || (p.k > kDepth && !thin))) return -1;  // bf16 sums: rounded once, in one pass
  if (p.m == 0 || p.n == 0) return 0;
  if (p.k == 0) {
    if (!accumulate)
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t j = 0; j < p.n; ++j) {
          if (p.c16) p.c16[r * p.ldc + j] = 0;
          else p.c[r * p.ldc + j] = p.bias ? p.bias[j] : 0.0f;
        }
    return 0;
  }
  if (thin) return thin_product(p, accumulate, threads, team);
  const int64_t depth = std::min(p.k, kDepth);
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, panels / 4));
  const int64_t most = (panels + count - 1) / count;  // panels of one thread, at most
  // B packed once where c has too many rows for one block and the thread's panels fit (a
  // weight gradient: few steps); else B's panels are packed once per block, of more rows.
  const bool once = p.m > kOneBlock && depth * most * kPanel <= kPackOnce;
  const int64_t block_rows = p.m <= kOneBlock ? p.m : once ? kBlockRows : kOneBlock;
  const int64_t a_floats = depth * ((block_rows + kTileRows - 1) / kTileRows * kTileRows);
  const size_t per_thread = static_cast<size_t>(depth * (once ? most : kGroup) * kPanel + a_floats);
  std::vector<float> buffers;
  try {  // no exception may leave a C entry point
    buffers.resize(per_thread * static_cast<size_t>(count));
  } catch (...) {
    return -1;
  }
  on_team(team, count, [&](int64_t t, int64_t parts) {
    int64_t q0, q1;
    share(panels, 1, t, parts, &q0, &q1);
    float* b_pack = buffers.data() + per_thread * t;
    float* a_pack = b_pack + depth * (once ? most : kGroup) * kPanel;
    // B packed once: each pass over every row block; else each row block through every pass,
    // so that the block's part of c stays in cache from pass to pass
    const int64_t outer = once ? p.m : block_rows;
    for (int64_t m0 = 0; m0 < p.m; m0 += outer)
      for (int64_t s0 = 0; s0 < p.k; s0 += kDepth) {
        const int64_t d = std::min(kDepth, p.k - s0), m1 = std::min(m0 + outer, p.m);
        // (a smaller team than asked for gives a thread more panels than its buffer holds)
        for (int64_t q = q0; q < q1; q += most)
          product_range(p, q, std::min(q + most, q1), m0, m1, s0, d, accumulate || s0 > 0, block_rows, once, b_pack,
                        a_pack);
      }
  });
  return 0;
}

// ---- forward in place: yᵀ = w·xᵀ in 6×16 register tiles ---------------------------------------
//
// float32, 12–256 rows of x (kInPlaceRows says which of them; the strips above keep the
// others): the packed product's register tiles with the roles turned, so that the weight is
// never packed. A tile is 6 rows of w by 16 rows of x: each step broadcasts one value from
// each of the 6 rows of w, read where they lie, against 16 rows of x packed as one panel of xᵀ
// (pack_b; x is small, packed once a call). The threads split w's rows; each walks its rows
// in blocks of kInPlaceBlockBytes of w (kept in L2) and passes every panel under a block's
// tiles. A last panel of at most 8 rows of x (kInPlaceStripRows) goes through the strips
// instead (linear_strip: 4 rows of x against 3 rows of w, dot products along the rows), over
// each block while it is in L2, where it took tiles of 12 rows of w by 8 (one broadcast an
// FMA), which ran slower than a whole 16-row panel: GFLOP/s strips for all rows → in place
// with the half tiles, fine-grained 1024×1024 at 20 / 24 / 34 / 40 rows 50.9 → 35.7, 53.7 →
// 45.0, 57.7 → 44.7, 59.2 → 49.6 (64 experts' weights in one linear_blocks call, 5
// interleaved rounds, Zen 1 EPYC, 2026-12-06). In place with the last panel's rows on the
// strips against the strips for all rows (5 rounds, the same), 1024×1024 / 1024×512 at 16 /
// 20 / 24 / 28 / 32 / 36 / 40 / 48 / 64 rows: 53 → 73 / 54 → 63, 59 → 65 / 62 → 61, 63 → 62 /
// 61 → 61, 63 → 67 / 64 → 63, 69 → 77 / 64 → 70, 60 → 66 / 67 → 69, 69 → 67 / 52 → 59, 68 →
// 80 / 66 → 75, 71 → 73 / 72 → 67; the layer's forward (interleaved, 9–11 rounds, same
// machine) fine-grained T = 256 fp32 0.947×, Mixtral T = 256 0.921×. Its first
// measurement, at 65–128 rows against the packed product (which first copies the whole weight
// into panels: the fine-grained shape's 4 MiB per expert) and oneDNN's inner product (torch's
// choice for Mixtral's weights), before the strips prefetched: GFLOP/s, 7 interleaved rounds,
// before / after, at 65 / 72 / 88 / 100 / 128 rows: fine 1024×1024 58 / 72, 64 / 85, 70 / 84,
// 73 / 82, 85 / 93; Mixtral 1024×3584 86 / 95, 92 / 104, 98 / 112, 99 / 112, 104 / 117;
// 7168×1024 level. Against the strips without prefetch it was behind wherever the rows leave
// a panel part full (fine 1024×1024 at 17 / 24 / 40 rows 57 / 38, 69 / 54, 86 / 68). Past 256
// rows the packed product (at 512 rows it was ahead: fine 1024×512 119 / 102) or torch's
// kernels, as before.
constexpr int64_t kInPlaceBlockBytes = 256 << 10;

template <int ROWS>
inline void in_place_tile(const float* w, int64_t ldw, const float* panel, int64_t depth, float* sums) {
  __m256 c[kTileRows][2];
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < depth; ++s, panel += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
#pragma GCC unroll 32
    for (int i = 0; i < ROWS; ++i) {
      const __m256 a = _mm256_broadcast_ss(w + i * ldw + s);
      c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < ROWS; ++i) {
    _mm256_store_ps(sums + i * kPanel, c[i][0]);
    _mm256_store_ps(sums + i * kPanel + 8, c[i][1]);
  }
}

constexpr int64_t kInPlaceStripRows = 8;

// (arguments checked by linear())
int linear_in_place(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b, float* y, int64_t ldy,
                    int64_t rows, int64_t out_features, int64_t in_features, int64_t threads, const Team& team) {
  const int64_t depth = in_features, panels = (rows + kPanel - 1) / kPanel;
  // the last panel's rows through the strips where it has at most kInPlaceStripRows of them
  const int64_t last_rows = rows - (panels - 1) * kPanel;
  const int64_t tiled = panels > 1 && last_rows <= kInPlaceStripRows ? panels - 1 : panels;
  const Linear<float, float> strips{x + tiled * kPanel * ldx, ldx, w, ldw, b, y + tiled * kPanel * ldy, ldy,
                                    rows - tiled * kPanel, in_features};
  const __m256i tail_mask = first_lanes(in_features % 8);
  float* x_pack = static_cast<float*>(moe_ffn_team::thread_scratch(sizeof(float) * tiled * depth * kPanel));
  if (!x_pack) return -1;
  // B = xᵀ [depth, rows]: its columns are x's rows (transposed while packed, zeros past rows)
  const Product xt{nullptr, 0, 0, x, 1, ldx, nullptr, nullptr, nullptr, nullptr, 0, depth, 0, rows};
  on_team(team, std::min(threads, tiled), [&](int64_t t, int64_t n) {
    int64_t q0, q1;
    share(tiled, 1, t, n, &q0, &q1);
    pack_b(xt, q0, q1, 0, depth, x_pack + q0 * depth * kPanel);
  });
  const int64_t block =  // (whole tiles)
      std::max(kTileRows, kInPlaceBlockBytes / (int64_t{sizeof(float)} * depth) / kTileRows * kTileRows);
  on_team(team, threads, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(out_features, kTileRows, t, n, &first, &last);
    alignas(32) float sums[kTileRows * kPanel];
    for (int64_t o0 = first; o0 < last; o0 += block) {
      const int64_t o1 = std::min(last, o0 + block);
      for (int64_t q = 0; q < tiled; ++q) {
        const float* panel = x_pack + q * depth * kPanel;
        const int64_t r0 = q * kPanel, width = std::min(kPanel, rows - r0);
        for (int64_t o = o0; o < o1; o += kTileRows) {
          const int64_t count = std::min(kTileRows, o1 - o);
          const float* w_o = w + o * ldw;
          switch (count) {
            case 6: in_place_tile<6>(w_o, ldw, panel, depth, sums); break;
            case 5: in_place_tile<5>(w_o, ldw, panel, depth, sums); break;
            case 4: in_place_tile<4>(w_o, ldw, panel, depth, sums); break;
            case 3: in_place_tile<3>(w_o, ldw, panel, depth, sums); break;
            case 2: in_place_tile<2>(w_o, ldw, panel, depth, sums); break;
            default: in_place_tile<1>(w_o, ldw, panel, depth, sums); break;
          }
          for (int64_t j = 0; j < width; ++j) {  // the tile's sums are yᵀ: stored transposed
            float* y_j = y + (r0 + j) * ldy + o;
            for (int64_t i = 0; i < count; ++i) y_j[i] = sums[i * kPanel + j] + (b ? b[o + i] : 0.0f);
          }
        }
      }
      if (tiled < panels) {  // (the block's rows of w still in L2)
        int64_t o = o0;
        for (; o + 3 <= o1; o += 3) linear_strip<3>(strips, o, tail_mask);
        if (o1 - o == 2) linear_strip<2>(strips, o, tail_mask);
        if (o1 - o == 1) linear_strip<1>(strips, o, tail_mask);
      }
    }
  });
  return 0;
}

// ---- SwiGLU's elementwise work: a = silu(gate)·up and its gradient ------------------------

// e^x for eight floats: x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by its Taylor series to r^7
// (remainder below 2^-27 of the sum, under half an ulp), times 2^n as 2^(n − ⌊n/2⌋)·2^⌊n/2⌋
// (exponent bits; each factor normal, the first product exact). x is clamped to [-87.3, kExpMax]
// (below -87.3 e^x is subnormal and 1 + e^x is 1 all the same, the only use here), past kExpMax
// e^x is +inf as float32's exp makes it (it was clamped at 88.3 until 2026-12-05: silu(g) for g
// below -88.72 came out a tiny nonzero number where torch's is -0, since e^-g overflows), and
// NaN stays NaN.
constexpr float kExpMax = 88.72283935546875f;  // the least float32 whose e^x overflows, rounded: ln(FLT_MAX)
inline __m256 exp8(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMax), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts: n·ln2_hi is exact for |n| < 2^11 (ln2_hi has 12 significant bits)
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i k = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(k, 1);
  const __m256i bits_a = _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, half), _mm256_set1_epi32(127)), 23);
  const __m256i bits_b = _mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits_a)), _mm256_castsi256_ps(bits_b));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), over);
  return _mm256_or_ps(e, nan);  // (NaN lanes: all bits set)
}

// Loads and stores of the first `n` ≤ 8 lanes (all eight when n is 8, unmasked).
inline __m256 load_n(const float* at, int64_t n, __m256i mask) {
  return n == 8 ? _mm256_loadu_ps(at) : _mm256_maskload_ps(at, mask);
}
inline void store_n(float* at, __m256 v, int64_t n, __m256i mask) {
  if (n == 8) _mm256_storeu_ps(at, v);
  else _mm256_maskstore_ps(at, mask, v);
}

using Swiglu = moe_ffn_team::Swiglu<float>;

// Eight float32 values rounded to bfloat16 (round8_bits), back as float32.
inline __m256 round_to_bf16_values(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(round8_bits(v), 16)); }

// Row r. silu(g) = g / (1 + e^-g), as torch computes it; its derivative
// s·(1 + g·(1 − s)) with s = 1 / (1 + e^-g), as torch's silu_backward. ROUND (a bf16 layer
// computing in float32, h holding bf16 values): a, da·weight and dh rounded to bf16 values
// where grouped._hidden / _hidden_backward's ops round them (dweight from the rounded a and
// the unscaled da), so that the layer makes one pass where those ops made seven to ten.
template <bool ROUND>
void swiglu_row(const Swiglu& p, int64_t r, int64_t ahead) {  // ahead: see swiglu_row_ahead
  auto round = [](__m256 v) { return ROUND ? round_to_bf16_values(v) : v; };
  const float* gate = p.h + r * p.ldh;
  const float* up = gate + p.features;
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 w = _mm256_set1_ps(p.weight ? p.weight[r] : 1.0f);
  __m256 dot = _mm256_setzero_ps();
  for (int64_t f = 0; f < p.features; f += 8) {
    const int64_t n = std::min<int64_t>(8, p.features - f);
    const __m256i mask = first_lanes(n);
    if ((f & 15) == 0) moe_ffn_team::swiglu_prefetch(p, ahead, f);  // (16 floats: one line)
    const __m256 g = load_n(gate + f, n, mask), u = load_n(up + f, n, mask);
    const __m256 denominator = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    const __m256 act = _mm256_div_ps(g, denominator);
    const __m256 a = round(_mm256_mul_ps(act, u));
    if (p.a) store_n(p.a + r * p.lda + f, a, n, mask);
    if (!p.dh) continue;
    const __m256 da = load_n(p.da + r * p.ldda + f, n, mask);  // (zeros past n: dot unaffected)
    dot = _mm256_fmadd_ps(a, da, dot);
    const __m256 dav = round(_mm256_mul_ps(da, w));
    const __m256 s = _mm256_div_ps(one, denominator);
    const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));
    store_n(p.dh + r * p.lddh + f, round(_mm256_mul_ps(_mm256_mul_ps(dav, u), slope)), n, mask);
    store_n(p.dh + r * p.lddh + p.features + f, round(_mm256_mul_ps(dav, act)), n, mask);
  }
  if (p.dweight) p.dweight[r] = horizontal_sum(dot);
}

int swiglu(const Swiglu& p, int64_t rows, bool round_bf16, int threads, const Team& team) {
  if (rows < 0 || p.features < 0 || threads < 1) return -1;
  if (rows == 0) return 0;
  // at least 2^15 elements a thread: below that the team costs more than it saves
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, rows * p.features >> 15));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(rows, 1, t, n, &first, &last);
    for (int64_t r = first; r < last; ++r) {
      const int64_t ahead = moe_ffn_team::swiglu_row_ahead(p, r, last);
      round_bf16 ? swiglu_row<true>(p, r, ahead) : swiglu_row<false>(p, r, ahead);
    }
  });
  return 0;
}

// ---- The routed layer's sum over each token's slots -----------------------------------------
//
// out[token[i], :] += src[i, :]·weight[i] (weight null: += src[i, :]) for i = 0, 1, … in order,
// out float32, src float32 or bf16 (widened exactly), the product rounded once and then added:
// torch.mul into a float32 temporary and index_add_ in one pass, without the temporary (and
// without index_add_'s [rows, cols] expansion of the index). The threads split the columns, so
// each element's additions keep the rows' order: the same on any number of threads.
struct ScatterAdd {
  float* out;
  int64_t ldo;
  const int64_t* token;
  const void* src;  // float32 or bf16 rows, lds apart
  int64_t lds;
  const float* weight;
  int64_t rows, cols;
};

template <bool BF16>
inline __m256 load_src8(const void* row, int64_t c) {
  if (BF16) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(row) + c);
}

template <bool BF16>
inline float load_src1(const void* row, int64_t c) {
  if (!BF16) return static_cast<const float*>(row)[c];
  const uint32_t bits = uint32_t{static_cast<const uint16_t*>(row)[c]} << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <bool BF16>
void scatter_add_columns(const ScatterAdd& p, int64_t c0, int64_t c1) {
  const int64_t whole = c0 + (c1 - c0) / 8 * 8;
  const int64_t src_bytes = BF16 ? 2 : 4;
  for (int64_t i = 0; i < p.rows; ++i) {
    float* dst = p.out + p.token[i] * p.ldo;
    const void* row = static_cast<const char*>(p.src) + i * p.lds * src_bytes;
    const float w = p.weight ? p.weight[i] : 1.0f;
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t c = c0; c < whole; c += 8) {
      __m256 v = load_src8<BF16>(row, c);
      if (p.weight) v = _mm256_mul_ps(v, wv);
      __asm__("" : "+x"(v));  // the product rounded on its own: g++ fuses a product and a sum into an FMA
      _mm256_storeu_ps(dst + c, _mm256_add_ps(_mm256_loadu_ps(dst + c), v));
    }
    for (int64_t c = whole; c < c1; ++c) {
      float v = p.weight ? load_src1<BF16>(row, c) * w : load_src1<BF16>(row, c);
      __asm__("" : "+x"(v));
      dst[c] += v;
    }
  }
}

int scatter_add(const ScatterAdd& p, bool bf16, int threads, const Team& team) {
  // at least 2^15 elements a thread (as the SwiGLU passes), columns in whole 64-byte lines
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, p.rows * p.cols >> 15));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(p.cols, 16, t, n, &first, &last);
    if (first >= last) return;
    if (bf16) scatter_add_columns<true>(p, first, last);
    else scatter_add_columns<false>(p, first, last);
  });
  return 0;
}

// The same sum token by token: out[t, :] = Σ src[i, :]·weight[i] over the rows i of token t in
// ascending order (`slots`, from offsets[t] to offsets[t + 1]), starting from +0 as the
// accumulator above does: the same additions in the same order, so the same bits, but each
// token's row is written once, built in the cache, where the pass above read and wrote the
// float32 row once per slot, wherever it was. Tokens without rows get zeros. A bf16 out gets
// each float32 sum rounded once (round_to_bf16: torch's rounding, NaN aside: 0x7FC0 here, and
// from torch's vectorised rounding 0xFFFF). The threads split the tokens.
struct SlotSum {
  void* out;  // float32, or bf16
  int64_t ldo;
  const int64_t* offsets;  // [tokens + 1]
  const int64_t* slots;    // [rows]: the rows of token 0, then token 1, … each ascending
  const void* src;
  int64_t lds;
  const float* weight;
  int64_t cols;
};

// Each token's rows are read side by side, 32 columns (64 or 128 bytes) of every row at a time:
// as many streams for the prefetchers as the token has rows, where reading them one after the
// other waited on each row's first lines; the next token's first lines are prefetched. The
// additions per element keep the rows' order. The 2-core EPYC of family 26, bf16 rows of 1024
// summed alone (medians of 7): 65536 rows into 8192 tokens 11.06 → 5.22 ms, 16384 into 2048
// 2.08 → 0.90; in the fine-grained layer's forward+backward at T=8192 (two calls, the rows cold)
// 47.2 → 12.6 ms a step.
template <bool BF16>
inline const char* slot_row(const SlotSum& p, int64_t j) {
  return static_cast<const char*>(p.src) + p.slots[j] * p.lds * (BF16 ? 2 : 4);
}

template <bool BF16, bool OUT_BF16>
void slot_sum_tokens(const SlotSum& p, int64_t t0, int64_t t1) {
  constexpr int64_t kChunk = 32;
  const int64_t chunks = p.cols / kChunk * kChunk, whole = p.cols / 8 * 8;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t first = p.offsets[t], last = p.offsets[t + 1];
    if (t + 1 < t1)
      for (int64_t j = last; j < p.offsets[t + 2]; ++j) _mm_prefetch(slot_row<BF16>(p, j), _MM_HINT_T0);
    float* dst32 = OUT_BF16 ? nullptr : static_cast<float*>(p.out) + t * p.ldo;
    uint16_t* dst16 = OUT_BF16 ? static_cast<uint16_t*>(p.out) + t * p.ldo : nullptr;
    auto store8 = [&](int64_t c, __m256 v) {
      if (OUT_BF16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst16 + c), round8_to_bf16(v));
      else _mm256_storeu_ps(dst32 + c, v);
    };
    for (int64_t c = 0; c < chunks; c += kChunk) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (int64_t j = first; j < last; ++j) {
        const char* row = slot_row<BF16>(p, j);
        const __m256 wv = _mm256_set1_ps(p.weight ? p.weight[p.slots[j]] : 1.0f);
        __m256 v0 = load_src8<BF16>(row, c), v1 = load_src8<BF16>(row, c + 8);
        __m256 v2 = load_src8<BF16>(row, c + 16), v3 = load_src8<BF16>(row, c + 24);
        if (p.weight) {
          v0 = _mm256_mul_ps(v0, wv), v1 = _mm256_mul_ps(v1, wv);
          v2 = _mm256_mul_ps(v2, wv), v3 = _mm256_mul_ps(v3, wv);
        }
        __asm__("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3));  // (each product rounded on its own, as above)
        acc0 = _mm256_add_ps(acc0, v0), acc1 = _mm256_add_ps(acc1, v1);
        acc2 = _mm256_add_ps(acc2, v2), acc3 = _mm256_add_ps(acc3, v3);
      }
      store8(c, acc0), store8(c + 8, acc1), store8(c + 16, acc2), store8(c + 24, acc3);
    }
    for (int64_t c = chunks; c < whole; c += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = first; j < last; ++j) {
        __m256 v = load_src8<BF16>(slot_row<BF16>(p, j), c);
        if (p.weight) v = _mm256_mul_ps(v, _mm256_set1_ps(p.weight[p.slots[j]]));
        __asm__("" : "+x"(v));
        acc = _mm256_add_ps(acc, v);
      }
      store8(c, acc);
    }
    for (int64_t c = whole; c < p.cols; ++c) {
      float acc = 0.0f;
      for (int64_t j = first; j < last; ++j) {
        const float x = load_src1<BF16>(slot_row<BF16>(p, j), c);
        float v = p.weight ? x * p.weight[p.slots[j]] : x;
        __asm__("" : "+x"(v));
        acc += v;
      }
      if (OUT_BF16) dst16[c] = round_to_bf16(acc);
      else dst32[c] = acc;
    }
  }
}

int slot_sum(const SlotSum& p, int64_t tokens, bool bf16, bool out_bf16, int threads, const Team& team) {
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, tokens * p.cols >> 15));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(tokens, 1, t, n, &first, &last);
    if (bf16 && out_bf16) slot_sum_tokens<true, true>(p, first, last);
    else if (bf16) slot_sum_tokens<true, false>(p, first, last);
    else if (out_bf16) slot_sum_tokens<false, true>(p, first, last);
    else slot_sum_tokens<false, false>(p, first, last);
  });
  return 0;
}

}  // namespace

// y = x·wᵀ (+ b) for x [rows, in_features], w [out_features, in_features], y [rows,
// out_features]; row strides ldx, ldw, ldy in elements, every last dim contiguous; threads
// and the runtime's entry points as above. Returns 0, or -1 for arguments it does not take
// (then y is untouched).
extern "C" int moe_ffn_linear_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b,
                                  float* y, int64_t ldy, int64_t rows, int64_t out_features,
                                  int64_t in_features, int threads, void* parallel, void* thread_num,
                                  void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return linear(x, ldx, w, ldw, b, y, ldy, rows, out_features, in_features, threads, team);
}

// The row blocks of a grouped product, each through its expert's weight, in one call: the
// layer's loop over the experts in C++ instead of Python (~20 µs a block in the wrappers and the
// slicing there). blocks: `count` rows of (e, start, stop, accumulate) int64s; each block runs
// exactly the product its entry point above runs for it alone (the same sums), one parallel
// region a block. The row counts at which the single-block paths switch to the packed
// product (_small_gemm.py's IN_PLACE_MAX_ROWS = kInPlaceRows[1] for float32 forward products,
// MAX_ROWS for bf16 ones, INPUT_GRAD_ROWS[1] for input gradients):
constexpr int64_t kUnpackedRows = 64;

// Blocks of at most kDecodeRows rows each (a decode step's) run in one parallel region, each
// thread its share of every block's rows of w, as linear() shares them (the same sums), where
// each block's own region cost a fork and join. Forward, fp32, interleaved A/B (21 rounds),
// T = 1 / 4 / 16: fine-grained 4.7 → 4.6, 12.9 → 12.6, 27.7 → 26.5 ms; Mixtral 6.5 → 6.2, 15.5
// → 15.5, 27.9 → 27.6.
constexpr int64_t kDecodeRows = 8;

bool decode_sized(const int64_t* blocks, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (blocks[4 * i + 2] - blocks[4 * i + 1] > kDecodeRows) return false;
  return true;
}

// (blocks checked by the caller)
template <typename W, typename Y>
int decode_blocks(const float* x, int64_t ldx, const W* w, int64_t w_expert, int64_t ldw, Y* y, int64_t ldy,
                  const int64_t* blocks, int64_t count, int64_t out_features, int64_t in_features, int threads,
                  const Team& team) {
  const int64_t team_size = std::min<int64_t>(threads, std::max<int64_t>(1, out_features / 24));
  on_team(team, team_size, [&](int64_t t, int64_t parts) {
    int64_t first, last;
    share(out_features, 3, t, parts, &first, &last);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = blocks[4 * i], start = blocks[4 * i + 1], rows = blocks[4 * i + 2] - start;
      if (rows == 0) continue;
      const Linear<W, Y> p{x + start * ldx, ldx, w + e * w_expert, ldw, nullptr, y + start * ldy, ldy, rows, in_features};
      linear_range(p, first, last);
    }
  });
  return 0;
}

// y[start:stop] = x[start:stop]·w[e]ᵀ for w [E, O, I] (experts w_expert apart, rows ldw apart).
extern "C" int moe_ffn_linear_blocks_f32(const float* x, int64_t ldx, const float* w, int64_t experts,
                                         int64_t w_expert, int64_t ldw, float* y, int64_t ldy, const int64_t* blocks,
                                         int64_t count, int64_t out_features, int64_t in_features, int threads,
                                         void* parallel, void* thread_num, void* num_threads) {
  if (out_features < 0 || in_features < 0 || threads < 1) return -1;
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  if (decode_sized(blocks, count)) {
    if (each_block(blocks, count, experts, [](int64_t, int64_t, int64_t, bool) { return 0; })) return -1;
    return decode_blocks(x, ldx, w, w_expert, ldw, y, ldy, blocks, count, out_features, in_features, threads, team);
  }
  return each_block(blocks, count, experts, [&](int64_t e, int64_t start, int64_t rows, bool) {
    const float *x_b = x + start * ldx, *w_e = w + e * w_expert;
    float* y_b = y + start * ldy;
    if (rows <= kInPlaceRows[1])
      return linear(x_b, ldx, w_e, ldw, static_cast<const float*>(nullptr), y_b, ldy, rows, out_features, in_features,
                    threads, team);
    // A = x [rows, I], B = wᵀ read from w's rows
    return product(Product{x_b, 1, ldx, w_e, 1, ldw, nullptr, nullptr, y_b, nullptr, ldy, in_features, rows, out_features},
                   false, threads, team);
  });
}

// The same for bf16 w and y with x given in float32 (a decode step's few rows, widened by the
// caller): each block's sums as moe_ffn_linear_bf16 forms them, rounded once as stored; blocks
// of up to kUnpackedRows rows (-1 otherwise, nothing run).
extern "C" int moe_ffn_linear_blocks_bf16(const float* x, int64_t ldx, const uint16_t* w, int64_t experts,
                                          int64_t w_expert, int64_t ldw, uint16_t* y, int64_t ldy,
                                          const int64_t* blocks, int64_t count, int64_t out_features,
                                          int64_t in_features, int threads, void* parallel, void* thread_num,
                                          void* num_threads) {
  if (out_features < 0 || in_features < 0 || threads < 1) return -1;
  for (int64_t i = 0; i < count; ++i)
    if (blocks[4 * i + 2] - blocks[4 * i + 1] > kUnpackedRows) return -1;
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  if (decode_sized(blocks, count)) {
    if (each_block(blocks, count, experts, [](int64_t, int64_t, int64_t, bool) { return 0; })) return -1;
    return decode_blocks(x, ldx, w, w_expert, ldw, y, ldy, blocks, count, out_features, in_features, threads, team);
  }
  return each_block(blocks, count, experts, [&](int64_t e, int64_t start, int64_t rows, bool) {
    return linear(x + start * ldx, ldx, w + e * w_expert, ldw, static_cast<const float*>(nullptr), y + start * ldy,
                  ldy, rows, out_features, in_features, threads, team);
  });
}

namespace {

// The backward's blocks where every one has more than kSplitRowsMax rows (a layer's at a few
// hundred tokens and more): shared among the team's threads, each block whole on one thread
// (_team.h's each_block_shared, where the blocks fall into even enough shares), where each
// block had a parallel region of its own and the threads split its product. Each thread then
// streams whole expert weights (an input gradient's column split had each thread read half
// of every row of w: a new short stream each row) and the team meets once a call. The team
// splits a product's columns or rows, never its depth: the same sums either way. Fine-grained
// float32 blocks of 32 rows, the 64 experts' 1024×1024 / 1024×512 weights in one call
// (2-core Zen 1 EPYC, 2026-12-06, interleaved with the build before): input gradients 79.4 →
// 69.6 / 43.3 → 37.1 ms, weight gradients 70.4 → 77.5 / 65.1 → 75.9 GFLOP/s; the layer's
// forward+backward, steps alternated in one process (same bits): fine-grained T = 256 float32
// 0.94×, bf16 0.93×; Mixtral T = 256 and fine-grained T = 2048 level. The forward's blocks
// (linear_blocks) shared the same way were level (0.99–1.00×) and keep their regions. From one
// block a thread (each_block_shared's default asks two): a Mixtral layer's groups at T = 256
// hold two experts' blocks of ~64 rows, one to each thread now; forward+backward T = 256
// float32 0.971×, bf16 0.929× (same bits); T = 2048 level.
// Decode-sized blocks keep the whole team on each (their products are reads of w, split
// across the threads so that both stream it; the decode paths run them in one region anyway).
template <typename Block>  // Block: int(int64_t e, int64_t start, int64_t rows, bool flag, int threads)
int each_backward_block(const int64_t* blocks, int64_t count, int64_t experts, int threads, const Team& team,
                        const Block& block) {
  bool larger = count > 0;
  for (int64_t i = 0; i < count && larger; ++i) larger = blocks[4 * i + 2] - blocks[4 * i + 1] > kSplitRowsMax;
  if (larger) return each_block_shared(blocks, count, experts, true, threads, team, block, 1);
  return each_block(blocks, count, experts, [&](int64_t e, int64_t start, int64_t rows, bool flag) {
    return block(e, start, rows, flag, threads);
  });
}

// y[start:stop] = g[start:stop]·w[e] for w [E, O, I] of float32 or bfloat16 (W): each block as
// input_grad (through bf16 weights: moe_ffn_input_grad_bf16w) or past kUnpackedRows the packed
// product (bf16 w widened while packed: moe_ffn_product_bf16b) runs it alone (each_backward_block).
template <typename W>
int input_grad_blocks(const float* g, int64_t ldg, const W* w, int64_t experts, int64_t w_expert, int64_t ldw, float* y,
                      int64_t ldy, const int64_t* blocks, int64_t count, int64_t out_features, int64_t in_features,
                      int threads, const Team& team) {
  if (out_features < 0 || in_features < 0 || threads < 1) return -1;
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  return each_backward_block(blocks, count, experts, threads, team,
                             [&](int64_t e, int64_t start, int64_t rows, bool, int block_threads) {
    const float* g_b = g + start * ldg;
    const W* w_e = w + e * w_expert;
    float* y_b = y + start * ldy;
    if (rows <= kUnpackedRows)
      return input_grad(g_b, ldg, w_e, ldw, y_b, ldy, rows, out_features, in_features, block_threads, team);
    // A = g [rows, O], B = w [O, I]
    Product p{g_b, 1, ldg, nullptr, ldw, 1, nullptr, nullptr, y_b, nullptr, ldy, out_features, rows, in_features};
    if constexpr (kBf16) p.b16 = w_e;
    else p.b = w_e;
    return product(p, false, block_threads, team);
  });
}

// bf16 weight gradients of decode-sized blocks (blocks checked by the caller, none added to),
// each in the row split as thin_product runs it (c of more than kOneBlock rows), all in one
// parallel region: each thread packs each block's B itself (a few rows of b) and writes its
// share of the block's rows of c, block after block, where each block took two regions (B
// packed by both threads, then the rows), each ending with the faster thread waiting for the
// slower. The same shares of c's rows as thin_product: the same sums. GB/s of bf16 written,
// per block → one region (48 fine-grained or 6 Mixtral experts' gradients in turn, evicted
// from the caches before each call, 9 interleaved rounds, 2-core AVX2 EPYC), 1 / 2 / 3 / 4 / 6
// rows: 1024×512 10.2 → 14.6, 8.5 → 13.3, 10.8 → 12.0, 7.0 → 10.4, 8.7 → 9.5; 1024×1024 14.6 →
// 14.1, 12.3 → 13.7, 11.7 → 12.6, 10.6 → 11.5, 9.1 → 9.8; Mixtral's weights level (0.95–1.02).
// float32 gradients keep a region a block: there it was behind on three of the four weights
// (0.90–1.0×; 1024×512 0.94–1.12×).
// -1 where the scratch memory could not be had.
int thin_blocks(const float* a, int64_t lda, const float* b, int64_t ldb, uint16_t* c, int64_t c_expert, int64_t ldc,
                const int64_t* blocks, int64_t count, int64_t m, int64_t n, int threads, const Team& team) {
  if (m == 0 || n == 0) return 0;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t team_size = std::min<int64_t>(threads, std::max<int64_t>(1, m / 12));  // (as thin_product)
  const int64_t b_floats = kDecodeRows * panels * kPanel, a_floats = kDecodeRows * kTileRows;
  float* scratch =
      static_cast<float*>(moe_ffn_team::thread_scratch(sizeof(float) * team_size * (b_floats + a_floats)));
  if (!scratch) return -1;
  on_team(team, team_size, [&](int64_t t, int64_t parts) {
    float* b_pack = scratch + t * (b_floats + a_floats);
    int64_t r0, r1;
    share(m, kTileRows, t, parts, &r0, &r1);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t* block = blocks + 4 * i;
      const int64_t start = block[1], rows = block[2] - start;
      uint16_t* c_e = c + block[0] * c_expert;
      if (rows == 0) {  // an empty sum, as product() writes it
        for (int64_t r = r0; r < r1; ++r) std::fill(c_e + r * ldc, c_e + r * ldc + n, uint16_t{0});
        continue;
      }
      Product p{a + start * lda, lda, 1, b + start * ldb, ldb, 1, nullptr, nullptr, nullptr, c_e, ldc, rows, m, n};
      pack_b(p, 0, panels, 0, rows, b_pack, line_panels(p));
      thin_share(p, false, r0, r1, b_pack, b_pack + b_floats);
    }
  });
  return 0;
}

// c[e] = a[start:stop]ᵀ·b[start:stop] for c [E, M, N] of float32 (c[e] += … where the block's
// accumulate is set) or bfloat16 bits (C: each sum rounded once as stored, never added to),
// each block as weight_grad_into runs it alone (decode-sized blocks into bf16 c of more than
// kOneBlock rows: all in one parallel region, thin_blocks; else each_backward_block).
template <typename C>
int weight_grad_blocks(const float* a, int64_t lda, const float* b, int64_t ldb, C* c, int64_t experts,
                       int64_t c_expert, int64_t ldc, const int64_t* blocks, int64_t count, int64_t m, int64_t n,
                       int threads, const Team& team) {
  if (m < 0 || n < 0 || threads < 1) return -1;
  constexpr bool kBf16 = std::is_same_v<C, uint16_t>;
  if constexpr (kBf16) {
    for (int64_t i = 0; i < count; ++i)
      if (blocks[4 * i + 3] != 0) return -1;  // (before any block runs)
    if (count > 0 && m > kOneBlock && decode_sized(blocks, count)) {
      if (each_block(blocks, count, experts, [](int64_t, int64_t, int64_t, bool) { return 0; })) return -1;
      return thin_blocks(a, lda, b, ldb, c, c_expert, ldc, blocks, count, m, n, threads, team);
    }
  }
  return each_backward_block(blocks, count, experts, threads, team,
                             [&](int64_t e, int64_t start, int64_t rows, bool accumulate, int block_threads) {
    Product p{a + start * lda, lda, 1, b + start * ldb, ldb, 1, nullptr, nullptr, nullptr, nullptr, ldc, rows, m, n};
    if constexpr (kBf16) p.c16 = c + e * c_expert;
    else p.c = c + e * c_expert;
    return product(p, accumulate, block_threads, team);
  });
}

}  // namespace

// y[start:stop] = g[start:stop]·w[e] for w [E, O, I]: the input gradient through each block's
// expert (one-row blocks too, on the row split); float32 w, or bfloat16 w read as it is.
extern "C" int moe_ffn_input_grad_blocks_f32(const float* g, int64_t ldg, const float* w, int64_t experts,
                                             int64_t w_expert, int64_t ldw, float* y, int64_t ldy,
                                             const int64_t* blocks, int64_t count, int64_t out_features,
                                             int64_t in_features, int threads, void* parallel, void* thread_num,
                                             void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return input_grad_blocks(g, ldg, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features, in_features,
                           threads, team);
}
extern "C" int moe_ffn_input_grad_blocks_bf16w(const float* g, int64_t ldg, const uint16_t* w, int64_t experts,
                                               int64_t w_expert, int64_t ldw, float* y, int64_t ldy,
                                               const int64_t* blocks, int64_t count, int64_t out_features,
                                               int64_t in_features, int threads, void* parallel, void* thread_num,
                                               void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return input_grad_blocks(g, ldg, w, experts, w_expert, ldw, y, ldy, blocks, count, out_features, in_features,
                           threads, team);
}

// c[e] = a[start:stop]ᵀ·b[start:stop] (c[e] += … where the block's accumulate is set) for c
// [E, M, N] (experts c_expert apart, rows ldc apart), a [rows, M], b [rows, N]: the weight
// gradient of each block's expert; into float32 c, or bfloat16 c (no block accumulating: -1,
// nothing run).
extern "C" int moe_ffn_weight_grad_blocks_f32(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                                              int64_t experts, int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                              int64_t count, int64_t m, int64_t n, int threads, void* parallel,
                                              void* thread_num, void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return weight_grad_blocks(a, lda, b, ldb, c, experts, c_expert, ldc, blocks, count, m, n, threads, team);
}
extern "C" int moe_ffn_weight_grad_blocks_bf16c(const float* a, int64_t lda, const float* b, int64_t ldb, uint16_t* c,
                                                int64_t experts, int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                                int64_t count, int64_t m, int64_t n, int threads, void* parallel,
                                                void* thread_num, void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return weight_grad_blocks(a, lda, b, ldb, c, experts, c_expert, ldc, blocks, count, m, n, threads, team);
}

// The same product with every tensor bfloat16 (their bits): x and b are widened to float32
// first (a few rows, on the calling thread), w is widened as it is loaded (exactly: a bf16 is
// the top half of the float32 of the same value), the sums run in float32, and each is
// rounded to bfloat16 once as it is stored. The sums are the ones moe_ffn_linear_f32 forms on
// float32 copies of x, w and b, in the same order.
extern "C" int moe_ffn_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                                   const uint16_t* b, uint16_t* y, int64_t ldy, int64_t rows,
                                   int64_t out_features, int64_t in_features, int threads, void* parallel,
                                   void* thread_num, void* num_threads) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  std::vector<float> x_wide, b_wide;
  try {  // no exception may leave a C entry point
    x_wide.resize(static_cast<size_t>(rows * in_features));
    b_wide.resize(b ? static_cast<size_t>(out_features) : 0);
  } catch (...) {
    return -1;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in_features; ++i) x_wide[r * in_features + i] = widen(x[r * ldx + i]);
  for (size_t o = 0; o < b_wide.size(); ++o) b_wide[o] = widen(b[o]);
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return linear(x_wide.data(), in_features, w, ldw, b ? b_wide.data() : nullptr, y, ldy, rows, out_features,
                in_features, threads, team);
}

// y = g·w for g [rows, out_features], w [out_features, in_features], y [rows, in_features];
// as above otherwise.
extern "C" int moe_ffn_input_grad_f32(const float* g, int64_t ldg, const float* w, int64_t ldw, float* y,
                                      int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                                      int threads, void* parallel, void* thread_num, void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return input_grad(g, ldg, w, ldw, y, ldy, rows, out_features, in_features, threads, team);
}

// The same with w bfloat16 (its bits), read as it is and widened exactly as it is loaded: the
// sums are the ones moe_ffn_input_grad_f32 forms on a float32 copy of w, in the same order.
extern "C" int moe_ffn_input_grad_bf16w(const float* g, int64_t ldg, const uint16_t* w, int64_t ldw, float* y,
                                        int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                                        int threads, void* parallel, void* thread_num, void* num_threads) {
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return input_grad(g, ldg, w, ldw, y, ldy, rows, out_features, in_features, threads, team);
}

// c = A·B (+ bias[n]), or c += A·B with `accumulate` (then no bias), for c [m, n] with rows
// ldc apart, A(s, i) = a[s · a_step + i · a_row] and B(s, j) = b[s · b_step + j · b_col] over
// s < k, one of each pair of strides 1 (see Product); threads and the runtime's entry points
// as above. Returns 0, or -1 for arguments it does not take (then c is untouched).
extern "C" int moe_ffn_product_f32(const float* a, int64_t a_step, int64_t a_row, const float* b, int64_t b_step,
                                   int64_t b_col, const float* bias, float* c, int64_t ldc, int64_t k, int64_t m,
                                   int64_t n, int accumulate, int threads, void* parallel, void* thread_num,
                                   void* num_threads) {
  const Product p{a, a_step, a_row, b, b_step, b_col, nullptr, bias, c, nullptr, ldc, k, m, n};
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return product(p, accumulate != 0, threads, team);
}

// The same product stored as bfloat16 (bits): each float32 sum rounded once as it is stored
// (round_to_bf16); one pass only (k ≤ 256), no bias, no accumulating (-1 otherwise).
extern "C" int moe_ffn_product_bf16c(const float* a, int64_t a_step, int64_t a_row, const float* b, int64_t b_step,
                                     int64_t b_col, uint16_t* c, int64_t ldc, int64_t k, int64_t m, int64_t n,
                                     int threads, void* parallel, void* thread_num, void* num_threads) {
  const Product p{a, a_step, a_row, b, b_step, b_col, nullptr, nullptr, nullptr, c, ldc, k, m, n};
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return product(p, false, threads, team);
}

// The same product c = A·B (float32 c, no bias, not accumulating) with B's values bfloat16
// (bits) read as they are, each widened exactly while B is packed: the sums are the ones
// moe_ffn_product_f32 forms on a float32 copy of B, in the same order.
extern "C" int moe_ffn_product_bf16b(const float* a, int64_t a_step, int64_t a_row, const uint16_t* b,
                                     int64_t b_step, int64_t b_col, float* c, int64_t ldc, int64_t k, int64_t m,
                                     int64_t n, int threads, void* parallel, void* thread_num, void* num_threads) {
  const Product p{a, a_step, a_row, nullptr, b_step, b_col, b, nullptr, c, nullptr, ldc, k, m, n};
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return product(p, false, threads, team);
}

// a = silu(h[:, :F])·h[:, F:] for h [rows, 2F] (rows ldh apart) into a [rows, F] (lda);
// round_bf16: a rounded to bf16 values (see swiglu_row).
extern "C" int moe_ffn_swiglu_f32(const float* h, int64_t ldh, float* a, int64_t lda, int64_t rows, int64_t features,
                                  int round_bf16, int threads, void* parallel, void* thread_num, void* num_threads) {
  const Swiglu p{h, ldh, nullptr, 0, nullptr, a, lda, nullptr, 0, nullptr, features};
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return a ? swiglu(p, rows, round_bf16 != 0, threads, team) : -1;
}

// The gradient dh [rows, 2F] (lddh) of a = silu(gate)·up (h = gate | up, ldh) from da [rows, F]
// (ldda) scaled by weight[r] (null: 1); on the way a itself (lda; null: not wanted) and
// dweight[r] = sum_f a·da before the scaling (null: not wanted); round_bf16: a, da·weight and
// dh rounded to bf16 values (see swiglu_row).
extern "C" int moe_ffn_swiglu_backward_f32(const float* h, int64_t ldh, const float* da, int64_t ldda,
                                           const float* weight, float* a, int64_t lda, float* dh, int64_t lddh,
                                           float* dweight, int64_t rows, int64_t features, int round_bf16,
                                           int threads, void* parallel, void* thread_num, void* num_threads) {
  const Swiglu p{h, ldh, da, ldda, weight, a, lda, dh, lddh, dweight, features};
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  return dh && da ? swiglu(p, rows, round_bf16 != 0, threads, team) : -1;
}


// out[token[i], :] += src[i, :]·weight[i] (weight null: += src[i, :]) for float32 out [out_rows,
// cols] (ldo), int64 token [rows], float32 or bf16 (src_bf16) src [rows, cols] (lds), float32
// weight [rows] (see scatter_add_columns). Returns 0, or -1 before writing anything where a token
// is outside [0, out_rows).
extern "C" int moe_ffn_scatter_add_rows(float* out, int64_t ldo, int64_t out_rows, const int64_t* token,
                                        const void* src, int src_bf16, int64_t lds, const float* weight,
                                        int64_t rows, int64_t cols, int threads, void* parallel, void* thread_num,
                                        void* num_threads) {
  if (rows < 0 || cols < 0 || threads < 1) return -1;
  for (int64_t i = 0; i < rows; ++i)
    if (token[i] < 0 || token[i] >= out_rows) return -1;
  if (rows == 0 || cols == 0) return 0;
  const ScatterAdd p{out, ldo, token, src, lds, weight, rows, cols};
  return scatter_add(p, src_bf16 != 0, threads, moe_ffn_team::make_team(parallel, thread_num, num_threads));
}

// The sum of moe_ffn_scatter_add_rows (same arguments; out float32, or bf16 where out_bf16)
// into all out_rows rows of out, each written once (see SlotSum): rows of tokens without slots
// become zeros, so out needs no zeroing. `index` is the caller's int64 workspace of out_rows + 1
// + rows (the rows sorted by token, a counting sort that keeps their order). Returns 0, or -1
// before writing anything where a token is outside [0, out_rows).
extern "C" int moe_ffn_slot_sum_rows(void* out, int out_bf16, int64_t ldo, int64_t out_rows, const int64_t* token,
                                     const void* src, int src_bf16, int64_t lds, const float* weight, int64_t rows,
                                     int64_t cols, int64_t* index, int threads, void* parallel, void* thread_num,
                                     void* num_threads) {
  if (rows < 0 || cols < 0 || out_rows < 0 || threads < 1) return -1;
  for (int64_t i = 0; i < rows; ++i)
    if (token[i] < 0 || token[i] >= out_rows) return -1;
  int64_t* offsets = index;
  int64_t* slots = index + out_rows + 1;
  std::fill(offsets, offsets + out_rows + 1, int64_t{0});
  for (int64_t i = 0; i < rows; ++i) ++offsets[token[i] + 1];
  for (int64_t t = 0; t < out_rows; ++t) offsets[t + 1] += offsets[t];
  for (int64_t i = 0; i < rows; ++i) slots[offsets[token[i]]++] = i;  // offsets[t] → end of t
  for (int64_t t = out_rows; t > 0; --t) offsets[t] = offsets[t - 1];
  offsets[0] = 0;
  if (cols == 0) return 0;
  const SlotSum p{out, ldo, offsets, slots, src, lds, weight, cols};
  return slot_sum(p, out_rows, src_bf16 != 0, out_bf16 != 0, threads,
                  moe_ffn_team::make_team(parallel, thread_num, num_threads));
}

// A routed SwiGLU layer's forward over decode-sized float32 blocks in one call: the rows of x
// (x [tokens, dim], ldx) picked by token [rows] copied into xg [rows, dim], h = xg·w1_eᵀ
// ([rows, 2F], gate | up) by `linear1`, a = silu(gate)·up ([rows, F]) by moe_ffn_swiglu_f32,
// y = a·w2_eᵀ ([rows, dim]) by `linear2`, and out[token[n]] += weight[n]·y[n] (float32 out
// [tokens, dim], contiguous rows) by moe_ffn_scatter_add_rows; w1 [E, 2F, dim] and w2 [E, dim,
// F], experts w1_expert / w2_expert elements apart, rows ldw1 / ldw2. linear1 and linear2:
// the linear-blocks entry points (moe_ffn_linear_blocks_f32's signature) the caller would call
// for each projection. These are the calls grouped.py's decode path makes one by one, on the
// same buffers in the same order: the same sums, with one crossing from Python instead of
// five (each a few tens of µs of a 1–3 ms decode step, most of it spent with the caches
// emptied by the weights just read). Returns 0, or -1 where a token is outside [0, tokens)
// (nothing written) or a step declines (then out is untouched, and h, xg, a, y may hold anything).
namespace {

// rows × cols values widened exactly into float32 `to` (rows cols apart): row n of `from` (rows
// ld apart) is its row pick[n] (null: row n).
template <typename X>
void widen_rows(float* to, const X* from, int64_t ld, const int64_t* pick, int64_t rows, int64_t cols) {
  for (int64_t n = 0; n < rows; ++n) {
    const X* row = from + (pick ? pick[n] : n) * ld;
    for (int64_t i = 0; i < cols; ++i) to[n * cols + i] = widen(row[i]);
  }
}

// X: float (float32 x and weights) or uint16_t (bf16 bits; h32: float32 [rows, 2F] scratch).
template <typename X>
int routed_swiglu_blocks(const X* x, int64_t ldx, int64_t tokens, const int64_t* token, const float* weight,
                         const X* w1, int64_t w1_expert, int64_t ldw1, const X* w2, int64_t w2_expert, int64_t ldw2,
                         int64_t experts, int64_t dim, int64_t features, const int64_t* blocks, int64_t count,
                         int64_t rows, float* xg, X* h, float* h32, float* a, X* y, float* out, void* linear1,
                         void* linear2, int threads, void* parallel, void* thread_num, void* num_threads) {
  using LinearBlocks = int (*)(const float*, int64_t, const X*, int64_t, int64_t, int64_t, X*, int64_t, const int64_t*,
                               int64_t, int64_t, int64_t, int, void*, void*, void*);
  constexpr bool kBf16 = std::is_same_v<X, uint16_t>;
  if (rows < 1 || dim < 1 || features < 1 || tokens < 1 || threads < 1 || !linear1 || !linear2) return -1;
  for (int64_t n = 0; n < rows; ++n)
    if (token[n] < 0 || token[n] >= tokens) return -1;
  widen_rows(xg, x, ldx, token, rows, dim);
  const int64_t width = 2 * features;
  if (reinterpret_cast<LinearBlocks>(linear1)(xg, dim, w1, experts, w1_expert, ldw1, h, width, blocks, count, width, dim,
                                              threads, parallel, thread_num, num_threads) != 0)
    return -1;
  const float* h_wide = h32;
  if constexpr (kBf16) {
    widen_rows(h32, h, width, nullptr, rows, width);
  } else {
    h_wide = h;
  }
  if (moe_ffn_swiglu_f32(h_wide, width, a, features, rows, features, kBf16 ? 1 : 0, threads, parallel, thread_num,
                         num_threads) != 0)
    return -1;
  if (reinterpret_cast<LinearBlocks>(linear2)(a, features, w2, experts, w2_expert, ldw2, y, dim, blocks, count, dim,
                                              features, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  return moe_ffn_scatter_add_rows(out, dim, tokens, token, y, kBf16 ? 1 : 0, dim, weight, rows, dim, threads, parallel,
                                  thread_num, num_threads);
}

}  // namespace

extern "C" int moe_ffn_routed_swiglu_blocks_f32(const float* x, int64_t ldx, int64_t tokens, const int64_t* token,
                                                const float* weight, const float* w1, int64_t w1_expert, int64_t ldw1,
                                                const float* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim,
                                                int64_t features, const int64_t* blocks, int64_t count, int64_t rows,
                                                float* xg, float* h, float* a, float* y, float* out, void* linear1,
                                                void* linear2, int threads, void* parallel, void* thread_num,
                                                void* num_threads) {
  return routed_swiglu_blocks(x, ldx, tokens, token, weight, w1, w1_expert, ldw1, w2, w2_expert, ldw2, experts, dim,
                              features, blocks, count, rows, xg, h, nullptr, a, y, out, linear1, linear2, threads,
                              parallel, thread_num, num_threads);
}

// The same for bf16 x, w1, w2 in a layer that computes in float32 (x's rows widened exactly as
// they are gathered into xg, float32), through the bf16 linear-blocks entry points
// (moe_ffn_linear_blocks_bf16's signature) into bf16 h and y: h widened into h32 (float32
// [rows, 2F]), a = silu(gate)·up rounded to bf16 values in float32 (moe_ffn_swiglu_f32 with
// round_bf16: a bf16 `a` widened, as the second projection reads it), and out[token[n]] +=
// weight[n]·y[n] from bf16 y. The calls grouped.py's decode path makes for a bf16 layer
// computing in float32 (gather, linear_blocks (x widened), h.to(float32), swiglu, .to(bf16),
// linear_blocks (a widened), scatter_add_rows), the same bits, in one crossing from Python
// instead of nine.
extern "C" int moe_ffn_routed_swiglu_blocks_bf16(const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
                                                 const float* weight, const uint16_t* w1, int64_t w1_expert,
                                                 int64_t ldw1, const uint16_t* w2, int64_t w2_expert, int64_t ldw2,
                                                 int64_t experts, int64_t dim, int64_t features, const int64_t* blocks,
                                                 int64_t count, int64_t rows, float* xg, uint16_t* h, float* h32,
                                                 float* a, uint16_t* y, float* out, void* linear1, void* linear2,
                                                 int threads, void* parallel, void* thread_num, void* num_threads) {
  return routed_swiglu_blocks(x, ldx, tokens, token, weight, w1, w1_expert, ldw1, w2, w2_expert, ldw2, experts, dim,
                              features, blocks, count, rows, xg, h, h32, a, y, out, linear1, linear2, threads,
                              parallel, thread_num, num_threads);
}

// ---- a decode step's gradients through one weight, in one pass over its rows ------------------
//
// For a block of ROWS (1–2) rows of one expert and its weight W [O, I] (rows ldw apart), rows
// [o0, o1) (one thread's part of the input gradient's row split, input_grad_split_rows):
//   y[r, :] = Σ_{o0 ≤ o < o1} g[r, o]·W[o, :]   (the input gradient's part, from zero, o ascending:
//                                                 the sums split_rows forms for that part)
//   G[o, :] = Σ_k a[k, o]·b[k, :]                (the weight gradient's rows o, k over the block's
//                                                 rows ascending, from zero: thin_product's sums)
// G bf16: each sum rounded once (round_line), b given with each 16 columns' even ones first (as
// pack_b's `pairs`); G float32 as summed. I (n) a multiple of 32. Why one pass: at a decode
// step each weight is read once for its input gradient and its gradient written once, and the
// two passes were each bound by one thing — the reads by memory, the rounding and writing by
// instructions (Zen 1: 128-bit units); interleaved, one waits on memory while the other computes.
// Layer forward+backward, the one call without → with this pass (2-core Zen 1 EPYC, two builds
// alternated in one process, same bits, 41 / 21 rounds): T = 1 bf16 fine-grained 9.1 → 8.3 ms,
// Mixtral 13.3 → 12.0; fp32 12.2 → 11.3, 18.1 → 17.0; T = 16 bf16 60.3 → 54.4, 69.1 → 68.3 (its
// blocks mostly of 3–5 rows, not taken); fp32 73.3 → 71.5, 78.7 → 78.2.
template <int ROWS, bool STREAM, bool FINITE, typename X>
void gradient_rows(const X* w, int64_t ldw, const float* g, int64_t ldg, float* y, int64_t ldy, const float* a,
                   int64_t lda, const float* b, int64_t ldb, X* G, int64_t ldG, int64_t o0, int64_t o1, int64_t n) {
  constexpr bool kBf16 = std::is_same_v<X, uint16_t>;
  LineRounding k{_mm256_set1_epi32(0x8000), _mm256_set1_epi32(0x1FFFF), _mm256_set1_epi32(0x10000)};
  __asm__("" : "+x"(k.half), "+x"(k.low17), "+x"(k.tie));  // (see line_tile)
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t o = o0; o < o1; ++o) {
    const X* w_o = w + o * ldw;
    X* G_o = G + o * ldG;
    __m256 g_o[ROWS], a_o[ROWS];
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) {
      g_o[r] = _mm256_broadcast_ss(g + r * ldg + o);
      a_o[r] = _mm256_broadcast_ss(a + r * lda + o);
    }
    const bool first = o == o0;
    for (int64_t c = 0; c < n; c += 32) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m256 w_v = load8(w_o + c + 8 * v);
#pragma GCC unroll 2
        for (int r = 0; r < ROWS; ++r) {
          float* at = y + r * ldy + c + 8 * v;
          _mm256_storeu_ps(at, _mm256_fmadd_ps(g_o[r], w_v, first ? zero : _mm256_loadu_ps(at)));
        }
      }
      __m256 s[4] = {zero, zero, zero, zero};
#pragma GCC unroll 2
      for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) s[v] = _mm256_fmadd_ps(a_o[r], _mm256_loadu_ps(b + r * ldb + c + 8 * v), s[v]);
      if constexpr (kBf16) {
        if constexpr (STREAM) {
          round_line<FINITE>(s[0], s[1], s[2], s[3], k, reinterpret_cast<__m256i*>(G_o + c));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(G_o + c), quiet_nans(round16_pairs(s[0], s[1], k), s[0], s[1]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(G_o + c + 16),
                              quiet_nans(round16_pairs(s[2], s[3], k), s[2], s[3]));
        }
      } else {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          if constexpr (STREAM) _mm256_stream_ps(G_o + c + 8 * v, s[v]);
          else _mm256_storeu_ps(G_o + c + 8 * v, s[v]);
        }
      }
    }
  }
  if (STREAM) _mm_sfence();
}

// Whether gradient_pass takes a block of `rows` rows through a weight of I columns.
bool gradient_pass_takes(int64_t rows, int64_t in_features) { return 1 <= rows && rows <= 2 && in_features % 32 == 0; }

// For every block (e, start, stop) that gradient_pass_takes: y[start:stop] = g[start:stop]·W[e]
// (input_grad's sums: the row split's two parts, each from gradient_rows, added in part order)
// and G[e] = a[start:stop]ᵀ·b[start:stop] (weight_grad_blocks' sums, never added to), in one
// parallel region, thread t the part t of every block. b_pairs: rows·I floats of scratch (b
// reordered for bf16 G), spare: rows·I floats (part 1's sums). The other blocks untouched.
template <typename X>
void gradient_pass(const X* w, int64_t w_expert, int64_t ldw, const float* g, int64_t ldg, float* y, int64_t ldy,
                   const float* a, int64_t lda, const float* b, int64_t ldb, X* G, int64_t G_expert, int64_t ldG,
                   const int64_t* blocks, int64_t count, int64_t out_features, int64_t in_features, float* b_pairs,
                   float* spare, int threads, const Team& team) {
  static_assert(kSplitParts == 2, "spare holds part 1's sums");
  constexpr bool kBf16 = std::is_same_v<X, uint16_t>;
  const int64_t n = in_features;
  auto taken = [&](int64_t i) { return gradient_pass_takes(blocks[4 * i + 2] - blocks[4 * i + 1], n); };
  if constexpr (kBf16) {
    for (int64_t i = 0; i < count; ++i) {
      if (!taken(i)) continue;
      for (int64_t r = blocks[4 * i + 1]; r < blocks[4 * i + 2]; ++r)
        for (int64_t c = 0; c < n; c += 16)
          for (int64_t j = 0; j < 8; ++j) {
            b_pairs[r * n + c + j] = b[r * ldb + c + 2 * j];
            b_pairs[r * n + c + 8 + j] = b[r * ldb + c + 2 * j + 1];
          }
    }
  }
  const float* b_read = kBf16 ? b_pairs : b;
  const int64_t ldb_read = kBf16 ? n : ldb;
  const bool stream = out_features * n >= kStreamFloats && reinterpret_cast<uintptr_t>(G) % 64 == 0 &&
                      (G_expert * int64_t{sizeof(X)}) % 64 == 0 && (ldG * int64_t{sizeof(X)}) % 64 == 0;
  on_team(team, std::min<int64_t>(threads, kSplitParts), [&](int64_t t, int64_t parts) {
    for (int64_t part = t; part < kSplitParts; part += parts) {
      for (int64_t i = 0; i < count; ++i) {
        if (!taken(i)) continue;
        const int64_t e = blocks[4 * i], start = blocks[4 * i + 1], rows = blocks[4 * i + 2] - start;
        int64_t o0, o1;
        share(out_features, kSplitBlock, part, kSplitParts, &o0, &o1);
        float* y_b = part == 0 ? y + start * ldy : spare + start * n;
        const int64_t ldy_b = part == 0 ? ldy : n;
        if (o0 >= o1) {
          for (int64_t r = 0; r < rows; ++r) std::fill(y_b + r * ldy_b, y_b + r * ldy_b + n, 0.0f);
          continue;
        }
        const X* w_e = w + e * w_expert;
        X* G_e = G + e * G_expert;
        const float *g_b = g + start * ldg, *a_b = a + start * lda, *b_b = b_read + start * ldb_read;
        // (the part's operands of G's sums: a's columns [o0, o1) and b, each row of the block)
        bool finite = kBf16 && stream;
        for (int64_t r = 0; r < rows && finite; ++r)
          finite = finite_operands(a_b + r * lda + o0, o1 - o0) && finite_operands(b_b + r * ldb_read, n);
        auto run = [&](auto rows_c) {  // (ROWS 1 or 2, streamed or stored; operands finite)
          constexpr int kRows = decltype(rows_c)::value;
          if (finite)
            gradient_rows<kRows, true, true>(w_e, ldw, g_b, ldg, y_b, ldy_b, a_b, lda, b_b, ldb_read, G_e, ldG, o0, o1, n);
          else if (stream)
            gradient_rows<kRows, true, false>(w_e, ldw, g_b, ldg, y_b, ldy_b, a_b, lda, b_b, ldb_read, G_e, ldG, o0, o1, n);
          else
            gradient_rows<kRows, false, false>(w_e, ldw, g_b, ldg, y_b, ldy_b, a_b, lda, b_b, ldb_read, G_e, ldG, o0, o1, n);
        };
        if (rows == 1) run(std::integral_constant<int, 1>{});
        else run(std::integral_constant<int, 2>{});
      }
    }
  });
  for (int64_t i = 0; i < count; ++i) {  // part 0's sums + part 1's, as input_grad_split_rows adds them
    if (!taken(i)) continue;
    for (int64_t r = blocks[4 * i + 1]; r < blocks[4 * i + 2]; ++r)
      for (int64_t c = 0; c < n; ++c) y[r * ldy + c] += spare[r * n + c];
  }
}

// The backward of the forward above over the same decode-sized blocks, in one call: what the
// calls grouped._ffn_backward makes one by one for one group of routed SwiGLU rows without bias
// compute, each sum as the kernel that call chooses forms it: the same bits. With g, xg the
// rows of grad_out and x picked by token (widened), h = gate | up the forward's first projection:
//   a = silu(gate)·up (moe_ffn_swiglu_f32's a), g scaled by weight[n] into gs; da = g·w2[e]
//   (input_grad_blocks' sums) and grad_w2[e] = gsᵀ·a (weight_grad_blocks', the experts with
//   rows overwritten, the others untouched: every block its own expert), blocks of 1–2 rows in
//   one pass over w2's rows (gradient_pass), the others by those calls; the SwiGLU backward
//   (moe_ffn_swiglu_backward_f32): dweight[n] = <a_n, da_n> into grad_weight [rows], dh from
//   da·weight[n]; grad_w1[e] = dhᵀ·xg and dx = dh·w1[e] the same way; grad_x[t] = Σ dx over the
//   rows of token t, zeros for a token without rows (moe_ffn_slot_sum_rows: each token's
//   float32 sum rounded once).
// X = uint16_t: a bf16 layer computing in float32 (h widened into a float32 copy; a, da·weight,
// dh, the scaled g and dx rounded to bf16 values as the Python path's ops round them; the
// weight gradients stored as bf16, each sum rounded once; grad_x's sums rounded once as
// .to(bfloat16) rounds the float32 accumulator the Python path sums into, since the token-by-
// token sum from +0 is the same additions in the same order as that scatter-add into zeros).
// work: float32 scratch of rows·(3·dim + 2·features + 2F + 2·max(dim, features)) floats, plus
// rows·2F for bf16.
// Returns 0, or -1 where a token is outside [0, tokens) (nothing written) or a step fails
// (memory for its packed operands: then the gradients may hold anything).
namespace {

template <typename X>
int routed_swiglu_backward_blocks(const X* grad_out, int64_t ldg, const X* x, int64_t ldx, int64_t tokens,
                                  const int64_t* token, const float* weight, const X* h, int64_t ldh, const X* w1,
                                  int64_t w1_expert, int64_t ldw1, const X* w2, int64_t w2_expert, int64_t ldw2,
                                  int64_t experts, int64_t dim, int64_t features, const int64_t* blocks,
                                  int64_t count, int64_t rows, X* grad_w1, int64_t gw1_expert, int64_t ldgw1,
                                  X* grad_w2, int64_t gw2_expert, int64_t ldgw2, float* grad_weight, X* grad_x,
                                  int64_t ldgx, float* work, int threads, void* parallel, void* thread_num,
                                  void* num_threads) {
  constexpr bool kBf16 = std::is_same_v<X, uint16_t>;
  if (rows < 1 || dim < 1 || features < 1 || tokens < 1 || threads < 1) return -1;
  for (int64_t n = 0; n < rows; ++n)
    if (token[n] < 0 || token[n] >= tokens) return -1;
  if (each_block(blocks, count, experts, [](int64_t, int64_t, int64_t, bool) { return 0; })) return -1;
  const Team team = moe_ffn_team::make_team(parallel, thread_num, num_threads);
  const int64_t width = 2 * features, wide = std::max(dim, features);
  float *g = work, *gs = g + rows * dim, *dx = gs + rows * dim, *da = dx + rows * dim, *act = da + rows * features;
  float *dh = act + rows * features, *pairs = dh + rows * width, *spare = pairs + rows * wide;
  float* h32 = spare + rows * wide;  // (bf16 only)
  float* xg = gs;  // (gathered once gs is used)
  auto to_bf16_value = [](float v) { return kBf16 ? widen(round_to_bf16(v)) : v; };
  // the blocks gradient_pass leaves for a weight of `columns` columns (table of its own)
  auto rest = [&](int64_t columns) {
    std::vector<int64_t> left;
    for (int64_t i = 0; i < count; ++i)
      if (!gradient_pass_takes(blocks[4 * i + 2] - blocks[4 * i + 1], columns))
        left.insert(left.end(), blocks + 4 * i, blocks + 4 * i + 4);
    return left;
  };
  std::vector<int64_t> rest2, rest1;
  try {  // no exception may leave a C entry point
    rest2 = rest(features), rest1 = rest(dim);
  } catch (...) {
    return -1;
  }
  const int64_t count2 = static_cast<int64_t>(rest2.size()) / 4, count1 = static_cast<int64_t>(rest1.size()) / 4;
  widen_rows(g, grad_out, ldg, token, rows, dim);
  const float* h_wide = nullptr;
  int64_t ldh_wide = ldh;
  if constexpr (kBf16) {
    widen_rows(h32, h, ldh, nullptr, rows, width);
    h_wide = h32, ldh_wide = width;
  } else {
    h_wide = h;
  }
  // act = silu(gate)·up (the swiglu backward's a: the same instructions), g scaled into gs
  const Swiglu forward{h_wide, ldh_wide, nullptr, 0, nullptr, act, features, nullptr, 0, nullptr, features};
  if (swiglu(forward, rows, kBf16, threads, team) != 0) return -1;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t i = 0; i < dim; ++i) gs[n * dim + i] = to_bf16_value(g[n * dim + i] * weight[n]);
  // down projection: da = g·w2[e] and grad_w2[e] = gsᵀ·act
  gradient_pass(w2, w2_expert, ldw2, g, dim, da, features, gs, dim, act, features, grad_w2, gw2_expert, ldgw2, blocks,
                count, dim, features, pairs, spare, threads, team);
  if (count2 > 0 &&
      (input_grad_blocks(g, dim, w2, experts, w2_expert, ldw2, da, features, rest2.data(), count2, dim, features,
                         threads, team) != 0 ||
       weight_grad_blocks(gs, dim, act, features, grad_w2, experts, gw2_expert, ldgw2, rest2.data(), count2, dim,
                          features, threads, team) != 0))
    return -1;
  const Swiglu backward{h_wide, ldh_wide, da, features, weight, nullptr, 0, dh, width, grad_weight, features};
  if (swiglu(backward, rows, kBf16, threads, team) != 0) return -1;
  // first projection: dx = dh·w1[e] and grad_w1[e] = dhᵀ·xg
  widen_rows(xg, x, ldx, token, rows, dim);
  gradient_pass(w1, w1_expert, ldw1, dh, width, dx, dim, dh, width, xg, dim, grad_w1, gw1_expert, ldgw1, blocks, count,
                width, dim, pairs, spare, threads, team);
  if (count1 > 0 &&
      (weight_grad_blocks(dh, width, xg, dim, grad_w1, experts, gw1_expert, ldgw1, rest1.data(), count1, width, dim,
                          threads, team) != 0 ||
       input_grad_blocks(dh, width, w1, experts, w1_expert, ldw1, dx, dim, rest1.data(), count1, width, dim, threads,
                         team) != 0))
    return -1;
  if constexpr (kBf16)
    for (int64_t i = 0; i < rows * dim; ++i) dx[i] = to_bf16_value(dx[i]);
  std::vector<int64_t> index;
  try {
    index.resize(static_cast<size_t>(tokens + 1 + rows));
  } catch (...) {
    return -1;
  }
  return moe_ffn_slot_sum_rows(grad_x, kBf16 ? 1 : 0, ldgx, tokens, token, dx, 0, dim, nullptr, rows, dim,
                               index.data(), threads, parallel, thread_num, num_threads);
}

}  // namespace

extern "C" int moe_ffn_routed_swiglu_backward_blocks_f32(
    const float* grad_out, int64_t ldg, const float* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const float* h, int64_t ldh, const float* w1, int64_t w1_expert, int64_t ldw1,
    const float* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, float* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    float* grad_w2, int64_t gw2_expert, int64_t ldgw2, float* grad_weight, float* grad_x, int64_t ldgx, float* work,
    int threads, void* parallel, void* thread_num, void* num_threads) {
  return routed_swiglu_backward_blocks(grad_out, ldg, x, ldx, tokens, token, weight, h, ldh, w1, w1_expert, ldw1, w2,
                                       w2_expert, ldw2, experts, dim, features, blocks, count, rows, grad_w1,
                                       gw1_expert, ldgw1, grad_w2, gw2_expert, ldgw2, grad_weight, grad_x, ldgx, work,
                                       threads, parallel, thread_num, num_threads);
}

// The same for bf16 tensors (their bits) in a layer that computes in float32 (see above).
extern "C" int moe_ffn_routed_swiglu_backward_blocks_bf16(
    const uint16_t* grad_out, int64_t ldg, const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const uint16_t* h, int64_t ldh, const uint16_t* w1, int64_t w1_expert, int64_t ldw1,
    const uint16_t* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, uint16_t* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    uint16_t* grad_w2, int64_t gw2_expert, int64_t ldgw2, float* grad_weight, uint16_t* grad_x, int64_t ldgx,
    float* work, int threads, void* parallel, void* thread_num, void* num_threads) {
  return routed_swiglu_backward_blocks(grad_out, ldg, x, ldx, tokens, token, weight, h, ldh, w1, w1_expert, ldw1, w2,
                                       w2_expert, ldw2, experts, dim, features, blocks, count, rows, grad_w1,
                                       gw1_expert, ldgw1, grad_w2, gw2_expert, ldgw2, grad_weight, grad_x, ldgx, work,
                                       threads, parallel, thread_num, num_threads);
}

// A routing plan's order without capacity: order[i] = the i-th of the n assignments (t·top_k +
// k, expert ids[t·top_k + k]) sorted by expert, equal experts in their own order (a counting
// sort: the order a stable sort gives), counts[e] = the assignments of expert e, token[i] =
// order[i] / top_k. One call where torch made four small ops (argsort, bincount, the division,
// and their dispatch), most of a decode step's plan. Returns 0, or -1 where an id is outside
// [0, experts) (nothing written).
extern "C" int moe_ffn_plan_rows(const int64_t* ids, int64_t n, int64_t experts, int64_t top_k, int64_t* order,
                                 int64_t* counts, int64_t* token) {
  if (n < 0 || experts < 1 || top_k < 1) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= experts) return -1;
  std::fill(counts, counts + experts, int64_t{0});
  for (int64_t i = 0; i < n; ++i) ++counts[ids[i]];
  std::vector<int64_t> next(static_cast<size_t>(experts));
  for (int64_t e = 0, at = 0; e < experts; ++e) next[e] = at, at += counts[e];
  for (int64_t i = 0; i < n; ++i) order[next[ids[i]]++] = i;
  for (int64_t i = 0; i < n; ++i) token[i] = order[i] / top_k;
  return 0;
}

// The router's choice: ids[r·k .. r·k + k) = the columns of row r's k largest scores (row r at
// scores + r·ld), largest first, equal scores lower column first (torch.topk leaves the order
// of equal scores unspecified: its own varies with E and k). One pass over a row keeps its k
// best so far sorted; past the first k, eight scores at a time are compared with the k-th best
// and only those above it go in, by insertion (a softmax's 64 scores with k = 8: ~17 of them,
// most in the first chunks). The threads split the rows. Returns 0, or -1 for arguments it
// does not take or a NaN score (torch ranks NaN above every number; the caller leaves such
// rows to torch), ids then partly written.
namespace {

// Inserts score v of column c into best[0, filled) / id (sorted, largest first; v after the
// scores equal to it), growing filled up to k, else dropping the k-th.
inline void offer(float v, int64_t c, float* best, int64_t* id, int64_t& filled, int64_t k) {
  int64_t i = filled < k ? filled++ : k - 1;
  for (; i > 0 && best[i - 1] < v; --i) best[i] = best[i - 1], id[i] = id[i - 1];
  best[i] = v, id[i] = c;
}

bool topk_row(const float* row, int64_t cols, int64_t k, float* best, int64_t* id) {
  int64_t filled = 0, c = 0;
  for (; c < cols && filled < k; ++c) {
    if (row[c] != row[c]) return false;
    offer(row[c], c, best, id, filled, k);
  }
  for (; c + 8 <= cols; c += 8) {  // lanes above the k-th best, or NaN (not ≤)
    unsigned above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + c), _mm256_set1_ps(best[k - 1]), _CMP_NLE_UQ));
    for (; above; above &= above - 1) {
      const int64_t j = c + __builtin_ctz(above);
      if (row[j] != row[j]) return false;
      if (row[j] > best[k - 1]) offer(row[j], j, best, id, filled, k);
    }
  }
  for (; c < cols; ++c) {
    if (row[c] != row[c]) return false;
    if (row[c] > best[k - 1]) offer(row[c], c, best, id, filled, k);
  }
  return true;
}

// The same for k ≤ 8 with the k best in one vector register, largest first (lanes not yet
// filled NaN: no score counts as below them), and their columns in another: a score goes in at
// the lane after every kept score ≥ it, the lanes past it moving down one, without the
// insertion loop's branches (mispredicted at most scores it inserts).
bool topk_row8(const float* row, int64_t cols, int64_t k, int64_t* id) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), down = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
  __m256 best = _mm256_set1_ps(__builtin_nanf(""));
  __m256i col = _mm256_setzero_si256();
  const __m256i last = _mm256_set1_epi32(static_cast<int>(k - 1));
  auto insert = [&](float v, int64_t c) {
    const __m256 vv = _mm256_set1_ps(v);
    const int at = __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(best, vv, _CMP_GE_OQ)));
    const __m256i pos = _mm256_set1_epi32(at);
    const __m256i after = _mm256_cmpgt_epi32(lane, pos), here = _mm256_cmpeq_epi32(lane, pos);
    best = _mm256_blendv_ps(best, _mm256_permutevar8x32_ps(best, down), _mm256_castsi256_ps(after));
    best = _mm256_blendv_ps(best, vv, _mm256_castsi256_ps(here));
    col = _mm256_blendv_epi8(col, _mm256_permutevar8x32_epi32(col, down), after);
    col = _mm256_blendv_epi8(col, _mm256_set1_epi32(static_cast<int>(c)), here);
  };
  auto floor = [&] { return _mm256_permutevar8x32_ps(best, last); };  // the k-th best, broadcast
  int64_t c = 0;
  for (; c < cols && c < k; ++c) {
    if (row[c] != row[c]) return false;
    insert(row[c], c);
  }
  for (; c + 8 <= cols; c += 8) {  // lanes above the k-th best, or NaN (not ≤)
    unsigned above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + c), floor(), _CMP_NLE_UQ));
    for (; above; above &= above - 1) {
      const int64_t j = c + __builtin_ctz(above);
      if (row[j] != row[j]) return false;
      if (row[j] > _mm256_cvtss_f32(floor())) insert(row[j], j);
    }
  }
  for (; c < cols; ++c) {
    if (row[c] != row[c]) return false;
    if (row[c] > _mm256_cvtss_f32(floor())) insert(row[c], c);
  }
  alignas(32) int32_t kept[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(kept), col);
  for (int64_t i = 0; i < k; ++i) id[i] = kept[i];
  return true;
}

}  // namespace

extern "C" int moe_ffn_topk_rows(const float* scores, int64_t rows, int64_t cols, int64_t ld, int64_t k,
                                 int64_t* ids, int threads, void* parallel, void* thread_num, void* num_threads) {
  if (rows < 0 || cols < 1 || k < 1 || k > cols || ld < cols || threads < 1) return -1;
  std::atomic<bool> nan{false};
  // at least 2^15 scores a thread (as the SwiGLU passes)
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, rows * cols >> 15));
  moe_ffn_team::on_team(moe_ffn_team::make_team(parallel, thread_num, num_threads), count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    moe_ffn_team::share(rows, 1, t, n, &first, &last);
    std::vector<float> best(static_cast<size_t>(k));
    for (int64_t r = first; r < last && !nan.load(std::memory_order_relaxed); ++r)
      if (!(k <= 8 && cols < (int64_t{1} << 31) ? topk_row8(scores + r * ld, cols, k, ids + r * k)
                                                : topk_row(scores + r * ld, cols, k, best.data(), ids + r * k)))
        nan.store(true);
  });
  return nan.load() ? -1 : 0;
}

// Zeros written over `count` byte ranges of `base` (runs [2·count]: start, stop offsets) with
// streaming stores: the idle experts' slices of a weight gradient kept from the last step
// (_memory.gradient_memory), tens of MiB that nothing reads before the optimizer. torch's zero_
// stores through the caches, each line read first to own it: 36 MiB after the caches were
// dirtied, 1.24–1.28 ms against glibc's streaming memset's 0.88–0.91 on one thread (the Zen 4
// EPYC); glibc streams only past a size threshold, not per slice (3 MiB slices: 1.64 ms). The
// ranges' bytes are shared among the threads in 64-byte lines. Layer forward+backward in the
// benchmark's setting (the step after transformers' and the dense blocks' steps), torch's zero_ →
// this, alternated in one process (medians, 15–21 rounds): fine-grained bf16 T = 8 (~23 idle
// experts of 64) 0.909×, T = 16 0.980×, float32 T = 16 0.985×. Returns 0, or -1 where a range is
// reversed.
extern "C" int moe_ffn_zero_streaming(void* base, const int64_t* runs, int64_t count, int threads, void* parallel,
                                      void* thread_num, void* num_threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (runs[2 * i + 1] < runs[2 * i]) return -1;
    total += runs[2 * i + 1] - runs[2 * i];
  }
  char* const bytes = static_cast<char*>(base);
  // this thread's part [first, last) of the ranges' bytes laid end to end, written range by range
  const auto zero_part = [&](int64_t first, int64_t last) {
    int64_t offset = 0;
    for (int64_t i = 0; i < count && offset < last; ++i) {
      const int64_t size = runs[2 * i + 1] - runs[2 * i];
      const int64_t lo = std::max(first, offset), hi = std::min(last, offset + size);
      if (lo < hi) {
        char* p = bytes + runs[2 * i] + (lo - offset);
        char* const end = bytes + runs[2 * i] + (hi - offset);
        char* const aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 31) & ~uintptr_t{31});
        if (aligned >= end) {
          std::memset(p, 0, end - p);
        } else {
          std::memset(p, 0, aligned - p);
          p = aligned;
          const __m256i zero = _mm256_setzero_si256();
          for (; p + 32 <= end; p += 32) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), zero);
          std::memset(p, 0, end - p);
        }
      }
      offset += size;
    }
    _mm_sfence();
  };
  on_team(moe_ffn_team::make_team(parallel, thread_num, num_threads), total >= (1 << 20) ? threads : 1,
          [&](int64_t t, int64_t n) {
            int64_t first = 0, last = 0;
            share(total, 64, t, n, &first, &last);
            zero_part(first, last);
          });
  return 0;
}
