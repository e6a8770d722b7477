// bfloat16 products of expert blocks on Intel's AMX tile units (Sapphire Rapids and newer):
//
//     forward         y[m, o] = sum_i x[m, i] * w[o, i]    (x·wᵀ)      moe_ffn_amx_linear
//     input gradient  y[m, i] = sum_o g[m, o] * w[o, i]    (g·w)       moe_ffn_amx_input_grad
//     weight gradient c[r, q] = sum_m a[m, r] * b[m, q]    (aᵀ·b)      moe_ffn_amx_weight_grad
//
// with bf16 operands (their bits, uint16_t), float32 sums (TDPBF16PS), and each result stored
// as float32 or rounded once to bf16 (nearest even, NaN kept, as torch rounds). Called through
// ctypes by moe_ffn/_small_gemm.py, which says where each is used and why (measured there).
//
// Why our own: torch's bf16 GEMMs on these CPUs (oneDNN's AMX kernels) first reorder the whole
// weight into their blocked layout on every call, which costs as much as the product itself
// for an expert's block of 16–128 rows. Here the weight is never copied:
// - forward: the weight's rows are AMX's A operand as they lie in memory (16 rows of w by 32
//   of its columns per tile, read with w's row stride); the block's rows x are the B operand,
//   rearranged into AMX's pair layout ("VNNI": B[k/2][n][2]) — a transpose of x in 32-bit units
//   (x is a few rows; the weight is the bulk of the bytes). The result tiles hold yᵀ and are
//   transposed as they are stored.
// - input gradient: g's rows are the A operand as they lie; the weight is the B operand in pair
//   layout, which interleaves its rows two by two: that is done for a chunk of w's rows over a
//   thread's columns at a time (sized with g's part to stay in L2, partial sums carried from
//   chunk to chunk) and reused for every row tile of g.
// - weight gradient: the sum runs over the block's rows, so one operand is transposed (a, the
//   output gradient, into tiles of 32 sums' steps) and the other interleaved two rows by two
//   (b, the input's rows), each packed tile by tile into contiguous memory; the gradient is
//   written row by row.
// Every product uses four 16×16 float32 accumulator tiles (a 32×32 block of the result), two
// A and two B tiles: each tile loaded feeds two TDPBF16PS.
//
// Numerics: TDPBF16PS multiplies bf16 pairs exactly and adds them into float32 accumulators
// with round-to-nearest-even, treating denormal inputs as zero and flushing denormal results
// (as oneDNN's AMX kernels behind torch's bf16 GEMMs on these CPUs do). The order of the sums
// differs from torch's; tests hold both to float64 bounds.
//
// Threads: torch's OpenMP team (_team.h). Each thread configures its tiles on entry and
// releases them before it leaves.
//
// The file is built with the package's AVX2 flags; only the code between push_options and
// pop_options is compiled for AVX-512 and AMX, and it runs only after moe_ffn_amx_ready() has
// found the CPU and the kernel able to (CPUID, XCR0, and Linux's per-process permission for
// the tile data state).

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "_team.h"

using moe_ffn_team::each_block;
using moe_ffn_team::each_block_shared;
using moe_ffn_team::make_team;
using moe_ffn_team::on_team;
using moe_ffn_team::share;
using moe_ffn_team::Team;

namespace {

bool amx_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!moe_ffn_team::avx512_enabled() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d & (1u << 22)) && (d & (1u << 24)))) return false;  // AMX-BF16, AMX-TILE
  // AVX512-BF16 (every CPU with AMX so far has it): the results' rounding instruction
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
  // Linux hands out the 8 KiB tile data state per process, on request (since 5.16).
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool ready() {
  static const bool usable = amx_usable();
  return usable;
}

// The packed operands live in the calling thread's scratch memory (_team.h), in uint16_t.
uint16_t* scratch(size_t elements) {
  return static_cast<uint16_t*>(moe_ffn_team::thread_scratch(elements * sizeof(uint16_t)));
}

// Where results go: float32 or bf16 (bits), rows ld elements apart.
struct Out {
  void* p;
  int64_t ld;
  bool f32;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")

#include "_bf16x16.h"  // to_bf16

namespace {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Eight tiles of 16 rows × 64 bytes: C(i, j) = tmm(2i + j), A(i) = tmm(4 + i), B(j) = tmm(6 + j).
void configure_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

inline void compiler_fence() { __asm__ volatile("" ::: "memory"); }  // tile loads/stores are asm

// Two rows of 32 bf16 into pair layout: lo holds (r0[n], r1[n]) for n < 16, hi for n = 16..31.
inline void interleave(__m512i r0, __m512i r1, __m512i* lo, __m512i* hi) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  *lo = _mm512_permutex2var_epi16(r0, _mm512_load_si512(kLo), r1);
  *hi = _mm512_permutex2var_epi16(r0, _mm512_load_si512(kHi), r1);
}

// Up to 32 bf16 of a row (n of them, zeros past), or zeros for a row past the operand's end.
inline __m512i load_row(const uint16_t* at, int64_t n, bool present) {
  if (!present) return _mm512_setzero_si512();
  return n >= 32 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), at);
}

inline __m512 from_bf16(const uint16_t* at) {  // exact: a bf16 is the top half of its float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)at)), 16));
}

inline void put(const Out& y, int64_t row, int64_t col, __m512 v, bool accumulate) {
  if (y.f32) {
    float* at = static_cast<float*>(y.p) + row * y.ld + col;
    if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(at));
    _mm512_storeu_ps(at, v);
  } else {
    uint16_t* at = static_cast<uint16_t*>(y.p) + row * y.ld + col;
    if (accumulate) v = _mm512_add_ps(v, from_bf16(at));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), to_bf16(v));
  }
}

