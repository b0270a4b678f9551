// Decode attention over a stacked StaticCache buffer or a paged pool, read in place: an XLA:CPU
// FFI kernel.
//
// XLA:CPU copies every dynamic-slice block out of the cache before it can feed a dot, so the
// blockwise loop in jaxkv/attention/blockwise.py moves each cached byte twice and runs the copy on one
// thread. This kernel reads keys and values where they lie in the [L, B, H, S, D] buffers,
// once each, split across XLA's intra-op thread pool, with the same visibility rule and
// online softmax as the blockwise loop (jaxkv.attention.attend is the specification).
//
// Shapes: q [B, Hq, T, D] (f32/bf16), keys/values [L, B, H, S, D] (f32/bf16, or bf16 bits as u16; same dtype),
// layer [] s32, q_pos [B, T] s32, kv_len [B] s32; out [B, Hq, T, D] in the dtype of q.
// Slot s holds position s. A query at position p sees slot s when s < kv_len[b], s <= p and,
// with a window W > 0, p - s < W. A query that sees nothing returns zeros.
//
// The paged target (JaxkvPagedDecodeAttention) takes a page pool keys/values [L, P, H, ps, D]
// and one more operand, block_table [B, M] s32: slot s of row b lies in page
// block_table[b, s / ps] at offset s % ps (ps a power of two; S = M * ps). Both targets run
// the same loops; only where a slot's key and value rows lie differs (ContiguousRows,
// PagedRows). A table entry outside [0, P) is read as the nearest page (-1 as page 0), as
// XLA's gather does: only slots past a row's length should have one, and those are never read.
//
// Non-finite inputs (the contract of jaxkv.attention): a slot a query does not see never
// affects it, whatever it holds. If a slot it sees has a non-finite raw logit (q.k scaled,
// before the soft cap) or a non-finite value element, its whole output row is NaN. A
// group of queries may read slots some of them do not see (a chunk's future, a window's
// start): those get weight 0 and are skipped, never multiplied in (0 * NaN is NaN).
//
// The quantized targets (JaxkvQuantizedDecodeAttention, JaxkvPagedQuantizedDecodeAttention)
// read int8 codes, or uint8 bytes holding two int4 codes (even head-dim element in the low
// nibble, odd in the high one, two's complement), with one scale per (slot, kv head):
// key_scales/value_scales [L, B, H, S] (pages: [L, P, H, ps]), f32 or bf16 bits as u16. The key
// scale multiplies a slot's logit ((q . codes) * s_k) and the value scale its weight
// ((p * s_v) . codes): the codes are dequantized in registers, never written out. A non-finite
// scale of a visible slot makes its logit or its weighted value non-finite: the row is NaN.
// The contiguous quantized target also takes the cache's residual ring of exact tokens
// (residual_keys/values [B, H, R, D], f32 or bf16; residual_positions [B, R]): a slot whose
// position a residual slot holds (position in [0, kv_len)) is read from there, unscaled.
//
// Work items are (row, kv head, slot range) pieces of about the same size; each keeps its
// own running max, sum and weighted values per query, merged at the end (split-K).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 128;          // slots scored before their values are read
constexpr int64_t kMinPiece = 256;       // smallest slot range worth a task of its own
constexpr int64_t kSerialSlots = 2048;   // below this many (row, head, slot) reads: one thread
constexpr int64_t kPrefetchBytes = 16384;  // how far ahead rows are requested
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Whether x[0, n) are all finite, from the exponent bits: integer work the compiler
// vectorises and cannot fold away under -fassociative-math.
inline bool all_finite(const float* x, int64_t n) {
  uint32_t worst = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    worst = std::max(worst, bits & 0x7F800000u);
  }
  return worst != 0x7F800000u;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *out = uint16_t((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  *out = uint16_t(bits >> 16);
}

// exp(x) for x <= 0 in a form the compiler vectorises: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error ~1e-7), 2^n built in the exponent.
inline float exp_nonpositive(float x) {
  // Below -87 exp(x) is under float's smallest normal: 0 (clamping there gave every such
  // weight e^-87, which a value near float's max turned into a visible output).
  const bool under = x < -87.0f;
  x = std::max(x, -87.0f);
  float n = std::floor(x * 1.44269504f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? 0.0f : p * scale;
}

struct Problem {
  int64_t batch, q_heads, kv_heads, tokens, slots, head_dim, groups;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  const float* q;  // [B, Hq, T, D] scaled, as float
  const void* keys;    // layer's [B, H, S, D] block of the stacked buffer, or its [P, H, ps, D] pages
  const void* values;
  const int32_t* q_pos;  // [B, T]
  const int32_t* kv_len; // [B]
  const int32_t* table = nullptr;  // [B, M] pages of each row; null: contiguous
  int64_t pages = 0, max_pages = 0, page_shift = 0;  // P, M, log2(ps)
  int64_t row_elems = 0;  // stored elements per key/value row: D, or D / 2 for int4 bytes
  const void* key_scales = nullptr;    // quantized: the layer's [B, H, S] (or [P, H, ps]) scales
  const void* value_scales = nullptr;
  bool scales_bf16 = false;  // scales as bf16 bits (else f32)
  // Quantized, contiguous: a ring of R exact tokens ([B, H, R, D], f32 or bf16); the slot of
  // position residual_pos[b, r] (when in [0, kv_len[b])) is read from it, not from the codes.
  const void* residual_keys = nullptr;
  const void* residual_values = nullptr;
  const int32_t* residual_pos = nullptr;  // [B, R]
  int64_t residual = 0;                    // R
  bool residual_bf16 = false;
};

// Two int4 codes per byte (the element type of an int4 row).
struct Int4 {
  uint8_t byte;
};

// Where the key (or value) row of slot s of one (row, kv head) lies: slot s of the stacked
// buffer's [S, D] block...
template <typename KV>
struct ContiguousRows {
  const KV* base;
  int64_t dim;
  ContiguousRows(const Problem& pb, const void* buffer, int64_t row, int64_t head, int64_t dim)
      : base(static_cast<const KV*>(buffer) + (row * pb.kv_heads + head) * pb.slots * dim), dim(dim) {}
  const KV* operator()(int64_t s) const { return base + s * dim; }
};

// ... or offset s % ps of page table[row, s / ps], the head's [ps, D] block of that page.
template <typename KV>
struct PagedRows {
  const KV* base;  // the head's block in page 0
  const int32_t* table;  // the row's M entries
  int64_t page_stride, dim, mask, shift, last_page;
  PagedRows(const Problem& pb, const void* pool, int64_t row, int64_t head, int64_t dim)
      : base(static_cast<const KV*>(pool) + (head << pb.page_shift) * dim),
        table(pb.table + row * pb.max_pages),
        page_stride((pb.kv_heads << pb.page_shift) * dim),
        dim(dim),
        mask((int64_t(1) << pb.page_shift) - 1),
        shift(pb.page_shift),
        last_page(pb.pages - 1) {}
  const KV* operator()(int64_t s) const {
    const int64_t page = std::clamp<int64_t>(table[s >> shift], 0, last_page);
    return base + page * page_stride + (s & mask) * dim;
  }
};

struct Piece {
  int64_t row, head, lo, hi;
};

// The slots [lo, hi) that query t of row b sees: filled, not in its future, inside the
// window (the rule of jaxkv.attention.attend). Empty when lo >= hi.
inline void visible_slots(const Problem& pb, int64_t b, int64_t t, int64_t* lo, int64_t* hi) {
  const int64_t pos = pb.q_pos[b * pb.tokens + t];
  const int64_t filled = std::clamp<int64_t>(pb.kv_len[b], 0, pb.slots);
  *lo = pb.window > 0 ? std::max<int64_t>(pos - pb.window + 1, 0) : 0;
  *hi = std::min<int64_t>(filled, pos + 1);
}

// Per query (g, t) of a piece: its visible slots [lo, hi) clipped to the piece, and its
// state in `part`: running max m, running sum l, weighted values acc[D] ([Q, D + 2]).
// l is NaN once the query has seen a non-finite logit: its row will be NaN.
inline void visible_ranges(const Problem& pb, const Piece& pc, float* part, int64_t* lo, int64_t* hi) {
  for (int64_t qi = 0; qi < pb.groups * pb.tokens; ++qi) {
    visible_slots(pb, pc.row, qi % pb.tokens, &lo[qi], &hi[qi]);
    lo[qi] = std::max(lo[qi], pc.lo);
    hi[qi] = std::max(lo[qi], std::min(hi[qi], pc.hi));
    float* state = part + qi * (pb.head_dim + 2);
    state[0] = kNegInf;
    state[1] = 0.0f;
    std::fill(state + 2, state + 2 + pb.head_dim, 0.0f);
  }
}

// Folds one chunk's scores of one query (slots [a, z) of the chunk are visible; the rest
// were not computed) into its state: scores become softmax weights, zero outside [a, z).
// A non-finite score marks the query (l = NaN) and zeroes the rest of its weights, so the
// max and sum stay finite. Returns the factor the query's acc must be multiplied by
// before this chunk's values.
inline float fold_scores(float* scores, int64_t n, int64_t a, int64_t z, float softcap, float* state) {
  if (a < z && !std::isnan(state[1]) && !all_finite(scores + a, z - a)) state[1] = kNaN;
  if (a >= z || std::isnan(state[1])) {
    std::fill(scores, scores + n, 0.0f);
    return 1.0f;
  }
  if (softcap > 0.0f) {
    for (int64_t j = a; j < z; ++j) scores[j] = softcap * std::tanh(scores[j] / softcap);
  }
  // Eight independent maxima, combined at the end: one chain would wait on each compare.
  float best[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  int64_t j = a;
  for (; j + 8 <= z; j += 8) {
    for (int u = 0; u < 8; ++u) best[u] = scores[j + u] > best[u] ? scores[j + u] : best[u];
  }
  for (; j < z; ++j) best[0] = scores[j] > best[0] ? scores[j] : best[0];
  float chunk_max = kNegInf;
  for (int u = 0; u < 8; ++u) chunk_max = best[u] > chunk_max ? best[u] : chunk_max;
  const float m = state[0];
  const float new_m = std::max(m, chunk_max);  // finite, as every score is
  for (int64_t j = a; j < z; ++j) scores[j] = exp_nonpositive(scores[j] - new_m);
  std::fill(scores, scores + a, 0.0f);
  std::fill(scores + z, scores + n, 0.0f);
  float sum = 0.0f;
  for (j = a; j < z; ++j) sum += scores[j];
  const float correction = m == kNegInf ? 0.0f : std::exp(m - new_m);
  state[0] = new_m;
  state[1] = state[1] * correction + sum;
  return correction;
}

// A quantized piece's per-slot scales, in the layout of its codes (one element per row);
// floats have none (every scale 1).
template <template <typename> class Layout>
struct Scales {
  Layout<float> f32;
  Layout<uint16_t> bf16;
  bool is_bf16;
  Scales(const Problem& pb, const void* buffer, int64_t row, int64_t head)
      : f32(pb, buffer, row, head, 1), bf16(pb, buffer, row, head, 1), is_bf16(pb.scales_bf16) {}
  float operator()(int64_t s) const { return is_bf16 ? to_float(*bf16(s)) : *f32(s); }
};

template <typename Rows> struct LayoutOf;
template <typename KV> struct LayoutOf<ContiguousRows<KV>> {
  template <typename T> using type = ContiguousRows<T>;
};
template <typename KV> struct LayoutOf<PagedRows<KV>> {
  template <typename T> using type = PagedRows<T>;
};

// What a piece reads: its kv head's key and value rows (by slot, through `Rows`), its
// queries ([G, T, D], contiguous) and each query's visible range; the queries' states are
// reset in `part`.
template <typename Rows>
struct PieceView {
  Rows keys, values;
  Scales<LayoutOf<Rows>::template type> key_scales, value_scales;
  const float* queries;
  std::vector<int64_t> lo, hi;
  // The residual: held[s - piece lo] is the residual slot holding slot s, or -1.
  std::vector<int32_t> held;
  int64_t piece_lo, dim;
  const char *residual_keys = nullptr, *residual_values = nullptr;
  bool residual_bf16;
  PieceView(const Problem& pb, const Piece& pc, float* part)
      : keys(pb, pb.keys, pc.row, pc.head, pb.row_elems), values(pb, pb.values, pc.row, pc.head, pb.row_elems),
        key_scales(pb, pb.key_scales, pc.row, pc.head), value_scales(pb, pb.value_scales, pc.row, pc.head),
        queries(pb.q + (pc.row * pb.kv_heads + pc.head) * pb.groups * pb.tokens * pb.head_dim),
        lo(pb.groups * pb.tokens), hi(pb.groups * pb.tokens), piece_lo(pc.lo), dim(pb.head_dim),
        residual_bf16(pb.residual_bf16) {
    visible_ranges(pb, pc, part, lo.data(), hi.data());
    if (pb.residual > 0 && pc.hi > pc.lo) {
      held.assign(pc.hi - pc.lo, -1);
      const int64_t filled = pb.kv_len[pc.row];
      for (int64_t r = 0; r < pb.residual; ++r) {
        const int64_t p = pb.residual_pos[pc.row * pb.residual + r];
        if (p >= 0 && p < filled && p >= pc.lo && p < pc.hi) held[p - pc.lo] = int32_t(r);
      }
      const int64_t element = pb.residual_bf16 ? 2 : 4;
      const int64_t offset = (pc.row * pb.kv_heads + pc.head) * pb.residual * pb.head_dim * element;
      residual_keys = static_cast<const char*>(pb.residual_keys) + offset;
      residual_values = static_cast<const char*>(pb.residual_values) + offset;
    }
  }
  // The residual slot holding slot s, or -1.
  int32_t residual_slot(int64_t s) const { return held.empty() ? -1 : held[s - piece_lo]; }
  // Residual row r of the keys (or values) as floats.
  void residual_row(const char* base, int32_t r, float* out) const {
    if (residual_bf16) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(base) + r * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] = to_float(row[d]);
    } else {
      std::memcpy(out, reinterpret_cast<const float*>(base) + r * dim, dim * sizeof(float));
    }
  }
};

// Element d of a stored row, as float: a float, bf16 bits, an int8 code or an int4 code.
inline float element(const float* row, int64_t d) { return row[d]; }
inline float element(const uint16_t* row, int64_t d) { return to_float(row[d]); }
inline float element(const int8_t* row, int64_t d) { return float(row[d]); }
inline float element(const Int4* row, int64_t d) {
  const int32_t byte = row[d >> 1].byte;
  const int32_t nibble = (d & 1) ? byte >> 4 : byte & 15;
  return float((nibble ^ 8) - 8);
}
template <typename KV> constexpr bool kQuantized = std::is_same<KV, int8_t>::value || std::is_same<KV, Int4>::value;

// Any head dim: one query at a time, plain loops.
template <typename KV, typename Rows>
void run_piece_scalar(const Problem& pb, const Piece& pc, float* part) {
  const int64_t D = pb.head_dim, nq = pb.groups * pb.tokens;
  const PieceView<Rows> in(pb, pc, part);
  const Rows &keys = in.keys, &values = in.values;
  const float* queries = in.queries;
  const std::vector<int64_t>&lo = in.lo, &hi = in.hi;
  float scores[kChunk];
  std::vector<float> exact;  // a residual row
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float* q = queries + qi * D;
    float* state = part + qi * (D + 2);
    for (int64_t c0 = lo[qi]; c0 < hi[qi]; c0 += kChunk) {
      const int64_t n = std::min(kChunk, hi[qi] - c0);
      for (int64_t j = 0; j < n; ++j) {
        const KV* k = keys(c0 + j);
        float dot = 0.0f;
        const int32_t r = kQuantized<KV> ? in.residual_slot(c0 + j) : -1;
        if (r >= 0) {
          exact.resize(D);
          in.residual_row(in.residual_keys, r, exact.data());
          for (int64_t d = 0; d < D; ++d) dot += q[d] * exact[d];
        } else {
          for (int64_t d = 0; d < D; ++d) dot += q[d] * element(k, d);
          if (kQuantized<KV>) dot *= in.key_scales(c0 + j);
        }
        scores[j] = dot;
      }
      const float correction = fold_scores(scores, n, 0, n, pb.softcap, state);
      float* acc = state + 2;
      for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
      for (int64_t j = 0; j < n; ++j) {
        const KV* v = values(c0 + j);
        const int32_t r = kQuantized<KV> ? in.residual_slot(c0 + j) : -1;
        if (r >= 0) {
          exact.resize(D);
          in.residual_row(in.residual_values, r, exact.data());
          for (int64_t d = 0; d < D; ++d) acc[d] += scores[j] * exact[d];
          continue;
        }
        const float w = kQuantized<KV> ? scores[j] * in.value_scales(c0 + j) : scores[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * element(v, d);
      }
    }
  }
}

// 16-float vectors in GCC/Clang's generic vector extension: the compiler maps them onto
// what the target has (one AVX-512 register, two AVX2 or four NEON registers).
typedef float Vec __attribute__((vector_size(64)));
typedef uint16_t Half16 __attribute__((vector_size(32)));
typedef uint32_t Word16 __attribute__((vector_size(64)));

inline Vec load16(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Vec load16(const uint16_t* p) {  // bf16 is the high half of an f32
  Half16 h;
  std::memcpy(&h, p, sizeof h);
  Word16 w = __builtin_convertvector(h, Word16) << 16;
  Vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

#if !defined(__AVX2__)
typedef uint8_t Byte8 __attribute__((vector_size(8)));
typedef int32_t Int8Lanes __attribute__((vector_size(32)));
typedef int32_t Int16Lanes __attribute__((vector_size(64)));

inline Vec load16(const int8_t* p) {  // 16 int8 codes, as two halves of 8 bytes sign-extended by hand
  Byte8 lo, hi;
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + 8, sizeof hi);
  const Int8Lanes a = (__builtin_convertvector(lo, Int8Lanes) ^ 128) - 128;
  const Int8Lanes b = (__builtin_convertvector(hi, Int8Lanes) ^ 128) - 128;
  const Int16Lanes both = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_convertvector(both, Vec);
}
inline Vec load16(const Int4* p) {  // 8 bytes: 16 int4 codes, the even ones in the low nibbles
  Byte8 c;
  std::memcpy(&c, p, sizeof c);
  const Int8Lanes w = __builtin_convertvector(c, Int8Lanes);
  const Int8Lanes lo = ((w & 15) ^ 8) - 8, hi = ((w >> 4) ^ 8) - 8;
  const Int16Lanes both = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return __builtin_convertvector(both, Vec);
}
#endif

// A quantized row of kD codes as floats in `out` (a stack buffer the row's vectors are then
// loaded from). With AVX2, the sign/zero extensions of x86: GCC turns the vector extension's
// int8 -> int32 widening into a byte load, shift and insert per lane there, and building the
// 16-float vectors from 8-float halves in registers spilled them; with both, the int8 kernel
// ran at half the XLA loop's speed (1024 tokens x 8 kv heads x 128, /tmp probes: 1.9 ms
// against 0.56 ms this way).
template <int kD>
inline void dequantize_row(const int8_t* p, float* out) {
#if defined(__AVX2__)
  for (int i = 0; i < kD; i += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
    _mm256_store_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
  }
#else
  for (int i = 0; i < kD; i += 16) {
    const Vec v = load16(p + i);
    std::memcpy(out + i, &v, sizeof v);
  }
#endif
}
template <int kD>
inline void dequantize_row(const Int4* p, float* out) {
#if defined(__AVX2__)
  const __m256i eight = _mm256_set1_epi32(8), fifteen = _mm256_set1_epi32(15);
  for (int i = 0; i < kD; i += 16) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2)));
    const __m256i lo = _mm256_sub_epi32(_mm256_xor_si256(_mm256_and_si256(w, fifteen), eight), eight);
    const __m256i hi = _mm256_sub_epi32(_mm256_xor_si256(_mm256_srli_epi32(w, 4), eight), eight);
    const __m256i a = _mm256_unpacklo_epi32(lo, hi), b = _mm256_unpackhi_epi32(lo, hi);
    _mm256_store_ps(out + i, _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x20)));
    _mm256_store_ps(out + i + 8, _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x31)));
  }
