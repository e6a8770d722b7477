// The products of one expert's small block of rows on x86 CPUs with AVX2 and FMA, float32:
//
//     forward         y[r, o] = sum_i x[r, i] * w[o, i] (+ b[o])    (x·wᵀ)
//     input gradient  y[r, i] = sum_o g[r, o] * w[o, i]             (g·w)
//     weight gradient c[m, n] = sum_r a[r, m] * b[r, n]             (aᵀ·b)
//
// for a few rows r (the block) and an expert's weight w [O, I] with contiguous rows; the
// forward also for bfloat16 tensors (summed in float32, see moe_ffn_linear_bf16). Built at
// install time as an optional extension (pyproject.toml) and called through ctypes by
// moe_ffn/_small_gemm.py, which says when it is used and why (measured numbers there). No
// Python or torch API here: plain pointers and strides in, the result written to y.
//
// forward: dot products along the contiguous I dim of x and w, in register tiles of up to 4
// rows of x by 3 rows of w (12 accumulators of 8 lanes); a tile reuses its 3 rows of w from
// L1 for every 4 rows of x, so w is streamed from memory once per call and never packed. The
// threads split the rows of w.
//
// input gradient: sums of rows of w scaled by g, in register tiles of up to 4 rows of g by 24
// columns of w. w is walked in chunks of consecutive rows, and every row tile of g passes over
// a chunk's 24-column panel, adding into y, which stays in L2. From 24 rows of g the chunk is
// first packed (read row after row) so that a panel's rows are adjacent (see grad_range). The
// threads split the columns of w.
//
// weight gradient: for a few rows r (an expert's block) and a large c (the expert's weight
// gradient), in register tiles of 6 rows by 16 columns of c; b's rows are packed into 16-column
// panels and a's into 6-row tiles, and each element of c is stored once (no clearing pass). The
// threads split the columns of c.
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
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

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
  for (int i = 0; i < 8; ++i) lanes[i] = i < n ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}

// ---- running a body on torch's OpenMP team --------------------------------------------------

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
using IntFn = int (*)();

struct Team {
  void* parallel;  // GOMP_parallel, or null
  IntFn thread_num, num_threads;
};

template <typename Body>  // Body: void(int64_t thread, int64_t count)
struct TeamCall {
  const Body* body;
  IntFn thread_num, num_threads;
  static void run(void* arg) {
    const TeamCall& call = *static_cast<const TeamCall*>(arg);
    (*call.body)(call.thread_num(), call.num_threads());
  }
};

template <typename Body>
void on_team(const Team& team, int64_t threads, const Body& body) {
  if (threads <= 1 || !team.parallel || !team.thread_num || !team.num_threads) {
    body(0, 1);
    return;
  }
  TeamCall<Body> call{&body, team.thread_num, team.num_threads};
  reinterpret_cast<ParallelFn>(team.parallel)(TeamCall<Body>::run, &call, static_cast<unsigned>(threads), 0);
}

// Part t of `count` parts of [0, units), in whole multiples of `step` but for the end.
inline void share(int64_t units, int64_t step, int64_t t, int64_t count, int64_t* first, int64_t* last) {
  const int64_t steps = (units + step - 1) / step;
  *first = std::min(units, steps * t / count * step);
  *last = std::min(units, steps * (t + 1) / count * step);
}

// ---- forward: y = x·wᵀ (+ b) ----------------------------------------------------------------

// Eight weights as float32 lanes: float32 as they are; bfloat16 (its bits, uint16_t) widened,
// exactly: a bf16 is the top half of the float32 with the same value.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
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

// A float32 sum as a bfloat16 (its bits), rounded to nearest, ties to even; NaN as the quiet
// NaN 0x7FC0. The same rounding as torch's float32 → bfloat16 conversion (c10::BFloat16).
inline uint16_t round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
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
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t whole = p.in_features & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 w_k[COLS];
    for (int j = 0; j < COLS; ++j) w_k[j] = load8(w + j * p.ldw + k);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_loadu_ps(x + i * p.ldx + k);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  if (whole < p.in_features) {
    __m256 w_k[COLS];
    for (int j = 0; j < COLS; ++j) w_k[j] = load_tail(w + j * p.ldw + whole, p.in_features - whole, tail_mask);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_maskload_ps(x + i * p.ldx + whole, tail_mask);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) store(y + i * p.ldy + j, horizontal_sum(acc[i][j]) + (b ? b[j] : 0.0f));
}

