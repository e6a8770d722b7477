// The library's entry points that another of its files calls (_decode.cpp: a decode step in one
// call), declared once here and included where they are defined too, so that a signature that
// drifts is a compile error rather than a crash. bf16 values travel as their bits (uint16_t).
#pragma once

#include <cstdint>

extern "C" {

// _avx512.cpp
int moe_ffn_avx512_router_logits_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* logits,
                                      int64_t ldl, int64_t tokens, int64_t experts, int64_t dim);
int moe_ffn_avx512_routed_swiglu_blocks_bf16(const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
                                             const float* weight, const uint16_t* w1, int64_t w1_expert, int64_t ldw1,
                                             const uint16_t* w2, int64_t w2_expert, int64_t ldw2, int64_t experts,
                                             int64_t dim, int64_t features, const int64_t* blocks, int64_t count,
                                             int64_t rows, uint16_t* xg, uint16_t* h, uint16_t* a, uint16_t* y,
                                             uint16_t* out, int64_t* index, int threads, void* parallel,
                                             void* thread_num, void* num_threads);
int moe_ffn_avx512_router_backward_bf16(const float* g, int64_t ldg, const uint16_t* x, int64_t ldx, const uint16_t* w,
                                        int64_t ldw, uint16_t* grad_x, int64_t ldgx, uint16_t* grad_w, int64_t ldgw,
                                        int64_t tokens, int64_t experts, int64_t dim, int threads, void* parallel,
                                        void* thread_num, void* num_threads);
int moe_ffn_avx512_routed_swiglu_backward_blocks_bf16(
    const uint16_t* g_out, int64_t ldg_out, const uint16_t* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const uint16_t* h, int64_t ldh, const uint16_t* w1, int64_t w1_expert, int64_t ldw1,
    const uint16_t* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, uint16_t* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    uint16_t* grad_w2, int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2, float* dweight, uint16_t* grad_x,
    uint16_t* rows_d, uint16_t* rows_h, float* wide_d, float* wide_h, int64_t outer_rows, int64_t* index, int threads,
    void* parallel, void* thread_num, void* num_threads);

int moe_ffn_avx512_routed_swiglu_backward_blocks_f32(
    const float* g_out, int64_t ldg_out, const float* x, int64_t ldx, int64_t tokens, const int64_t* token,
    const float* weight, const float* h, int64_t ldh, const float* w1, int64_t w1_expert, int64_t ldw1,
    const float* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim, int64_t features,
    const int64_t* blocks, int64_t count, int64_t rows, float* grad_w1, int64_t gw1_expert, int64_t ldgw1,
    float* grad_w2, int64_t gw2_expert, int64_t ldgw2, int stream1, int stream2, float* dweight, float* grad_x,
    float* rows_d, float* rows_h, float* wide_d, float* wide_h, int64_t outer_rows, int64_t* index, int threads,
    void* parallel, void* thread_num, void* num_threads);

// _decode.cpp
int moe_ffn_decode_routing_backward(int routing, int norm, double scale, int64_t tokens, int64_t experts,
                                    int64_t top_k, const float* logits, const int64_t* ids, const int64_t* order,
                                    const float* grad_rows, const float* grad_weights, const float* grad_probs,
                                    const float* grad_logits_in, float* grad_logits);

// _small_gemm.cpp
int moe_ffn_plan_rows(const int64_t* ids, int64_t n, int64_t experts, int64_t top_k, int64_t* order, int64_t* counts,
                      int64_t* token);
int moe_ffn_routed_swiglu_blocks_f32(const float* x, int64_t ldx, int64_t tokens, const int64_t* token,
                                     const float* weight, const float* w1, int64_t w1_expert, int64_t ldw1,
                                     const float* w2, int64_t w2_expert, int64_t ldw2, int64_t experts, int64_t dim,
                                     int64_t features, const int64_t* blocks, int64_t count, int64_t rows, float* xg,
                                     float* h, float* a, float* y, float* out, void* linear1, void* linear2,
                                     int threads, void* parallel, void* thread_num, void* num_threads);

}  // extern "C"
