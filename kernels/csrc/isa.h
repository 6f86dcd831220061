// Which SIMD path the CPU kernels take, chosen at run time.
//
// The extension is compiled with -march=native, so a kernel's wider paths exist in the binary
// only where the build machine has them (`compiled_isa`). At run time the kernels take the
// widest path that was compiled and that the CPU reports (CPUID), capped by LLMOPT_CPU_ISA
// (`avx2`, `avx512`, `amx`) when set, or by `set_cpu_isa` (tests run every path on one machine).
// AMX needs the kernel's permission to use the tile registers (Linux arch_prctl); without it
// the AVX-512 path is taken.
#pragma once
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llmopt_isa {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

inline const char* isa_name(int isa) {
  static const char* names[] = {"scalar", "avx2", "avx512", "amx"};
  return names[isa < 0 ? 0 : (isa > 3 ? 3 : isa)];
}

inline int isa_from_name(const std::string& name) {
  for (int i = kScalar; i <= kAmx; ++i)
    if (name == isa_name(i)) return i;
  return -1;
}

// What this build compiled, for the preprocessor: kernels guard their wider code with these
// (the same conditions as compiled_isa; AVX-512 means F+BW+VL+VNNI: the int8 dot products).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LLMOPT_COMPILED_AVX512 1
#else
#define LLMOPT_COMPILED_AVX512 0
#endif
#if LLMOPT_COMPILED_AVX512 && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define LLMOPT_COMPILED_AMX 1
#else
#define LLMOPT_COMPILED_AMX 0
#endif

// AVX512-BF16 (`vdpbf16ps`: pairs of bf16 products summed into fp32 lanes) beside the AVX-512 path.
#if LLMOPT_COMPILED_AVX512 && defined(__AVX512BF16__)
#define LLMOPT_COMPILED_BF16_DOT 1
#else
#define LLMOPT_COMPILED_BF16_DOT 0
#endif

// The widest path compiled into this build.
constexpr int compiled_isa() {
#if LLMOPT_COMPILED_AMX
  return kAmx;
#elif LLMOPT_COMPILED_AVX512
  return kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kScalar;
#endif
}

// Asks Linux for the AMX tile data state (once per process); false where it refuses.
inline bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// What this CPU supports, as far as this build can use it.
inline int cpu_supported_isa() {
  int isa = kScalar;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = kAvx2;
  if (isa == kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    isa = kAvx512;
  if (isa == kAvx512 && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") &&
      request_amx_permission())
    isa = kAmx;
#endif
  return isa < compiled_isa() ? isa : compiled_isa();
}

inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{[] {
    const char* env = std::getenv("LLMOPT_CPU_ISA");
    const int named = env != nullptr ? isa_from_name(env) : -1;
    return named >= 0 ? named : static_cast<int>(kAmx);
  }()};
  return cap;
}

// The path the kernels take now.
inline int active_isa() {
  static const int supported = cpu_supported_isa();
  const int cap = isa_cap().load(std::memory_order_relaxed);
  return supported < cap ? supported : cap;
}

// Whether kernels may take their bf16 dot-product paths now: compiled, the CPU has AVX512-BF16, and the
// active path is AVX-512 or wider (LLMOPT_CPU_ISA=avx2 keeps the fp32 paths).
inline bool bf16_dot_active() {
#if LLMOPT_COMPILED_BF16_DOT && defined(__GNUC__)
  static const bool cpu_has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return cpu_has && active_isa() >= kAvx512;
#else
  return false;
#endif
}

}  // namespace llmopt_isa