template <int COLS, typename W, typename Y>
void linear_strip(const Linear<W, Y>& p, int64_t o, __m256i tail_mask) {
  const W* w = p.w + o * p.ldw;
  const float* b = p.b ? p.b + o : nullptr;
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4) linear_tile<4, COLS>(p, p.x + r * p.ldx, w, p.y + r * p.ldy + o, b, tail_mask);
  const float* x = p.x + r * p.ldx;
  Y* y = p.y + r * p.ldy + o;
  switch (p.rows - r) {
    case 3: linear_tile<3, COLS>(p, x, w, y, b, tail_mask); break;
    case 2: linear_tile<2, COLS>(p, x, w, y, b, tail_mask); break;
    case 1: linear_tile<1, COLS>(p, x, w, y, b, tail_mask); break;
    default: break;
  }
}

// Rows [first, last) of w, in strips of 3 rows.
template <typename W, typename Y>
void linear_range(const Linear<W, Y>& p, int64_t first, int64_t last) {
  const __m256i tail_mask = first_lanes(p.in_features % 8);
  int64_t o = first;
  for (; o + 3 <= last; o += 3) linear_strip<3>(p, o, tail_mask);
  if (last - o == 2) linear_strip<2>(p, o, tail_mask);
  if (last - o == 1) linear_strip<1>(p, o, tail_mask);
}

template <typename W, typename Y>
int linear(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* b, Y* y, int64_t ldy,
           int64_t rows, int64_t out_features, int64_t in_features, int threads, const Team& team) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  if (rows == 0 || out_features == 0) return 0;
  const Linear<W, Y> p{x, ldx, w, ldw, b, y, ldy, rows, in_features};
  // At least 24 rows of w (8 strips) per thread.
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, out_features / 24));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(out_features, 3, t, n, &first, &last);
    linear_range(p, first, last);
  });
  return 0;
}

// ---- input gradient: y = g·w ----------------------------------------------------------------

struct InputGrad {
  const float* g;
  int64_t ldg;
  const float* w;
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
template <int ROWS, int VECS, bool MASKED>
void grad_tile(const InputGrad& p, const float* g, int64_t c, float* y, int64_t o0, int64_t count, bool fresh,
               __m256i mask, const float* w, int64_t ldw) {
  static_assert(1 <= ROWS && ROWS <= 4 && 1 <= VECS && VECS <= 3, "tile");
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
  const int64_t ldg = p.ldg;
  const float *g0 = g + o0, *g1 = g0 + ldg, *g2 = g1 + ldg, *g3 = g2 + ldg;
  auto load = [mask](const float* at, bool partial) {
    return partial ? _mm256_maskload_ps(at, mask) : _mm256_loadu_ps(at);
  };
  for (int64_t o = 0; o < count; ++o, w += ldw) {
    const __m256 w0 = load(w, MASKED && VECS == 1);
    const __m256 w1 = VECS > 1 ? load(w + 8, MASKED && VECS == 2) : z;
    const __m256 w2 = VECS > 2 ? load(w + 16, MASKED) : z;
    fma_row<VECS>(_mm256_broadcast_ss(g0 + o), w0, w1, w2, a00, a01, a02);
    if constexpr (ROWS > 1) fma_row<VECS>(_mm256_broadcast_ss(g1 + o), w0, w1, w2, a10, a11, a12);
    if constexpr (ROWS > 2) fma_row<VECS>(_mm256_broadcast_ss(g2 + o), w0, w1, w2, a20, a21, a22);
    if constexpr (ROWS > 3) fma_row<VECS>(_mm256_broadcast_ss(g3 + o), w0, w1, w2, a30, a31, a32);
  }
  const __m256 acc[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < VECS; ++v) {
      float* at = y + i * p.ldy + c + 8 * v;
      const bool partial = MASKED && v == VECS - 1;
      const __m256 sum = fresh ? acc[i][v] : _mm256_add_ps(acc[i][v], load(at, partial));
      if (partial) _mm256_maskstore_ps(at, mask, sum);
      else _mm256_storeu_ps(at, sum);
    }
}

// w: the panel's first row at its first column, ldw apart (w itself, or a packed copy).
template <int VECS, bool MASKED>
void grad_panel(const InputGrad& p, int64_t c, int64_t o0, int64_t count, bool fresh, __m256i mask, const float* w,
                int64_t ldw) {
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4)
    grad_tile<4, VECS, MASKED>(p, p.g + r * p.ldg, c, p.y + r * p.ldy, o0, count, fresh, mask, w, ldw);
  const float* g = p.g + r * p.ldg;
  float* y = p.y + r * p.ldy;
  switch (p.rows - r) {
    case 3: grad_tile<3, VECS, MASKED>(p, g, c, y, o0, count, fresh, mask, w, ldw); break;
    case 2: grad_tile<2, VECS, MASKED>(p, g, c, y, o0, count, fresh, mask, w, ldw); break;
    case 1: grad_tile<1, VECS, MASKED>(p, g, c, y, o0, count, fresh, mask, w, ldw); break;
    default: break;
  }
}