#else
  for (int i = 0; i < kD; i += 16) {
    const Vec v = load16(p + i / 2);
    std::memcpy(out + i, &v, sizeof v);
  }
#endif
}

// A row of kD bf16 values (as uint16 bits) as floats in `out`.
template <int kD>
inline void widen_row(const uint16_t* p, float* out) {
#if defined(__AVX2__)
  for (int i = 0; i < kD; i += 8) {
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))), 16);
    _mm256_store_ps(out + i, _mm256_castsi256_ps(w));
  }
#else
  for (int i = 0; i < kD; i += 16) {
    const Vec v = load16(p + i);
    std::memcpy(out + i, &v, sizeof v);
  }
#endif
}

// Slot s's key (or value) row as kD / 16 vectors in `out`, through an aligned stack row: a
// float32 row copied (loading the vectors straight from the cache row ran 1.6x slower on
// AVX2: /tmp probes, 1024 tokens x 8 kv heads x 128, 0.96-1.08 ms against 0.60-0.71), bf16
// bits widened (1.2-1.4x), int8/int4 codes dequantized, or, for a slot the residual holds,
// its exact token. Returns the row's scale: a quantized row's, else 1.
template <typename KV, int kD, typename View, typename RowScales>
inline float load_row(const View& in, const KV* stored, const char* residual, const RowScales& scales, int64_t s,
                      Vec* out) {
  alignas(64) float row[kD];
  float scale = 1.0f;
  if constexpr (kQuantized<KV>) {
    const int32_t r = in.residual_slot(s);
    if (r >= 0) {
      in.residual_row(residual, r, row);
    } else {
      dequantize_row<kD>(stored, row);
      scale = scales(s);
    }
  } else if constexpr (std::is_same<KV, float>::value) {
    std::memcpy(row, stored, sizeof row);
  } else {
    widen_row<kD>(stored, row);
  }
  for (int c = 0; c < kD / 16; ++c) out[c] = load16(row + c * 16);
  return scale;
}

