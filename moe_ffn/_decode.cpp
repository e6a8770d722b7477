// A decode step of a routed SwiGLU layer in one call, from the tokens to the layer's output:
//
//     logits = x·Rᵀ → scores → each token's k experts and combine weights → the plan (rows in
//     expert order) → the experts' one-call forward (gather, x·w1ᵀ, silu(gate)·up, ·w2ᵀ, the
//     weighted slot sum)
//
// for a few tokens (moe_ffn/decode.py says when and why). With the experts' weights streamed
// from memory, every crossing from Python and every torch op of a decode step ran with its code
// and data out of the caches: the router's ops, the plan and the way into the experts' call
// cost ~0.3–0.5 ms a step around a ~0.8 ms read of the weights (fine-grained bf16, T = 1, on
// the Zen 4 EPYC). Here those steps are plain loops on a few hundred numbers.
//
// The experts' part is the library's own one-call forward (moe_ffn_avx512_routed_swiglu_blocks_bf16
// or moe_ffn_routed_swiglu_blocks_f32), given the blocks the layer's decode path gives it: the
// same bits as that path for the same combine weights. bf16 logits are the router kernel's
// (moe_ffn_avx512_router_logits_bf16: the router's own for a few bf16 tokens, on AVX512-BF16
// CPUs the pair products' that it takes past them too). float32 logits
// are sums in double, each rounded once to float32. The scores and the combine weights are
// computed in double from the float32 logits and each rounded once to float32 (torch's float32
// softmax and division round at every step: the two differ in the last bits of a weight).
// No Python or torch API here: plain pointers in, results written where the caller says.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "_bf16.h"
#include "_entry_points.h"

using bf16_t = uint16_t;

namespace {

enum Kind { kFloat32 = 0, kBf16 = 1 };
enum Routing { kSoftmaxTopk = 0, kTopkSoftmax = 1, kSigmoidTopk = 2 };

// logits[t, e] = Σ_d x[t, d]·r[e, d] for float32 x and r: each product exact in double, the sum
// in double (four lanes of four accumulators, then across), rounded to float32 once.
void logits_f32(const float* x, int64_t ldx, const float* r, int64_t ldr, float* logits, int64_t tokens,
                int64_t experts, int64_t dim) {
  const int64_t whole = dim & ~int64_t{15};
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * ldx;
    for (int64_t e = 0; e < experts; ++e) {
      const float* re = r + e * ldr;
      __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
      for (int64_t d = 0; d < whole; d += 16)
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(xt + d + 4 * j)),
                                   _mm256_cvtps_pd(_mm_loadu_ps(re + d + 4 * j)), acc[j]);
      alignas(32) double lanes[4];
      _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
      double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      for (int64_t d = whole; d < dim; ++d) sum += static_cast<double>(xt[d]) * re[d];
      logits[t * experts + e] = static_cast<float>(sum);
    }
  }
}

// One token's routing from its float32 logits l [E]: probs [E] (the distribution the balance
// loss averages), ids [K] (the k largest of score + bias, largest first, equal ones lower
// expert first) and weights [K]. `score`, `key`: scratch of E doubles, `best` of K. Returns
// false for a logit that is not finite or a NaN bias (the caller leaves such steps to torch's
// ops).
bool route_token(const float* l, const float* bias, int routing, bool norm, double scale, int64_t experts,
                 int64_t top_k, double* score, double* key, double* best, float* probs, int64_t* ids,
                 float* weights) {
  double top = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) {
    if (!std::isfinite(l[e])) return false;
    top = std::max(top, static_cast<double>(l[e]));
  }
  double total = 0;
  if (routing == kSigmoidTopk) {
    for (int64_t e = 0; e < experts; ++e) total += score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
  } else {
    for (int64_t e = 0; e < experts; ++e) total += score[e] = std::exp(static_cast<double>(l[e]) - top);
  }
  for (int64_t e = 0; e < experts; ++e) probs[e] = static_cast<float>(score[e] / total);
  if (routing == kSoftmaxTopk)
    for (int64_t e = 0; e < experts; ++e) score[e] /= total;
  // what the k are chosen by: the scores (softmax / sigmoid) or, for topk_softmax, the logits
  for (int64_t e = 0; e < experts; ++e) {
    key[e] = (routing == kTopkSoftmax ? static_cast<double>(l[e]) : score[e]) + (bias ? bias[e] : 0.0);
    if (std::isnan(key[e])) return false;
  }
  // (the top-k kernel's insertion, moe_ffn_topk_ids's `offer`, on double keys: its float32
  // scores would tie where these do not)
  int64_t filled = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (filled == top_k && !(key[e] > best[top_k - 1])) continue;
    int64_t i = filled < top_k ? filled++ : top_k - 1;
    for (; i > 0 && best[i - 1] < key[e]; --i) best[i] = best[i - 1], ids[i] = ids[i - 1];
    best[i] = key[e], ids[i] = e;
  }
  double chosen = 0;
  if (routing == kTopkSoftmax) {  // a softmax over the k chosen logits
    for (int64_t k = 0; k < top_k; ++k) chosen += std::exp(static_cast<double>(l[ids[k]]) - top);
    for (int64_t k = 0; k < top_k; ++k)
      weights[k] = static_cast<float>(std::exp(static_cast<double>(l[ids[k]]) - top) / chosen * scale);
    return true;
  }
  for (int64_t k = 0; k < top_k; ++k) chosen += score[ids[k]];
  for (int64_t k = 0; k < top_k; ++k) weights[k] = static_cast<float>((norm ? score[ids[k]] / chosen : score[ids[k]]) * scale);
  return true;
}

