// The tile path of the paged attention: scores through AMX tiles, the softmax and the weighted
// values in fp32 lanes.
//
// The vector path scores a key against one query at a time, a dot product and a horizontal sum
// each. Here the query rows of a group (the G heads of each token, times the tokens of a verify
// or draft block, at most 16 rows) are transposed once into the B operand of TDPBF16PS, and 16
// keys at a time are its A operand, read in place from their page: one tile multiply per 32
// dimensions gives the scores of 16 keys for every row. The softmax then runs across the rows in
// the lanes of one register (one exp per key for all of them), and each key's value row is read
// once for the whole group. A row's numbers depend only on its own query and keys: a causal end
// is a mask, not a shorter loop, so a token's output is bit-identical alone, in a verify block or
// beside a padding token.
#include "kernels.h"

#include <array>
#include <cmath>
#include <cstring>
#include <utility>

namespace dspark_cpu {
namespace {

constexpr int kLanes = kTileQueryRows;   // query rows per group, and keys per score tile
constexpr int64_t kChunk = 32;           // dimensions per tile multiply
constexpr int64_t kMaxDim = kMaxHeadDim;

// The group's rows: keys [begin, end) of the request (end: the latest row's end), each row's own
// end relative to begin, and how many rows are live (lanes past them see nothing).
struct LaneKeys {
  int64_t begin, end, live;
  alignas(64) int32_t ends[kLanes];
};

// Q^T as tile B operands, one per 32 dimensions: [16 pairs][16 rows] dwords, zero padded.
void transpose_queries(const uint16_t* const* rows, int64_t live, int64_t dim, uint32_t* qt) {
  const int64_t chunks = (dim + kChunk - 1) / kChunk;
  std::memset(qt, 0, chunks * kChunk / 2 * kLanes * sizeof(uint32_t));
  for (int64_t j = 0; j < live; ++j)
    for (int64_t p = 0; p < dim / 2; ++p) std::memcpy(qt + p * kLanes + j, rows[j] + 2 * p, sizeof(uint32_t));
}

// Key l of the group (context keys first, then the extra keys), or nullptr past them.
const uint16_t* key_row(const uint16_t* cache, const int64_t* table, const LaneKeys& lk, const AttentionShape& s,
                        const ExtraKeys& extra, int64_t kvh, int64_t l) {
  const int64_t context = lk.end - lk.begin;
  if (l < context) {
    const int64_t key = lk.begin + l;
    return cache + ((table[key / s.block_size] * s.block_size + key % s.block_size) * s.kv_heads + kvh) * s.dim;
  }
  if (l < context + extra.count)
    return reinterpret_cast<const uint16_t*>(extra.k) + (l - context) * extra.stride + kvh * s.dim;
  return nullptr;
}

// Tile A for keys [l0, l0 + 16): in place when they are 16 context keys of one page and D is
// whole chunks; otherwise copied into buf (zeros past the keys and past D). Sets *stride (bytes).
const uint16_t* key_tile(const uint16_t* cache, const int64_t* table, const LaneKeys& lk, const AttentionShape& s,
                         const ExtraKeys& extra, int64_t kvh, int64_t l0, uint16_t* buf, int64_t* stride) {
  const int64_t key = lk.begin + l0, padded = (s.dim + kChunk - 1) / kChunk * kChunk;
  if (s.dim % kChunk == 0 && l0 + kLanes <= lk.end - lk.begin && key % s.block_size + kLanes <= s.block_size) {
    *stride = s.kv_heads * s.dim * 2;
    return key_row(cache, table, lk, s, extra, kvh, l0);
  }
  std::memset(buf, 0, kLanes * padded * sizeof(uint16_t));
  for (int64_t j = 0; j < kLanes; ++j)
    if (const uint16_t* row = key_row(cache, table, lk, s, extra, kvh, l0 + j))
      std::memcpy(buf + j * padded, row, s.dim * sizeof(uint16_t));
  *stride = padded * 2;
  return buf;
}

// scores [len, 16]: every key's scaled score in each row's lane; -inf where the row does not
// see the key. Returns the lanes' maxima.
__m512 score_keys(const uint32_t* qt, const uint16_t* kc, const int64_t* table, const LaneKeys& lk,
                  const AttentionShape& s, const ExtraKeys& extra, int64_t kvh, float scale, int64_t len,
                  float* scores) {
  const int64_t chunks = (s.dim + kChunk - 1) / kChunk;
  alignas(64) uint16_t buf[kLanes * kMaxDim];
  TileConfig cfg;                                    // 0: C scores, 1: A keys, 2: B queries
  for (int t = 0; t < 3; ++t) cfg.rows[t] = kLanes, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  for (int64_t l0 = 0; l0 < len; l0 += kLanes) {
    int64_t stride;
    const uint16_t* a = key_tile(kc, table, lk, s, extra, kvh, l0, buf, &stride);
    _tile_zero(0);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(1, a + c * kChunk, stride);
      _tile_loadd(2, qt + c * kChunk / 2 * kLanes, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores + l0 * kLanes, 64);
  }
  _tile_release();
  const int64_t context = lk.end - lk.begin;
  const __m512i lane_end = _mm512_load_si512(lk.ends);
  const __mmask16 live = lanes(lk.live);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  __m512 top = neg_inf;
  for (int64_t l = 0; l < len; ++l) {
    const __mmask16 sees = l < context ? _mm512_cmplt_epi32_mask(_mm512_set1_epi32(int32_t(l)), lane_end) : live;
    const __m512 row = _mm512_mask_mov_ps(neg_inf, sees, _mm512_mul_ps(_mm512_load_ps(scores + l * kLanes), sc));
    _mm512_store_ps(scores + l * kLanes, row);
    top = _mm512_max_ps(top, row);
  }
  return top;
}

// scores -> e^(score - top) in place (0 where unseen); returns the lanes' sums.
__m512 softmax_weights(float* scores, int64_t len, __m512 top) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 total = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    const __m512 x = _mm512_load_ps(scores + l * kLanes);
    const __mmask16 seen = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(x, top)));
    _mm512_store_ps(scores + l * kLanes, e);
    total = _mm512_add_ps(total, e);
  }
  return total;
}