// Bytes per stored row of head dim kD (int4: two codes per byte).
template <typename KV, int kD>
constexpr int64_t kRowBytes = std::is_same<KV, Int4>::value ? kD / 2 : int64_t(kD) * int64_t(sizeof(KV));

// Asks for a key or value row kPrefetchBytes ahead of the one being read, into L2. One
// core's hardware prefetcher alone cannot keep enough reads in flight while the core also
// computes; benchmarks/bench_attention.py shows the bandwidth reached with this.
template <int kD, typename KV>
inline void prefetch_row(const KV* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int c = 0; c < int(kRowBytes<KV, kD>); c += 64) __builtin_prefetch(p + c, 0, 2);
}

// The lane sums of four vectors at once, in lanes 0-3: each level adds two halves of a
// pair of vectors packed side by side (12 shuffles, 6 adds for the four sums).
inline Vec lane_sum4(Vec a, Vec b, Vec c, Vec d) {
  Vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  Vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  Vec abcd = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  Vec pairs = __builtin_shufflevector(abcd, abcd, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
              __builtin_shufflevector(abcd, abcd, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6) +
         __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
}

// Head dim kD, a multiple of 16: queries in groups of four. Each key and each value row is
// loaded into registers once per group and used by all four queries (scores reduced
// together by lane_sum4; the four accumulators stay in registers through a chunk), so the
// cache streams from memory once per group of four queries.
template <typename KV, int kD, typename Rows>
void run_piece_vec(const Problem& pb, const Piece& pc, float* part) {
  constexpr int kNV = kD / 16, kQB = 4;
  constexpr int64_t kAhead = std::max<int64_t>(1, kPrefetchBytes / kRowBytes<KV, kD>);
  const int64_t nq = pb.groups * pb.tokens;
  const PieceView<Rows> in(pb, pc, part);
  const Rows &keys = in.keys, &values = in.values;
  const float* queries = in.queries;
  const std::vector<int64_t>&lo = in.lo, &hi = in.hi;
  alignas(64) float scores[kQB][kChunk];
  for (int64_t g0 = 0; g0 < nq; g0 += kQB) {
    const int nb = int(std::min<int64_t>(kQB, nq - g0));
    int64_t first = pc.hi, last = pc.lo;  // the union of the group's visible ranges
    bool same_range = true;  // every query sees all of it (always so for one token per row)
    for (int b = 0; b < nb; ++b) {
      same_range = same_range && lo[g0 + b] == lo[g0] && hi[g0 + b] == hi[g0];
      if (lo[g0 + b] < hi[g0 + b]) {
        first = std::min(first, lo[g0 + b]);
        last = std::max(last, hi[g0 + b]);
      }
    }
    Vec qv[kQB][kNV];
    for (int b = 0; b < kQB; ++b) {
      for (int c = 0; c < kNV; ++c) qv[b][c] = b < nb ? load16(queries + (g0 + b) * kD + c * 16) : Vec{};
    }
    for (int b = nb; b < kQB; ++b) std::fill(scores[b], scores[b] + kChunk, 0.0f);
    // A query's slots outside its own range get weight exactly 0 and are skipped when values
    // are summed (they may hold NaN or inf). The skip tests the range, not the weight: a slot
    // the query sees can have weight 0 too (its score more than ~87 below the maximum), and
    // its non-finite value must still reach the row (0 * NaN), as on the XLA path.
    for (int64_t c0 = first; c0 < last; c0 += kChunk) {
      const int64_t n = std::min(kChunk, last - c0);
      for (int64_t j = 0; j < n; ++j) {
        if (c0 + j + kAhead < last) prefetch_row<kD>(keys(c0 + j + kAhead));
        Vec kr[kNV];
        const float key_scale = load_row<KV, kD>(in, keys(c0 + j), in.residual_keys, in.key_scales, c0 + j, kr);
        Vec dot[kQB];
        for (int b = 0; b < kQB; ++b) {
          dot[b] = qv[b][0] * kr[0];
          for (int c = 1; c < kNV; ++c) dot[b] += qv[b][c] * kr[c];
        }
        const Vec sums = lane_sum4(dot[0], dot[1], dot[2], dot[3]);
        for (int b = 0; b < kQB; ++b) scores[b][j] = sums[b] * key_scale;  // the scale is 1 for float rows
      }
      float correction[kQB] = {1.0f, 1.0f, 1.0f, 1.0f};
      for (int b = 0; b < nb; ++b) {
        const int64_t a = std::clamp<int64_t>(lo[g0 + b] - c0, 0, n), z = std::clamp<int64_t>(hi[g0 + b] - c0, 0, n);
        correction[b] = fold_scores(scores[b], n, a, z, pb.softcap, part + (g0 + b) * (kD + 2));
      }
      Vec acc[kQB][kNV];
      for (int b = 0; b < kQB; ++b) {
        for (int c = 0; c < kNV; ++c) acc[b][c] = b < nb ? load16(part + (g0 + b) * (kD + 2) + 2 + c * 16) * correction[b] : Vec{};
      }
      for (int64_t j = 0; j < n; ++j) {
        if (c0 + j + kAhead < last) prefetch_row<kD>(values(c0 + j + kAhead));
        Vec vr[kNV];
        const float value_scale = load_row<KV, kD>(in, values(c0 + j), in.residual_values, in.value_scales, c0 + j, vr);
        for (int b = 0; b < kQB; ++b) {
          if (!same_range && (b >= nb || c0 + j < lo[g0 + b] || c0 + j >= hi[g0 + b])) continue;
          const float w = scores[b][j];
          for (int c = 0; c < kNV; ++c) acc[b][c] += (w * value_scale) * vr[c];
        }
      }
      for (int b = 0; b < nb; ++b) {
        for (int c = 0; c < kNV; ++c) std::memcpy(part + (g0 + b) * (kD + 2) + 2 + c * 16, &acc[b][c], sizeof(Vec));
      }
    }
  }
}

template <typename KV, typename Rows>
void run_piece_in(const Problem& pb, const Piece& pc, float* part) {
  switch (pb.head_dim) {
    case 16: return run_piece_vec<KV, 16, Rows>(pb, pc, part);
    case 32: return run_piece_vec<KV, 32, Rows>(pb, pc, part);
    case 48: return run_piece_vec<KV, 48, Rows>(pb, pc, part);
    case 64: return run_piece_vec<KV, 64, Rows>(pb, pc, part);
    case 80: return run_piece_vec<KV, 80, Rows>(pb, pc, part);
    case 96: return run_piece_vec<KV, 96, Rows>(pb, pc, part);
    case 128: return run_piece_vec<KV, 128, Rows>(pb, pc, part);
    case 256: return run_piece_vec<KV, 256, Rows>(pb, pc, part);  // queries spill to L1: still far ahead of scalar
    default: return run_piece_scalar<KV, Rows>(pb, pc, part);
  }
}

template <typename KV>
void run_piece(const Problem& pb, const Piece& pc, float* part) {
  if (pb.table) run_piece_in<KV, PagedRows<KV>>(pb, pc, part);
  else run_piece_in<KV, ContiguousRows<KV>>(pb, pc, part);
}

// What a cache row holds.
enum class Kind { kF32, kBF16, kInt8, kInt4 };

// Runs items [0, n) on the caller and up to `helpers` pool threads. Each thread claims the
// next unclaimed item; the caller waits only for items another thread has claimed (and is
// running), so a pool that never runs our tasks cannot deadlock us.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
};