template <typename T>
T* take(char* space, size_t& at, int64_t count) {
  T* p = reinterpret_cast<T*>(space + at);
  at += (static_cast<size_t>(count) * sizeof(T) + 63) & ~size_t{63};
  return p;
}

}  // namespace

// kind 0 (float32 x, router weight, experts' weights, out; linear1 / linear2 the linear-blocks
// entry points moe_ffn_routed_swiglu_blocks_f32 is given for these blocks) or 1 (bf16 ones,
// the AVX512-BF16 kernels). x [tokens, dim] rows ldx apart; router [experts, dim] rows ldr
// apart; bias [experts] float32 or null (added to the scores for choosing only); routing 0
// softmax_topk, 1 topk_softmax, 2 sigmoid_topk; norm: weights over the chosen scores' sum
// (softmax_topk, sigmoid_topk); scale multiplies the weights. w1 [E, 2F, dim], w2 [E, dim, F]
// with rows ldw1 / ldw2 and experts w1_expert / w2_expert elements apart. Writes logits, probs
// [tokens, experts], ids, weights [tokens, top_k] (contiguous) and out [tokens, dim]
// (contiguous, x's dtype: every row, zeros for a token without rows); where given (autograd
// keeps them for backward), h_out [tokens·top_k, 2F] (x's dtype) the rows' first projection,
// plan_out the plan as int64s (the rows' assignments t·top_k + j [rows], their tokens [rows],
// each expert's rows [experts]) and weight_out [rows] their combine weights. Returns 0; 1 where a
// logit is not finite (out not written; the caller runs the layer's ops instead); 2 where an
// expert has more than most_rows rows, the most the experts' call takes (the routing written,
// out not: the caller runs the experts' ops on it); -1 for arguments it does not take, a kernel
// that is not ready or scratch that could not be had.
extern "C" int moe_ffn_decode_step(int kind, const void* x, int64_t ldx, int64_t tokens, int64_t dim,
                                   const void* router, int64_t ldr, const float* bias, int routing, int norm,
                                   double scale, int64_t experts, int64_t top_k, const void* w1, int64_t w1_expert,
                                   int64_t ldw1, const void* w2, int64_t w2_expert, int64_t ldw2, int64_t features,
                                   int64_t most_rows, float* logits, float* probs, int64_t* ids, float* weights,
                                   void* out, void* h_out, int64_t* plan_out, float* weight_out, void* linear1,
                                   void* linear2, int threads, void* parallel, void* thread_num, void* num_threads) {
  if ((kind != kFloat32 && kind != kBf16) || routing < 0 || routing > 2 || tokens < 1 || dim < 1 || experts < 1 ||
      top_k < 1 || top_k > experts || features < 1 || most_rows < 1 || threads < 1)
    return -1;
  if (kind == kBf16) {
    if (moe_ffn_avx512_router_logits_bf16(static_cast<const bf16_t*>(x), ldx, static_cast<const bf16_t*>(router), ldr,
                                          logits, experts, tokens, experts, dim) != 0)
      return -1;
  } else {
    logits_f32(static_cast<const float*>(x), ldx, static_cast<const float*>(router), ldr, logits, tokens, experts, dim);
  }
  std::vector<double> score(static_cast<size_t>(2 * experts + top_k));
  for (int64_t t = 0; t < tokens; ++t)
    if (!route_token(logits + t * experts, bias, routing, norm != 0, scale, experts, top_k, score.data(),
                     score.data() + experts, score.data() + 2 * experts, probs + t * experts, ids + t * top_k,
                     weights + t * top_k))
      return 1;

  // the plan (moe_ffn_plan_rows: rows in expert order, each expert's rows in the order of their
  // assignments t·k + j), into plan_out where autograd keeps it: order [rows], token [rows],
  // counts [experts]
  const int64_t rows = tokens * top_k, elt = kind == kBf16 ? 2 : 4;
  const int64_t bytes = elt * rows * (2 * dim + 3 * features) + 8 * (tokens + 1 + 4 * rows + 5 * experts) + 4 * rows;
  // (left uninitialised: every byte the kernels read is written first)
  std::unique_ptr<char[]> owner(new (std::nothrow) char[static_cast<size_t>(bytes + 64 * 14)]);
  if (!owner) return -1;
  char* space = owner.get();
  size_t at = (64 - reinterpret_cast<uintptr_t>(space) % 64) % 64;
  int64_t* plan = plan_out ? plan_out : take<int64_t>(space, at, 2 * rows + experts);
  int64_t *order = plan, *token = plan + rows, *counts = plan + 2 * rows;
  int64_t* table = take<int64_t>(space, at, 4 * experts);
  int64_t* index = take<int64_t>(space, at, tokens + 1 + rows);
  float* weight = weight_out ? weight_out : take<float>(space, at, rows);
  if (moe_ffn_plan_rows(ids, rows, experts, top_k, order, counts, token) != 0) return -1;
  int64_t count = 0;
  for (int64_t e = 0, start = 0; e < experts; start += counts[e++]) {
    if (counts[e] > most_rows) return 2;
    if (counts[e] > 0) {
      int64_t* entry = table + 4 * count++;
      entry[0] = e, entry[1] = start, entry[2] = start + counts[e], entry[3] = 0;
    }
  }
  for (int64_t n = 0; n < rows; ++n) weight[n] = weights[order[n]];

  if (kind == kBf16) {
    auto* xg = take<bf16_t>(space, at, rows * dim);
    auto* h = h_out ? static_cast<bf16_t*>(h_out) : take<bf16_t>(space, at, rows * 2 * features);
    auto* a = take<bf16_t>(space, at, rows * features);
    auto* y = take<bf16_t>(space, at, rows * dim);
    return moe_ffn_avx512_routed_swiglu_blocks_bf16(
               static_cast<const bf16_t*>(x), ldx, tokens, token, weight, static_cast<const bf16_t*>(w1), w1_expert,
               ldw1, static_cast<const bf16_t*>(w2), w2_expert, ldw2, experts, dim, features, table, count, rows, xg, h,
               a, y, static_cast<bf16_t*>(out), index, threads, parallel, thread_num, num_threads) == 0
               ? 0
               : -1;
  }
  auto* xg = take<float>(space, at, rows * dim);
  auto* h = h_out ? static_cast<float*>(h_out) : take<float>(space, at, rows * 2 * features);
  auto* a = take<float>(space, at, rows * features);
  auto* y = take<float>(space, at, rows * dim);
  std::memset(out, 0, sizeof(float) * tokens * dim);  // (the f32 forward adds into out)
  return moe_ffn_routed_swiglu_blocks_f32(static_cast<const float*>(x), ldx, tokens, token, weight,
                                          static_cast<const float*>(w1), w1_expert, ldw1,
                                          static_cast<const float*>(w2), w2_expert, ldw2, experts, dim, features, table,
                                          count, rows, xg, h, a, y, static_cast<float*>(out), linear1, linear2, threads,
                                          parallel, thread_num, num_threads) == 0
             ? 0
             : -1;
}

