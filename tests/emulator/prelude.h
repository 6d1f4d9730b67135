// tq-mlx MSL emulator: a Metal Shading Language prelude for clang C++17.
//
// The generated kernel source (exactly what MLX builds, see source.py) is
// compiled as C++ after this header. It stands in for <metal_stdlib> plus the
// part of MLX's `metal::utils()` preamble that custom kernels use.
//
// Supported subset
// * Scalars: bool, char/uchar, short/ushort, int/uint, long/ulong, float,
//   half (_Float16; built with -ffloat16-excess-precision=none so every op
//   rounds to half), bfloat (__bf16, same), size_t, intN_t/uintN_t,
//   float16_t / bfloat16_t (MLX's typedefs).
// * Vectors <scalar>{2,3,4} and metal::vec<T, N> as clang ext_vector_type:
//   swizzles, splats and elementwise operators come from clang. Constructors
//   `float4(a, b.xy, c)` are function-like macros (component count checked at
//   compile time). packed_* types are NOT provided.
// * Address spaces: `device` (1), `constant` (2), `threadgroup` (3) as clang
//   address_space attributes, `thread` empty. With TQEMU_NO_ADDRESS_SPACES
//   (ASan / "plain" builds) all four are empty.
// * metal:: math for float/half/bfloat scalars and vectors: abs fabs acos acosh
//   asin asinh atan atan2 atanh ceil copysign cos cosh cospi exp exp2 exp10
//   floor fma fmax fmin fmod fract log log2 log10 max min clamp mix pow powr
//   rint round rsqrt saturate sign sin sinh sinpi sqrt step tan tanh tanpi
//   trunc, with fast:: and precise:: aliases; isnan isinf isfinite isnormal
//   signbit select all any; dot length length_squared distance normalize
//   cross; as_type; integer abs absdiff clamp max min clz ctz popcount
//   extract_bits insert_bits reverse_bits rotate mulhi;
//   metal::numeric_limits (incl. half/bfloat) and a few type traits.
// * threadgroup_barrier / simdgroup_barrier (mem_flags::...).
// * SIMD-group functions (width 32): simd_shuffle, _xor, _up, _down,
//   _rotate_up, _rotate_down, _and_fill_up, _and_fill_down, simd_broadcast,
//   simd_broadcast_first, simd_sum, simd_product, simd_min, simd_max,
//   simd_and, simd_or, simd_xor, simd_prefix_{exclusive,inclusive}_{sum,product},
//   simd_ballot, simd_all, simd_any, simd_is_first, simd_active_threads_mask.
//   Quad versions: quad_shuffle, _xor, _up, _down, quad_broadcast, quad_sum,
//   quad_product, quad_min, quad_max, quad_and, quad_or, quad_xor,
//   quad_prefix_{exclusive,inclusive}_sum, quad_all, quad_any, quad_ballot.
//   Operand types: scalars/vectors of float, half, bfloat, (u)int, (u)short,
//   (u)char; the shuffle family also takes int64_t/uint64_t/bool scalars (as
//   MLX's preamble adds them). Anything else is a compile-time error.
// * Atomics on device/threadgroup atomic<T> (atomic_int, atomic_uint,
//   atomic_float, atomic_bool): atomic_{load,store,exchange}_explicit,
//   atomic_compare_exchange_weak_explicit, atomic_fetch_{add,sub,and,or,xor,
//   min,max}_explicit; only memory_order_relaxed is meaningful.
// * From MLX's utils.h: Limits<T>, WorkPerThread<T>, ceildiv, elem_to_loc
//   (generic, _1, _2, _3), ConditionalType, cast_to, log1p, hypot,
//   bfloat16_to_uint16 / uint16_to_bfloat16, METAL_FUNC,
//   MLX_MTL_PRAGMA_UNROLL.
//
// Not provided: complex64_t, textures/samplers, simdgroup_matrix, packed
// vectors, Metal's implicit bool-vector results of vector comparisons (clang
// gives int vectors: use select/all/any, which accept both).
#pragma once

#include <cfloat>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime.h"

typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename T, int N>
using tqemu_vec_t = T __attribute__((ext_vector_type(N)));

#define TQEMU_VECTOR_TYPES(T, NAME)                      \
  typedef T NAME##2 __attribute__((ext_vector_type(2))); \
  typedef T NAME##3 __attribute__((ext_vector_type(3))); \
  typedef T NAME##4 __attribute__((ext_vector_type(4)));
TQEMU_VECTOR_TYPES(float, float)
TQEMU_VECTOR_TYPES(half, half)
TQEMU_VECTOR_TYPES(bfloat, bfloat)
TQEMU_VECTOR_TYPES(int, int)
TQEMU_VECTOR_TYPES(uint, uint)
TQEMU_VECTOR_TYPES(short, short)
TQEMU_VECTOR_TYPES(ushort, ushort)
TQEMU_VECTOR_TYPES(char, char)
TQEMU_VECTOR_TYPES(uchar, uchar)
TQEMU_VECTOR_TYPES(long, long)
TQEMU_VECTOR_TYPES(ulong, ulong)
TQEMU_VECTOR_TYPES(bool, bool)
#undef TQEMU_VECTOR_TYPES

// ---------------------------------------------------------------------------
// Address spaces. Defined after every system header so no library code sees
// them. In strict builds clang type-checks them like Metal does (a `device
// float*` does not convert to `float*` or `threadgroup float*`).
#ifdef TQEMU_NO_ADDRESS_SPACES
#define device
#define constant
#define threadgroup
#else
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#endif
#define thread

// <metal_math> constants.
#define NAN __builtin_nanf("")
#define INFINITY __builtin_inff()
#define HUGE_VALF __builtin_inff()
#define MAXFLOAT FLT_MAX
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define HALF_EPSILON 0.0009765625f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define METAL_FUNC inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

// Every SIMD function and barrier records its call site: lanes only
// rendezvous with lanes at the same site.
#define TQEMU_SITE_PARAMS                                                \
  const char *tq_file_ = __builtin_FILE(), unsigned tq_line_ = __builtin_LINE(), \
  unsigned tq_col_ = __builtin_COLUMN()
#define TQEMU_SITE ::tqemu::Site{tq_file_, tq_line_, tq_col_}

namespace tqemu {

template <class T>
struct vec_info {
  static constexpr int n = 1;
  using elem = T;
};
template <class T, int N>
struct vec_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr int n = N;
  using elem = T;
};
template <class T>
constexpr bool is_vec = vec_info<std::remove_cv_t<T>>::n > 1;
template <class T>
using elem_t = typename vec_info<std::remove_cv_t<T>>::elem;

template <class T>
constexpr bool is_float_scalar = std::is_same_v<T, float> || std::is_same_v<T, half> ||
                                 std::is_same_v<T, bfloat>;
template <class T>
constexpr bool is_int_scalar = std::is_integral_v<T> && !std::is_same_v<T, bool>;

