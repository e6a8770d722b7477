// Running a body on torch's OpenMP team, shared by moe_ffn's CPU kernels (_small_gemm.cpp,
// _amx.cpp; why torch's team and not threads of our own: _small_gemm.cpp's header).
#pragma once

#include <algorithm>
#include <cstdint>

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

}  // namespace moe_ffn_team