constexpr int64_t kPackRows = 24;     // rows of g from which w is packed
constexpr int64_t kPackedChunk = 64;  // rows of w per pass over y when packed

// Columns [first, last) of y (first a multiple of 8), all rows of w. From kPackRows rows of g,
// each chunk of w's rows is first copied, row after row (read in memory order), into panels
// of consecutive rows: read in place, a panel's rows lie a row length apart, which for a
// power-of-two length puts them all in one L1 set, evicting each other while the row tiles
// pass over them.
void grad_range(const InputGrad& p, int64_t out_features, int64_t first, int64_t last) {
  const __m256i mask = first_lanes((last - first) % 8);
  const bool pack = p.rows >= kPackRows;
  const int64_t chunk = pack ? kPackedChunk : kChunk;
  const int64_t width = last - first, padded = (width + 7) / 8 * 8;
  std::vector<float> packed(pack ? chunk * padded : 0);
  for (int64_t o0 = 0; o0 < out_features; o0 += chunk) {
    const int64_t count = std::min(chunk, out_features - o0);
    const bool fresh = o0 == 0;
    // panel q of width wq starts at column c (relative to first); packed at chunk·c, rows wq apart
    auto panel = [&](int64_t c, int64_t wq) -> std::pair<const float*, int64_t> {
      if (!pack) return {p.w + o0 * p.ldw + first + c, p.ldw};
      return {packed.data() + chunk * c, wq};
    };
    if (pack) {
      for (int64_t o = 0; o < count; ++o) {
        const float* src = p.w + (o0 + o) * p.ldw + first;
        int64_t c = 0;
        for (; c + 24 <= width; c += 24)
          for (int v = 0; v < 3; ++v) _mm256_storeu_ps(packed.data() + chunk * c + o * 24 + 8 * v, _mm256_loadu_ps(src + c + 8 * v));
        for (; c + 8 <= width; c += 8) _mm256_storeu_ps(packed.data() + chunk * c + o * 8, _mm256_loadu_ps(src + c));
        if (c < width) _mm256_storeu_ps(packed.data() + chunk * c + o * 8, _mm256_maskload_ps(src + c, mask));
      }
    }
    int64_t c = 0;
    for (; c + 24 <= width; c += 24) {
      const auto [w, ldw] = panel(c, 24);
      grad_panel<3, false>(p, first + c, o0, count, fresh, mask, w, ldw);
    }
    for (; c + 8 <= width; c += 8) {
      const auto [w, ldw] = panel(c, 8);
      grad_panel<1, false>(p, first + c, o0, count, fresh, mask, w, ldw);
    }
    if (c < width) {
      const auto [w, ldw] = panel(c, 8);
      grad_panel<1, true>(p, first + c, o0, count, fresh, mask, w, ldw);
    }
  }
}

// ---- weight gradient: c = aᵀ·b --------------------------------------------------------------

struct WeightGrad {
  const float* a;  // [k, m], rows lda apart (the output gradient's rows of the block)
  int64_t lda;
  const float* b;  // [k, n], rows ldb apart (the layer input's rows)
  int64_t ldb;
  float* c;        // [m, n], rows ldc apart
  int64_t ldc;
  int64_t k, m, n;
};

constexpr int64_t kWgTileRows = 6;   // rows of c per register tile
constexpr int64_t kWgPanel = 16;     // columns of c per register tile (two vectors)
constexpr int64_t kWgBlockRows = 48; // rows of c whose slice of a is packed at a time
constexpr int64_t kWgDepth = 256;    // rows of a and b per pass (deeper products add passes)

// One step of one row of a tile: c0 += a·b0, c1 += a·b1 (16 columns).
inline __attribute__((always_inline)) void wgrad_row(const float* a, __m256 b0, __m256 b1, __m256& c0, __m256& c1) {
  const __m256 a_i = _mm256_broadcast_ss(a);
  c0 = _mm256_fmadd_ps(a_i, b0, c0);
  c1 = _mm256_fmadd_ps(a_i, b1, c1);
}

