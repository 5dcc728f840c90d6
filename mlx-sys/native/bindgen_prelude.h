// Seen by bindgen only. On x86 mlx-c's half.h defines no half types; give bindgen 16-bit
// stand-ins, which build.rs then maps to the Rust types mlx-rs expects.
#include <stdint.h>
#if !(defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC) || defined(__aarch64__))
typedef uint16_t float16_t;
#define HAS_FLOAT16
#endif
#if !(defined(__ARM_FEATURE_BF16) || defined(__aarch64__))
typedef uint16_t bfloat16_t;
#define HAS_BFLOAT16
#endif
