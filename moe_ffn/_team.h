// What moe_ffn's CPU kernels (_small_gemm.cpp, _amx.cpp, _avx512.cpp) share: running a body on
// torch's OpenMP team (why torch's team and not threads of our own: _small_gemm.cpp's header),
// the calling thread's scratch memory, the AVX-512 check, SwiGLU's arguments, and the loop of
// the *_blocks entry points over their table of expert blocks.
#pragma once

#include <cpuid.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace moe_ffn_team {

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
using IntFn = int (*)();

struct Team {
  void* parallel;  // GOMP_parallel, or null
  IntFn thread_num, num_threads;
};

inline Team make_team(void* parallel, void* thread_num, void* num_threads) {
  return Team{parallel, reinterpret_cast<IntFn>(thread_num), reinterpret_cast<IntFn>(num_threads)};
}

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

// Scratch memory of the calling thread, kept from call to call: a kernel's packed operands are
// a few hundred KiB to 16 MiB, and allocating them anew (fresh pages, faulted in as they
// are first written) cost as much as a small product. `bytes` at 64-byte alignment, not
// zeroed, valid until the thread's next call; grown to the largest size asked for, freed when
// the thread ends. Null where the allocation failed.
inline void* thread_scratch(size_t bytes) {
  struct Arena {
    void* data = nullptr;
    size_t size = 0;
    ~Arena() { std::free(data); }
  };
  thread_local Arena arena;
  const size_t rounded = (bytes + 63) / 64 * 64 + 64;
  if (rounded > arena.size) {
    std::free(arena.data);
    arena.data = std::aligned_alloc(64, rounded);
    arena.size = arena.data ? rounded : 0;
  }
  return arena.data;
}

// Whether the CPU has AVX-512 F, BW and VL and the OS saves their state (XCR0): what the
// AVX-512 parts of _amx.cpp and _avx512.cpp need before any of their code may run.
inline bool avx512_enabled() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31)))) return false;  // F, BW, VL
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;       // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (((uint64_t{hi} << 32) | lo) & 0xE6) == 0xE6;  // SSE, AVX and AVX-512 state enabled
}

// SwiGLU's elementwise work over rows of h = gate | up (a = silu(gate)·up, and its gradient):
// T float for the float32 kernel (_small_gemm.cpp), uint16_t (bf16 bits) for the bf16 one
// (_amx.cpp).
template <typename T>
struct Swiglu {
  const T* h;  // [rows, 2F]: gate | up, rows ldh apart
  int64_t ldh;
  const T* da;  // [rows, F], the gradient of a (backward only)
  int64_t ldda;
  const float* weight;  // [rows], scales da (backward; null: 1)
  T* a;                 // [rows, F] out (null: not wanted)
  int64_t lda;
  T* dh;  // [rows, 2F] out (backward only)
  int64_t lddh;
  float* dweight;  // [rows] out: sum over f of a·da before the scaling (null: not wanted)
  int64_t features;
};

// The SwiGLU passes read their inputs ahead: while row r's line at column f is worked on, the
// same lines of gate, up and da of a row ~512 elements later are prefetched into L1 (rows of
// 512 or more elements: the next row). Without it the passes stalled on memory wherever h had
// left the cache (in the layer it always has: the projections stream the weights in between):
// on the 2-core EPYC (Zen 5), bf16, caches evicted before each call, 1014 rows × F = 512
// backward 1.29 → 0.47 ms, forward 0.75 → 0.28 (the same as with the rows in cache); 131 × 3584
// 0.77 → 0.42 and 0.43 → 0.24. A distance of 1024 or 2048 elements was no faster, and
// prefetching the outputs' lines for writing neither.
template <typename T>
inline int64_t swiglu_row_ahead(const Swiglu<T>& p, int64_t r, int64_t last) {
  const int64_t ahead = r + std::max<int64_t>(1, (511 + p.features) / std::max<int64_t>(1, p.features));
  return ahead < last ? ahead : -1;
}

// Prefetch row `ahead`'s line at column f of gate, up and (backward) da; none where ahead < 0.
// Always inlined: called from a kernel's AVX-512 target region it was not inlined, and GCC,
// finding a function whose only effects are prefetches free of side effects, dropped the calls.
template <typename T>
__attribute__((always_inline)) inline void swiglu_prefetch(const Swiglu<T>& p, int64_t ahead, int64_t f) {
  if (ahead < 0) return;
  const T* gate = p.h + ahead * p.ldh + f;
  _mm_prefetch(reinterpret_cast<const char*>(gate), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(gate + p.features), _MM_HINT_T0);
  if (p.da) _mm_prefetch(reinterpret_cast<const char*>(p.da + ahead * p.ldda + f), _MM_HINT_T0);
}