template <class T, int N, class A>
inline void put_components(tqemu_vec_t<T, N>& r, int& i, const A& a) {
  if constexpr (vec_info<A>::n == 1) {
    r[i++] = static_cast<T>(a);
  } else {
    for (int k = 0; k < vec_info<A>::n; ++k) r[i++] = static_cast<T>(a[k]);
  }
}

// Metal vector constructor: one scalar splats, otherwise the components of
// all arguments are concatenated and must add up to N.
// `auto` return: the body (and its static_assert) is instantiated right at
// the call, so clang's diagnostic names the kernel line.
template <class T, int N, class... A>
inline auto make_vec(const A&... a) {
  constexpr int total = (0 + ... + vec_info<A>::n);
  tqemu_vec_t<T, N> r;
  if constexpr (sizeof...(A) == 0) {
    r = T(0);
  } else if constexpr (sizeof...(A) == 1 && total == 1) {
    ((r = static_cast<T>(a)), ...);
  } else {
    static_assert(total == N,
                  "Metal vector constructor: the argument components must add up to the "
                  "vector size (or be a single scalar)");
    int i = 0;
    (put_components<T, N>(r, i, a), ...);
  }
  return r;
}

template <class T>
inline T poison_value() {
  T v;
  std::memset(static_cast<void*>(&v), 0xFF, sizeof(T));
  return v;
}

}  // namespace tqemu

#define TQEMU_CTORS(T, NAME)                                   \
  template <class... A>                                        \
  inline auto tqemu_ctor_##NAME##2(const A&... a) {            \
    return ::tqemu::make_vec<T, 2>(a...);                      \
  }                                                            \
  template <class... A>                                        \
  inline auto tqemu_ctor_##NAME##3(const A&... a) {            \
    return ::tqemu::make_vec<T, 3>(a...);                      \
  }                                                            \
  template <class... A>                                        \
  inline auto tqemu_ctor_##NAME##4(const A&... a) {            \
    return ::tqemu::make_vec<T, 4>(a...);                      \
  }
TQEMU_CTORS(float, float)
TQEMU_CTORS(half, half)
TQEMU_CTORS(bfloat, bfloat)
TQEMU_CTORS(int, int)
TQEMU_CTORS(uint, uint)
TQEMU_CTORS(short, short)
TQEMU_CTORS(ushort, ushort)
TQEMU_CTORS(char, char)
TQEMU_CTORS(uchar, uchar)
TQEMU_CTORS(long, long)
TQEMU_CTORS(ulong, ulong)
TQEMU_CTORS(bool, bool)
#undef TQEMU_CTORS
// Function-like macros only expand before "(", so `float4 x;` and
// `sizeof(float4)` still name the type.
#define float2(...) tqemu_ctor_float2(__VA_ARGS__)
#define float3(...) tqemu_ctor_float3(__VA_ARGS__)
#define float4(...) tqemu_ctor_float4(__VA_ARGS__)
#define half2(...) tqemu_ctor_half2(__VA_ARGS__)
#define half3(...) tqemu_ctor_half3(__VA_ARGS__)
#define half4(...) tqemu_ctor_half4(__VA_ARGS__)
#define bfloat2(...) tqemu_ctor_bfloat2(__VA_ARGS__)
#define bfloat3(...) tqemu_ctor_bfloat3(__VA_ARGS__)
#define bfloat4(...) tqemu_ctor_bfloat4(__VA_ARGS__)
#define int2(...) tqemu_ctor_int2(__VA_ARGS__)
#define int3(...) tqemu_ctor_int3(__VA_ARGS__)
#define int4(...) tqemu_ctor_int4(__VA_ARGS__)
#define uint2(...) tqemu_ctor_uint2(__VA_ARGS__)
#define uint3(...) tqemu_ctor_uint3(__VA_ARGS__)
#define uint4(...) tqemu_ctor_uint4(__VA_ARGS__)
#define short2(...) tqemu_ctor_short2(__VA_ARGS__)
#define short3(...) tqemu_ctor_short3(__VA_ARGS__)
#define short4(...) tqemu_ctor_short4(__VA_ARGS__)
#define ushort2(...) tqemu_ctor_ushort2(__VA_ARGS__)
#define ushort3(...) tqemu_ctor_ushort3(__VA_ARGS__)
#define ushort4(...) tqemu_ctor_ushort4(__VA_ARGS__)
#define char2(...) tqemu_ctor_char2(__VA_ARGS__)
#define char3(...) tqemu_ctor_char3(__VA_ARGS__)
#define char4(...) tqemu_ctor_char4(__VA_ARGS__)
#define uchar2(...) tqemu_ctor_uchar2(__VA_ARGS__)
#define uchar3(...) tqemu_ctor_uchar3(__VA_ARGS__)
#define uchar4(...) tqemu_ctor_uchar4(__VA_ARGS__)
#define long2(...) tqemu_ctor_long2(__VA_ARGS__)
#define long3(...) tqemu_ctor_long3(__VA_ARGS__)
#define long4(...) tqemu_ctor_long4(__VA_ARGS__)
#define ulong2(...) tqemu_ctor_ulong2(__VA_ARGS__)
#define ulong3(...) tqemu_ctor_ulong3(__VA_ARGS__)
#define ulong4(...) tqemu_ctor_ulong4(__VA_ARGS__)
#define bool2(...) tqemu_ctor_bool2(__VA_ARGS__)
#define bool3(...) tqemu_ctor_bool3(__VA_ARGS__)
#define bool4(...) tqemu_ctor_bool4(__VA_ARGS__)

namespace metal {

template <typename T, int N>
using vec = tqemu_vec_t<T, N>;

// ----------------------------------------------------------------- traits
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::enable_if;
using std::enable_if_t;
using std::integral_constant;
using std::is_integral;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_reference;
using std::remove_reference_t;
using std::false_type;
using std::true_type;

template <class T>
struct is_floating_point
    : std::integral_constant<bool, tqemu::is_float_scalar<std::remove_cv_t<T>>> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_arithmetic
    : std::integral_constant<bool, is_floating_point_v<T> || std::is_integral_v<T>> {};
template <class T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return __builtin_bit_cast(half, (unsigned short)0x0400); }
  static constexpr half max() { return __builtin_bit_cast(half, (unsigned short)0x7BFF); }
  static constexpr half lowest() { return __builtin_bit_cast(half, (unsigned short)0xFBFF); }
  static constexpr half epsilon() { return __builtin_bit_cast(half, (unsigned short)0x1400); }
  static constexpr half infinity() { return __builtin_bit_cast(half, (unsigned short)0x7C00); }
  static constexpr half quiet_NaN() { return __builtin_bit_cast(half, (unsigned short)0x7E00); }
  static constexpr half denorm_min() { return __builtin_bit_cast(half, (unsigned short)0x0001); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F7F); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xFF7F); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3C00); }
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7FC0); }
  static constexpr bfloat denorm_min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0001); }
};

// ------------------------------------------------------------------ as_type
template <class To, class From>
METAL_FUNC To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination sizes differ");
  return __builtin_bit_cast(To, x);
}