// ROWS (≤ 6) rows of c by 16 columns, summed over `depth` steps: a_pack holds the steps' 6
// values of a one after another (6 floats a step), b_pack the 16 values of b (16 a step).
// The accumulators are named variables (see grad_tile for why). Stored into c, added to it
// when `add`; the last COLS < 16 columns masked by `mask0`/`mask1` when `partial`.
template <int ROWS>
void wgrad_tile(const float* a_pack, const float* b_pack, int64_t depth, float* c, int64_t ldc, bool add,
                bool partial, __m256i mask0, __m256i mask1) {
  static_assert(1 <= ROWS && ROWS <= 6, "tile");
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t s = 0; s < depth; ++s, a_pack += kWgTileRows, b_pack += kWgPanel) {
    const __m256 b0 = _mm256_loadu_ps(b_pack), b1 = _mm256_loadu_ps(b_pack + 8);
    wgrad_row(a_pack, b0, b1, c00, c01);
    if constexpr (ROWS > 1) wgrad_row(a_pack + 1, b0, b1, c10, c11);
    if constexpr (ROWS > 2) wgrad_row(a_pack + 2, b0, b1, c20, c21);
    if constexpr (ROWS > 3) wgrad_row(a_pack + 3, b0, b1, c30, c31);
    if constexpr (ROWS > 4) wgrad_row(a_pack + 4, b0, b1, c40, c41);
    if constexpr (ROWS > 5) wgrad_row(a_pack + 5, b0, b1, c50, c51);
  }
  const __m256 acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < ROWS; ++i) {
    float* row = c + i * ldc;
    for (int v = 0; v < 2; ++v) {
      float* at = row + 8 * v;
      const __m256i mask = v == 0 ? mask0 : mask1;
      if (partial) {
        const __m256 sum = add ? _mm256_add_ps(acc[i][v], _mm256_maskload_ps(at, mask)) : acc[i][v];
        _mm256_maskstore_ps(at, mask, sum);
      } else {
        _mm256_storeu_ps(at, add ? _mm256_add_ps(acc[i][v], _mm256_loadu_ps(at)) : acc[i][v]);
      }
    }
  }
}