// A 16×16 float32 tile (64-byte rows) into y at (row0, col0), its first `rows` rows; or, with
// `transposed`, its columns as rows of y (the tile's first `rows` columns).
inline void store_tile(const float* tile, const Out& y, int64_t row0, int64_t col0, int64_t rows, bool transposed,
                       bool accumulate) {
  if (!transposed) {
    for (int64_t r = 0; r < rows; ++r) put(y, row0 + r, col0, _mm512_load_ps(tile + 16 * r), accumulate);
    return;
  }
  __m512i v[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(tile + 16 * r);
  transpose16(v);
  for (int64_t r = 0; r < rows; ++r) put(y, row0 + r, col0, _mm512_castsi512_ps(v[r]), accumulate);
}

// Lanes that AVX512-BF16's rounding (vcvtne2ps2bf16) does not round as torch does: NaN (it
// keeps sign and payload, torch writes 0x7FC0) and subnormals (it flushes them to zero); quiet
// NaN, signalling NaN, subnormal in vfpclassps' terms.
constexpr int kNanOrSubnormal = 0x01 | 0x80 | 0x20;

// From here to the SwiGLU section the products may also use AVX512-BF16, which every CPU with
// AMX has (amx_usable checks): store_bf16_pair rounds a line by one instruction.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16,avx512bf16")

// Two 16×16 float32 tiles that lie side by side in a bf16 y (`left` at columns col0..col0+15,
// `right` at the next 16; with `transposed`, each tile's columns are y's rows) into y's rows
// row0..row0+rows-1, each row's 32 values in one 64-byte store: a whole cache line where y's
// rows are 64-byte aligned there. Stored tile by tile, each line took two 32-byte writes, and
// the products writing their bf16 results that way spent up to 45 % of their time storing
// (2-core Xeon, 64 blocks of 256 rows through 1024×512 weights: 788 GFLOP/s, 1420 with the
// stores left out). With `stream` the lines go past the caches (the caller fences before it
// returns): for results too large to be read back from the caches anyway.
// 32 float32 (lo, then hi) rounded to bf16 as torch rounds them: one 64-byte line.
inline __m512i bf16_line(__m512 lo, __m512 hi) {
  if (_mm512_fpclass_ps_mask(lo, kNanOrSubnormal) | _mm512_fpclass_ps_mask(hi, kNanOrSubnormal))
    return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

inline void store_line(uint16_t* at, __m512i line, bool stream) {
  if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(at), line);
  else _mm512_storeu_si512(at, line);
}

inline void store_bf16_pair(const float* left, const float* right, const Out& y, int64_t row0, int64_t col0,
                            int64_t rows, bool transposed, bool stream) {
  __m512i l[16], r[16];
  for (int i = 0; i < 16; ++i) {
    l[i] = _mm512_load_si512(left + 16 * i);
    r[i] = _mm512_load_si512(right + 16 * i);
  }
  if (transposed) {
    transpose16(l);
    transpose16(r);
  }
  for (int64_t i = 0; i < rows; ++i)
    store_line(static_cast<uint16_t*>(y.p) + (row0 + i) * y.ld + col0,
               bf16_line(_mm512_castsi512_ps(l[i]), _mm512_castsi512_ps(r[i])), stream);
}

// Whether a bf16 result of `elements` elements at y (rows ld elements apart, written in 64-byte
// lines from columns that are multiples of 32) goes past the caches: from `least` elements
// (kStreamResult; weight gradients kStreamElements), where y's rows are 64-byte aligned. The forward's and input gradients' results
// are read next by another pass (SwiGLU, the slots' sums) or kept for backward, mostly from
// memory anyway at these sizes. 2-core Xeon, against the tile-by-tile stores (products, 64
// blocks, interleaved, the same bits): forward 256 rows through 1024×1024 / 1024×512 1.27 /
// 1.44×, Mixtral's 7168×1024 at 64 rows 1.12×, input gradients 256 rows 1.28 / 1.33×, 32–64
// rows level; layer bf16, interleaved A/B (13 rounds), streamed from 2^12 elements:
// forward+backward fine-grained T = 2048 1.05×, T = 16 / 1 level, Mixtral T = 8192 0.99×;
// forward fine-grained T = 256 1.02×, Mixtral T = 256 / 16 1.00 / 1.02×. From 2^18 elements the
// ~256-row blocks of the fine-grained T = 2048 fell on both sides of the line (1.03×); from 2^16
// Mixtral T = 1 read 0.98×.
constexpr int64_t kStreamResult = int64_t{1} << 12;
inline bool stream_result(const Out& y, int64_t elements, int64_t least = kStreamResult) {
  return !y.f32 && elements >= least && reinterpret_cast<uintptr_t>(y.p) % 64 == 0 && y.ld % 32 == 0;
}

// One 32×32 block (AT × BT tiles of 16×16) of A·B over `steps` steps of 32 along the sum:
// A tile i at a + i·a_tile, step s at + s·a_step (rows a_stride bytes apart); B likewise, in
// pair layout. The accumulators go to tiles[(2i + j)·256].
struct Operand {
  const uint16_t* p;
  int64_t stride;  // bytes between a tile's rows
  int64_t tile;    // elements between tiles i (or j)
  int64_t step;    // elements between steps of 32 along the sum
};

struct NoWork {
  void operator()(int64_t) const {}
};

// The tile products of one 32×32 block, its sums left in the accumulator tiles 0–3;
// `between(s)` after step s (work for the core's vector units placed among the tile
// instructions: see linear_swiglu). kStreamB: B's tiles loaded with TILELOADDT1, the hint that
// they are not read again soon, which keeps them from pushing A's tiles out of L1 (see
// weight_grad).
template <int AT, int BT, bool kStreamB = false, typename Between = NoWork>
void block_products(const Operand& a, const Operand& b, int64_t steps, const float* init,
                    const Between& between = Between{}) {
  if (init) {  // partial sums of earlier steps, laid out as `tiles`
    _tile_loadd(0, init, 64);
    if (BT > 1) _tile_loadd(1, init + 256, 64);
    if (AT > 1) _tile_loadd(2, init + 512, 64);
    if (AT > 1 && BT > 1) _tile_loadd(3, init + 768, 64);
  } else {
    _tile_zero(0);
    if (BT > 1) _tile_zero(1);
    if (AT > 1) _tile_zero(2);
    if (AT > 1 && BT > 1) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (kStreamB) {
      _tile_stream_loadd(6, b.p + s * b.step, b.stride);
      if (BT > 1) _tile_stream_loadd(7, b.p + b.tile + s * b.step, b.stride);
    } else {
      _tile_loadd(6, b.p + s * b.step, b.stride);
      if (BT > 1) _tile_loadd(7, b.p + b.tile + s * b.step, b.stride);
    }
    _tile_loadd(4, a.p + s * a.step, a.stride);
    _tile_dpbf16ps(0, 4, 6);
    if (BT > 1) _tile_dpbf16ps(1, 4, 7);
    if (AT > 1) {
      _tile_loadd(5, a.p + a.tile + s * a.step, a.stride);
      _tile_dpbf16ps(2, 5, 6);
      if (BT > 1) _tile_dpbf16ps(3, 5, 7);
    }
    between(s);
  }
}

template <int AT, int BT>
void block_sums(float* tiles) {  // the accumulators to tiles[(2i + j)·256]
  _tile_stored(0, tiles, 64);
  if (BT > 1) _tile_stored(1, tiles + 256, 64);
  if (AT > 1) _tile_stored(2, tiles + 512, 64);
  if (AT > 1 && BT > 1) _tile_stored(3, tiles + 768, 64);
}

// The block's products (run_products), then its sums to `tiles` (run_sums), or both (run_block).
// (The tile instructions are inline assembly: the fences keep the compiler from moving the
// vector code that reads `tiles` across them.)
template <bool kStreamB = false>
void run_products(int at, int bt, const Operand& a, const Operand& b, int64_t steps, const float* init = nullptr) {
  compiler_fence();
  if (at == 2 && bt == 2) block_products<2, 2, kStreamB>(a, b, steps, init);
  else if (at == 2) block_products<2, 1, kStreamB>(a, b, steps, init);
  else if (bt == 2) block_products<1, 2, kStreamB>(a, b, steps, init);
  else block_products<1, 1, kStreamB>(a, b, steps, init);
}

void run_sums(int at, int bt, float* tiles) {
  if (at == 2 && bt == 2) block_sums<2, 2>(tiles);
  else if (at == 2) block_sums<2, 1>(tiles);
  else if (bt == 2) block_sums<1, 2>(tiles);
  else block_sums<1, 1>(tiles);
  compiler_fence();
}

void run_block(int at, int bt, const Operand& a, const Operand& b, int64_t steps, float* tiles,
               const float* init = nullptr) {
  run_products(at, bt, a, b, steps, init);
  run_sums(at, bt, tiles);
}

// A block whose sums wait in `sums` (at × bt tiles, laid out as run_sums writes them) to be
// stored while the next block's products run (see linear); `row` and `col` place it in the
// result, each kernel in its own units.
struct Pending {
  int64_t row = 0, col = 0;
  int at = 0, bt = 0;
  const float* sums = nullptr;
};

// A thread's two sums buffers and the block waiting in one of them. After a block's products
// are issued, `next` stores the waiting block (`store(const Pending&)`, vector work done while
// the tile unit multiplies), then saves the new block's sums to the free buffer (unless they
// are there already, `saved`: written by run_block into `free_buffer()`), and makes it wait.
struct LateStores {
  alignas(64) float tiles[2][1024];
  Pending pending;
  int buffer = 0;

  float* free_buffer() { return tiles[buffer]; }

  template <typename Store>
  void next(const Store& store, Pending block, bool saved = false) {
    if (pending.sums) store(pending);
    compiler_fence();
    if (!saved) run_sums(block.at, block.bt, tiles[buffer]);
    block.sums = tiles[buffer];
    pending = block;
    buffer ^= 1;
  }

  template <typename Store>
  void finish(const Store& store) {
    if (pending.sums) store(pending);
    pending = Pending{};
  }
};

// The rows of a product's operand where they lie: row m at base + m·ld, or, with an index, the
// rows of a larger tensor it picks (base + index[m]·ld): a routed layer's token rows gathered by
// the packing below, which copies the rows anyway, rather than by a pass of their own.
struct Rows {
  const uint16_t* base;
  int64_t ld;
  const int64_t* index;  // null: rows in order
  const uint16_t* row(int64_t m) const { return base + (index ? index[m] : m) * ld; }
  // A block's rows from row `start` of the blocks' order: its rows of base, or of the index.
  static Rows from(const uint16_t* base, int64_t ld, const int64_t* index, int64_t start) {
    return index ? Rows{base, ld, index + start} : Rows{base + start * ld, ld, nullptr};
  }
};

// x [rows, I] as the B operand: per block of 16 rows, I/2 pair rows of 16 units (x's 32-bit
// units transposed), rows past `rows` zero. blocks·I·16 elements.
void pack_rows_transposed(const Rows& x, int64_t rows, int64_t in_features, int64_t b0, int64_t b1, uint16_t* dst) {
  const int64_t units = in_features / 2;
  for (int64_t mb = b0; mb < b1; ++mb)
    for (int64_t u0 = 0; u0 < units; u0 += 16) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t m = mb * 16 + r;
        v[r] = m < rows ? _mm512_loadu_si512(x.row(m) + 2 * u0) : _mm512_setzero_si512();
      }
      transpose16(v);
      uint16_t* at = dst + (mb * units + u0) * 32;
      for (int j = 0; j < 16; ++j) _mm512_store_si512(at + 32 * j, v[j]);
    }
}

// The forward takes a block's rows in chunks whose packed part stays in L2 while every row tile
// of w passes over it, w read again for each chunk: 512 KiB of packed rows, and twice that
// where w is past 2^20 elements (then read from memory, not from the caches, each time; at
// 512 KiB Mixtral's 3584-deep down projection took its 512-row blocks 64 rows at a time, eight
// reads of a 7 MiB weight). 2-core Xeon, 8 weights at 512 rows, GFLOP/s (3 alternated runs):
// 1024×3584 1754–1823 → 1910–1932 (one 1607), 7168×1024 1906–1921 → 1987–2060; layer bf16
// forward Mixtral T = 1024 / 2048 34.4 → 31.6 / 59.4 → 55.4 ms, forward+backward T = 2048
// 210 → 206; T = 512 19.4 → 18.2. The fine-grained 1M-element weights kept at 512 KiB: at 1
// MiB 0.98–0.99× at T = 8192 (their 1024-row blocks), level at T = 2048.
inline int64_t row_chunk_blocks(int64_t out_features, int64_t in_features) {
  const int64_t bytes = out_features * in_features > (int64_t{1} << 20) ? int64_t{1} << 20 : int64_t{1} << 19;
  return std::max<int64_t>(2, bytes / (in_features * 32) / 2 * 2);  // (pairs of 16-row blocks)
}

// Whether the forward loads the packed rows of x (its B tiles) with the streaming hint: where a
// pair of the weight's row tiles is at most 64 KiB deep (in_features ≤ 1024), which it keeps
// more of in L1 while x's blocks pass. GFLOP/s, 2 threads, without → with: 1024×512 at 64 / 256
// / 1024 rows 1569–1603 / 1895–1963 / 2083–2240 → 1651–1759 / 2443–2637 / 2805–2895,
// 1024×1024 at 256 rows 1932–2124 → 2041–2244, 7168×1024 at 16–512 rows level; 1024×3584 at
// 64 / 512 rows 2165–2204 / 2403–2517 → 2106–2181 / 2165–2546 (not taken). Layer bf16 forward
// (processes alternated): fine-grained T = 256 / 2048 / 8192 12.4 / 39.7–41.2 / 127–136 → 11.6–11.9
// / 37.1–39.2 / 119–120 ms, Mixtral T = 2048 level.
inline bool stream_packed_rows(int64_t in_features) { return in_features <= 1024; }

// The forward's B operand: x's rows packed (pack_rows_transposed) into the calling thread's
// scratch memory by the team; null where that memory could not be had.
const uint16_t* packed_rows(const Rows& x, int64_t rows, int64_t in_features, int threads, const Team& team) {
  const int64_t blocks = (rows + 15) / 16;
  uint16_t* xp = scratch(static_cast<size_t>(blocks * in_features * 16));
  if (!xp) return nullptr;
  on_team(team, std::min<int64_t>(threads, blocks), [&](int64_t t, int64_t n) {
    int64_t b0, b1;
    share(blocks, 1, t, n, &b0, &b1);
    pack_rows_transposed(x, rows, in_features, b0, b1, xp);
  });
  return xp;
}

// Whether `linear` takes a weight [out_features, in_features] (any rows from 1).
bool linear_fits(int64_t out_features, int64_t in_features) {
  return ready() && out_features >= 16 && out_features % 16 == 0 && in_features >= 32 && in_features % 32 == 0;
}