// The backward of the routing above for `tokens` tokens: from the float32 logits [tokens,
// experts], the chosen ids [tokens, top_k] and the gradients of the combine weights —
// grad_rows [rows] in the plan's order (order [rows]: each row's assignment t·top_k + j; the
// experts' backward gives these) and/or grad_weights [tokens, top_k] — of the probs [tokens,
// experts] and of the logits themselves (each null where none came), the gradient of the
// logits, grad_logits [tokens, experts] float32: the chain rule through the weights (a
// softmax over the chosen logits for softmax_topk with norm and topk_softmax, the full
// softmax's Jacobian without norm; for sigmoid_topk the sigmoid's, after the normalisation's
// where norm), through probs (softmax's Jacobian, or the normalised sigmoid's), plus the
// logits' own, in double, each rounded once. The bias chose the experts only: no gradient.
// Returns 0, or -1 for arguments it does not take.
extern "C" int moe_ffn_decode_routing_backward(int routing, int norm, double scale, int64_t tokens, int64_t experts,
                                               int64_t top_k, const float* logits, const int64_t* ids,
                                               const int64_t* order, const float* grad_rows,
                                               const float* grad_weights, const float* grad_probs,
                                               const float* grad_logits_in, float* grad_logits) {
  if (routing < 0 || routing > 2 || tokens < 1 || experts < 1 || top_k < 1 || top_k > experts) return -1;
  const int64_t rows = tokens * top_k;
  std::vector<double> gw(static_cast<size_t>(rows), 0.0);  // d loss / d weight, per assignment
  if (grad_rows)
    for (int64_t n = 0; n < rows; ++n) gw[order[n]] += grad_rows[n];
  if (grad_weights)
    for (int64_t n = 0; n < rows; ++n) gw[n] += grad_weights[n];
  std::vector<double> score(static_cast<size_t>(experts)), dl(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    const int64_t* id = ids + t * top_k;
    const double* g = gw.data() + t * top_k;
    double top = -INFINITY, total = 0;
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, static_cast<double>(l[e]));
    for (int64_t e = 0; e < experts; ++e) {
      total += score[e] = routing == kSigmoidTopk ? 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])))
                                                   : std::exp(static_cast<double>(l[e]) - top);
      dl[e] = grad_logits_in ? grad_logits_in[t * experts + e] : 0.0;
    }
    // through the weights: w_k = scale·ŵ_k
    if (routing != kSigmoidTopk && (norm || routing == kTopkSoftmax)) {  // ŵ = softmax over the chosen
      double chosen = 0, dot = 0;
      for (int64_t k = 0; k < top_k; ++k) chosen += score[id[k]];
      for (int64_t k = 0; k < top_k; ++k) dot += score[id[k]] / chosen * g[k];
      for (int64_t k = 0; k < top_k; ++k) dl[id[k]] += scale * score[id[k]] / chosen * (g[k] - dot);
    } else if (routing == kSoftmaxTopk) {  // ŵ = p at the chosen: p's Jacobian
      double dot = 0;
      for (int64_t k = 0; k < top_k; ++k) dot += score[id[k]] / total * g[k];
      for (int64_t e = 0; e < experts; ++e) dl[e] -= scale * score[e] / total * dot;
      for (int64_t k = 0; k < top_k; ++k) dl[id[k]] += scale * score[id[k]] / total * g[k];
    } else {  // sigmoid: ŵ = s at the chosen (over their sum where norm)
      double chosen = 0, dot = 0;
      for (int64_t k = 0; k < top_k; ++k) chosen += score[id[k]];
      for (int64_t k = 0; k < top_k; ++k) dot += score[id[k]] / chosen * g[k];
      for (int64_t k = 0; k < top_k; ++k) {
        const double s = score[id[k]], ds = norm ? (g[k] - dot) / chosen : g[k];
        dl[id[k]] += scale * ds * s * (1.0 - s);
      }
    }
    if (grad_probs) {  // probs = score / total
      const float* gp = grad_probs + t * experts;
      double dot = 0;
      for (int64_t e = 0; e < experts; ++e) dot += score[e] / total * gp[e];
      for (int64_t e = 0; e < experts; ++e) {
        const double dprob = (gp[e] - dot) / total;  // d loss / d score[e]
        dl[e] += routing == kSigmoidTopk ? dprob * score[e] * (1.0 - score[e]) : dprob * score[e];
      }
    }
    for (int64_t e = 0; e < experts; ++e) grad_logits[t * experts + e] = static_cast<float>(dl[e]);
  }
  return 0;
}