// ------------------------------------------------------------- float math
namespace tqemu_impl {
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float exp10(float x) { return __builtin_powf(10.0f, x); }
inline float fract(float x) { return __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f); }
inline float saturate(float x) { return __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f); }
inline float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? x : 0.0f)); }
inline float cospi(float x) { return __builtin_cosf(3.14159265358979323846f * x); }
inline float sinpi(float x) { return __builtin_sinf(3.14159265358979323846f * x); }
inline float tanpi(float x) { return __builtin_tanf(3.14159265358979323846f * x); }
inline float step(float edge, float x) { return x < edge ? 0.0f : 1.0f; }
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline float clamp(float x, float lo, float hi) { return __builtin_fminf(__builtin_fmaxf(x, lo), hi); }
}  // namespace tqemu_impl

#define TQEMU_F1(NAME, IMPL)                                                  \
  METAL_FUNC float NAME(float x) { return IMPL(x); }                          \
  METAL_FUNC half NAME(half x) { return (half)IMPL((float)x); }               \
  METAL_FUNC bfloat NAME(bfloat x) { return (bfloat)IMPL((float)x); }         \
  template <class T, int N, class = std::enable_if_t<tqemu::is_float_scalar<T>>> \
  METAL_FUNC vec<T, N> NAME(vec<T, N> v) {                                    \
    vec<T, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = NAME(T(v[i]));                         \
    return r;                                                                 \
  }
#define TQEMU_F2(NAME, IMPL)                                                       \
  METAL_FUNC float NAME(float x, float y) { return IMPL(x, y); }                   \
  METAL_FUNC half NAME(half x, half y) { return (half)IMPL((float)x, (float)y); }  \
  METAL_FUNC bfloat NAME(bfloat x, bfloat y) {                                     \
    return (bfloat)IMPL((float)x, (float)y);                                       \
  }                                                                                \
  template <class T, int N, class = std::enable_if_t<tqemu::is_float_scalar<T>>>   \
  METAL_FUNC vec<T, N> NAME(vec<T, N> a, vec<T, N> b) {                            \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = NAME(T(a[i]), T(b[i]));                     \
    return r;                                                                      \
  }
#define TQEMU_F3(NAME, IMPL)                                                           \
  METAL_FUNC float NAME(float x, float y, float z) { return IMPL(x, y, z); }           \
  METAL_FUNC half NAME(half x, half y, half z) {                                       \
    return (half)IMPL((float)x, (float)y, (float)z);                                   \
  }                                                                                    \
  METAL_FUNC bfloat NAME(bfloat x, bfloat y, bfloat z) {                               \
    return (bfloat)IMPL((float)x, (float)y, (float)z);                                 \
  }                                                                                    \
  template <class T, int N, class = std::enable_if_t<tqemu::is_float_scalar<T>>>       \
  METAL_FUNC vec<T, N> NAME(vec<T, N> a, vec<T, N> b, vec<T, N> c) {                   \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = NAME(T(a[i]), T(b[i]), T(c[i]));               \
    return r;                                                                          \
  }

TQEMU_F1(acos, __builtin_acosf)
TQEMU_F1(acosh, __builtin_acoshf)
TQEMU_F1(asin, __builtin_asinf)
TQEMU_F1(asinh, __builtin_asinhf)
TQEMU_F1(atan, __builtin_atanf)
TQEMU_F1(atanh, __builtin_atanhf)
TQEMU_F1(ceil, __builtin_ceilf)
TQEMU_F1(cos, __builtin_cosf)
TQEMU_F1(cosh, __builtin_coshf)
TQEMU_F1(cospi, tqemu_impl::cospi)
TQEMU_F1(exp, __builtin_expf)
TQEMU_F1(exp2, __builtin_exp2f)
TQEMU_F1(exp10, tqemu_impl::exp10)
TQEMU_F1(fabs, __builtin_fabsf)
TQEMU_F1(floor, __builtin_floorf)
TQEMU_F1(fract, tqemu_impl::fract)
TQEMU_F1(log, __builtin_logf)
TQEMU_F1(log2, __builtin_log2f)
TQEMU_F1(log10, __builtin_log10f)
TQEMU_F1(rint, __builtin_rintf)
TQEMU_F1(round, __builtin_roundf)
TQEMU_F1(rsqrt, tqemu_impl::rsqrt)
TQEMU_F1(saturate, tqemu_impl::saturate)
TQEMU_F1(sign, tqemu_impl::sign)
TQEMU_F1(sin, __builtin_sinf)
TQEMU_F1(sinh, __builtin_sinhf)
TQEMU_F1(sinpi, tqemu_impl::sinpi)
TQEMU_F1(sqrt, __builtin_sqrtf)
TQEMU_F1(tan, __builtin_tanf)
TQEMU_F1(tanh, __builtin_tanhf)
TQEMU_F1(tanpi, tqemu_impl::tanpi)
TQEMU_F1(trunc, __builtin_truncf)
TQEMU_F2(atan2, __builtin_atan2f)
TQEMU_F2(copysign, __builtin_copysignf)
TQEMU_F2(fdim, __builtin_fdimf)
TQEMU_F2(fmax, __builtin_fmaxf)
TQEMU_F2(fmin, __builtin_fminf)
TQEMU_F2(fmod, __builtin_fmodf)
TQEMU_F2(pow, __builtin_powf)
TQEMU_F2(powr, __builtin_powf)
TQEMU_F2(step, tqemu_impl::step)
TQEMU_F3(fma, __builtin_fmaf)
TQEMU_F3(mix, tqemu_impl::mix)
#undef TQEMU_F1
#undef TQEMU_F2
#undef TQEMU_F3

// max/min/clamp/abs: one overload per Metal scalar type, so mixed calls such
// as max(float, int) are ambiguous here exactly as with Metal's overload set.
// Floating max/min follow fmax/fmin (a NaN operand is ignored).
#define TQEMU_FLOAT_MINMAX(T)                                                  \
  METAL_FUNC T max(T a, T b) { return (T)__builtin_fmaxf((float)a, (float)b); }        \
  METAL_FUNC T min(T a, T b) { return (T)__builtin_fminf((float)a, (float)b); }        \
  METAL_FUNC T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }          \
  METAL_FUNC T abs(T x) { return (T)__builtin_fabsf((float)x); }
TQEMU_FLOAT_MINMAX(float)
TQEMU_FLOAT_MINMAX(half)
TQEMU_FLOAT_MINMAX(bfloat)
#undef TQEMU_FLOAT_MINMAX

#define TQEMU_INT_FUNCS(T)                                                            \
  METAL_FUNC T max(T a, T b) { return a < b ? b : a; }                               \
  METAL_FUNC T min(T a, T b) { return b < a ? b : a; }                               \
  METAL_FUNC T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }                \
  METAL_FUNC T abs(T x) {                                                            \
    if constexpr (std::is_signed_v<T>) return x < 0 ? static_cast<T>(-x) : x;        \
    else return x;                                                                   \
  }                                                                                  \
  METAL_FUNC std::make_unsigned_t<T> absdiff(T a, T b) {                             \
    return a > b ? std::make_unsigned_t<T>(a - b) : std::make_unsigned_t<T>(b - a); \
  }