template <typename Work>
void drain(Shared& shared, const Work* work) {  // `work` is dereferenced only for a claimed item
  for (int64_t i; (i = shared.next.fetch_add(1)) < shared.total;) {
    (*work)(i);
    if (shared.done.fetch_add(1) + 1 == shared.total) {
      std::lock_guard<std::mutex> lock(shared.mu);
      shared.cv.notify_all();
    }
  }
}

template <typename Work>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t helpers, const Work& work) {
  auto shared = std::make_shared<Shared>();
  shared->total = n;
  // A task that starts after every item is claimed touches only `shared` (kept alive by its
  // own copy) and finds no work; `work` outlives every claimed item, as we wait for them.
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, work_ptr = &work]() { drain(*shared, work_ptr); });
  }
  drain(*shared, &work);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->total; });
}

template <typename QT>
void load_queries(const ffi::AnyBuffer& q, float scale, std::vector<float>& out) {
  const QT* src = static_cast<const QT*>(q.untyped_data());
  for (size_t i = 0; i < out.size(); ++i) out[i] = to_float(src[i]) * scale;
}

template <typename QT>
void store_output(const std::vector<float>& src, ffi::AnyBuffer& out) {
  QT* dst = static_cast<QT*>(out.untyped_data());
  for (size_t i = 0; i < src.size(); ++i) from_float(src[i], dst + i);
}