namespace {

// out[d] = Σ_i c[i·ldc]·v[i·ldv + d] over i < n for d < dim (products exact in double, summed in
// double in i's order, rounded once): 32 columns at a time in eight registers (FMA chains enough
// to cover its latency), the rest one by one.
void weighted_rows_f32(const float* c, int64_t ldc, const float* v, int64_t ldv, int64_t n, int64_t dim, float* out) {
  constexpr int kVecs = 8;
  const int64_t whole = dim - dim % (4 * kVecs);
  for (int64_t d = 0; d < whole; d += 4 * kVecs) {
    __m256d acc[kVecs];
    for (int j = 0; j < kVecs; ++j) acc[j] = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; ++i) {
      const __m256d ci = _mm256_set1_pd(c[i * ldc]);
      const float* vi = v + i * ldv + d;
      for (int j = 0; j < kVecs; ++j) acc[j] = _mm256_fmadd_pd(ci, _mm256_cvtps_pd(_mm_loadu_ps(vi + 4 * j)), acc[j]);
    }
    for (int j = 0; j < kVecs; ++j) _mm_storeu_ps(out + d + 4 * j, _mm256_cvtpd_ps(acc[j]));
  }
  for (int64_t d = whole; d < dim; ++d) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(c[i * ldc]) * v[i * ldv + d];
    out[d] = static_cast<float>(sum);
  }
}