int linear(const Rows& x, const uint16_t* w, int64_t ldw, const Out& y, int64_t rows, int64_t out_features,
           int64_t in_features, int threads, const Team& team) {
  if (!linear_fits(out_features, in_features) || rows < 1 || threads < 1) return -1;
  const int64_t blocks = (rows + 15) / 16;
  const uint16_t* xp = packed_rows(x, rows, in_features, threads, team);
  if (!xp) return -1;
  const int64_t o_tiles = out_features / 16, steps = in_features / 32;
  const bool stream = stream_result(y, rows * out_features);
  on_team(team, std::min<int64_t>(threads, (o_tiles + 1) / 2), [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(o_tiles, 2, t, n, &first, &last);
    if (first >= last) return;
    configure_tiles();
    // A block's results are stored while the next block's products run: those are issued
    // first, then the previous block's sums are rounded and stored (vector work the core does
    // while the tile unit multiplies), then the new sums go to the other buffer. Stored right
    // after their own products, storing and multiplying added up (a weight gradient 7168×1024
    // of 64 rows, 8 in turn: 5.8 ms storing alone, 3.7 multiplying alone, 9.2–9.7 both; one
    // lone tile instruction per block took the store-only loop from 5.3 to 7.5 ms). 2-core
    // Xeon, against the stores right after (with to_bf16's rounding), interleaved, 11 rounds:
    // forward 7168×1024 at 16 / 64 / 256 rows 1.11 / 1.02 / 1.11×, 1024×512 at 32 / 256 rows
    // 1.08 / 1.06×; weight gradients 1.05–1.11× from 16 to 256 rows (32 rows level); input
    // gradients (only their last depth chunk stores) 1024×512 at 128 / 256 rows 1.03 /
    // 1.05×, the rest level. Layer bf16, interleaved, 13 rounds: forward+backward Mixtral
    // T = 16 / 256 / 2048 1.03 / 1.04 / 1.005×, fine-grained T = 256 / 2048 1.03 / 1.02×;
    // forward Mixtral T = 256 1.03×, fine-grained T = 2048 1.05×.
    LateStores late;  // a block's row: its first row tile of x (mb), col: of w (ot)
    auto store = [&](const Pending& block) {
      for (int j = 0; j < block.bt; ++j) {
        const int64_t m0 = (block.row + j) * 16, n = std::min<int64_t>(16, rows - m0);
        if (!y.f32 && block.at == 2) {  // tiles (0, j) and (1, j): 32 columns of y
          store_bf16_pair(block.sums + j * 256, block.sums + (2 + j) * 256, y, m0, block.col * 16, n, true, stream);
          continue;
        }
        for (int i = 0; i < block.at; ++i)
          store_tile(block.sums + (2 * i + j) * 256, y, m0, (block.col + i) * 16, n, true, false);
      }
    };
    const int64_t chunk_blocks = row_chunk_blocks(out_features, in_features);  // (see there)
    const bool stream_x = stream_packed_rows(in_features);
    for (int64_t mb0 = 0; mb0 < blocks; mb0 += chunk_blocks)
    for (int64_t ot = first; ot < last; ot += 2) {
      const int at = static_cast<int>(std::min<int64_t>(2, last - ot));
      const Operand a{w + ot * 16 * ldw, ldw * 2, 16 * ldw, 32};
      for (int64_t mb = mb0; mb < std::min(blocks, mb0 + chunk_blocks); mb += 2) {
        const int bt = static_cast<int>(std::min<int64_t>(2, blocks - mb));
        const Operand b{xp + mb * in_features * 16, 64, in_features * 16, 512};
        if (stream_x) run_products</*kStreamB=*/true>(at, bt, a, b, steps);
        else run_products(at, bt, a, b, steps);
        late.next(store, Pending{mb, ot, at, bt});
      }
    }
    late.finish(store);
    if (stream) _mm_sfence();
    _tile_release();
  });
  return 0;
}

// Rows k0..k0+16 of w's columns c0..c0+cols into pair layout: for each group of 32 columns,
// 8 pair rows of 64 elements at dst + group·group_stride. The 16 rows are read by one tile
// load (16 cache lines in flight; two rows at a time with vector loads read w at half the rate)
// and interleaved from L1.
inline void pack_pairs_16(const uint16_t* w, int64_t ldw, int64_t c0, int64_t cols, uint16_t* dst,
                          int64_t group_stride) {
  alignas(64) uint16_t rows16[16 * 32];
  for (int64_t c = 0; c < cols; c += 32) {
    _tile_loadd(4, w + c0 + c, ldw * 2);  // (a last group of 16 columns reads 16 past them: still within w's rows)
    _tile_stored(4, rows16, 64);
    compiler_fence();
    uint16_t* at = dst + (c / 32) * group_stride;
    for (int p = 0; p < 8; ++p) {
      __m512i lo, hi;
      interleave(_mm512_load_si512(rows16 + 64 * p), _mm512_load_si512(rows16 + 64 * p + 32), &lo, &hi);
      _mm512_store_si512(at + 64 * p, lo);
      if (cols - c > 16) _mm512_store_si512(at + 64 * p + 32, hi);
    }
  }
}

// Whether `input_grad` takes a weight [out_features, in_features] (any rows from 1).
bool input_grad_fits(int64_t out_features, int64_t in_features) {
  return ready() && out_features >= 32 && out_features % 32 == 0 && in_features >= 32 && in_features % 32 == 0;
}

// `total` in the fewest chunks of at most `most`, as even as multiples of `unit` allow: the
// chunks' size (the last may be smaller).
inline int64_t even_chunk(int64_t total, int64_t most, int64_t unit) {
  const int64_t chunks = (total + most - 1) / most;
  return ((total + chunks - 1) / chunks + unit - 1) / unit * unit;
}

// More rows than this go in chunks of at most this many, as even as 16-row tiles allow, each
// a product of its own (w interleaved again for each): the partial sums between depth chunks,
// 4 KiB per pair of row tiles and group of 32 columns, outgrew L2 past ~512 rows (2 MiB a
// thread at 1024 rows through 1024×1024). GFLOP/s, 2 threads, whole → chunks of 256:
// 1024×512 at 512 / 768 / 1024 / 2048 rows 2131 / 1796 / 1248 / 722 → 2122 / 2127 / 2135 /
// 2023, 1024×1024 at 1024 / 2048 1188 / 680 → 1844 / 1869 (chunks of 128 below; of 512 level
// with 256); but chunks of 256 from 257 rows cost the layer where a block's last chunk came
// out a few rows (the weight interleaved for them): fine-grained forward+backward T = 4096
// 215 → 229–231 ms. Even chunks of at most 512: 530–700 rows level with whole (1753–1908 /
// 1799–1981); the layer at T = 8192 486–496 → 461–463 ms, at T = 4096 (blocks of ~512 rows)
// 222–230 → 222–238 (processes alternated, 4 runs each: level or a little behind).
constexpr int64_t kInputGradRowChunk = 512;

int input_grad(const uint16_t* g, int64_t ldg, const uint16_t* w, int64_t ldw, const Out& y, int64_t rows,
               int64_t out_features, int64_t in_features, int threads, const Team& team) {
  if (!input_grad_fits(out_features, in_features) || rows < 1 || threads < 1) return -1;
  if (rows > kInputGradRowChunk) {  // (see there)
    const int64_t chunk = even_chunk(rows, kInputGradRowChunk, 16);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      const Out part{static_cast<char*>(y.p) + r0 * y.ld * (y.f32 ? 4 : 2), y.ld, y.f32};
      const int status = input_grad(g + r0 * ldg, ldg, w, ldw, part, n, out_features, in_features, threads, team);
      if (status != 0) return status;
    }
    return 0;
  }
  const int64_t blocks = (rows + 15) / 16, pairs = (blocks + 1) / 2;
  // w in chunks of its depth: a chunk's rows over this thread's columns, interleaved into
  // groups of 32 columns, each used by every row tile of g; chunks sized so that one and g's
  // part stay in L2 (partial sums in `sums` between chunks). A group's part is one cache line
  // longer than its rows: at a multiple of 4 KiB apart, the groups' rows would fall into one
  // L1 set while they are written.
  const int64_t n_tiles = in_features / 16;
  const int64_t count = std::min<int64_t>(threads, n_tiles / 2);
  const int64_t most_cols = ((n_tiles + count - 1) / count + 1) / 2 * 32;  // a thread's columns, at most
  constexpr int64_t kBudget = int64_t{1} << 19;                             // bytes of each
  const int64_t chunk = std::min(
      out_features, std::max<int64_t>(32, std::min(kBudget / (2 * most_cols), kBudget / (2 * rows)) / 32 * 32));
  const int64_t groups = most_cols / 32, group_stride = chunk * 32 + 32;
  const int64_t per_thread = groups * group_stride + groups * pairs * 2048;  // panel, float sums
  // g's rows are the A operand as they are; a last block of fewer than 16 rows is copied with
  // zero rows under it (tile loads read 16 rows)
  const int64_t full = rows / 16 * 16, tail_elements = rows > full ? 16 * out_features : 0;
  const bool stream = stream_result(y, rows * in_features);
  uint16_t* memory = scratch(static_cast<size_t>(tail_elements + count * per_thread));
  if (!memory) return -1;
  uint16_t* tail = memory + count * per_thread;
  if (tail_elements) {
    std::memset(tail, 0, tail_elements * sizeof(uint16_t));
    for (int64_t m = full; m < rows; ++m) std::memcpy(tail + (m - full) * out_features, g + m * ldg, out_features * 2);
  }
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(n_tiles, 2, t, n, &first, &last);
    if (first >= last) return;
    const int64_t col0 = first * 16, cols = (last - first) * 16;
    uint16_t* panel = memory + per_thread * t;                          // [groups][chunk/2][32][2]
    float* sums = reinterpret_cast<float*>(panel + groups * group_stride);  // [groups][pairs][1024]
    configure_tiles();
    LateStores late;  // a block's row: its first row of g (m0), col: its first column past col0 (c)
    auto store = [&](const Pending& block) {
      for (int i = 0; i < block.at; ++i) {
        const int64_t r0 = block.row + 16 * i, n = std::min<int64_t>(16, rows - r0);
        const float* left = block.sums + 2 * i * 256;
        if (!y.f32 && block.bt == 2) {  // tiles (i, 0) and (i, 1): 32 columns of y
          store_bf16_pair(left, left + 256, y, r0, col0 + block.col, n, false, stream);
          continue;
        }
        for (int j = 0; j < block.bt; ++j) store_tile(left + j * 256, y, r0, col0 + block.col + 16 * j, n, false, false);
      }
    };
    for (int64_t k0 = 0; k0 < out_features; k0 += chunk) {
      const int64_t k1 = std::min(out_features, k0 + chunk), steps = (k1 - k0) / 32;
      const bool first_chunk = k0 == 0, last_chunk = k1 == out_features;
      for (int64_t row = k0; row < k1; row += 16)
        pack_pairs_16(w + row * ldw, ldw, col0, cols, panel + (row - k0) * 32, group_stride);
      compiler_fence();
      for (int64_t c = 0; c < cols; c += 32) {
        const int bt = static_cast<int>(std::min<int64_t>(2, (cols - c) / 16));
        const Operand b{panel + (c / 32) * group_stride, 128, 32, 1024};
        for (int64_t mb = 0; mb < blocks; mb += 2) {
          const int at = static_cast<int>(std::min<int64_t>(2, blocks - mb));
          const int64_t m0 = mb * 16;
          float* partial = sums + ((c / 32) * pairs + mb / 2) * 1024;
          float* out = last_chunk ? late.free_buffer() : partial;
          const float* init = first_chunk ? nullptr : partial;
          // rows of the copied tail block come from `tail` (only ever the last block)
          const bool last_in_tail = m0 + 16 * at > full;
          const Operand a{g + m0 * ldg + k0, ldg * 2, 16 * ldg, 32};
          const Operand a_tail{tail + k0, out_features * 2, 0, 32};
          if (last_in_tail && at == 1) {
            run_block(1, bt, a_tail, b, steps, out, init);
          } else if (last_in_tail) {  // first tile from g, second from the tail copy
            alignas(64) float second[512];
            run_block(1, bt, a, b, steps, out, init);
            run_block(1, bt, a_tail, b, steps, second, init ? init + 512 : nullptr);
            std::memcpy(out + 512, second, sizeof second);
          } else {
            run_products(at, bt, a, b, steps, init);
          }
          if (last_chunk) {  // the previous block stored while these products run
            late.next(store, Pending{m0, c, at, bt}, last_in_tail);
          } else if (!last_in_tail) {
            run_sums(at, bt, out);
          }
        }
      }
    }
    late.finish(store);
    if (stream) _mm_sfence();
    _tile_release();
  });
  return 0;
}