TQEMU_INT_FUNCS(char)
typedef signed char tqemu_schar;
TQEMU_INT_FUNCS(tqemu_schar)
TQEMU_INT_FUNCS(uchar)
TQEMU_INT_FUNCS(short)
TQEMU_INT_FUNCS(ushort)
TQEMU_INT_FUNCS(int)
TQEMU_INT_FUNCS(uint)
TQEMU_INT_FUNCS(long)
TQEMU_INT_FUNCS(ulong)
#undef TQEMU_INT_FUNCS

template <class T, int N>
METAL_FUNC vec<T, N> max(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(T(a[i]), T(b[i]));
  return r;
}
template <class T, int N>
METAL_FUNC vec<T, N> min(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(T(a[i]), T(b[i]));
  return r;
}
template <class T, int N>
METAL_FUNC vec<T, N> clamp(vec<T, N> x, vec<T, N> lo, vec<T, N> hi) {
  return min(max(x, lo), hi);
}
template <class T, int N>
METAL_FUNC vec<T, N> abs(vec<T, N> x) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(T(x[i]));
  return r;
}

// ------------------------------------------------------------- relational
#define TQEMU_PRED(NAME, IMPL)                                                   \
  METAL_FUNC bool NAME(float x) { return IMPL(x); }                              \
  METAL_FUNC bool NAME(half x) { return IMPL((float)x); }                        \
  METAL_FUNC bool NAME(bfloat x) { return IMPL((float)x); }                      \
  template <class T, int N, class = std::enable_if_t<tqemu::is_float_scalar<T>>> \
  METAL_FUNC vec<bool, N> NAME(vec<T, N> v) {                                    \
    vec<bool, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = NAME(T(v[i]));                            \
    return r;                                                                    \
  }
TQEMU_PRED(isnan, __builtin_isnan)
TQEMU_PRED(isinf, __builtin_isinf)
TQEMU_PRED(isfinite, __builtin_isfinite)
TQEMU_PRED(isnormal, __builtin_isnormal)
TQEMU_PRED(signbit, __builtin_signbit)
#undef TQEMU_PRED

// Masks may be bool vectors or the int vectors clang's comparisons produce.
METAL_FUNC bool all(bool b) { return b; }
METAL_FUNC bool any(bool b) { return b; }
template <class T, int N>
METAL_FUNC bool all(vec<T, N> m) {
  for (int i = 0; i < N; ++i)
    if (!m[i]) return false;
  return true;
}
template <class T, int N>
METAL_FUNC bool any(vec<T, N> m) {
  for (int i = 0; i < N; ++i)
    if (m[i]) return true;
  return false;
}
template <class T, class = std::enable_if_t<!tqemu::is_vec<T>>>
METAL_FUNC T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N, class M>
METAL_FUNC vec<T, N> select(vec<T, N> a, vec<T, N> b, M c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) {
    bool ci;
    if constexpr (tqemu::is_vec<M>) {
      static_assert(tqemu::vec_info<M>::n == N, "select: mask size differs");
      ci = c[i];
    } else {
      ci = c;
    }
    r[i] = ci ? T(b[i]) : T(a[i]);
  }
  return r;
}

// --------------------------------------------------------------- geometric
template <class T, int N>
METAL_FUNC T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(a[0]) * T(b[0]);
  for (int i = 1; i < N; ++i) s += T(a[i]) * T(b[i]);
  return s;
}
template <class T, int N>
METAL_FUNC T length_squared(vec<T, N> a) {
  return dot(a, a);
}
template <class T, int N>
METAL_FUNC T length(vec<T, N> a) {
  return sqrt(dot(a, a));
}
template <class T, int N>
METAL_FUNC T distance(vec<T, N> a, vec<T, N> b) {
  return length(a - b);
}
template <class T, int N>
METAL_FUNC vec<T, N> normalize(vec<T, N> a) {
  return a * rsqrt(dot(a, a));
}
template <class T>
METAL_FUNC vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) {
  return vec<T, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}

// ------------------------------------------------------------- integer ops
namespace tqemu_impl {
template <class T>
using U = std::make_unsigned_t<T>;
template <class T>
constexpr int bits_of = int(sizeof(T) * 8);
}  // namespace tqemu_impl

