// Run-time CPU feature checks shared by the compiled CPU kernels (cpu_attention.cpp, cpu_ops.cpp),
// which pick their per-ISA region with them. Baseline code: no target region.
#pragma once

inline bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline bool has_avx512() {  // the F/BW/DQ/VL subset both kernels' AVX-512 regions are compiled for
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