// a [rows, R] into tiles: at + (t·steps + s)·512 holds the tile of row tile t (16 columns of a)
// and step s (32 rows of a, zeros past `rows`), 16 × 32 contiguous, row r of the tile a[32s:32s+32,
// 16t + r]; rows of a taken two by two (pairs of the sum's steps) and transposed in 32-bit units.
// (Contiguous tiles rather than rows of a's columns `depth` apart: a tile's 16 rows 2–4 KiB apart
// fell into one or two L1 sets and 16 pages.)
void pack_transposed(const uint16_t* a, int64_t lda, int64_t rows, int64_t r0, int64_t r1, int64_t depth,
                     uint16_t* at) {
  const int64_t steps = depth / 32;
  for (int64_t c = r0; c < r1; c += 16)  // 16 columns of a at a time
    for (int64_t k0 = 0; k0 < depth; k0 += 32) {
      __m512i v[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t k = k0 + 2 * p;
        const __m512i even = k < rows ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + k * lda + c)))
                                      : _mm512_setzero_si512();
        const __m512i odd = k + 1 < rows
                                ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + (k + 1) * lda + c)))
                                : _mm512_setzero_si512();
        __m512i hi;
        interleave(even, odd, &v[p], &hi);  // v[p]: 16 units (a[k, c + j], a[k + 1, c + j])
      }
      transpose16(v);
      uint16_t* tile = at + ((c / 16) * steps + k0 / 32) * 512;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + j * 32, v[j]);
    }
}

// b [rows, Q] into groups of 32 columns in pair layout: bv + g·(depth/2)·64 holds columns
// 32g..32g+31 as [depth/2][32][2], rows past `rows` zero; pair rows p0..p1. (A group's step, 16
// pairs of rows, is 2 KiB in one piece; in rows of all Q columns its lines were Q·4 bytes apart.)
void pack_pairs(const Rows& b, int64_t rows, int64_t cols, int64_t depth, int64_t p0, int64_t p1, uint16_t* bv) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t q = 0; q < cols; q += 32) {
      __m512i lo, hi;
      const bool even = 2 * p < rows, odd = 2 * p + 1 < rows;  // (rows past `rows` not read)
      interleave(load_row(even ? b.row(2 * p) + q : nullptr, 32, even), load_row(odd ? b.row(2 * p + 1) + q : nullptr, 32, odd),
                 &lo, &hi);
      uint16_t* line = bv + ((q / 32) * (depth / 2) + p) * 64;
      _mm512_storeu_si512(line, lo);
      _mm512_storeu_si512(line + 32, hi);
    }
}

// A bf16 c of at least this many elements is written with streaming stores (whole 64-byte
// lines, past the caches): a weight gradient written once and read only by the optimizer.
// 7168×1024 from 16 / 64 / 256 rows, 8 gradients in turn: 139 → 315, 516 → 991, 1596 → 1797
// GFLOP/s. From 2^19 elements rather than 2^21 (the fine-grained shape's 2^19–2^20-element
// gradients too), bf16 forward+backward, separate processes alternated twice, 11 rounds
// each: fine-grained T = 16 49.7 / 51.9 → 42.2 / 43.2 ms, T = 64 54.5 / 57.7 → 46.3 / 47.4,
// T = 256 67.7 / 71.4 → 61.8 / 61.2; from 2^17, level with 2^19.
constexpr int64_t kStreamElements = int64_t{1} << 19;

// Whether `weight_grad` takes a result [r_count, q_count] (any rows from 1).
bool weight_grad_fits(int64_t r_count, int64_t q_count) {
  return ready() && r_count >= 16 && r_count % 16 == 0 && q_count >= 32 && q_count % 32 == 0;
}

// Each thread takes row tiles of c two by two; for each pair, a's two packed tiles over the
// depth (32 · depth · 2 bytes, or a depth chunk's: below) are read from L1 while b's column
// groups pass through the products (loaded with the streaming hint: without it b's tiles pushed a's out of L1 where
// their pairs exceeded ~40 KiB). Both packed tile by tile, in contiguous memory: in rows
// `depth` or Q·4 bytes apart, each tile's 16 lines had fallen into one or two L1 sets and 16
// pages. Same products in the same order (the same bits). Against those row layouts, GFLOP/s
// on 2 threads (blocks of 8–32 experts, processes alternated twice): 7168×1024 at 256 / 512 /
// 1024 / 2048 rows 1734–1891 / 1915–1917 / 1163–1202 / 592 → 1961–2017 / 2090–2103 /
// 1663–1770 / 1390–1433, 1024×1024 at 512 / 1024 / 2048 1782–2050 / 1180–1254 / 646–655 →
// 2065–2085 / 1588–1652 / 1475–1487, 1024×3584 at 512 / 2048 2190–2267 / 1086–1115 →
// 2530–2539 / 1756–1815, 1024×512 at 2048 622–857 → 1086–1165; level at 16–64 rows.
// Deeper sums (more rows) in chunks of kWeightGradDepthSteps steps, so that a's part of a pair
// of row tiles (32 KiB) stays in L1; the sums of a group of kWeightGradGroupPairs pairs over a
// chunk of b's columns wait in float32 between depth chunks (storing and reloading the
// accumulators is exact: the same bits). GFLOP/s, 2 threads, whole depth → chunks of 16 steps,
// groups of 8 pairs: 7168×1024 at 1024 / 2048 / 4096 rows 1700–1814 / 1529–1561 / 1099–1136 →
// 1921–1989 / 1584–1600 / 1492–1518, 1024×3584 1701 / 1689 / 1461 → 2329 / 1981 / 1698,
// 1024×1024 1757 / 1575 / 1320 → 1987 / 1663 / 1523, 1024×512 1586 / 1220 / 1070 → 1696 /
// 1291 / 1160 (chunks of 8, 12 or 24 steps, groups of 4 or 16 pairs: below these). Past 20
// steps (640 rows) in even chunks of at most 16 steps, rather than whole to 24 and then 16 at
// a time (a last chunk of a few steps): 7168×1024 at 640 / 700 / 768 rows 1978–2008 / 1839–1970
// / 1832–1843 → 2047–2128 / 1930–2076 / 1873–2025, 1024×3584 at 700 1643–2091 → 2099–2148,
// 1024×1024 at 768 1660–1756 → 1851–1873; 1100 rows level.
constexpr int64_t kWeightGradWholeSteps = 20, kWeightGradDepthSteps = 16, kWeightGradGroupPairs = 8;

// A weight gradient from a few rows (outer_rows; decode steps: one row an expert at T = 1)
// is almost all output, and the tile path writes it at 14–18 GB/s (its streaming stores do not
// overlap its tile work: JOURNAL, 2026-12-05 from 09:59 UTC). Here each row of c is a sum of
// `rows` outer-product terms on AVX-512 FMAs, c[m, :] = Σ_k a[k, m]·b[k, :] in k's order from
// +0, each term exact (bf16 × bf16) and each addition rounded once, then rounded to bf16 by
// bf16_line and stored a 64-byte line at a time (streamed where stream_result says so): as the
// tiles do, inputs and results below float32's normal range count as zero (DAZ, FTZ). One row
// gives the tiles' bits exactly (one exact product plus +0); more rows sum in this order where
// the tiles sum pairs. 8 experts' gradients in turn, 2 threads, GB/s of c written (the tiles'
// rate is flat from 1 to 32 rows): 7168×1024 tiles 17.7–18.3, here from 1 / 2 / 4 / 8 rows 40.7 /
// 34.6 / 26.9 / 19.0; 1024×3584 16.4–16.7 against 37.4 / 34.7 / 19.5 / 12.8; 1024×1024
// 14.7–15.0 against 35.3 / 30.3 / 23.6 / 16.6; 1024×512 13.2–13.6 against 27.0 / 25.4 / 19.9 /
// 14.5: here to 4 rows, and to 8 where b's widened rows stay in L1 (kOuterL1Floats). Layer bf16
// forward+backward, interleaved A/B in one process (caches swept before each step / not):
// T = 1 fine-grained 1.17 / 1.23×, Mixtral 1.21 / 1.32×; T = 16 (swept) 1.13 / 1.10×; T = 256
// level.
constexpr int64_t kOuterRows = 4, kOuterMostRows = 8, kOuterL1Floats = 8192;

bool outer_rows(int64_t rows, int64_t q_count) {
  return rows <= kOuterRows || (rows <= kOuterMostRows && rows * q_count <= kOuterL1Floats);
}

