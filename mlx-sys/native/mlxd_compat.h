// Force-included into every mlx-c translation unit (C++ only).
//
// 1. libstdc++ 12 (Debian 12's GCC) has no std::format. mlx-c only formats with bare "{}"
//    placeholders, so a small stand-in covers it.
// 2. mlx-c defines float16_t / bfloat16_t only on ARM; on x86 they are MLX's own half types.
#pragma once
#ifdef __cplusplus
#include <string>
#include <sstream>
#include <version>
#include "mlx/types/half_types.h"

#if !(defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC) || defined(__aarch64__))
using float16_t = mlx::core::float16_t;
#define HAS_FLOAT16
#endif
#if !(defined(__ARM_FEATURE_BF16) || defined(__aarch64__))
using bfloat16_t = mlx::core::bfloat16_t;
#define HAS_BFLOAT16
#endif

#if !defined(__cpp_lib_format)
namespace std {
namespace mlxd_compat {
inline void format_into(std::ostringstream& out, std::string_view fmt) { out << fmt; }
template <typename T, typename... Rest>
void format_into(std::ostringstream& out, std::string_view fmt, const T& value, const Rest&... rest) {
  auto at = fmt.find("{}");
  if (at == std::string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, at) << value;
  format_into(out, fmt.substr(at + 2), rest...);
}
}  // namespace mlxd_compat
template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream out;
  mlxd_compat::format_into(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif
#endif
