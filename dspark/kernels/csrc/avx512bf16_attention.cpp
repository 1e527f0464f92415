// The paged attention of a group of query rows on CPUs without AMX: AVX512-BF16 scores against
// keys transposed 16 at a time, an fp32 softmax per row, the weighted values summed in fp32 from
// bf16 weights, two keys per VDPBF16PS.
//
// Scoring a key against one query at a time costs a dot product and a horizontal sum each. Here
// 16 keys at a time are transposed once (their dimension pairs become rows of 16 lanes, one key a
// lane), and every query row of the group (the G heads of each token, times the tokens of a
// verify or draft block, at most 16 rows) then scores all 16 keys with one VDPBF16PS per
// dimension pair and no horizontal sum: the transpose is shared by the group, and a decode
// token's G heads share it too. A row's numbers depend only on its own query and keys: each
// score sums its pairs in one fixed order, a causal end is a mask (exp gives an exact 0, which
// adds nothing), so a token's output is bit-identical alone, in a verify block or beside a
// padding token.
//
// The weighted values were 4 fp32 FMAs per row, key and 64 dimensions, most of an 8-row verify
// block's attention; rounding the weights to bf16 (as the torch path does before its P·V matmul)
// lets one dot product take two keys, and each value row is read once per 4 rows instead of once
// per 16 dimensions. An 8-token verify step at a 400-token context then cost 0.4 ms less.
#include "kernels.h"

#include <cmath>
#include <cstring>
#include <utility>

namespace dspark_cpu {
namespace {

constexpr int kKeys = 16;                // keys per transposed block (one register of scores)
constexpr int64_t kMaxPairs = kMaxHeadDim / 2;   // dimension pairs of a head
constexpr int kRowChunk = 4;             // query rows scored together (4 sums each in registers)

// One stage of transpose16: swap the off-diagonal B x B blocks of every 2B x 2B block (lanes of
// `lo` and `hi` index the two registers' concatenation, as VPERMT2D reads it).
template <int B>
inline void swap_blocks(__m512i* r) {
  const __m512i lo = B == 8 ? _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0)
                   : B == 4 ? _mm512_set_epi32(27, 26, 25, 24, 11, 10, 9, 8, 19, 18, 17, 16, 3, 2, 1, 0)
                   : B == 2 ? _mm512_set_epi32(29, 28, 13, 12, 25, 24, 9, 8, 21, 20, 5, 4, 17, 16, 1, 0)
                            : _mm512_set_epi32(30, 14, 28, 12, 26, 10, 24, 8, 22, 6, 20, 4, 18, 2, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(B));
  for (int i = 0; i < 16; ++i) {
    if (i & B) continue;
    const __m512i a = r[i], c = r[i + B];
    r[i] = _mm512_permutex2var_epi32(a, lo, c);
    r[i + B] = _mm512_permutex2var_epi32(a, hi, c);
  }
}

// In-register transpose of a 16 x 16 block of dwords: r[i] lane j <-> r[j] lane i.
inline void transpose16(__m512i* r) {
  swap_blocks<8>(r);
  swap_blocks<4>(r);
  swap_blocks<2>(r);
  swap_blocks<1>(r);
}

// kt [pairs][16] dwords: pair p of keys rows[0..n) in lanes 0..n-1, zeros past n.
void transpose_keys(const uint16_t* const* rows, int64_t n, int64_t pairs, uint32_t* kt) {
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const __mmask16 m = lanes(pairs - p0);
    __m512i r[16];
    for (int k = 0; k < 16; ++k)
      r[k] = k < n ? _mm512_maskz_loadu_epi32(m, rows[k] + 2 * p0) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t p = 0; p < std::min<int64_t>(16, pairs - p0); ++p) _mm512_store_si512(kt + (p0 + p) * kKeys, r[p]);
  }
}

// Scores of 16 keys (kt) for query rows q[0..N): four sums per row over the pairs (p mod 4), so
// no sum waits on its last add, combined as (s0 + s1) + (s2 + s3).
template <int N, int J>
inline void score_pair(const uint32_t* const* q, const uint32_t* kt, int64_t p, __m512 (*acc)[4]) {
  const __m512bh k = (__m512bh)_mm512_load_si512(kt + p * kKeys);
  for (int r = 0; r < N; ++r) acc[r][J] = _mm512_dpbf16_ps(acc[r][J], (__m512bh)_mm512_set1_epi32(q[r][p]), k);
}