int weight_grad_outer(const uint16_t* a, int64_t lda, const Rows& b, const Out& c, int64_t rows, int64_t r_count,
                      int64_t q_count, bool stream, int threads, const Team& team) {
  // b's rows widened to float32 once (subnormals to zero), shared by the threads
  float* bw = reinterpret_cast<float*>(scratch(static_cast<size_t>(rows * q_count * 2)));
  if (!bw) return -1;
  const __m512 tiny = _mm512_set1_ps(0x1p-126f);
  auto normal_or_zero = [&](__m512 v) {  // (|v| < 2^-126: ±0)
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(_mm512_abs_ps(v), tiny, _CMP_LT_OQ), _mm512_setzero_ps());
  };
  for (int64_t k = 0; k < rows; ++k)
    for (int64_t q = 0; q < q_count; q += 16)
      _mm512_store_ps(bw + k * q_count + q, normal_or_zero(_mm512_castsi512_ps(_mm512_slli_epi32(
                                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b.row(k) + q))), 16))));
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, r_count * q_count >> 15));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(r_count, 1, t, n, &first, &last);
    __m512 coef[kOuterMostRows];
    for (int64_t m = first; m < last; ++m) {
      for (int64_t k = 0; k < rows; ++k) {
        const uint32_t bits = static_cast<uint32_t>(a[k * lda + m]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof v);
        coef[k] = _mm512_set1_ps(std::fabs(v) < 0x1p-126f ? 0.0f : v);
      }
      uint16_t* out = static_cast<uint16_t*>(c.p) + m * c.ld;
      int64_t q = 0;
      for (; q + 128 <= q_count; q += 128) {  // four lines at a time: four chains of FMAs side by side
        __m512 sum[8];
        for (int j = 0; j < 8; ++j) sum[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < rows; ++k)
          for (int j = 0; j < 8; ++j) sum[j] = _mm512_fmadd_ps(coef[k], _mm512_load_ps(bw + k * q_count + q + 16 * j), sum[j]);
        for (int j = 0; j < 4; ++j)
          store_line(out + q + 32 * j, bf16_line(normal_or_zero(sum[2 * j]), normal_or_zero(sum[2 * j + 1])), stream);
      }
      for (; q < q_count; q += 32) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        for (int64_t k = 0; k < rows; ++k) {
          lo = _mm512_fmadd_ps(coef[k], _mm512_load_ps(bw + k * q_count + q), lo);
          hi = _mm512_fmadd_ps(coef[k], _mm512_load_ps(bw + k * q_count + q + 16), hi);
        }
        store_line(out + q, bf16_line(normal_or_zero(lo), normal_or_zero(hi)), stream);
      }
    }
    if (stream) _mm_sfence();
  });
  return 0;
}

int weight_grad(const uint16_t* a, int64_t lda, const Rows& b, const Out& c, int64_t rows,
                int64_t r_count, int64_t q_count, bool accumulate, int threads, const Team& team) {
  if (!weight_grad_fits(r_count, q_count) || rows < 1 || threads < 1) return -1;
  if (outer_rows(rows, q_count) && !accumulate && !c.f32)
    return weight_grad_outer(a, lda, b, c, rows, r_count, q_count, stream_result(c, r_count * q_count, kStreamElements),
                             threads, team);
  const int64_t depth = (rows + 31) / 32 * 32;
  const int64_t r_tiles = r_count / 16, q_tiles = q_count / 16, steps = depth / 32;
  const int64_t count = std::min<int64_t>(threads, (r_tiles + 1) / 2);
  const bool whole = steps <= kWeightGradWholeSteps;
  const int64_t k_steps = whole ? steps : even_chunk(steps, kWeightGradDepthSteps, 1);
  const int64_t chunk_tiles = std::max<int64_t>(2, (int64_t{1} << 19) / (k_steps * 32 * 2 * 16) / 2 * 2);
  const int64_t group_pairs = whole ? r_tiles : kWeightGradGroupPairs;
  const int64_t partial_floats = whole ? 0 : group_pairs * (chunk_tiles / 2) * 1024;
  uint16_t* at = scratch(static_cast<size_t>(r_count * depth + depth * q_count + count * partial_floats * 2 + 32));
  if (!at) return -1;
  uint16_t* bv = at + r_count * depth;
  float* partials_all = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(bv + depth * q_count) + 63) / 64 * 64);
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(r_tiles, 1, t, n, &first, &last);
    pack_transposed(a, lda, rows, first * 16, last * 16, depth, at);
    share(depth / 2, 1, t, n, &first, &last);
    pack_pairs(b, rows, q_count, depth, first, last, bv);
  });
  const bool stream = !accumulate && stream_result(c, r_count * q_count, kStreamElements);
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(r_tiles, 2, t, n, &first, &last);
    if (first >= last) return;
    float* partials = partials_all + t * partial_floats;
    configure_tiles();
    // a block's results stored while the next block's products run (as in linear)
    LateStores late;  // a block's row: its first row tile of c (rt), col: its first column tile (qt)
    auto store = [&](const Pending& block) {
      for (int i = 0; i < block.at; ++i) {
        const int64_t r0 = (block.row + i) * 16, q0 = block.col * 16;
        const float* left = block.sums + 2 * i * 256;
        if (c.f32 || accumulate) {
          store_tile(left, c, r0, q0, 16, false, accumulate);
          store_tile(left + 256, c, r0, q0 + 16, 16, false, accumulate);
        } else {
          store_bf16_pair(left, left + 256, c, r0, q0, 16, false, stream);
        }
      }
    };
    // b's columns in chunks whose packed part (of a depth chunk) stays in L2 while the row
    // tiles of a pass; past kWeightGradWholeSteps, the row tiles in groups, each group's sums
    // carried in float32 (`partials`) from depth chunk to depth chunk
    for (int64_t q0 = 0; q0 < q_tiles; q0 += chunk_tiles) {
      const int64_t q1 = std::min(q_tiles, q0 + chunk_tiles);
      for (int64_t g0 = first; g0 < last; g0 += 2 * group_pairs) {
        const int64_t g1 = std::min(last, g0 + 2 * group_pairs);
        for (int64_t s0 = 0; s0 < steps; s0 += k_steps) {
          const int64_t n_steps = std::min(k_steps, steps - s0);
          const bool first_k = s0 == 0, last_k = s0 + n_steps == steps;
          for (int64_t rt = g0; rt < g1; rt += 2) {
            const int ta = static_cast<int>(std::min<int64_t>(2, g1 - rt));
            const Operand oa{at + rt * 16 * depth + s0 * 512, 64, 16 * depth, 512};
            for (int64_t qt = q0; qt < q1; qt += 2) {
              const Operand ob{bv + (qt / 2) * depth * 32 + s0 * 1024, 128, 32, 1024};
              float* partial = partials + (((rt - g0) / 2) * ((q1 - q0) / 2) + (qt - q0) / 2) * 1024;
              run_products</*kStreamB=*/true>(ta, 2, oa, ob, n_steps, first_k ? nullptr : partial);
              if (last_k) late.next(store, Pending{rt, qt, ta, 2});
              else run_sums(ta, 2, partial);
            }
          }
        }
      }
    }
    late.finish(store);
    if (stream) _mm_sfence();
    _tile_release();
  });
  return 0;
}

#pragma GCC pop_options  // (the products' AVX512-BF16)

// ---- SwiGLU's elementwise work in bf16 -----------------------------------------------------

}  // namespace

#include "_exp16.h"  // exp16, rounded, ExactRound, widened

namespace {

inline __m512 load16(const uint16_t* at, __mmask16 mask) {  // zeros past the mask
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at)), 16));
}
inline void store16(uint16_t* at, __m512 v, __mmask16 mask) { _mm256_mask_storeu_epi16(at, mask, to_bf16(v)); }

using Swiglu = moe_ffn_team::Swiglu<uint16_t>;

// silu's two parts for every bf16 gate value g (65536 of them), made once by the steps below
// (exp16 and the divisions, in the default float environment): act = g / (1 + e^-g) rounded
// to bf16 as ExactRound rounds it (NativeRound rounds the same where it runs, on ordinary
// values), and s = 1 / (1 + e^-g). A step then gathers both by g's bits instead of forming
// e^-g and dividing twice: the same bits. 512 KiB, of which gates within a few binades of 1
// (a layer's usual ones) use a few thousand entries. 2-core Xeon, the backward pass alone
// (medians of 15–41, old and new library alternated twice): 64 rows × 512 in cache 78.7 → 55.8
// cycles a 16-lane step, Mixtral's 4096 × 3584 10.8 → 7.9 ms (then ~22 GB/s of h, da, a and
// dh: at the memory's rate); layer bf16 forward+backward T = 2048 Mixtral 1.017×, fine-grained
// level (4 rounds). The forward's activation beside the tile products (swiglu16) gained nothing
// from it (level: it waits on the tiles) and computes as before. Only where gathers pay
// (gathers_pay: not on AMD's CPUs).
struct GateTable {
  alignas(64) float act[65536];
  alignas(64) float s[65536];
};

const GateTable& gate_table();


// Whether the float environment is the default one the table was made in (round to nearest,
// no flushing of subnormal inputs or results): elsewhere the steps compute.
inline bool default_float_environment() { return (_mm_getcsr() & 0xE040u) == 0; }

// Whether the table's gathers beat the steps on this CPU: not on AMD's (CPUID's vendor
// "AuthenticAMD"), where a 16-lane gather is several times slower than on Intel's cores. Zen 4
// EPYC (2026-12-07), both ways alternated in one process, 2048 rows × 512 in cache: the
// backward pass 1.515 → 1.127 ms, the forward 0.678 → 0.587 (one thread, 16.8 against 19.5 ns
// a 16-lane step); layer bf16 forward+backward fine-grained T = 256 / 2048 0.995 / 0.996×,
// Mixtral T = 256 0.991×, fine-grained T = 16 level. Not measured on Zen 5.
inline bool gathers_pay() {
  static const bool pay = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __get_cpuid(0, &a, &b, &c, &d);
    return !(b == 0x68747541u && d == 0x69746E65u && c == 0x444D4163u);  // "Auth" "enti" "cAMD"
  }();
  return pay;
}