std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// What both targets check alike, and the problem's fields other than the cache's layout:
// sizes from q, options, positions, lengths, queries (scaled, as float, into `qf`).
ffi::Error common_setup(const char* who, const ffi::AnyBuffer& q, const ffi::AnyBuffer& keys,
                        const ffi::AnyBuffer& values, const ffi::Buffer<ffi::S32>& layer,
                        const ffi::Buffer<ffi::S32>& q_pos, const ffi::Buffer<ffi::S32>& kv_len,
                        ffi::DataType out_type, int64_t window, float softcap, float scale,
                        Problem& pb, std::vector<float>& qf, int32_t* layer_index, int64_t bits = 0) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      keys.element_type() != values.element_type()) {
    return ffi::Error::InvalidArgument(std::string(who) + ": expected q [B, Hq, T, D] and keys == values (rank 5), got q " +
                                       dims_str(qd) + ", keys " + dims_str(kd) + ", values " + dims_str(vd));
  }
  pb.batch = qd[0];
  pb.q_heads = qd[1];
  pb.tokens = qd[2];
  pb.head_dim = qd[3];
  pb.kv_heads = kd[2];
  // int4: two codes per byte, so D / 2 stored elements per row.
  pb.row_elems = bits == 4 ? pb.head_dim / 2 : pb.head_dim;
  if (kd[4] != pb.row_elems || (bits == 4 && pb.head_dim % 2) || pb.kv_heads == 0 || pb.q_heads % pb.kv_heads) {
    return ffi::Error::InvalidArgument(std::string(who) + ": q " + dims_str(qd) + " does not fit keys " + dims_str(kd));
  }
  const auto is_float = [](ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; };
  // A cache may hold bf16 as its uint16 bits (jaxkv stores 16-bit floats so, since XLA:CPU
  // cannot update a bf16 array in place); the bytes are the same.
  const ffi::DataType kt = keys.element_type();
  const bool kv_ok = bits == 8   ? kt == ffi::DataType::S8
                     : bits == 4 ? kt == ffi::DataType::U8
                                 : is_float(kt) || kt == ffi::DataType::U16;
  if (!is_float(q.element_type()) || !kv_ok || out_type != q.element_type()) {
    return ffi::Error::InvalidArgument(std::string(who) + (bits ? ": queries must be float32 or bfloat16, the codes int8 (bits 8) or uint8 (bits 4), and the output the queries' dtype"
                                                                : ": queries and cache must be float32 or bfloat16 (the cache may be bfloat16 bits as uint16), and the output the queries' dtype"));
  }
  if (q_pos.element_count() != size_t(pb.batch * pb.tokens) || kv_len.element_count() != size_t(pb.batch) ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(who) + ": q_pos must be [B, T], kv_len [B] and layer a scalar");
  }
  *layer_index = layer.typed_data()[0];
  if (*layer_index < 0 || *layer_index >= kd[0]) {
    return ffi::Error::InvalidArgument(std::string(who) + ": layer index " + std::to_string(*layer_index) +
                                       " is outside [0, " + std::to_string(kd[0]) + ")");
  }
  pb.groups = pb.q_heads / pb.kv_heads;
  pb.window = window;
  pb.softcap = softcap;
  pb.q_pos = q_pos.typed_data();
  pb.kv_len = kv_len.typed_data();
  qf.resize(q.element_count());
  if (q.element_type() == ffi::DataType::BF16) load_queries<uint16_t>(q, scale, qf);
  else load_queries<float>(q, scale, qf);
  pb.q = qf.data();
  return ffi::Error::Success();
}