template <int N>
void score_block(const uint32_t* const* q, const uint32_t* kt, int64_t pairs, __m512* out) {
  __m512 acc[N][4];
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) {
    score_pair<N, 0>(q, kt, p, acc);
    score_pair<N, 1>(q, kt, p + 1, acc);
    score_pair<N, 2>(q, kt, p + 2, acc);
    score_pair<N, 3>(q, kt, p + 3, acc);
  }
  if (p < pairs) score_pair<N, 0>(q, kt, p, acc);          // pair p + j always goes to sum j
  if (p + 1 < pairs) score_pair<N, 1>(q, kt, p + 1, acc);
  if (p + 2 < pairs) score_pair<N, 2>(q, kt, p + 2, acc);
  for (int r = 0; r < N; ++r)
    out[r] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
}

using ScoreFn = void (*)(const uint32_t* const*, const uint32_t*, int64_t, __m512*);
constexpr ScoreFn kScoreFns[kRowChunk] = {score_block<1>, score_block<2>, score_block<3>, score_block<4>};

// The group's rows: query, output, and the end of its context keys (relative to the first key).
struct GroupRows {
  int64_t count = 0, context = 0;          // rows; context keys of the group (the longest row's)
  const uint32_t* q[kTileQueryRows];
  at::BFloat16* out[kTileQueryRows];
  int64_t end[kTileQueryRows];
};

// scores [rows][stride]: each row's scaled scores, -inf for keys it does not see.
void score_rows(const GroupRows& g, const std::vector<const uint16_t*>& keys, int64_t len, int64_t stride,
                int64_t pairs, float scale, float* scores) {
  alignas(64) uint32_t kt[kMaxPairs * kKeys];
  const __m512 sc = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t l0 = 0; l0 < len; l0 += kKeys) {
    transpose_keys(keys.data() + l0, std::min<int64_t>(kKeys, len - l0), pairs, kt);
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(l0)));
    for (int64_t r0 = 0; r0 < g.count; r0 += kRowChunk) {
      const int64_t n = std::min<int64_t>(kRowChunk, g.count - r0);
      __m512 s[kRowChunk];
      kScoreFns[n - 1](g.q + r0, kt, pairs, s);
      for (int64_t r = 0; r < n; ++r) {
        // seen: a context key before the row's end, or an extra (block) key; nothing past len
        const __mmask16 context = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(g.end[r0 + r])));
        const __mmask16 extra = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(g.context)));
        const __mmask16 seen = (context | extra) & lanes(len - l0);
        _mm512_store_ps(scores + (r0 + r) * stride + l0, _mm512_mask_mul_ps(neg_inf, seen, s[r], sc));
      }
    }
  }
}

// A row's scores -> its weights e^(score - max) as bf16 in `w` (0 where unseen); returns the sum
// of the rounded weights, so the weights the values are summed with are the ones normalised.
float softmax_row(const float* row, int64_t len, uint16_t* w) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < len; l += 16) top = _mm512_max_ps(top, _mm512_load_ps(row + l));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top)), neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; l += 16) {
    const __m512 x = _mm512_load_ps(row + l);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(x, mx)));
    const __m256bh b = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + l), (__m256i)b);
    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(b));
  }
  return _mm512_reduce_add_ps(sum);
}

alignas(64) constexpr uint16_t kZeroKey[2 * kMaxPairs] = {};   // the partner of a segment's odd last key

inline __mmask32 lanes32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFF) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
}

// Weighted values of N rows over 64 dimensions, two keys a step: the keys' values interleaved
// (UNPCKLWD/HWD) into pairs, each row's two weights one dword, one VDPBF16PS per row and 16 lanes.
// Lanes of the lo sums hold dimensions {0-3, 8-11, 16-19, 24-27} of each 32, of hi the other
// halves of each 8 (unshuffled at the end).
template <int N>
struct PairSums {
  __m512 acc[N][4];

  PairSums() {
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  // keys a and b (b: kZeroKey, its weights 0, when a segment has an odd count); wd[r] the row's pair
  inline void add(const uint16_t* a, const uint16_t* b, const uint32_t* wd, __mmask32 m0, __mmask32 m1) {
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, a), b0 = _mm512_maskz_loadu_epi16(m0, b);
    const __m512i a1 = _mm512_maskz_loadu_epi16(m1, a + 32), b1 = _mm512_maskz_loadu_epi16(m1, b + 32);
    const __m512bh v[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                           (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
    for (int r = 0; r < N; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(wd[r]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, v[j]);
    }
  }
  // Row r's 64 dimensions divided by its total, in order, to bf16.
  void store(int r, float inv, at::BFloat16* out, __mmask32 m0, __mmask32 m1) const {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 scale = _mm512_set1_ps(inv);
    const __mmask16 m[4] = {__mmask16(m0), __mmask16(m0 >> 16), __mmask16(m1), __mmask16(m1 >> 16)};
    for (int h = 0; h < 2; ++h) {
      const __m512 lo = acc[r][2 * h], hi = acc[r][2 * h + 1];
      store16(out + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale), m[2 * h]);
      store16(out + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale), m[2 * h + 1]);
    }
  }
};