// Columns [f, f + 16) of row r (the lanes of `mask`), in float32, every intermediate that one
// of torch's bf16 ops would store rounded where that op rounds it (grouped._hidden and
// _hidden_backward, each a native bf16 op computing in float32): act = silu(g) = g / (1 + e^-g),
// a = act·u, the products a·da (returned, to be summed for dweight), the routing weight w
// (rounded by the caller), dav = da·w, dav·u, and both halves of dh, silu_backward's as torch
// forms it: (dy·s)·(1 + g·(1 − s)) with s = 1 / (1 + e^-g). a is stored as the bits it was
// rounded to (to_bf16 of the rounded value gave the same bits again).
template <typename Round, bool kTable = false>
inline __m512 swiglu_step(const Swiglu& p, int64_t r, int64_t f, __mmask16 mask, __m512 w, Round& round) {
  const uint16_t* gate = p.h + r * p.ldh;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i g_bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, gate + f));
  const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(g_bits, 16)), u = load16(gate + p.features + f, mask);
  __m512 act, s;
  if constexpr (kTable) {  // (see GateTable)
    const GateTable& table = gate_table();
    act = _mm512_i32gather_ps(g_bits, table.act, 4);
    s = p.dh ? _mm512_i32gather_ps(g_bits, table.s, 4) : one;
  } else {
    const __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    act = round.rounded(_mm512_div_ps(g, denominator));
    s = p.dh ? _mm512_div_ps(one, denominator) : one;
  }
  const __m256i a_bits = round.bits(_mm512_mul_ps(act, u));
  if (p.a) _mm256_mask_storeu_epi16(p.a + r * p.lda + f, mask, a_bits);
  if (!p.dh) return _mm512_setzero_ps();
  const __m512 da = load16(p.da + r * p.ldda + f, mask);  // (zeros past the mask: the sum unaffected)
  const __m512 a_da = round.rounded(_mm512_mul_ps(widened(a_bits), da));
  const __m512 dav = round.rounded(_mm512_mul_ps(da, w));
  const __m512 dy = round.rounded(_mm512_mul_ps(dav, u));
  const __m512 slope = _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, s)));
  _mm256_mask_storeu_epi16(p.dh + r * p.lddh + f, mask, round.bits(_mm512_mul_ps(_mm512_mul_ps(dy, s), slope)));
  _mm256_mask_storeu_epi16(p.dh + r * p.lddh + p.features + f, mask, round.bits(_mm512_mul_ps(dav, act)));
  return a_da;
}

// Whether row r's inputs keep every value swiglu_step rounds a normal float32 or zero (never
// NaN or subnormal, which AVX512-BF16's rounding instruction gets wrong: see NativeRound): each
// gate g with 2^-24 ≤ |g| ≤ 16, each up u and gradient da (backward) with 2^-24 ≤ |·| ≤ 2^24,
// and the rounded routing weight w likewise. Then s = 1/(1 + e^-g) ∈ [e^-16, 1] and |act| ≥
// 2^-25; a, a·da, da·w, dav·u and dav·act lie within 2^-73 … 2^76; dy·s ≥ 2^-95, and the slope
// 1 + g(1 − s), formed in float32 from values near 1, is 0 or at least 2^-25, so (dy·s)·slope
// is 0 or at least 2^-120: all normal, all finite. A row with a value outside (a zero, a huge or
// tiny value, NaN, an infinity) takes ExactRound. Checked on the bf16 bits, 32 lanes at a time:
// the largest of |x| − 2^-24 (unsigned, so values below 2^-24 wrap past every bound) over the
// gates, and over the ups and gradients together.
inline bool ordinary_row(const Swiglu& p, int64_t r, __m512 w) {
  const float weight = std::fabs(_mm512_cvtss_f32(w));
  if (p.dh && !(weight >= 0x1p-24f && weight <= 0x1p24f)) return false;
  constexpr short kTiny = 0x3380, kSixteen = 0x4180, kHuge = 0x4B80;  // 2^-24, 16, 2^24 as bf16
  const uint16_t* gate = p.h + r * p.ldh;
  const uint16_t* da = p.dh ? p.da + r * p.ldda : nullptr;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), tiny = _mm512_set1_epi16(kTiny);
  // |x| − 2^-24 as an unsigned 16-bit number: at most (bound − 2^-24) where 2^-24 ≤ |x| ≤ bound
  // (below 2^-24 it wraps past every bound); the largest over the gates, and over the rest
  __m512i gates = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
  for (int64_t f = 0; f < p.features; f += 32) {
    const int64_t n = std::min<int64_t>(32, p.features - f);
    const __mmask32 mask = n == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
    // (lanes past the row's end read as 2^-24 itself: in range)
    auto offset = [&](const uint16_t* at) {
      const __m512i bits = _mm512_mask_loadu_epi16(tiny, mask, at + f);
      return _mm512_sub_epi16(_mm512_and_si512(bits, magnitude), tiny);
    };
    gates = _mm512_max_epu16(gates, offset(gate));
    rest = _mm512_max_epu16(rest, offset(gate + p.features));
    if (da) rest = _mm512_max_epu16(rest, offset(da));
  }
  auto largest = [](__m512i v) {  // (65535 − the least of 65535 − v)
    v = _mm512_sub_epi16(_mm512_set1_epi16(-1), v);
    const __m256i h = _mm256_min_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    const __m128i q = _mm_min_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return 0xFFFF - (_mm_cvtsi128_si32(_mm_minpos_epu16(q)) & 0xFFFF);
  };
  return largest(gates) <= kSixteen - kTiny && largest(rest) <= kHuge - kTiny;
}

// Row r's routing weight as the bf16 ops use it: rounded to bf16 (1 where there is none).
inline __m512 row_weight(const Swiglu& p, int64_t r) { return rounded(_mm512_set1_ps(p.weight ? p.weight[r] : 1.0f)); }

// Row r, step by step (swiglu_step) with the rounding `Round`.
template <typename Round, bool kTable>
void swiglu_row(const Swiglu& p, int64_t r, int64_t ahead) {  // ahead: see swiglu_row_ahead
  const __m512 w = row_weight(p, r);
  __m512 dot = _mm512_setzero_ps();
  for (int64_t f = 0; f < p.features; f += 16) {
    const int64_t n = std::min<int64_t>(16, p.features - f);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    if ((f & 31) == 0) moe_ffn_team::swiglu_prefetch(p, ahead, f);  // (32 bf16: one line)
    Round round;
    dot = _mm512_add_ps(dot, swiglu_step<Round, kTable>(p, r, f, mask, w, round));
  }
  if (p.dweight) p.dweight[r] = _mm512_cvtss_f32(rounded(_mm512_set1_ps(_mm512_reduce_add_ps(dot))));
}

// (AVX-512 only, no AMX: the SwiGLU passes run on AVX-512 CPUs without tiles too.)
bool avx512_ready() {
  static const bool usable = moe_ffn_team::avx512_enabled();
  return usable;
}

// Whether the CPU rounds float32 to bf16 by instruction (AVX512-BF16: see NativeRound).
bool avx512_bf16_ready() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return avx512_ready() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  }();
  return usable;
}

template <bool kTable>
void swiglu_row_exact(const Swiglu& p, int64_t r, int64_t ahead) { swiglu_row<ExactRound, kTable>(p, r, ahead); }

const GateTable& gate_table() {
  static const GateTable* const table = [] {
    auto* t = new GateTable;  // (kept for the process, as a constant)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(0x1F80u);  // the default environment (see default_float_environment)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < 65536; i += 16) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      const __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      _mm512_store_ps(t->act + i, ExactRound::rounded(_mm512_div_ps(g, denominator)));
      _mm512_store_ps(t->s + i, _mm512_div_ps(one, denominator));
    }
    _mm_setcsr(csr);
    return t;
  }();
  return *table;
}

}  // namespace

#pragma GCC pop_options

// The SwiGLU passes' rounding where the CPU has AVX512-BF16: one vcvtneps2bf16 for to_bf16's
// seven steps. It rounds to nearest even as to_bf16 does, but quiets a NaN keeping its sign and
// payload (torch: 0x7FC0) and flushes subnormals to zero (torch keeps them), so it runs only
// on rows whose inputs rule both out (`ordinary_row`); the others take ExactRound. That
// screen replaced a check of every rounded value (vfpclassps, seven a step) with a step done
// again where one met either (2-core Xeon; one thread, 64 rows × 512 in cache: the backward 82
// → 69 cycles a 16-lane step at ~3 GHz, the forward 39 → 34-35; bf16 forward+backward, old and
// new library alternated in separate processes, 3 × 7 rounds: fine-grained T = 2048 181.4 →
// 176.9 ms, Mixtral T = 2048 221.7 → 220.1, Mixtral T = 256 level).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16,avx512bf16")

#include "_swiglu16.h"  // NativeRound, swiglu16

namespace {

template <bool kTable>
__attribute__((flatten)) void swiglu_row_native(const Swiglu& p, int64_t r, int64_t ahead) {
  if (ordinary_row(p, r, row_weight(p, r)))
    swiglu_row<NativeRound, kTable>(p, r, ahead);
  else
    swiglu_row<ExactRound, kTable>(p, r, ahead);
}

}  // namespace

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")

namespace {

int swiglu(const Swiglu& p, int64_t rows, int threads, const Team& team) {
  if (!avx512_ready() || rows < 0 || p.features < 0 || threads < 1) return -1;
  if (rows == 0) return 0;
  // at least 2^15 elements a thread: below that the team costs more than it saves
  const int64_t count = std::min<int64_t>(threads, std::max<int64_t>(1, rows * p.features >> 15));
  on_team(team, count, [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(rows, 1, t, n, &first, &last);
    const bool native = avx512_bf16_ready(), table = gathers_pay() && default_float_environment();
    if (table) gate_table();  // (made before the rows: see GateTable)
    for (int64_t r = first; r < last; ++r) {
      const int64_t ahead = moe_ffn_team::swiglu_row_ahead(p, r, last);
      if (table)
        native ? swiglu_row_native<true>(p, r, ahead) : swiglu_row_exact<true>(p, r, ahead);
      else
        native ? swiglu_row_native<false>(p, r, ahead) : swiglu_row_exact<false>(p, r, ahead);
    }
  });
  return 0;
}

}  // namespace

#pragma GCC pop_options

// ---- The first projection of a SwiGLU expert with its activation ---------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16,avx512bf16")