// Points the problem at layer `li` of the stacked keys and values ([L, ...] each).
void select_layer(const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values, int32_t li, Problem& pb) {
  const size_t layer_bytes = keys.size_bytes() / keys.dimensions()[0];
  pb.keys = static_cast<const char*>(keys.untyped_data()) + li * layer_bytes;
  pb.values = static_cast<const char*>(values.untyped_data()) + li * layer_bytes;
}

// The attention itself, for either layout: pieces, run on the pool, merged, stored in `out`.
void attend(ffi::ThreadPool& pool, const Problem& pb, Kind kind, ffi::AnyBuffer& out) {
  // Pieces: each row's slot range that any of its queries can see, cut into even lengths.
  std::vector<int64_t> row_lo(pb.batch), row_hi(pb.batch);
  int64_t total = 0;
  for (int64_t b = 0; b < pb.batch; ++b) {
    int64_t lo = pb.slots, hi = 0;
    for (int64_t t = 0; t < pb.tokens; ++t) {
      int64_t a, z;
      visible_slots(pb, b, t, &a, &z);
      if (a < z) {
        lo = std::min(lo, a);
        hi = std::max(hi, z);
      }
    }
    row_lo[b] = lo;
    row_hi[b] = std::max(lo, hi);
    total += (row_hi[b] - row_lo[b]) * pb.kv_heads;
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t piece = std::max<int64_t>(kMinPiece, (total + 4 * threads - 1) / (4 * threads));
  piece = (piece + kChunk - 1) / kChunk * kChunk;
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < pb.batch; ++b) {
    for (int64_t h = 0; h < pb.kv_heads; ++h) {
      int64_t lo = row_lo[b];
      do {  // at least one piece per (row, head), even an empty one, so every query is written
        const int64_t hi = std::min(row_hi[b], lo + piece);
        pieces.push_back({b, h, lo, hi});
        lo = hi;
      } while (lo < row_hi[b]);
    }
  }
  const int64_t nq = pb.groups * pb.tokens;
  const int64_t stride = nq * (pb.head_dim + 2);
  std::vector<float> parts(pieces.size() * stride);
  auto work = [&](int64_t i) {
    float* part = parts.data() + i * stride;
    switch (kind) {
      case Kind::kF32: return run_piece<float>(pb, pieces[i], part);
      case Kind::kBF16: return run_piece<uint16_t>(pb, pieces[i], part);
      case Kind::kInt8: return run_piece<int8_t>(pb, pieces[i], part);
      case Kind::kInt4: return run_piece<Int4>(pb, pieces[i], part);
    }
  };
  const int64_t n = static_cast<int64_t>(pieces.size());
  if (total < kSerialSlots || n == 1 || pool.num_threads() == 0) {
    for (int64_t i = 0; i < n; ++i) work(i);
  } else {
    parallel_for(pool, n, std::min<int64_t>(pool.num_threads() - 1, n - 1), work);
  }

  // Merge the pieces of each (row, kv head): one softmax over all of them.
  const int64_t D = pb.head_dim;
  std::vector<float> result(pb.batch * pb.q_heads * pb.tokens * D, 0.0f);
  for (int64_t first = 0; first < n;) {
    int64_t last = first;
    while (last < n && pieces[last].row == pieces[first].row && pieces[last].head == pieces[first].head) ++last;
    const int64_t b = pieces[first].row, h = pieces[first].head;
    for (int64_t qi = 0; qi < nq; ++qi) {
      float m = kNegInf;
      bool marked = false;  // a non-finite logit in some piece
      for (int64_t i = first; i < last; ++i) {
        m = std::max(m, parts[i * stride + qi * (D + 2)]);
        marked = marked || std::isnan(parts[i * stride + qi * (D + 2) + 1]);
      }
      float* dst = result.data() + ((b * pb.kv_heads + h) * nq + qi) * D;  // q layout [B, H, G, T, D]
      if (marked) {
        std::fill(dst, dst + D, kNaN);
        continue;
      }
      if (m == kNegInf) continue;  // sees nothing: zeros
      float l = 0.0f;
      for (int64_t i = first; i < last; ++i) {
        const float* src = parts.data() + i * stride + qi * (D + 2);
        if (src[0] == kNegInf) continue;
        const float w = std::exp(src[0] - m);
        l += w * src[1];
        for (int64_t d = 0; d < D; ++d) dst[d] += w * src[2 + d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = l > 0.0f ? dst[d] * inv : 0.0f;
      // A non-finite value element of a visible slot left an inf or NaN here: the whole row.
      if (!all_finite(dst, D)) std::fill(dst, dst + D, kNaN);
    }
    first = last;
  }
  if (out.element_type() == ffi::DataType::BF16) store_output<uint16_t>(result, out);
  else store_output<float>(result, out);
}

Kind float_kind(const ffi::AnyBuffer& keys) {
  const bool bf16 = keys.element_type() == ffi::DataType::BF16 || keys.element_type() == ffi::DataType::U16;
  return bf16 ? Kind::kBF16 : Kind::kF32;
}

ffi::Error decode_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer keys,
                            ffi::AnyBuffer values, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_len,
                            ffi::Result<ffi::AnyBuffer> out, int64_t window, float softcap,
                            float scale) {
  constexpr const char* kWho = "jaxkv decode_attention";
  Problem pb;
  std::vector<float> qf;
  int32_t li;
  ffi::Error err = common_setup(kWho, q, keys, values, layer, q_pos, kv_len, out->element_type(), window, softcap, scale, pb, qf, &li);
  if (err.failure()) return err;
  const auto kd = keys.dimensions();  // [L, B, H, S, D]
  if (kd[1] != pb.batch) {
    return ffi::Error::InvalidArgument(std::string(kWho) + ": q " + dims_str(q.dimensions()) + " does not fit keys " + dims_str(kd));
  }
  pb.slots = kd[3];
  select_layer(keys, values, li, pb);
  attend(pool, pb, float_kind(keys), *out);
  return ffi::Error::Success();
}

ffi::Error paged_setup(const char* kWho, const ffi::AnyBuffer& keys, const ffi::Buffer<ffi::S32>& block_table, Problem& pb);

ffi::Error paged_decode_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer keys,
                                  ffi::AnyBuffer values, ffi::Buffer<ffi::S32> layer,
                                  ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_len,
                                  ffi::Buffer<ffi::S32> block_table, ffi::Result<ffi::AnyBuffer> out,
                                  int64_t window, float softcap, float scale) {
  constexpr const char* kWho = "jaxkv paged_decode_attention";
  Problem pb;
  std::vector<float> qf;
  int32_t li;
  ffi::Error err = common_setup(kWho, q, keys, values, layer, q_pos, kv_len, out->element_type(), window, softcap, scale, pb, qf, &li);
  if (err.failure()) return err;
  err = paged_setup(kWho, keys, block_table, pb);
  if (err.failure()) return err;
  select_layer(keys, values, li, pb);
  attend(pool, pb, float_kind(keys), *out);
  return ffi::Error::Success();
}