// The backward of the router's float32 product logits = x·rᵀ for a few tokens: grad_x [tokens,
// dim] = g·r and grad_r [experts, dim] = gᵀ·x (g [tokens, experts] rows ldg apart; each output
// null where not wanted, rows dim apart), each element's products exact in double, summed in
// double in the experts' (grad_x) or the tokens' (grad_r) order, rounded to float32 once, as
// the forward's logits_f32 sums (a product of two floats is exact in double: FMA or not, the
// same bits). For the decode step's node, where torch's float32 products, called from Python
// around the experts' backward, were two more crossings and torch ops run with the caches
// emptied by the weights' stream.
void router_backward_f32(const float* g, int64_t ldg, const float* x, int64_t ldx, const float* r, int64_t ldr,
                         float* grad_x, float* grad_r, int64_t tokens, int64_t experts, int64_t dim) {
  for (int64_t t = 0; grad_x && t < tokens; ++t) weighted_rows_f32(g + t * ldg, 1, r, ldr, experts, dim, grad_x + t * dim);
  for (int64_t e = 0; grad_r && e < experts; ++e) weighted_rows_f32(g + e, ldg, x, ldx, tokens, dim, grad_r + e * dim);
}

// The backward of a step of moe_ffn_decode_step with autograd (its kept h, plan and rows'
// weights) in one call, where the experts' backward is the AVX512-BF16 CPUs' one-call kernel
// (T = bf16_t or float): the experts' part (moe_ffn_avx512_routed_swiglu_backward_blocks_bf16 /
// _f32 on the plan's blocks: x's part grad_x, both weights' gradients, each expert with rows
// written over with stream1 / stream2 as that entry point takes them, and the rows'
// combine-weight gradients), the routing's (moe_ffn_decode_routing_backward from those,
// grad_weights, grad_probs and grad_logits_in, each null where none came) and the router's
// product's (bf16: moe_ffn_avx512_router_backward_bf16; float32: router_backward_f32; x's part
// and grad_router [experts, dim], contiguous, null where not wanted); with want_x, x's two parts
// added in T, as autograd adds them (bf16: each sum of the widened parts rounded once). The
// calls _decode.py's node makes one by one otherwise, on the same kernels in the same order:
// the same bits, one crossing from Python instead of three and the Python around them (checks,
// scratch, the block table), run with the caches emptied by the weights' stream: the node's
// backward of a fine-grained bf16 training step at T = 1 took 1.82 → 1.39 ms of a ~3.3 ms step
// (Zen 4 EPYC, the benchmark's setting, medians of 55 steps).
// grad_x [tokens, dim] contiguous; grad_out rows ldg apart; h [rows, 2F] contiguous; plan and
// weight as the step wrote them; outer_rows as the experts' entry point takes it. Returns 0, or
// -1 where a call declined (a block past the experts' kernel's rows, an odd dim: before writing)
// or scratch could not be had (the gradients may hold part of the result: the caller computes
// them again, whole).
template <typename T>
int decode_backward(const T* grad_out, int64_t ldg, const T* x, int64_t ldx, int64_t tokens, int64_t dim,
                    const T* router, int64_t ldr, int routing, int norm, double scale, int64_t experts, int64_t top_k,
                    const T* w1, int64_t w1_expert, int64_t ldw1, const T* w2, int64_t w2_expert, int64_t ldw2,
                    int64_t features, const T* h, const int64_t* plan, const float* weight, const float* logits,
                    const int64_t* ids, const float* grad_weights, const float* grad_probs, const float* grad_logits_in,
                    T* grad_w1, int64_t gw1_expert, int64_t ldgw1, T* grad_w2, int64_t gw2_expert, int64_t ldgw2,
                    int stream1, int stream2, int want_x, T* grad_x, T* grad_router, int64_t outer_rows, int threads,
                    void* parallel, void* thread_num, void* num_threads) {
  constexpr bool kIsBf16 = std::is_same_v<T, bf16_t>;
  if (routing < 0 || routing > 2 || tokens < 1 || dim < 2 || experts < 1 || top_k < 1 || top_k > experts ||
      features < 1 || threads < 1)
    return -1;
  const int64_t rows = tokens * top_k;
  const int64_t *order = plan, *token = plan + rows, *counts = plan + 2 * rows;
  // scratch: the block table, the experts' rows_d [4, rows, dim] and rows_h [rows, 4F] (in T),
  // for bf16 wide_d [2, rows, dim] and wide_h [rows, 2F] (float32), index, the rows'
  // combine-weight gradients, the logits' gradient and x's router part
  const int64_t wide = kIsBf16 ? 4 * rows * (2 * dim + 2 * features) : 0;
  const int64_t bytes = int64_t{sizeof(T)} * rows * (4 * dim + 4 * features) + wide +
                        8 * (4 * experts + tokens + 1 + rows) + 4 * rows + 4 * tokens * experts +
                        int64_t{sizeof(T)} * tokens * dim;
  std::unique_ptr<char[]> owner(new (std::nothrow) char[static_cast<size_t>(bytes + 64 * 10)]);
  if (!owner) return -1;
  char* space = owner.get();
  size_t at = (64 - reinterpret_cast<uintptr_t>(space) % 64) % 64;
  int64_t* table = take<int64_t>(space, at, 4 * experts);
  int64_t count = 0;
  for (int64_t e = 0, start = 0; e < experts; start += counts[e++]) {
    if (counts[e] > 0) {  // (the experts' entry point declines a block past its rows, writing nothing)
      int64_t* entry = table + 4 * count++;
      entry[0] = e, entry[1] = start, entry[2] = start + counts[e], entry[3] = 0;
    }
  }
  auto* rows_d = take<T>(space, at, 4 * rows * dim);
  auto* rows_h = take<T>(space, at, 4 * rows * features);
  float* wide_d = kIsBf16 ? take<float>(space, at, 2 * rows * dim) : nullptr;
  float* wide_h = kIsBf16 ? take<float>(space, at, 2 * rows * features) : nullptr;
  auto* index = take<int64_t>(space, at, tokens + 1 + rows);
  auto* grad_rows = take<float>(space, at, rows);
  constexpr auto experts_backward = [] {
    if constexpr (kIsBf16) return &moe_ffn_avx512_routed_swiglu_backward_blocks_bf16;
    else return &moe_ffn_avx512_routed_swiglu_backward_blocks_f32;
  }();
  if (experts_backward(grad_out, ldg, x, ldx, tokens, token, weight, h, 2 * features, w1, w1_expert, ldw1, w2,
                       w2_expert, ldw2, experts, dim, features, table, count, rows, grad_w1, gw1_expert, ldgw1, grad_w2,
                       gw2_expert, ldgw2, stream1, stream2, grad_rows, grad_x, rows_d, rows_h, wide_d, wide_h,
                       outer_rows, index, threads, parallel, thread_num, num_threads) != 0)
    return -1;
  if (!want_x && grad_router == nullptr) return 0;
  auto* grad_logits = take<float>(space, at, tokens * experts);
  auto* router_x = want_x ? take<T>(space, at, tokens * dim) : nullptr;
  if (moe_ffn_decode_routing_backward(routing, norm, scale, tokens, experts, top_k, logits, ids, order, grad_rows,
                                      grad_weights, grad_probs, grad_logits_in, grad_logits) != 0)
    return -1;
  if constexpr (kIsBf16) {
    if (moe_ffn_avx512_router_backward_bf16(grad_logits, experts, x, ldx, router, ldr, router_x, dim, grad_router, dim,
                                            tokens, experts, dim, threads, parallel, thread_num, num_threads) != 0)
      return -1;
    for (int64_t i = 0; want_x && i < tokens * dim; ++i)
      grad_x[i] = moe_ffn_bf16::round_to_bf16(moe_ffn_bf16::widen(grad_x[i]) + moe_ffn_bf16::widen(router_x[i]));
  } else {
    router_backward_f32(grad_logits, experts, x, ldx, router, ldr, router_x, grad_router, tokens, experts, dim);
    for (int64_t i = 0; want_x && i < tokens * dim; ++i) grad_x[i] += router_x[i];
  }
  return 0;
}

}  // namespace