namespace {

// Whether `linear_swiglu` takes a weight [2·features, in_features] (any rows from 1).
bool linear_swiglu_fits(int64_t features, int64_t in_features) {
  return ready() && features >= 32 && features % 32 == 0 && in_features >= 32 && in_features % 32 == 0;
}

// h = x·wᵀ for w = gate | up [2F, I] (the gate's F rows first), and a = silu(h[:, :F])·h[:, F:],
// in one pass: `linear`'s products and sums for h (the same bits), a from h's bf16 values
// rounded where `swiglu` rounds (the same bits as moe_ffn_amx_swiglu_bf16 on this h). h null:
// not stored (inference: only a is wanted). Each 2×2 block of tiles pairs 16 gate rows of w
// with the same features' 16 up rows, so a block holds both halves of 16 features of 32 rows of
// x; two such blocks (32 features) run back to back and their results go out together, as whole
// 64-byte lines of h's halves and of a, while the next blocks' products run (as `linear`'s
// stores): the activation's vector work, a pass over h of its own otherwise, is done beside
// the tile unit.
int linear_swiglu(const Rows& x, const uint16_t* w, int64_t ldw, uint16_t* h, int64_t ldh, uint16_t* a, int64_t lda,
                  int64_t rows, int64_t features, int64_t in_features, int threads, const Team& team) {
  if (!linear_swiglu_fits(features, in_features) || rows < 1 || threads < 1 || !a) return -1;
  const int64_t blocks = (rows + 15) / 16;
  const uint16_t* xp = packed_rows(x, rows, in_features, threads, team);
  if (!xp) return -1;
  const int64_t f_tiles = features / 16, steps = in_features / 32;
  const Out h_out{h, ldh, false}, a_out{a, lda, false};
  const bool stream_h = h && stream_result(h_out, rows * 2 * features), stream_a = stream_result(a_out, rows * features);
  on_team(team, std::min<int64_t>(threads, f_tiles / 2), [&](int64_t t, int64_t n) {
    int64_t first, last;
    share(f_tiles, 2, t, n, &first, &last);
    if (first >= last) return;
    configure_tiles();
    // sums[buffer][k]: the pair's block k (features ft + k's tile), tiles (gate, j) at j·256,
    // (up, j) at (2 + j)·256, as run_sums lays them out
    alignas(64) float sums[2][2][1024];
    struct Pair {
      int64_t mb = 0, ft = 0;
      int bt = 0;
      const float (*sums)[1024] = nullptr;
    } pending;
    int buffer = 0;
    // Row tile j of a pair's results (16 rows × 32 features of h's halves and of a) goes out
    // row by row between the next products' steps (block_products' `between`): the activation's vector
    // work after a block's tile instructions waited for them to retire (the reorder buffer
    // filled), and took as long as a pass of its own. `prepare` transposes the row tile into
    // `rows_out` (gate features 0–15, 16–31, then up's), `row` finishes row r.
    alignas(64) float rows_out[4][256];
    struct Out16 {
      int64_t m0 = 0, col = 0, count = 0;
    } current;
    auto prepare = [&](const Pair& pair, int j) {
      current = Out16{(pair.mb + j) * 16, pair.ft * 16, 0};
      if (j >= pair.bt) return;
      current.count = std::min<int64_t>(16, rows - current.m0);
      const float* tiles[4] = {pair.sums[0] + j * 256, pair.sums[1] + j * 256, pair.sums[0] + (2 + j) * 256,
                               pair.sums[1] + (2 + j) * 256};
      for (int q = 0; q < 4; ++q) {
        __m512i v[16];
        for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(tiles[q] + 16 * r);
        transpose16(v);
        for (int r = 0; r < 16; ++r) _mm512_store_si512(rows_out[q] + 16 * r, v[r]);
      }
    };
    auto row = [&](int64_t r) {
      const int64_t m = current.m0 + r;
      const __m512i gate = bf16_line(_mm512_load_ps(rows_out[0] + 16 * r), _mm512_load_ps(rows_out[1] + 16 * r));
      const __m512i up = bf16_line(_mm512_load_ps(rows_out[2] + 16 * r), _mm512_load_ps(rows_out[3] + 16 * r));
      if (h) {
        store_line(h + m * ldh + current.col, gate, stream_h);
        store_line(h + m * ldh + features + current.col, up, stream_h);
      }
      const __m256i lo = swiglu16(widened(_mm512_castsi512_si256(gate)), widened(_mm512_castsi512_si256(up)));
      const __m256i hi = swiglu16(widened(_mm512_extracti64x4_epi64(gate, 1)), widened(_mm512_extracti64x4_epi64(up, 1)));
      store_line(a + m * lda + current.col, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), stream_a);
    };
    // rows of the prepared tile to finish after step s of `steps`: spread evenly, the rest at the end
    const int64_t every = std::max<int64_t>(1, steps / 16);
    auto between = [&](int64_t s) {
      const int64_t r = s / every;
      compiler_fence();
      if (s % every == 0 && r < current.count) row(r);
      compiler_fence();
    };
    const int64_t chunk_blocks = row_chunk_blocks(2 * features, in_features);
    const bool stream_x = stream_packed_rows(in_features);
    for (int64_t mb0 = 0; mb0 < blocks; mb0 += chunk_blocks)
    for (int64_t ft = first; ft < last; ft += 2)
    for (int64_t mb = mb0; mb < std::min(blocks, mb0 + chunk_blocks); mb += 2) {
      const int bt = static_cast<int>(std::min<int64_t>(2, blocks - mb));
      const Operand b{xp + mb * in_features * 16, 64, in_features * 16, 512};
      for (int k = 0; k < 2; ++k) {  // features ft + k: gate rows as A tile 0, up rows as A tile 1
        const Operand gate_up{w + (ft + k) * 16 * ldw, ldw * 2, features * ldw, 32};
        if (pending.sums) prepare(pending, k);  // the previous pair's row tile k, beside these products
        else current.count = 0;
        compiler_fence();
        if (stream_x && bt == 2) block_products<2, 2, true>(gate_up, b, steps, nullptr, between);
        else if (stream_x) block_products<2, 1, true>(gate_up, b, steps, nullptr, between);
        else if (bt == 2) block_products<2, 2, false>(gate_up, b, steps, nullptr, between);
        else block_products<2, 1, false>(gate_up, b, steps, nullptr, between);
        for (int64_t r = (steps + every - 1) / every; r < current.count; ++r) row(r);
        run_sums(2, bt, sums[buffer][k]);
      }
      pending = Pair{mb, ft, bt, sums[buffer]};
      buffer ^= 1;
    }
    for (int k = 0; k < 2 && pending.sums; ++k) {
      prepare(pending, k);
      for (int64_t r = 0; r < current.count; ++r) row(r);
    }
    if (stream_h || stream_a) _mm_sfence();
    _tile_release();
  });
  return 0;
}

}  // namespace

#pragma GCC pop_options

// 1 where the products below run on this CPU (AVX-512, AVX512-BF16 and AMX-BF16, enabled by
// the OS, and the tile state granted to this process), else 0 (then every entry point
// returns -1).
extern "C" int moe_ffn_amx_ready() { return ready() ? 1 : 0; }

// y = x·wᵀ for bf16 x [rows, I] and w [O, I] (row strides ldx, ldw in elements, last dims
// contiguous) into y [rows, O] (ldy), float32 (y_f32) or bf16 rounded once. I a multiple of
// 32, O of 16. Returns 0, or -1 for arguments it does not take (y untouched).
extern "C" int moe_ffn_amx_linear(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* y, int64_t ldy,
                                  int y_f32, int64_t rows, int64_t out_features, int64_t in_features, int threads,
                                  void* parallel, void* thread_num, void* num_threads) {
  return linear(Rows{x, ldx, nullptr}, w, ldw, Out{y, ldy, y_f32 != 0}, rows, out_features, in_features, threads,
                make_team(parallel, thread_num, num_threads));
}

// The *_blocks entry points below run a grouped product's row blocks in one call, each through
// its expert's weight: `blocks` holds count entries (e, start, stop, flag), as _small_gemm.cpp's
// *_blocks entry points take them, and each block's sums are the ones the single-block entry
// point forms for it. The Python around a call per block cost ~20–35 µs a block (the first
// tensor ops after a kernel call run several times slower than the next ones). They return 0,
// or -1 with nothing run where an entry does not fit (moe_ffn_team::each_block; every block
// needs a row) or the shapes are not taken (the first block's product declines before it
// writes).
//
// An operand given with an index (not null) is a routed layer's token rows: row n of the blocks'
// order is row index[n] of the operand's `source_rows` (the packing gathers them; -1 with
// nothing run where an index of a block's rows is out of range).
bool indexes_fit(const int64_t* index, int64_t source_rows, const int64_t* blocks, int64_t count) {
  if (!index) return true;
  for (int64_t i = 0; i < count; ++i)
    if (blocks[4 * i + 1] < 0) return false;  // (each_block declines it)
  for (int64_t i = 0; i < count; ++i)
    for (int64_t n = blocks[4 * i + 1]; n < blocks[4 * i + 2]; ++n)
      if (index[n] < 0 || index[n] >= source_rows) return false;
  return true;
}

// Forward blocks (input_grad 0): y[start:stop] = x[start:stop]·w_eᵀ, w_e = w + e·w_expert, x's
// rows by `index` where given; input gradient blocks (input_grad 1, no index): y[start:stop] =
// x[start:stop]·w_e (x the output gradient). bf16 y.
extern "C" int moe_ffn_amx_product_blocks(int input_grad_blocks, const uint16_t* x, int64_t ldx, const int64_t* index,
                                          int64_t source_rows, const uint16_t* w, int64_t experts, int64_t w_expert,
                                          int64_t ldw, uint16_t* y, int64_t ldy, const int64_t* blocks, int64_t count,
                                          int64_t out_features, int64_t in_features, int threads, void* parallel,
                                          void* thread_num, void* num_threads) {
  if ((input_grad_blocks && index) || count < 0 || !indexes_fit(index, source_rows, blocks, count)) return -1;
  const Team team = make_team(parallel, thread_num, num_threads);
  const bool fits = input_grad_blocks ? input_grad_fits(out_features, in_features) : linear_fits(out_features, in_features);
  return each_block_shared(blocks, count, experts, fits, threads, team, [&](int64_t e, int64_t start, int64_t rows, bool,
                                                                            int threads) {
    const Out out{y + start * ldy, ldy, false};
    if (input_grad_blocks)
      return input_grad(x + start * ldx, ldx, w + e * w_expert, ldw, out, rows, out_features, in_features, threads, team);
    return linear(Rows::from(x, ldx, index, start), w + e * w_expert, ldw, out, rows, out_features, in_features, threads, team);
  });
}

// SwiGLU forward blocks: h[start:stop] = x[start:stop]·w_eᵀ (w_e = w + e·w_expert = gate | up,
// [2F, I]) and a[start:stop] = silu(gate)·up (`linear_swiglu`); h null: a only. x's rows by
// `index` where given. bf16 h and a.
extern "C" int moe_ffn_amx_swiglu_forward_blocks(const uint16_t* x, int64_t ldx, const int64_t* index,
                                                 int64_t source_rows, const uint16_t* w, int64_t experts,
                                                 int64_t w_expert, int64_t ldw, uint16_t* h, int64_t ldh, uint16_t* a,
                                                 int64_t lda, const int64_t* blocks, int64_t count, int64_t features,
                                                 int64_t in_features, int threads, void* parallel, void* thread_num,
                                                 void* num_threads) {
  if (count < 0 || !a || !indexes_fit(index, source_rows, blocks, count)) return -1;
  const Team team = make_team(parallel, thread_num, num_threads);
  return each_block_shared(blocks, count, experts, linear_swiglu_fits(features, in_features), threads, team,
                           [&](int64_t e, int64_t start, int64_t rows, bool, int threads) {
    return linear_swiglu(Rows::from(x, ldx, index, start), w + e * w_expert, ldw, h ? h + start * ldh : nullptr, ldh,
                         a + start * lda, lda, rows, features, in_features, threads, team);
  });
}

