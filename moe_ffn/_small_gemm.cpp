// The forward product of one expert's small block of rows on x86 CPUs with AVX2 and FMA:
//
//     y[r, o] = sum_i x[r, i] * w[o, i] (+ b[o])     float32, r < R (a few rows), o < O, i < I
//
// Built at install time as an optional extension (pyproject.toml) and called through ctypes
// by moe_ffn/_small_gemm.py, which says when it is used and why (measured numbers there).
// No Python or torch API here: plain pointers and strides in, the result written to y.
//
// The kernel: dot products along the contiguous I dim of x and w, in register tiles of up to
// 4 rows of x by 3 rows of w (12 accumulators of 8 lanes); a tile reuses its 3 rows of w from
// L1 for every 4 rows of x, so w is streamed from memory once per call and never packed.
// The rows of w are split between threads in contiguous ranges: with a few rows of x the
// product is a read of w, and each thread reads its own part (threads: see the entry point).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

struct Problem {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t ldw;
  const float* b;  // nullptr: no bias
  float* y;
  int64_t ldy;
  int64_t rows, in_features;
};

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ROWS rows of x (from x) against COLS rows of w (from w), into y; the last I % 8 elements
// of each row come in through a masked load that reads zeros past the end.
template <int ROWS, int COLS>
void tile(const Problem& p, const float* x, const float* w, float* y, const float* b, __m256i tail_mask) {
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t whole = p.in_features & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 w_k[COLS];
    for (int j = 0; j < COLS; ++j) w_k[j] = _mm256_loadu_ps(w + j * p.ldw + k);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_loadu_ps(x + i * p.ldx + k);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  if (whole < p.in_features) {
    __m256 w_k[COLS];
    for (int j = 0; j < COLS; ++j) w_k[j] = _mm256_maskload_ps(w + j * p.ldw + whole, tail_mask);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x_k = _mm256_maskload_ps(x + i * p.ldx + whole, tail_mask);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) y[i * p.ldy + j] = horizontal_sum(acc[i][j]) + (b ? b[j] : 0.0f);
}

template <int COLS>
void column_strip(const Problem& p, int64_t o, __m256i tail_mask) {
  const float* w = p.w + o * p.ldw;
  const float* b = p.b ? p.b + o : nullptr;
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4) tile<4, COLS>(p, p.x + r * p.ldx, w, p.y + r * p.ldy + o, b, tail_mask);
  const float* x = p.x + r * p.ldx;
  float* y = p.y + r * p.ldy + o;
  switch (p.rows - r) {
    case 3: tile<3, COLS>(p, x, w, y, b, tail_mask); break;
    case 2: tile<2, COLS>(p, x, w, y, b, tail_mask); break;
    case 1: tile<1, COLS>(p, x, w, y, b, tail_mask); break;
    default: break;
  }
}

struct Job {
  const Problem* problem;
  int64_t out_features;
  int (*thread_num)();   // omp_get_thread_num of the runtime that runs the team
  int (*num_threads)();  // omp_get_num_threads of that runtime
};

// Rows [first, last) of w, as whole strips of 3 rows.
void run_range(const Problem& p, int64_t first, int64_t last) {
  const int tail = static_cast<int>(p.in_features % 8);
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < tail ? -1 : 0;
  const __m256i tail_mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  int64_t o = first;
  for (; o + 3 <= last; o += 3) column_strip<3>(p, o, tail_mask);
  if (last - o == 2) column_strip<2>(p, o, tail_mask);
  if (last - o == 1) column_strip<1>(p, o, tail_mask);
}

// The body every thread of the team runs: its share of the rows of w.
void team_body(void* arg) {
  const Job& job = *static_cast<const Job*>(arg);
  const int64_t t = job.thread_num(), count = job.num_threads();
  const int64_t strips = (job.out_features + 2) / 3;
  run_range(*job.problem, std::min(job.out_features, strips * t / count * 3),
            std::min(job.out_features, strips * (t + 1) / count * 3));
}

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
using IntFn = int (*)();

}  // namespace

// y = x·wᵀ (+ b) for x [rows, in_features], w [out_features, in_features], y [rows,
// out_features]; row strides ldx, ldw, ldy in elements, every last dim contiguous.
//
// Threads: the caller passes the entry points of the OpenMP runtime torch runs its own
// parallel loops on (GOMP_parallel, omp_get_thread_num, omp_get_num_threads of the libgomp
// loaded with torch), and the kernel runs as one parallel region of `threads` threads on
// torch's team. Why not threads of our own: torch's OpenMP threads keep spinning for a while
// after each parallel op, and threads started beside them share the cores with that spinning
// (measured in the layer: 1.2–1.7× slower than torch's kernels, where the same kernel on
// torch's team is faster). Null entry points: the caller's thread does all of it.
// Returns 0, or -1 for arguments it does not take (then y is untouched).
extern "C" int moe_ffn_linear_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* b,
                                  float* y, int64_t ldy, int64_t rows, int64_t out_features,
                                  int64_t in_features, int threads, void* parallel, void* thread_num,
                                  void* num_threads) {
  if (rows < 0 || out_features < 0 || in_features < 0 || threads < 1) return -1;
  if (rows == 0 || out_features == 0) return 0;
  const Problem problem{x, ldx, w, ldw, b, y, ldy, rows, in_features};
  // At least 24 rows of w per thread (8 strips), and no more threads than asked.
  const int64_t useful = std::max<int64_t>(1, out_features / 24);
  const unsigned count = static_cast<unsigned>(std::min<int64_t>(threads, useful));
  if (count == 1 || !parallel || !thread_num || !num_threads) {
    run_range(problem, 0, out_features);
    return 0;
  }
  Job job{&problem, out_features, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
  reinterpret_cast<ParallelFn>(parallel)(team_body, &job, count, 0);
  return 0;
}