// The float32 router's backward alone (router_backward_f32, above), for the node's general
// backward: the same sums as the one-call backward's. Returns 0, or -1 for arguments it does not
// take.
extern "C" int moe_ffn_decode_router_backward_f32(const float* g, int64_t ldg, const float* x, int64_t ldx,
                                                   const float* r, int64_t ldr, float* grad_x, float* grad_r,
                                                   int64_t tokens, int64_t experts, int64_t dim) {
  if (tokens < 1 || experts < 1 || dim < 1 || ldg < experts || ldx < dim || ldr < dim) return -1;
  router_backward_f32(g, ldg, x, ldx, r, ldr, grad_x, grad_r, tokens, experts, dim);
  return 0;
}

// decode_backward's two instances (bf16 values as their bits).
extern "C" int moe_ffn_decode_backward_bf16(
    const bf16_t* grad_out, int64_t ldg, const bf16_t* x, int64_t ldx, int64_t tokens, int64_t dim,
    const bf16_t* router, int64_t ldr, int routing, int norm, double scale, int64_t experts, int64_t top_k,
    const bf16_t* w1, int64_t w1_expert, int64_t ldw1, const bf16_t* w2, int64_t w2_expert, int64_t ldw2,
    int64_t features, const bf16_t* h, const int64_t* plan, const float* weight, const float* logits,
    const int64_t* ids, const float* grad_weights, const float* grad_probs, const float* grad_logits_in,
    bf16_t* grad_w1, int64_t gw1_expert, int64_t ldgw1, bf16_t* grad_w2, int64_t gw2_expert, int64_t ldgw2,
    int stream1, int stream2, int want_x, bf16_t* grad_x, bf16_t* grad_router, int64_t outer_rows, int threads,
    void* parallel, void* thread_num, void* num_threads) {
  return decode_backward(grad_out, ldg, x, ldx, tokens, dim, router, ldr, routing, norm, scale, experts, top_k, w1,
                         w1_expert, ldw1, w2, w2_expert, ldw2, features, h, plan, weight, logits, ids, grad_weights,
                         grad_probs, grad_logits_in, grad_w1, gw1_expert, ldgw1, grad_w2, gw2_expert, ldgw2, stream1,
                         stream2, want_x, grad_x, grad_router, outer_rows, threads, parallel, thread_num, num_threads);
}