// out[r] = Σ_l w[r][l] · V[l] / total[r] for N rows. The context keys [0, context) pair up from
// key 0 and the block keys [context, len) from their first, so a row's keys always meet in the
// same pairs and the same order whatever group it is in (a weight of 0 adds an exact 0).
template <int N>
void weigh_rows(const uint16_t* const* w, const float* total, const std::vector<const uint16_t*>& values,
                int64_t context, int64_t len, int64_t dim, at::BFloat16* const* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const __mmask32 m0 = lanes32(dim - d0), m1 = lanes32(dim - d0 - 32);
    PairSums<N> sums;
    alignas(64) uint32_t wd[N];
    const std::pair<int64_t, int64_t> segments[2] = {{0, context}, {context, len}};
    for (const auto& [begin, end] : segments) {
      int64_t l = begin;
      for (; l + 1 < end; l += 2) {          // each row's two weights, one dword
        for (int r = 0; r < N; ++r) std::memcpy(wd + r, w[r] + l, sizeof(uint32_t));
        sums.add(values[l] + d0, values[l + 1] + d0, wd, m0, m1);
      }
      if (l < end) {                           // an odd last key: its partner is a zero row
        for (int r = 0; r < N; ++r) wd[r] = w[r][l];
        sums.add(values[l] + d0, kZeroKey, wd, m0, m1);
      }
    }
    for (int r = 0; r < N; ++r) sums.store(r, total[r] > 0.0f ? 1.0f / total[r] : 0.0f, out[r] + d0, m0, m1);
  }
}

using WeighFn = void (*)(const uint16_t* const*, const float*, const std::vector<const uint16_t*>&, int64_t, int64_t,
                         int64_t, at::BFloat16* const*);
constexpr WeighFn kWeighFns[kRowChunk] = {weigh_rows<1>, weigh_rows<2>, weigh_rows<3>, weigh_rows<4>};

}  // namespace

void attend_rows_vector(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                        const int64_t* keys, int64_t first, int64_t count, const AttentionShape& s,
                        const ExtraKeys& extra, int64_t kvh, float scale, RowScratch& scratch, at::BFloat16* out) {
  const int64_t G = s.heads / s.kv_heads, begin = keys[3 * first + 1];
  TORCH_CHECK(G * count <= kTileQueryRows && s.dim % 2 == 0 && s.dim / 2 <= kMaxPairs,
              "paged attention: more than ", kTileQueryRows, " query rows in a group, or an odd or over-",
              kMaxHeadDim, " head dimension");
  GroupRows g;
  for (int64_t j = 0; j < G * count; ++j) {
    const int64_t t = first + j / G, head = kvh * G + j % G;
    g.q[j] = reinterpret_cast<const uint32_t*>(q + (t * s.heads + head) * s.dim);
    g.out[j] = out + (t * s.heads + head) * s.dim;
    g.end[j] = keys[3 * t + 2] - begin;
    g.context = std::max(g.context, g.end[j]);
  }
  g.count = G * count;
  const int64_t len = g.context + extra.count, stride = (len + 15) / 16 * 16;
  scratch.keys.resize(len);
  scratch.values.resize(len);
  const auto* ek = reinterpret_cast<const uint16_t*>(extra.k);
  const auto* ev = reinterpret_cast<const uint16_t*>(extra.v);
  for_each_key(kc, ek, table, begin, begin + g.context, s, extra, kvh, [&](int64_t l, const uint16_t* k) { scratch.keys[l] = k; });
  for_each_key(vc, ev, table, begin, begin + g.context, s, extra, kvh, [&](int64_t l, const uint16_t* v) { scratch.values[l] = v; });
  scratch.scores.resize(g.count * stride + 16);
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.scores.data()) + 63) & ~uintptr_t(63));
  score_rows(g, scratch.keys, len, stride, s.dim / 2, scale, sc);
  scratch.weights.resize(g.count * stride);
  float total[kTileQueryRows];
  const uint16_t* w[kTileQueryRows];
  for (int64_t r = 0; r < g.count; ++r) {
    total[r] = softmax_row(sc + r * stride, stride, scratch.weights.data() + r * stride);
    w[r] = scratch.weights.data() + r * stride;
  }
  for (int64_t r0 = 0; r0 < g.count; r0 += kRowChunk) {
    const int64_t n = std::min<int64_t>(kRowChunk, g.count - r0);
    kWeighFns[n - 1](w + r0, total + r0, scratch.values, g.context, len, s.dim, g.out + r0);
  }
}

}  // namespace dspark_cpu