// block(e, start, rows, flag) for each entry (e, start, stop, flag) of a *_blocks entry point's
// table in turn, once every entry was checked (-1: an expert out of range, or fewer than
// min_rows rows, nothing run); the first nonzero status a block returns.
template <typename Block>
int each_block(const int64_t* blocks, int64_t count, int64_t experts, const Block& block, int64_t min_rows = 0) {
  if (count < 0) return -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (b[0] < 0 || b[0] >= experts || b[1] < 0 || b[2] - b[1] < min_rows) return -1;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (const int status = block(b[0], b[1], b[2] - b[1], b[3] != 0)) return status;
  }
  return 0;
}

constexpr double kShareSlack = 1.2;  // (see each_block_shared)
constexpr int64_t kMaxShared = 1024;  // (entries a call shares at most)

// The shares of each_block_shared: owner[i], the thread that runs entry i (checked entries: an
// expert in range, at least one row each); false where the blocks do not fall into even enough
// shares, are too few (fewer than `per_thread` a thread) or too many, or are not in ascending
// order of experts (grouped.py's tables are), and run on the whole team in turn.
inline bool block_owners(const int64_t* blocks, int64_t count, int threads, int16_t* owner, int64_t per_thread = 2) {
  if (threads < 2 || threads > 64 || count < per_thread * threads || count > kMaxShared) return false;
  int64_t total = 0, share_rows[64] = {};
  for (int64_t i = 0; i < count; ++i) total += blocks[4 * i + 2] - blocks[4 * i + 1];
  for (int64_t i = 0, before = 0; i < count;) {  // an expert's run of entries: the share holding its middle row
    // (runs in ascending order of experts only: an expert's entries apart from each other could
    // fall to two threads, which would both write its weight gradient)
    if (i > 0 && blocks[4 * i] < blocks[4 * (i - 1)]) return false;
    int64_t j = i, rows = 0;
    for (; j < count && blocks[4 * j] == blocks[4 * i]; ++j) rows += blocks[4 * j + 2] - blocks[4 * j + 1];
    const int64_t t = std::min<int64_t>(threads - 1, (2 * before + rows) * threads / (2 * total));
    for (int64_t k = i; k < j; ++k) owner[k] = static_cast<int16_t>(t);
    share_rows[t] += rows;
    before += rows, i = j;
  }
  for (int t = 0; t < threads; ++t)
    if (share_rows[t] * threads > kShareSlack * total) return false;
  return true;
}

// The same blocks shared among a team's threads, each block whole on one thread (block(e, start,
// rows, flag, 1)), where they fall into `threads` shares of about equal rows (`block_owners`):
// every expert's blocks (consecutive entries, experts ascending) in one share, the shares in
// order, none more than kShareSlack times an even share; else each block on the whole team in
// turn (block(…, threads)), as each_block runs them. Each thread then streams whole expert weights and the
// team meets once a call instead of once or twice a block; an output element's sum is the same
// sequence of steps on one thread as on the team (the team splits a product's columns or rows,
// never its depth), so the same bits either way. Only for blocks whose products take the same
// shapes for any row count (a product that declines must decline for the first block alike:
// `fits`, checked before anything runs). Returns -1 with nothing run where an entry does not
// fit (as each_block) or `fits` is false; else 0, or the first nonzero status of a block.
template <typename Block>  // Block: int(int64_t e, int64_t start, int64_t rows, bool flag, int threads)
int each_block_shared(const int64_t* blocks, int64_t count, int64_t experts, bool fits, int threads, const Team& team,
                      const Block& block, int64_t per_thread = 2) {
  if (count < 0 || !fits) return -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* b = blocks + 4 * i;
    if (b[0] < 0 || b[0] >= experts || b[1] < 0 || b[2] - b[1] < 1) return -1;
  }
  int16_t owner[kMaxShared];
  if (!block_owners(blocks, count, threads, owner, per_thread)) {  // (entries checked above)
    for (int64_t i = 0; i < count; ++i) {
      const int64_t* b = blocks + 4 * i;
      if (const int status = block(b[0], b[1], b[2] - b[1], b[3] != 0, threads)) return status;
    }
    return 0;
  }
  int failed = 0;  // (a status written by either thread: any nonzero one)
  on_team(team, threads, [&](int64_t t, int64_t n) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t* b = blocks + 4 * i;
      if (owner[i] % n == t)  // (a team smaller than asked: its threads take the missing ones' shares too)
        if (const int status = block(b[0], b[1], b[2] - b[1], b[3] != 0, 1)) __atomic_store_n(&failed, status, __ATOMIC_RELAXED);
    }
  });
  return failed;
}

}  // namespace moe_ffn_team