// dst(j) = Σ_l weight[l, j] · V[l] / total[j] for the first N rows, 16 dimensions at a time
// with the N sums in registers.
template <int N>
void weigh_values(const float* weights, const float* total, const uint16_t* vc, const int64_t* table,
                  const LaneKeys& lk, const AttentionShape& s, const ExtraKeys& extra, int64_t kvh,
                  at::BFloat16* const* dst) {
  for (int64_t i = 0; i < s.dim; i += 16) {
    const __mmask16 m = lanes(s.dim - i);
    __m512 acc[N];
    for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
    for_each_key(vc, reinterpret_cast<const uint16_t*>(extra.v), table, lk.begin, lk.end, s, extra, kvh,
                 [&](int64_t l, const uint16_t* v) {
      const __m512 vv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, v + i));
      for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(weights[l * kLanes + j]), vv, acc[j]);
    });
    for (int j = 0; j < N; ++j) {
      const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
      store16(dst[j] + i, _mm512_mul_ps(acc[j], _mm512_set1_ps(inv)), m);
    }
  }
}

using WeighFn = void (*)(const float*, const float*, const uint16_t*, const int64_t*, const LaneKeys&,
                         const AttentionShape&, const ExtraKeys&, int64_t, at::BFloat16* const*);
template <int... N>
constexpr std::array<WeighFn, sizeof...(N)> weigh_table(std::integer_sequence<int, N...>) {
  return {weigh_values<N + 1>...};
}
constexpr auto kWeighFns = weigh_table(std::make_integer_sequence<int, kLanes>{});

}  // namespace

void attend_rows_tiles(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                       const int64_t* keys, int64_t first, int64_t count, const AttentionShape& s,
                       const ExtraKeys& extra, int64_t kvh, float scale, std::vector<float>& scores,
                       at::BFloat16* out) {
  const int64_t G = s.heads / s.kv_heads;
  TORCH_CHECK(G * count <= kLanes && s.dim <= kMaxDim, "paged attention: more than ", kLanes,
              " query rows in a tile group, or a head dimension over ", kMaxDim);
  LaneKeys lk{keys[3 * first + 1], keys[3 * first + 1], G * count, {}};
  const uint16_t* rows[kLanes];
  at::BFloat16* dst[kLanes];
  for (int64_t j = 0; j < lk.live; ++j) {
    const int64_t t = first + j / G, head = kvh * G + j % G;
    lk.end = std::max(lk.end, keys[3 * t + 2]);
    lk.ends[j] = static_cast<int32_t>(keys[3 * t + 2] - lk.begin);
    rows[j] = q + (t * s.heads + head) * s.dim;
    dst[j] = out + (t * s.heads + head) * s.dim;
  }
  alignas(64) uint32_t qt[kMaxDim / 2 * kLanes];
  transpose_queries(rows, lk.live, s.dim, qt);
  const int64_t len = lk.end - lk.begin + extra.count;
  const int64_t tiles = (len + kLanes - 1) / kLanes;
  scores.resize((tiles * kLanes + 1) * kLanes);                  // + one row of slack to align
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scores.data()) + 63) & ~uintptr_t(63));
  const __m512 top = score_keys(qt, kc, table, lk, s, extra, kvh, scale, len, sc);
  alignas(64) float total[kLanes];
  _mm512_store_ps(total, softmax_weights(sc, len, top));
  kWeighFns[lk.live - 1](sc, total, vc, table, lk, s, extra, kvh, dst);
}

}  // namespace dspark_cpu