// Panels [q0, q1) of c (16 columns each) over steps [s0, s0 + depth) of a and b, every row of
// c. b's steps are packed first into the panels (zeros past n), a panel's steps adjacent; then
// a block of c's rows at a time, a's slice for the block is packed into tiles of 6 (zeros past
// the block), and each panel of b passes under the block's tiles from L1. Read in place, a's
// and b's rows lie a row length apart, a power of two for these shapes, which puts a panel's
// rows in one L1 set.
void wgrad_range(const WeightGrad& p, int64_t q0, int64_t q1, int64_t s0, int64_t depth, bool add, float* b_pack,
                 float* a_pack) {
  const int64_t full = p.n / kWgPanel;
  for (int64_t q = q0; q < q1; ++q) {
    float* dst = b_pack + (q - q0) * depth * kWgPanel;
    const int64_t col = q * kWgPanel, width = std::min(kWgPanel, p.n - col);
    for (int64_t s = 0; s < depth; ++s) {
      const float* src = p.b + (s0 + s) * p.ldb + col;
      if (width == kWgPanel) {
        _mm256_storeu_ps(dst + s * kWgPanel, _mm256_loadu_ps(src));
        _mm256_storeu_ps(dst + s * kWgPanel + 8, _mm256_loadu_ps(src + 8));
      } else {
        for (int64_t j = 0; j < kWgPanel; ++j) dst[s * kWgPanel + j] = j < width ? src[j] : 0.0f;
      }
    }
  }
  const int64_t tail = p.n - full * kWgPanel;
  const __m256i mask0 = first_lanes(std::min<int64_t>(tail, 8)), mask1 = first_lanes(std::max<int64_t>(tail - 8, 0));
  for (int64_t r0 = 0; r0 < p.m; r0 += kWgBlockRows) {
    const int64_t rows = std::min(kWgBlockRows, p.m - r0);
    const int64_t tiles = (rows + kWgTileRows - 1) / kWgTileRows;
    for (int64_t t = 0; t < tiles; ++t) {
      float* dst = a_pack + t * depth * kWgTileRows;
      const int64_t row = r0 + t * kWgTileRows, count = std::min(kWgTileRows, r0 + rows - row);
      for (int64_t s = 0; s < depth; ++s) {
        const float* src = p.a + (s0 + s) * p.lda + row;
        for (int64_t i = 0; i < kWgTileRows; ++i) dst[s * kWgTileRows + i] = i < count ? src[i] : 0.0f;
      }
    }
    for (int64_t q = q0; q < q1; ++q) {
      const float* b_q = b_pack + (q - q0) * depth * kWgPanel;
      const bool partial = q == full;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t row = r0 + t * kWgTileRows, count = std::min(kWgTileRows, r0 + rows - row);
        const float* a_t = a_pack + t * depth * kWgTileRows;
        float* c = p.c + row * p.ldc + q * kWgPanel;
        switch (count) {
          case 6: wgrad_tile<6>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
          case 5: wgrad_tile<5>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
          case 4: wgrad_tile<4>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
          case 3: wgrad_tile<3>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
          case 2: wgrad_tile<2>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
          default: wgrad_tile<1>(a_t, b_q, depth, c, p.ldc, add, partial, mask0, mask1); break;
        }
      }
    }
  }
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
  const Team team{parallel, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
  return linear(x, ldx, w, ldw, b, y, ldy, rows, out_features, in_features, threads, team);
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
  auto widen = [](uint16_t bits) {
    const uint32_t wide = uint32_t{bits} << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    return value;
  };
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
  const Team team{parallel, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
  return linear(x_wide.data(), in_features, w, ldw, b ? b_wide.data() : nullptr, y, ldy, rows, out_features,
                in_features, threads, team);
}

// y = g·w for g [rows, out_features], w [out_features, in_features], y [rows, in_features];
// as above otherwise.
extern "C" int moe_ffn_input_grad_f32(const float* g, int64_t ldg, const float* w, int64_t ldw, float* y,
                                      int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                                      int threads, void* parallel, void* thread_num, void* num_threads) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  if (rows == 0 || in_features == 0) return 0;
  if (out_features == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * ldy, y + r * ldy + in_features, 0.0f);
    return 0;
  }
  const InputGrad p{g, ldg, w, ldw, y, ldy, rows, in_features};
  const Team team{parallel, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
  // At least 48 columns (6 vectors) per thread.
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, in_features / 48));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(in_features, 8, t, n, &first, &last);
    if (first < last) grad_range(p, out_features, first, last);
  });
  return 0;
}

// c = aᵀ·b, or c += aᵀ·b with `accumulate`, for a [k, m], b [k, n], c [m, n] (a weight
// gradient: a the output gradient's rows, b the input's); row strides lda, ldb, ldc in
// elements, every last dim contiguous; threads and the runtime's entry points as above. The
// threads split c's columns. Returns 0, or -1 for arguments it does not take (c untouched).
extern "C" int moe_ffn_weight_grad_f32(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                                       int64_t ldc, int64_t k, int64_t m, int64_t n, int accumulate, int threads,
                                       void* parallel, void* thread_num, void* num_threads) {
  if (k < 0 || m < 0 || n < 0 || threads < 1) return -1;
  if (m == 0 || n == 0) return 0;
  if (k == 0) {
    if (!accumulate)
      for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return 0;
  }
  const WeightGrad p{a, lda, b, ldb, c, ldc, k, m, n};
  const int64_t depth = std::min(k, kWgDepth);
  const int64_t panels = (n + kWgPanel - 1) / kWgPanel;
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, panels / 4));
  const int64_t most = (panels + count - 1) / count;  // panels of one thread, at most
  const size_t per_thread = static_cast<size_t>(depth * (most * kWgPanel + kWgBlockRows));
  std::vector<float> buffers;
  try {  // no exception may leave a C entry point
    buffers.resize(per_thread * static_cast<size_t>(count));
  } catch (...) {
    return -1;
  }
  const Team team{parallel, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
  on_team(team, count, [&](int64_t t, int64_t parts) {
    int64_t q0, q1;
    share(panels, 1, t, parts, &q0, &q1);
    float* b_pack = buffers.data() + per_thread * t;
    float* a_pack = b_pack + depth * most * kWgPanel;
    for (int64_t s0 = 0; s0 < k; s0 += kWgDepth) {
      const int64_t d = std::min(kWgDepth, k - s0);
      // (a smaller team than asked for gives a thread more panels than its buffer holds)
      for (int64_t q = q0; q < q1; q += most)
        wgrad_range(p, q, std::min(q + most, q1), s0, d, accumulate || s0 > 0, b_pack, a_pack);
    }
  });
  return 0;
}