extern "C" int moe_ffn_decode_backward_f32(
    const float* grad_out, int64_t ldg, const float* x, int64_t ldx, int64_t tokens, int64_t dim, const float* router,
    int64_t ldr, int routing, int norm, double scale, int64_t experts, int64_t top_k, const float* w1,
    int64_t w1_expert, int64_t ldw1, const float* w2, int64_t w2_expert, int64_t ldw2, int64_t features,
    const float* h, const int64_t* plan, const float* weight, const float* logits, const int64_t* ids,
    const float* grad_weights, const float* grad_probs, const float* grad_logits_in, float* grad_w1,
    int64_t gw1_expert, int64_t ldgw1, float* grad_w2, int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2,
    int want_x, float* grad_x, float* grad_router, int64_t outer_rows, int threads, void* parallel,
    void* thread_num, void* num_threads) {
  return decode_backward(grad_out, ldg, x, ldx, tokens, dim, router, ldr, routing, norm, scale, experts, top_k, w1,
                         w1_expert, ldw1, w2, w2_expert, ldw2, features, h, plan, weight, logits, ids, grad_weights,
                         grad_probs, grad_logits_in, grad_w1, gw1_expert, ldgw1, grad_w2, gw2_expert, ldgw2, stream1,
                         stream2, want_x, grad_x, grad_router, outer_rows, threads, parallel, thread_num, num_threads);
}