template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T popcount(T x) {
  return T(__builtin_popcountll((unsigned long long)(tqemu_impl::U<T>)x));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T clz(T x) {
  auto u = (unsigned long long)(tqemu_impl::U<T>)x;
  if (u == 0) return T(tqemu_impl::bits_of<T>);
  return T(__builtin_clzll(u) - (64 - tqemu_impl::bits_of<T>));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T ctz(T x) {
  auto u = (unsigned long long)(tqemu_impl::U<T>)x;
  if (u == 0) return T(tqemu_impl::bits_of<T>);
  return T(__builtin_ctzll(u));
}
// Bits [offset, offset + bits) moved to the bottom; signed types sign-extend.
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T extract_bits(T x, uint offset, uint bits) {
  constexpr int W = tqemu_impl::bits_of<T>;
  if (bits == 0) return T(0);
  unsigned long long u = (unsigned long long)(tqemu_impl::U<T>)x >> offset;
  unsigned long long mask = bits >= 64 ? ~0ull : ((1ull << bits) - 1);
  u &= mask;
  if constexpr (std::is_signed_v<T>) {
    if (bits < (uint)W && ((u >> (bits - 1)) & 1)) u |= ~mask;
  }
  return T(tqemu_impl::U<T>(u));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T insert_bits(T base, T insert, uint offset, uint bits) {
  if (bits == 0) return base;
  unsigned long long mask = (bits >= 64 ? ~0ull : ((1ull << bits) - 1)) << offset;
  unsigned long long b = (unsigned long long)(tqemu_impl::U<T>)base;
  unsigned long long ins = (unsigned long long)(tqemu_impl::U<T>)insert << offset;
  return T(tqemu_impl::U<T>((b & ~mask) | (ins & mask)));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T reverse_bits(T x) {
  constexpr int W = tqemu_impl::bits_of<T>;
  unsigned long long u = (unsigned long long)(tqemu_impl::U<T>)x, r = 0;
  for (int i = 0; i < W; ++i) r |= ((u >> i) & 1ull) << (W - 1 - i);
  return T(tqemu_impl::U<T>(r));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T rotate(T v, T i) {
  constexpr int W = tqemu_impl::bits_of<T>;
  auto u = (tqemu_impl::U<T>)v;
  int s = int((tqemu_impl::U<T>)i % W);
  if (s == 0) return v;
  return T(tqemu_impl::U<T>((u << s) | (u >> (W - s))));
}
template <class T, class = std::enable_if_t<tqemu::is_int_scalar<T>>>
METAL_FUNC T mulhi(T a, T b) {
  static_assert(sizeof(T) <= 4, "mulhi: 64-bit operands are not supported by the emulator");
  using W = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  return T((W(a) * W(b)) >> (tqemu_impl::bits_of<T>));
}
#define TQEMU_INT_VEC1(NAME)                                                      \
  template <class T, int N, class = std::enable_if_t<tqemu::is_int_scalar<T>>>    \
  METAL_FUNC vec<T, N> NAME(vec<T, N> v) {                                        \
    vec<T, N> r;                                                                  \
    for (int i = 0; i < N; ++i) r[i] = NAME(T(v[i]));                             \
    return r;                                                                     \
  }
TQEMU_INT_VEC1(popcount)
TQEMU_INT_VEC1(clz)
TQEMU_INT_VEC1(ctz)
TQEMU_INT_VEC1(reverse_bits)
#undef TQEMU_INT_VEC1

// fast:: and precise:: only differ in accuracy guarantees on the GPU; here
// both are the IEEE float implementation (compare with tolerances).
namespace fast {
using metal::abs; using metal::acos; using metal::acosh; using metal::asin; using metal::asinh;
using metal::atan; using metal::atan2; using metal::atanh; using metal::ceil; using metal::clamp;
using metal::copysign; using metal::cos; using metal::cosh; using metal::cospi; using metal::exp;
using metal::exp10; using metal::exp2; using metal::fabs; using metal::fdim; using metal::floor;
using metal::fma; using metal::fmax; using metal::fmin; using metal::fmod; using metal::fract;
using metal::log; using metal::log10; using metal::log2; using metal::max; using metal::min;
using metal::mix; using metal::pow; using metal::powr; using metal::rint; using metal::round;
using metal::rsqrt; using metal::saturate; using metal::sign; using metal::sin; using metal::sinh;
using metal::sinpi; using metal::sqrt; using metal::step; using metal::tan; using metal::tanh;
using metal::tanpi; using metal::trunc; using metal::normalize; using metal::length;
using metal::distance; using metal::dot;
}  // namespace fast
namespace precise {
using namespace fast;
}  // namespace precise

// ---------------------------------------------------------------- barriers
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
METAL_FUNC constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}
METAL_FUNC void threadgroup_barrier(mem_flags, TQEMU_SITE_PARAMS) {
  ::tqemu::barrier(TQEMU_SITE, false);
}
METAL_FUNC void simdgroup_barrier(mem_flags, TQEMU_SITE_PARAMS) {
  ::tqemu::barrier(TQEMU_SITE, true);
}

}  // namespace metal

// --------------------------------------------------------- SIMD-group ops
namespace tqemu {

template <class T>
constexpr bool simd_elem_ok =
    is_float_scalar<T> || std::is_same_v<T, int> || std::is_same_v<T, uint> ||
    std::is_same_v<T, short> || std::is_same_v<T, ushort> || std::is_same_v<T, char> ||
    std::is_same_v<T, signed char> || std::is_same_v<T, uchar>;
template <class T>
constexpr bool simd_value_ok = simd_elem_ok<elem_t<T>>;
// MLX's preamble adds int64/uint64/bool overloads for the shuffle family.
template <class T>
constexpr bool shuffle_value_ok = simd_value_ok<T> || std::is_same_v<T, int64_t> ||
                                  std::is_same_v<T, uint64_t> || std::is_same_v<T, bool>;

template <class T>
inline T lane_in(const SimdCall& c, uint32_t lane) {
  T v;
  std::memcpy(static_cast<void*>(&v), c.slots[lane].in, sizeof(T));
  return v;
}
template <class T>
inline T lane_in2(const SimdCall& c, uint32_t lane) {
  T v;
  std::memcpy(static_cast<void*>(&v), c.slots[lane].in2, sizeof(T));
  return v;
}
template <class T>
inline void lane_out(const SimdCall& c, uint32_t lane, const T& v) {
  std::memcpy(c.slots[lane].out, static_cast<const void*>(&v), sizeof(T));
}
inline bool has_lane(uint32_t mask, uint32_t lane) { return lane < 32 && ((mask >> lane) & 1u); }

enum class Shuf { Idx, Xor, Up, Down, RotUp, RotDown, FillUp, FillDown, BcastFirst,
                  QIdx, QXor, QUp, QDown };

template <class T, Shuf K>
void resolve_shuffle(const SimdCall& c) {
  uint32_t first = c.mask ? uint32_t(__builtin_ctz(c.mask)) : 0;
  for (uint32_t l = 0; l < 32; ++l) {
    if (!has_lane(c.mask, l)) continue;
    const uint32_t a = c.slots[l].arg;
    uint32_t src = l;
    bool fill = false;
    switch (K) {
      case Shuf::Idx: src = a; break;
      case Shuf::Xor: src = l ^ a; break;
      case Shuf::Up: src = l >= a ? l - a : l; break;
      case Shuf::Down: src = l + a < 32 ? l + a : l; break;
      case Shuf::RotUp: src = (l + 32 - (a & 31)) & 31; break;
      case Shuf::RotDown: src = (l + a) & 31; break;
      case Shuf::FillUp: {
        uint32_t m = c.slots[l].arg2 ? c.slots[l].arg2 : 32;
        uint32_t idx = l % m;
        if (idx >= a) src = l - a;
        else { src = l + m - a; fill = true; }
        break;
      }
      case Shuf::FillDown: {
        uint32_t m = c.slots[l].arg2 ? c.slots[l].arg2 : 32;
        uint32_t idx = l % m;
        if (idx + a < m) src = l + a;
        else { src = l + a - m; fill = true; }
        break;
      }
      case Shuf::BcastFirst: src = first; break;
      case Shuf::QIdx: src = a < 4 ? (l & ~3u) + a : 32; break;
      case Shuf::QXor: src = a < 4 ? (l & ~3u) + ((l & 3u) ^ a) : 32; break;
      case Shuf::QUp: src = (l & 3u) >= a ? l - a : l; break;
      case Shuf::QDown: src = (l & 3u) + a < 4 ? l + a : l; break;
    }
    if (!has_lane(c.mask, src)) {
      warn_inactive_read(c, l, src);
      lane_out(c, l, poison_value<T>());
    } else {
      lane_out(c, l, fill ? lane_in2<T>(c, src) : lane_in<T>(c, src));
    }
  }
}

enum class Red { Sum, Prod, Min, Max, And, Or, Xor };

// bfloat reductions accumulate in float, as MLX's bf16 SIMD overloads do.
template <class T>
struct acc_of {
  using type = T;
};
template <>
struct acc_of<bfloat> {
  using type = float;
};
template <int N>
struct acc_of<tqemu_vec_t<bfloat, N>> {
  using type = tqemu_vec_t<float, N>;
};

template <class To, class From>
inline To convert_to(const From& v) {
  if constexpr (std::is_same_v<To, From>) return v;
  else if constexpr (is_vec<To>) return __builtin_convertvector(v, To);
  else return static_cast<To>(v);
}

template <Red R, class A>
inline A combine(A x, A y) {
  switch (R) {
    case Red::Sum: return x + y;
    case Red::Prod: return x * y;
    case Red::Min: return metal::min(x, y);
    case Red::Max: return metal::max(x, y);
    case Red::And: if constexpr (is_int_scalar<elem_t<A>>) return x & y; else return x;
    case Red::Or: if constexpr (is_int_scalar<elem_t<A>>) return x | y; else return x;
    case Red::Xor: if constexpr (is_int_scalar<elem_t<A>>) return x ^ y; else return x;
  }
  return x;
}

// Group = 32 for SIMD ops, 4 for quad ops. Lanes combine in lane order.
template <class T, Red R, int Group>
void resolve_reduce(const SimdCall& c) {
  using A = typename acc_of<T>::type;
  for (uint32_t g0 = 0; g0 < 32; g0 += Group) {
    bool have = false;
    A acc{};
    for (uint32_t l = g0; l < g0 + Group; ++l) {
      if (!has_lane(c.mask, l)) continue;
      A v = convert_to<A>(lane_in<T>(c, l));
      acc = have ? combine<R>(acc, v) : v;
      have = true;
    }
    if (!have) continue;
    T res = convert_to<T>(acc);
    for (uint32_t l = g0; l < g0 + Group; ++l)
      if (has_lane(c.mask, l)) lane_out(c, l, res);
  }
}

template <class T, Red R, bool Inclusive, int Group>
void resolve_prefix(const SimdCall& c) {
  using A = typename acc_of<T>::type;
  for (uint32_t g0 = 0; g0 < 32; g0 += Group) {
    A acc = convert_to<A>(T(R == Red::Prod ? 1 : 0));
    for (uint32_t l = g0; l < g0 + Group; ++l) {
      if (!has_lane(c.mask, l)) continue;
      A v = convert_to<A>(lane_in<T>(c, l));
      if (Inclusive) {
        acc = combine<R>(acc, v);
        lane_out(c, l, convert_to<T>(acc));
      } else {
        lane_out(c, l, convert_to<T>(acc));
        acc = combine<R>(acc, v);
      }
    }
  }
}

enum class Vote { Ballot, All, Any, IsFirst, ActiveMask, QBallot, QAll, QAny };

template <Vote K>
void resolve_vote(const SimdCall& c) {
  uint64_t ballot = 0;
  for (uint32_t l = 0; l < 32; ++l)
    if (has_lane(c.mask, l) && c.slots[l].arg) ballot |= 1ull << l;
  uint32_t first = c.mask ? uint32_t(__builtin_ctz(c.mask)) : 0;
  for (uint32_t l = 0; l < 32; ++l) {
    if (!has_lane(c.mask, l)) continue;
    uint64_t qmask = 0xFull << (l & ~3u);
    uint64_t qactive = uint64_t(c.mask) & qmask;
    switch (K) {
      case Vote::Ballot: lane_out<uint64_t>(c, l, ballot); break;
      case Vote::ActiveMask: lane_out<uint64_t>(c, l, uint64_t(c.mask)); break;
      case Vote::All: lane_out<bool>(c, l, ballot == uint64_t(c.mask)); break;
      case Vote::Any: lane_out<bool>(c, l, ballot != 0); break;
      case Vote::IsFirst: lane_out<bool>(c, l, l == first); break;
      case Vote::QBallot: lane_out<uint64_t>(c, l, (ballot & qmask) >> (l & ~3u)); break;
      case Vote::QAll: lane_out<bool>(c, l, (ballot & qmask) == qactive); break;
      case Vote::QAny: lane_out<bool>(c, l, (ballot & qmask) != 0); break;
    }
  }
}

inline void resolve_nothing(const SimdCall&) {}

}  // namespace tqemu

namespace metal {

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v_;
  explicit constexpr simd_vote(vote_t v = 0) : v_(v) {}
  explicit constexpr operator vote_t() const { return v_; }
  constexpr bool all() const { return v_ != 0 && (v_ & (v_ + 1)) == 0; }
  constexpr bool any() const { return v_ != 0; }
};
typedef simd_vote quad_vote;

#define TQEMU_CHECK_SHUFFLE(T, OP)                                                        \
  static_assert(::tqemu::shuffle_value_ok<T>,                                            \
                OP ": Metal supports scalars/vectors of float, half, bfloat, (u)int, "    \
                   "(u)short, (u)char (MLX adds 64-bit and bool scalars)")
#define TQEMU_CHECK_SIMD(T, OP)                                                           \
  static_assert(::tqemu::simd_value_ok<T>,                                               \
                OP ": Metal supports scalars/vectors of float, half, bfloat, (u)int, "    \
                   "(u)short, (u)char (no 64-bit or bool operands)")

#define TQEMU_SHUFFLE(NAME, KIND, ARGT)                                                \
  template <class T>                                                                   \
  METAL_FUNC T NAME(T data, ARGT a, TQEMU_SITE_PARAMS) {                               \
    TQEMU_CHECK_SHUFFLE(T, #NAME);                                                     \
    T out;                                                                             \
    ::tqemu::simd_op(#NAME, &data, nullptr, &out, uint32_t(a), 0,                      \
                     &::tqemu::resolve_shuffle<T, ::tqemu::Shuf::KIND>, TQEMU_SITE);   \
    return out;                                                                        \
  }
TQEMU_SHUFFLE(simd_shuffle, Idx, ushort)
TQEMU_SHUFFLE(simd_broadcast, Idx, ushort)
TQEMU_SHUFFLE(simd_shuffle_xor, Xor, ushort)
TQEMU_SHUFFLE(simd_shuffle_up, Up, ushort)
TQEMU_SHUFFLE(simd_shuffle_down, Down, ushort)
TQEMU_SHUFFLE(simd_shuffle_rotate_up, RotUp, ushort)
TQEMU_SHUFFLE(simd_shuffle_rotate_down, RotDown, ushort)
TQEMU_SHUFFLE(quad_shuffle, QIdx, ushort)
TQEMU_SHUFFLE(quad_broadcast, QIdx, ushort)
TQEMU_SHUFFLE(quad_shuffle_xor, QXor, ushort)
TQEMU_SHUFFLE(quad_shuffle_up, QUp, ushort)
TQEMU_SHUFFLE(quad_shuffle_down, QDown, ushort)
#undef TQEMU_SHUFFLE

template <class T>
METAL_FUNC T simd_broadcast_first(T data, TQEMU_SITE_PARAMS) {
  TQEMU_CHECK_SHUFFLE(T, "simd_broadcast_first");
  T out;
  ::tqemu::simd_op("simd_broadcast_first", &data, nullptr, &out, 0, 0,
                   &::tqemu::resolve_shuffle<T, ::tqemu::Shuf::BcastFirst>, TQEMU_SITE);
  return out;
}
#define TQEMU_FILL(NAME, KIND)                                                           \
  template <class T>                                                                     \
  METAL_FUNC T NAME(T data, T filling, ushort delta, TQEMU_SITE_PARAMS) {                \
    TQEMU_CHECK_SHUFFLE(T, #NAME);                                                       \
    T out;                                                                               \
    ::tqemu::simd_op(#NAME, &data, &filling, &out, delta, 32,                            \
                     &::tqemu::resolve_shuffle<T, ::tqemu::Shuf::KIND>, TQEMU_SITE);     \
    return out;                                                                          \
  }                                                                                      \
  template <class T>                                                                     \
  METAL_FUNC T NAME(T data, T filling, ushort delta, ushort modulo, TQEMU_SITE_PARAMS) { \
    TQEMU_CHECK_SHUFFLE(T, #NAME);                                                       \
    T out;                                                                               \
    ::tqemu::simd_op(#NAME, &data, &filling, &out, delta, modulo,                        \
                     &::tqemu::resolve_shuffle<T, ::tqemu::Shuf::KIND>, TQEMU_SITE);     \
    return out;                                                                          \
  }
TQEMU_FILL(simd_shuffle_and_fill_up, FillUp)
TQEMU_FILL(simd_shuffle_and_fill_down, FillDown)
#undef TQEMU_FILL

#define TQEMU_REDUCE(NAME, RED, GROUP)                                                 \
  template <class T>                                                                   \
  METAL_FUNC T NAME(T data, TQEMU_SITE_PARAMS) {                                       \
    TQEMU_CHECK_SIMD(T, #NAME);                                                        \
    T out;                                                                             \
    ::tqemu::simd_op(#NAME, &data, nullptr, &out, 0, 0,                                \
                     &::tqemu::resolve_reduce<T, ::tqemu::Red::RED, GROUP>, TQEMU_SITE); \
    return out;                                                                        \
  }
TQEMU_REDUCE(simd_sum, Sum, 32)
TQEMU_REDUCE(simd_product, Prod, 32)
TQEMU_REDUCE(simd_min, Min, 32)
TQEMU_REDUCE(simd_max, Max, 32)
TQEMU_REDUCE(quad_sum, Sum, 4)
TQEMU_REDUCE(quad_product, Prod, 4)
TQEMU_REDUCE(quad_min, Min, 4)
TQEMU_REDUCE(quad_max, Max, 4)
#undef TQEMU_REDUCE

#define TQEMU_BITWISE(NAME, RED, GROUP)                                                \
  template <class T>                                                                   \
  METAL_FUNC T NAME(T data, TQEMU_SITE_PARAMS) {                                       \
    TQEMU_CHECK_SIMD(T, #NAME);                                                        \
    static_assert(::tqemu::is_int_scalar<::tqemu::elem_t<T>>,                          \
                  #NAME ": needs an integer operand");                                 \
    T out;                                                                             \
    ::tqemu::simd_op(#NAME, &data, nullptr, &out, 0, 0,                                \
                     &::tqemu::resolve_reduce<T, ::tqemu::Red::RED, GROUP>, TQEMU_SITE); \
    return out;                                                                        \
  }
TQEMU_BITWISE(simd_and, And, 32)
TQEMU_BITWISE(simd_or, Or, 32)
TQEMU_BITWISE(simd_xor, Xor, 32)
TQEMU_BITWISE(quad_and, And, 4)
TQEMU_BITWISE(quad_or, Or, 4)
TQEMU_BITWISE(quad_xor, Xor, 4)
#undef TQEMU_BITWISE

#define TQEMU_PREFIX(NAME, RED, INCL, GROUP)                                             \
  template <class T>                                                                     \
  METAL_FUNC T NAME(T data, TQEMU_SITE_PARAMS) {                                         \
    TQEMU_CHECK_SIMD(T, #NAME);                                                          \
    T out;                                                                               \
    ::tqemu::simd_op(#NAME, &data, nullptr, &out, 0, 0,                                  \
                     &::tqemu::resolve_prefix<T, ::tqemu::Red::RED, INCL, GROUP>,        \
                     TQEMU_SITE);                                                        \
    return out;                                                                          \
  }
TQEMU_PREFIX(simd_prefix_exclusive_sum, Sum, false, 32)
TQEMU_PREFIX(simd_prefix_inclusive_sum, Sum, true, 32)
TQEMU_PREFIX(simd_prefix_exclusive_product, Prod, false, 32)
TQEMU_PREFIX(simd_prefix_inclusive_product, Prod, true, 32)
TQEMU_PREFIX(quad_prefix_exclusive_sum, Sum, false, 4)
TQEMU_PREFIX(quad_prefix_inclusive_sum, Sum, true, 4)
TQEMU_PREFIX(quad_prefix_exclusive_product, Prod, false, 4)
TQEMU_PREFIX(quad_prefix_inclusive_product, Prod, true, 4)
#undef TQEMU_PREFIX

#define TQEMU_VOTE(NAME, KIND, RET, WRAP)                                       \
  METAL_FUNC RET NAME(bool expr, TQEMU_SITE_PARAMS) {                           \
    std::conditional_t<std::is_same_v<RET, bool>, bool, uint64_t> out;          \
    ::tqemu::simd_op(#NAME, nullptr, nullptr, &out, expr ? 1u : 0u, 0,          \
                     &::tqemu::resolve_vote<::tqemu::Vote::KIND>, TQEMU_SITE);  \
    return WRAP(out);                                                           \
  }
TQEMU_VOTE(simd_ballot, Ballot, simd_vote, simd_vote)
TQEMU_VOTE(simd_all, All, bool, bool)
TQEMU_VOTE(simd_any, Any, bool, bool)
TQEMU_VOTE(quad_ballot, QBallot, quad_vote, quad_vote)
TQEMU_VOTE(quad_all, QAll, bool, bool)
TQEMU_VOTE(quad_any, QAny, bool, bool)
#undef TQEMU_VOTE

METAL_FUNC bool simd_is_first(TQEMU_SITE_PARAMS) {
  bool out;
  ::tqemu::simd_op("simd_is_first", nullptr, nullptr, &out, 0, 0,
                   &::tqemu::resolve_vote<::tqemu::Vote::IsFirst>, TQEMU_SITE);
  return out;
}
METAL_FUNC simd_vote simd_active_threads_mask(TQEMU_SITE_PARAMS) {
  uint64_t out;
  ::tqemu::simd_op("simd_active_threads_mask", nullptr, nullptr, &out, 0, 0,
                   &::tqemu::resolve_vote<::tqemu::Vote::ActiveMask>, TQEMU_SITE);
  return simd_vote(out);
}
#undef TQEMU_CHECK_SHUFFLE
#undef TQEMU_CHECK_SIMD

// ------------------------------------------------------------------ atomics
enum memory_order {
  memory_order_relaxed = 0,
  memory_order_acquire = 2,
  memory_order_release = 3,
  memory_order_acq_rel = 4,
  memory_order_seq_cst = 5,
};
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup,
                          thread_scope_threadgroup, thread_scope_device };

// The value member is accessed with plain member syntax (no member
// functions), which works through any address space.
template <class T>
struct atomic {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, uint> ||
                    std::is_same_v<T, float> || std::is_same_v<T, bool> ||
                    std::is_same_v<T, ulong> || std::is_same_v<T, long>,
                "Metal atomics: atomic<int|uint|float|bool> (and 64-bit on newer GPUs)");
  T tq_value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

// Atomic builtins want every pointer in one address space: use generic ones.
#define TQEMU_ATOMIC_T(obj) std::remove_cv_t<decltype((obj)->tq_value_)>
#define TQEMU_ATOMIC_PTR(obj) ((TQEMU_ATOMIC_T(obj)*)&(obj)->tq_value_)
#define TQEMU_ATOMIC_NOTE(obj, W) \
  ::tqemu::note_access((const void*)TQEMU_ATOMIC_PTR(obj), sizeof((obj)->tq_value_), W)

// The memory operations themselves run in functions the access hooks do not
// instrument, so each atomic is counted exactly once, explicitly.
namespace tqemu_impl {
#define TQEMU_UNCOUNTED __attribute__((noinline, no_sanitize("coverage")))
template <class T>
TQEMU_UNCOUNTED T atomic_load(T* p) {
  T v;
  __atomic_load(p, &v, __ATOMIC_RELAXED);
  return v;
}
template <class T>
TQEMU_UNCOUNTED void atomic_store(T* p, T v) {
  __atomic_store(p, &v, __ATOMIC_RELAXED);
}
template <class T>
TQEMU_UNCOUNTED T atomic_exchange(T* p, T v) {
  T old;
  __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
  return old;
}
template <class T>
TQEMU_UNCOUNTED bool atomic_cas(T* p, T* expected, T desired) {
  return __atomic_compare_exchange(p, expected, &desired, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED);
}
// Read-modify-write through a compare-exchange loop: works for every type,
// including float min/max.
template <class T, class F>
TQEMU_UNCOUNTED T atomic_rmw(T* p, F f) {
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T next = f(old);
  while (!__atomic_compare_exchange(p, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    next = f(old);
  return old;
}
#undef TQEMU_UNCOUNTED
}  // namespace tqemu_impl

template <class A>
METAL_FUNC auto atomic_load_explicit(A* obj, memory_order) -> TQEMU_ATOMIC_T(obj) {
  TQEMU_ATOMIC_NOTE(obj, false);
  return tqemu_impl::atomic_load(TQEMU_ATOMIC_PTR(obj));
}
template <class A, class V>
METAL_FUNC void atomic_store_explicit(A* obj, V desired, memory_order) {
  TQEMU_ATOMIC_NOTE(obj, true);
  tqemu_impl::atomic_store(TQEMU_ATOMIC_PTR(obj), TQEMU_ATOMIC_T(obj)(desired));
}
template <class A, class V>
METAL_FUNC auto atomic_exchange_explicit(A* obj, V desired, memory_order)
    -> TQEMU_ATOMIC_T(obj) {
  TQEMU_ATOMIC_NOTE(obj, false);
  TQEMU_ATOMIC_NOTE(obj, true);
  return tqemu_impl::atomic_exchange(TQEMU_ATOMIC_PTR(obj), TQEMU_ATOMIC_T(obj)(desired));
}
template <class A, class E, class V>
METAL_FUNC bool atomic_compare_exchange_weak_explicit(A* obj, E* expected, V desired,
                                                      memory_order, memory_order) {
  TQEMU_ATOMIC_T(obj) e = *expected;
  TQEMU_ATOMIC_NOTE(obj, false);
  bool ok = tqemu_impl::atomic_cas(TQEMU_ATOMIC_PTR(obj), &e, TQEMU_ATOMIC_T(obj)(desired));
  if (ok) TQEMU_ATOMIC_NOTE(obj, true);
  *expected = e;
  return ok;
}

#define TQEMU_ATOMIC_RMW(NAME, EXPR)                                                 \
  template <class A, class V>                                                        \
  METAL_FUNC auto NAME(A* obj, V operand, memory_order) -> TQEMU_ATOMIC_T(obj) {     \
    using T = TQEMU_ATOMIC_T(obj);                                                   \
    T b = T(operand);                                                                \
    TQEMU_ATOMIC_NOTE(obj, false);                                                   \
    TQEMU_ATOMIC_NOTE(obj, true);                                                    \
    return tqemu_impl::atomic_rmw(TQEMU_ATOMIC_PTR(obj), [b](T a) { return EXPR; }); \
  }
TQEMU_ATOMIC_RMW(atomic_fetch_add_explicit, T(a + b))
TQEMU_ATOMIC_RMW(atomic_fetch_sub_explicit, T(a - b))
TQEMU_ATOMIC_RMW(atomic_fetch_and_explicit, T(a & b))
TQEMU_ATOMIC_RMW(atomic_fetch_or_explicit, T(a | b))
TQEMU_ATOMIC_RMW(atomic_fetch_xor_explicit, T(a ^ b))
TQEMU_ATOMIC_RMW(atomic_fetch_min_explicit, T(b < a ? b : a))
TQEMU_ATOMIC_RMW(atomic_fetch_max_explicit, T(a < b ? b : a))
#undef TQEMU_ATOMIC_RMW

METAL_FUNC void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope::thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

}  // namespace metal

using namespace metal;

// ---------------------------------------------- subset of MLX's utils.h
inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return as_type<uint16_t>(x); }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) { return as_type<bfloat16_t>(x); }

template <typename U>
struct WorkPerThread {
  static_assert(sizeof(U) <= 8, "Type too large");
  static constexpr int n = 8 / sizeof(U);
};

template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define TQEMU_FLOAT_LIMITS(T)                                            \
  template <>                                                            \
  struct Limits<T> {                                                     \
    static constexpr T max = metal::numeric_limits<T>::infinity();      \
    static constexpr T min = -metal::numeric_limits<T>::infinity();     \
    static constexpr T finite_max = metal::numeric_limits<T>::max();    \
    static constexpr T finite_min = -metal::numeric_limits<T>::max();   \
  };
TQEMU_FLOAT_LIMITS(float)
TQEMU_FLOAT_LIMITS(half)
TQEMU_FLOAT_LIMITS(bfloat)
#undef TQEMU_FLOAT_LIMITS
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, constant const int* shape,
                            constant const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, constant const int* shape,
                            constant const int64_t* strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_1(uint elem, constant const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_2(uint2 elem, constant const int64_t* strides) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_3(uint3 elem, constant const int64_t* strides) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

inline float log1p(float x) {
  float xp1 = 1.0f + x;
  if (xp1 == Limits<float>::max) return Limits<float>::max;
  if (xp1 == 1.0f) return x;
  return x * (metal::log(xp1) / (xp1 - 1.0f));
}
inline bfloat16_t log1p(bfloat16_t x) { return bfloat16_t(log1p(float(x))); }
inline float hypot(float x, float y) { return __builtin_hypotf(x, y); }

template <bool condition, typename T, typename U>
struct ConditionalType {
  using type = U;
};
template <typename T, typename U>
struct ConditionalType<true, T, U> {
  using type = T;
};

template <typename U, typename T>
inline U cast_to(T val) {
  return static_cast<U>(val);
}
template <>
inline bool cast_to<bool, float>(float val) {
  return (as_type<uint32_t>(val) & 0x7FFFFFFF) != 0;
}
template <>
inline bool cast_to<bool, bfloat16_t>(bfloat16_t val) {
  return (as_type<uint16_t>(val) & 0x7FFF) != 0;
}