// Weight gradient blocks: c_e = a[start:stop]ᵀ·b[start:stop] (c_e = c + e·c_expert, bf16; b's
// rows by `b_index` where given), added to what c_e holds where the entry's flag is set (a second
// block of the same expert).
extern "C" int moe_ffn_amx_weight_grad_blocks(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                              const int64_t* b_index, int64_t b_source_rows, uint16_t* c,
                                              int64_t experts, int64_t c_expert, int64_t ldc, const int64_t* blocks,
                                              int64_t count, int64_t r_count, int64_t q_count, int threads,
                                              void* parallel, void* thread_num, void* num_threads) {
  if (count < 0 || !indexes_fit(b_index, b_source_rows, blocks, count)) return -1;
  const Team team = make_team(parallel, thread_num, num_threads);
  return each_block_shared(blocks, count, experts, weight_grad_fits(r_count, q_count), threads, team,
                           [&](int64_t e, int64_t start, int64_t rows, bool add, int threads) {
    return weight_grad(a + start * lda, lda, Rows::from(b, ldb, b_index, start), Out{c + e * c_expert, ldc, false}, rows, r_count, q_count, add,
                       threads, team);
  });
}

// y = g·w for bf16 g [rows, O] and w [O, I] into y [rows, I]; O and I multiples of 32.
extern "C" int moe_ffn_amx_input_grad(const uint16_t* g, int64_t ldg, const uint16_t* w, int64_t ldw, void* y,
                                      int64_t ldy, int y_f32, int64_t rows, int64_t out_features, int64_t in_features,
                                      int threads, void* parallel, void* thread_num, void* num_threads) {
  return input_grad(g, ldg, w, ldw, Out{y, ldy, y_f32 != 0}, rows, out_features, in_features, threads,
                    make_team(parallel, thread_num, num_threads));
}

// c = aᵀ·b for bf16 a [rows, R] and b [rows, Q] into c [R, Q] (ldc); c += with `accumulate`
// (a bf16 c then rounded again). R a multiple of 16, Q of 32.
extern "C" int moe_ffn_amx_weight_grad(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, void* c,
                                       int64_t ldc, int c_f32, int64_t rows, int64_t r_count, int64_t q_count,
                                       int accumulate, int threads, void* parallel, void* thread_num,
                                       void* num_threads) {
  return weight_grad(a, lda, Rows{b, ldb, nullptr}, Out{c, ldc, c_f32 != 0}, rows, r_count, q_count, accumulate != 0,
                     threads, make_team(parallel, thread_num, num_threads));
}

// a = silu(h[:, :F])·h[:, F:] for bf16 h [rows, 2F] (rows ldh apart) into bf16 a [rows, F] (lda),
// rounded where torch's two bf16 ops round (swiglu_row). This and the backward below need
// AVX-512 only (F/BW/VL/DQ; no tiles), not moe_ffn_amx_ready().
extern "C" int moe_ffn_amx_swiglu_bf16(const uint16_t* h, int64_t ldh, uint16_t* a, int64_t lda, int64_t rows,
                                       int64_t features, int threads, void* parallel, void* thread_num,
                                       void* num_threads) {
  const Swiglu p{h, ldh, nullptr, 0, nullptr, a, lda, nullptr, 0, nullptr, features};
  return a ? swiglu(p, rows, threads, make_team(parallel, thread_num, num_threads)) : -1;
}

// The gradient dh [rows, 2F] (lddh) of a = silu(gate)·up (h = gate | up, ldh) from da [rows, F]
// (ldda) scaled by weight[r] (float32; null: 1); on the way a itself (lda; null: not wanted)
// and dweight[r] = sum_f a·da before the scaling (float32 holding a bf16 value; null: not
// wanted). bf16 h, da, a, dh, rounded where the bf16 ops of grouped._hidden_backward round.
extern "C" int moe_ffn_amx_swiglu_backward_bf16(const uint16_t* h, int64_t ldh, const uint16_t* da, int64_t ldda,
                                                const float* weight, uint16_t* a, int64_t lda, uint16_t* dh,
                                                int64_t lddh, float* dweight, int64_t rows, int64_t features,
                                                int threads, void* parallel, void* thread_num, void* num_threads) {
  const Swiglu p{h, ldh, da, ldda, weight, a, lda, dh, lddh, dweight, features};
  return dh && da ? swiglu(p, rows, threads, make_team(parallel, thread_num, num_threads)) : -1;
}

extern "C" int moe_ffn_slot_sum_rows(void* out, int out_bf16, int64_t ldo, int64_t out_rows, const int64_t* token,
                                     const void* src, int src_bf16, int64_t lds, const float* weight, int64_t rows,
                                     int64_t cols, int64_t* index, int threads, void* parallel, void* thread_num,
                                     void* num_threads);

// A routed SwiGLU layer's bf16 forward over blocks the AMX kernels take, in one call: h = x·w1ᵀ
// and a = silu(gate)·up of the rows x[token[n]] (moe_ffn_amx_swiglu_forward_blocks, gathering
// them as it packs them; h null: not written), y = a·w2ᵀ (moe_ffn_amx_product_blocks), and
// each token's bf16 row of out = Σ weight[n]·y[n] over its rows (moe_ffn_slot_sum_rows: every
// row of out [tokens, dim] written, zeros for a token without rows; `index` its int64
// workspace of tokens + 1 + rows). w1 [E, 2F, dim], w2 [E, dim, F] (experts w1_expert /
// w2_expert elements apart, rows ldw1 / ldw2), a [rows, F] and y [rows, dim] contiguous. The
// calls grouped.py's forward makes one by one at decode, on the same buffers in the same
// order: the same bits, with one crossing from Python instead of three and the Python around
// them. Returns 0, or -1 where a step declines (out untouched; h, a, y may hold anything).
extern "C" int moe_ffn_amx_routed_swiglu_blocks(const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
                                                const float* weight, const uint16_t* w1, int64_t w1_expert,
                                                int64_t ldw1, const uint16_t* w2, int64_t w2_expert, int64_t ldw2,
                                                int64_t experts, int64_t dim, int64_t features, const int64_t* blocks,
                                                int64_t count, int64_t rows, uint16_t* h, uint16_t* a, uint16_t* y,
                                                uint16_t* out, int64_t* index, int threads, void* parallel,
                                                void* thread_num, void* num_threads) {
  if (rows < 1 || tokens < 1 || dim < 1 || features < 1) return -1;
  if (moe_ffn_amx_swiglu_forward_blocks(x, ldx, token, tokens, w1, experts, w1_expert, ldw1, h, 2 * features, a,
                                        features, blocks, count, features, dim, threads, parallel, thread_num,
                                        num_threads) != 0)
    return -1;
  if (moe_ffn_amx_product_blocks(0, a, features, nullptr, rows, w2, experts, w2_expert, ldw2, y, dim, blocks, count,
                                 dim, features, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  return moe_ffn_slot_sum_rows(out, 1, dim, tokens, token, y, 1, dim, weight, rows, dim, index, threads, parallel,
                               thread_num, num_threads);
}

// A routed SwiGLU layer's bf16 backward over one group of blocks the AMX kernels take, in one
// call: g = the output gradient's rows g_out[token[n]] (gathered into g [rows, dim]), da = g·w2_e
// (moe_ffn_amx_product_blocks), a, dh and dweight from h and da (moe_ffn_amx_swiglu_backward_bf16:
// dweight [rows] float32, da scaled by weight inside it), g scaled by bf16(weight[n]) in place
// (scale_rows_bf16, _bf16x16.h), w2's gradient gᵀ·a and w1's dhᵀ·x[token]
// (moe_ffn_amx_weight_grad_blocks, the blocks' table flags saying which add to what the
// gradient holds), dx = dh·w1_e [rows, dim] (moe_ffn_amx_product_blocks), and grad_x's bf16 rows = Σ dx[n] over each token's rows
// (moe_ffn_slot_sum_rows, every row written; `index` its int64 workspace of tokens + 1 + rows).
// The calls grouped._ffn_backward makes one by one for such a group, on the same buffers in
// the same order: the same bits. g, da, a, dh, dx contiguous scratch ([rows, dim], [rows, F],
// [rows, F], [rows, 2F], [rows, dim]). Returns 0, or -1 where a step declines (the gradients may
// then hold part of the result: the caller computes them again).
extern "C" int moe_ffn_amx_routed_swiglu_backward_blocks(
    const uint16_t* g_out, int64_t ldg_out, const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const uint16_t* h, int64_t ldh, const uint16_t* w1, int64_t w1_expert, int64_t ldw1,
    const uint16_t* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, uint16_t* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    uint16_t* grad_w2, int64_t gw2_expert, int64_t ldgw2, float* dweight, uint16_t* grad_x, uint16_t* g, uint16_t* da,
    uint16_t* a, uint16_t* dh, uint16_t* dx, int64_t* index, int threads, void* parallel, void* thread_num,
    void* num_threads) {
  if (rows < 1 || tokens < 1 || dim < 1 || dim % 16 || features < 1) return -1;
  for (int64_t n = 0; n < rows; ++n)
    if (token[n] < 0 || token[n] >= tokens) return -1;
  for (int64_t n = 0; n < rows; ++n) std::memcpy(g + n * dim, g_out + token[n] * ldg_out, sizeof(uint16_t) * dim);
  const int64_t width = 2 * features;
  if (moe_ffn_amx_product_blocks(1, g, dim, nullptr, rows, w2, experts, w2_expert, ldw2, da, features, blocks, count,
                                 dim, features, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  if (moe_ffn_amx_swiglu_backward_bf16(h, ldh, da, features, weight, a, features, dh, width, dweight, rows, features,
                                       threads, parallel, thread_num, num_threads) != 0)
    return -1;
  scale_rows_bf16(g, dim, g, dim, weight, rows, dim);
  if (moe_ffn_amx_weight_grad_blocks(g, dim, a, features, nullptr, rows, grad_w2, experts, gw2_expert, ldgw2, blocks,
                                     count, dim, features, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  if (moe_ffn_amx_weight_grad_blocks(dh, width, x, ldx, token, tokens, grad_w1, experts, gw1_expert, ldgw1, blocks,
                                     count, width, dim, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  if (moe_ffn_amx_product_blocks(1, dh, width, nullptr, rows, w1, experts, w1_expert, ldw1, dx, dim, blocks, count,
                                 width, dim, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  return moe_ffn_slot_sum_rows(grad_x, 1, dim, tokens, token, dx, 1, dim, nullptr, rows, dim, index, threads, parallel,
                               thread_num, num_threads);
}