// The pool's and the block table's part of a paged problem.
ffi::Error paged_setup(const char* kWho, const ffi::AnyBuffer& keys, const ffi::Buffer<ffi::S32>& block_table, Problem& pb) {
  const auto kd = keys.dimensions();  // [L, P, H, ps, D']
  const auto td = block_table.dimensions();
  const int64_t page_size = kd[3];
  if (td.size() != 2 || td[0] != pb.batch || kd[1] == 0 || page_size <= 0 || (page_size & (page_size - 1))) {
    return ffi::Error::InvalidArgument(std::string(kWho) + ": expected a pool [L, P, H, ps, D] with P >= 1 and ps a power of two, and block_table [B, M] with B = " +
                                       std::to_string(pb.batch) + ", got pool " + dims_str(kd) + ", block_table " + dims_str(td));
  }
  pb.table = block_table.typed_data();
  pb.pages = kd[1];
  pb.max_pages = td[1];
  while ((int64_t(1) << pb.page_shift) < page_size) ++pb.page_shift;
  pb.slots = pb.max_pages * page_size;
  return ffi::Error::Success();
}

// The scales of a quantized target: [L, B, H, S] (pages: [L, P, H, ps]), as the codes' first
// four dimensions, f32 or bf16 (bits as u16); points the problem at layer `li`'s.
ffi::Error select_scales(const char* who, const ffi::AnyBuffer& keys, const ffi::AnyBuffer& key_scales,
                         const ffi::AnyBuffer& value_scales, int32_t li, Problem& pb) {
  const auto kd = keys.dimensions();
  const auto sd = key_scales.dimensions();
  const auto vd = value_scales.dimensions();
  const ffi::DataType st = key_scales.element_type();
  const bool shape_ok = sd.size() == 4 && std::equal(sd.begin(), sd.end(), kd.begin()) && vd.size() == 4 &&
                        std::equal(vd.begin(), vd.end(), sd.begin());
  const bool type_ok = st == value_scales.element_type() &&
                       (st == ffi::DataType::F32 || st == ffi::DataType::BF16 || st == ffi::DataType::U16);
  if (!shape_ok || !type_ok) {
    return ffi::Error::InvalidArgument(std::string(who) + ": expected key and value scales of the codes' first four dimensions " +
                                       dims_str(kd) + ", float32 or bfloat16 (as uint16 bits), got " + dims_str(sd) + " and " +
                                       dims_str(vd));
  }
  const size_t layer_bytes = key_scales.size_bytes() / kd[0];
  pb.key_scales = static_cast<const char*>(key_scales.untyped_data()) + li * layer_bytes;
  pb.value_scales = static_cast<const char*>(value_scales.untyped_data()) + li * layer_bytes;
  pb.scales_bf16 = st != ffi::DataType::F32;
  return ffi::Error::Success();
}

ffi::Error check_bits(const char* who, int64_t bits) {
  if (bits == 8 || bits == 4) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(who) + ": bits must be 8 or 4, got " + std::to_string(bits));
}

ffi::Error quantized_decode_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer keys,
                                      ffi::AnyBuffer values, ffi::AnyBuffer key_scales, ffi::AnyBuffer value_scales,
                                      ffi::AnyBuffer residual_keys, ffi::AnyBuffer residual_values,
                                      ffi::Buffer<ffi::S32> residual_pos, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> q_pos,
                                      ffi::Buffer<ffi::S32> kv_len, ffi::Result<ffi::AnyBuffer> out, int64_t window,
                                      float softcap, float scale, int64_t bits) {
  constexpr const char* kWho = "jaxkv quantized_decode_attention";
  ffi::Error err = check_bits(kWho, bits);
  if (err.failure()) return err;
  Problem pb;
  std::vector<float> qf;
  int32_t li;
  err = common_setup(kWho, q, keys, values, layer, q_pos, kv_len, out->element_type(), window, softcap, scale, pb, qf, &li, bits);
  if (err.failure()) return err;
  const auto kd = keys.dimensions();  // [L, B, H, S, D']
  if (kd[1] != pb.batch) {
    return ffi::Error::InvalidArgument(std::string(kWho) + ": q " + dims_str(q.dimensions()) + " does not fit codes " + dims_str(kd));
  }
  pb.slots = kd[3];
  err = select_scales(kWho, keys, key_scales, value_scales, li, pb);
  if (err.failure()) return err;
  // The residual ring: keys/values [B, H, R, D] in f32 or bf16, positions [B, R].
  const auto rd = residual_keys.dimensions();
  const auto pd = residual_pos.dimensions();
  const ffi::DataType rt = residual_keys.element_type();
  const bool residual_ok = rd.size() == 4 && rd[0] == pb.batch && rd[1] == pb.kv_heads && rd[3] == pb.head_dim &&
                           std::equal(rd.begin(), rd.end(), residual_values.dimensions().begin()) &&
                           residual_values.dimensions().size() == 4 && residual_values.element_type() == rt &&
                           (rt == ffi::DataType::F32 || rt == ffi::DataType::BF16 || rt == ffi::DataType::U16) &&
                           pd.size() == 2 && pd[0] == pb.batch && pd[1] == rd[2];
  if (!residual_ok) {
    return ffi::Error::InvalidArgument(std::string(kWho) + ": expected residual keys and values [B, H, R, D] (float32 or bfloat16) and positions [B, R] for q " +
                                       dims_str(q.dimensions()) + ", got " + dims_str(rd) + " and " + dims_str(pd));
  }
  pb.residual = rd[2];
  pb.residual_keys = residual_keys.untyped_data();
  pb.residual_values = residual_values.untyped_data();
  pb.residual_pos = residual_pos.typed_data();
  pb.residual_bf16 = rt != ffi::DataType::F32;
  select_layer(keys, values, li, pb);
  attend(pool, pb, bits == 8 ? Kind::kInt8 : Kind::kInt4, *out);
  return ffi::Error::Success();
}

ffi::Error paged_quantized_decode_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer keys,
                                            ffi::AnyBuffer values, ffi::AnyBuffer key_scales,
                                            ffi::AnyBuffer value_scales, ffi::Buffer<ffi::S32> layer,
                                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_len,
                                            ffi::Buffer<ffi::S32> block_table, ffi::Result<ffi::AnyBuffer> out,
                                            int64_t window, float softcap, float scale, int64_t bits) {
  constexpr const char* kWho = "jaxkv paged_quantized_decode_attention";
  ffi::Error err = check_bits(kWho, bits);
  if (err.failure()) return err;
  Problem pb;
  std::vector<float> qf;
  int32_t li;
  err = common_setup(kWho, q, keys, values, layer, q_pos, kv_len, out->element_type(), window, softcap, scale, pb, qf, &li, bits);
  if (err.failure()) return err;
  err = paged_setup(kWho, keys, block_table, pb);
  if (err.failure()) return err;
  err = select_scales(kWho, keys, key_scales, value_scales, li, pb);
  if (err.failure()) return err;
  select_layer(keys, values, li, pb);
  attend(pool, pb, bits == 8 ? Kind::kInt8 : Kind::kInt4, *out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedQuantizedDecodeAttention, paged_quantized_decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // keys: the pool's codes
                                  .Arg<ffi::AnyBuffer>()          // values
                                  .Arg<ffi::AnyBuffer>()          // key_scales [L, P, H, ps]
                                  .Arg<ffi::AnyBuffer>()          // value_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_table
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantizedDecodeAttention, quantized_decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // keys: int8 codes, or uint8 (two int4)
                                  .Arg<ffi::AnyBuffer>()          // values
                                  .Arg<ffi::AnyBuffer>()          // key_scales
                                  .Arg<ffi::AnyBuffer>()          // value_scales
                                  .Arg<ffi::AnyBuffer>()          // residual_keys [B, H, R, D]
                                  .Arg<ffi::AnyBuffer>()          // residual_values
                                  .Arg<ffi::Buffer<ffi::S32>>()   // residual_positions [B, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_len
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDecodeAttention, decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // keys
                                  .Arg<ffi::AnyBuffer>()          // values
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_len
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedDecodeAttention, paged_decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // keys: the pool
                                  .Arg<ffi::AnyBuffer>()          // values: the pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_table
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale"));
