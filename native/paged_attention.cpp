#include "paged_attention.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX2 region below

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// e^x for x <= 0 (scores less their maximum): Cephes' expf polynomial on x - n ln 2, times
// 2^n through the exponent bits; about 1e-7 relative, 0 below -87.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2, high part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);      // and the rest
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

inline float dot(const float* a, const float* b, std::int64_t dim) {
  std::int64_t i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= dim; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
  float sum = _mm_cvtss_f32(half);
  for (; i < dim; i++) sum += a[i] * b[i];
  return sum;
}

// out += p * v over dim
inline void axpy(float p, const float* v, float* out, std::int64_t dim) {
  std::int64_t i = 0;
  const __m256 pp = _mm256_set1_ps(p);
  for (; i + 8 <= dim; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  }
  for (; i < dim; i++) out[i] += p * v[i];
}

// q . k[m] for 8 keys at once, lane m: eight independent FMA chains (one chain per dot
// waits on each FMA's latency, ~4x slower), summed across lanes by a tree of hadds.
// dim % 8 == 0.
inline __m256 dots8(const float* q, const float* const* k, std::int64_t dim) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int m = 0; m < 8; m++) acc[m] = _mm256_setzero_ps();
  for (std::int64_t i = 0; i < dim; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) acc[m] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[m] + i), acc[m]);
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]: two rounds
  // leave each key's low-half sum in one 128-bit half and its high-half sum in the other.
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// out[0, 8 W) = sum over the n keys of p[j] * v(j)[0, 8 W), the accumulators in registers
// (an axpy per key reloads and stores the output instead).
template <int W, typename Value>
void weighted_values(const float* p, std::int64_t n, Value v, std::int64_t offset, float* out) {
  __m256 acc[W];
#pragma GCC unroll 8
  for (int m = 0; m < W; m++) acc[m] = _mm256_setzero_ps();
  for (std::int64_t j = 0; j < n; j++) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    const float* row = v(j) + offset;
#pragma GCC unroll 8
    for (int m = 0; m < W; m++) acc[m] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * m), acc[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < W; m++) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

// In place: s[i] = e^(s[i] - max) over n scores; returns their sum.
float softmax_numerators(float* s, std::int64_t n) {
  float top = *std::max_element(s, s + n);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; i < n; i++) {
    s[i] = std::exp(s[i] - top);
    sum += s[i];
  }
  return sum;
}

// A share's scratch: one row of scores per query head of a group, and their sums.
struct Scratch {
  std::vector<float> scores;
  std::vector<float> sums;
};

// One (row, kv head): its group's query heads over the row's visible keys.
void attend_one(const PagedDecode& a, std::int64_t row, std::int64_t head, Scratch& scratch) {
  const std::int64_t pos = a.positions[row];
  const std::int64_t lo = a.window > 0 ? std::max<std::int64_t>(0, pos - a.window + 1) : 0;
  const std::int64_t n = pos - lo + 1, dim = a.dim, groups = a.groups;
  const std::int64_t token_stride = a.heads_kv * dim;        // one slot of a block
  const std::int64_t half = a.block_size * token_stride;      // K or V of one layer
  const std::int64_t block_stride = a.num_layers * 2 * half;  // one block of the pool
  const std::int64_t* table = a.tables + row * a.table_width;
  // Key j of this head; its value lies `half` further.
  auto key = [&](std::int64_t j) {
    return a.kv + table[j / a.block_size] * block_stride + a.layer * 2 * half +
           (j % a.block_size) * token_stride + head * dim;
  };
  const float* q = a.q + (row * a.heads_kv + head) * groups * dim;
  scratch.scores.resize(static_cast<std::size_t>(groups * n));
  scratch.sums.resize(static_cast<std::size_t>(groups));
  float* scores = scratch.scores.data();
  const bool lanes = dim % 8 == 0;  // the 8-key dots and the register-held values
  std::int64_t j = lo;
  if (lanes) {
    const __m256 scale = _mm256_set1_ps(a.scale);
    for (; j + 8 <= pos + 1; j += 8) {
      const float* keys[8];
#pragma GCC unroll 8
      for (int m = 0; m < 8; m++) keys[m] = key(j + m);
      for (std::int64_t g = 0; g < groups; g++) {
        const __m256 s8 = _mm256_mul_ps(dots8(q + g * dim, keys, dim), scale);
        _mm256_storeu_ps(scores + g * n + (j - lo), s8);
      }
    }
  }
  for (; j <= pos; j++) {  // the last keys (or all, off the lanes)
    const float* k = key(j);
    for (std::int64_t g = 0; g < groups; g++) {
      scores[g * n + (j - lo)] = dot(q + g * dim, k, dim) * a.scale;
    }
  }
  for (std::int64_t g = 0; g < groups; g++) {
    scratch.sums[g] = softmax_numerators(scores + g * n, n);
  }
  float* out = a.out + (row * a.heads_kv + head) * groups * dim;
  if (lanes) {
    auto value = [&](std::int64_t i) { return key(lo + i) + half; };
    for (std::int64_t g = 0; g < groups; g++) {
      for (std::int64_t c = 0; c < dim; c += 64) {  // 8 registers of 8 lanes at a time
        const float* p = scores + g * n;
        float* o = out + g * dim + c;
        switch (std::min<std::int64_t>(8, (dim - c) / 8)) {
          case 8: weighted_values<8>(p, n, value, c, o); break;
          case 7: weighted_values<7>(p, n, value, c, o); break;
          case 6: weighted_values<6>(p, n, value, c, o); break;
          case 5: weighted_values<5>(p, n, value, c, o); break;
          case 4: weighted_values<4>(p, n, value, c, o); break;
          case 3: weighted_values<3>(p, n, value, c, o); break;
          case 2: weighted_values<2>(p, n, value, c, o); break;
          default: weighted_values<1>(p, n, value, c, o); break;
        }
      }
    }
  } else {
    std::fill(out, out + groups * dim, 0.0f);
    for (std::int64_t k = lo; k <= pos; k++) {
      const float* v = key(k) + half;
      for (std::int64_t g = 0; g < groups; g++) axpy(scores[g * n + (k - lo)], v, out + g * dim, dim);
    }
  }
  for (std::int64_t g = 0; g < groups; g++) {
    const float inv = 1.0f / scratch.sums[g];
    for (std::int64_t i = 0; i < dim; i++) out[g * dim + i] *= inv;
  }
}

#pragma GCC pop_options

}  // namespace

void check_paged_decode(const PagedDecode& a) {
  if (a.rows < 0 || a.heads_kv < 1 || a.groups < 1 || a.dim < 1 || a.num_blocks < 1 ||
      a.num_layers < 1 || a.block_size < 1 || a.layer < 0 || a.layer >= a.num_layers ||
      a.table_width < 1 || a.window < 0 || !a.q || !a.kv || !a.tables || !a.positions || !a.out) {
    throw std::invalid_argument("paged_decode_attention: bad shapes or pointers");
  }
  for (std::int64_t row = 0; row < a.rows; row++) {
    const std::int64_t pos = a.positions[row];
    if (pos < 0 || pos >= a.table_width * a.block_size) {
      throw std::invalid_argument("paged_decode_attention: position " + std::to_string(pos) +
                                  " of row " + std::to_string(row) + " is past its " +
                                  std::to_string(a.table_width) + " blocks");
    }
    const std::int64_t lo = a.window > 0 ? std::max<std::int64_t>(0, pos - a.window + 1) : 0;
    for (std::int64_t b = lo / a.block_size; b <= pos / a.block_size; b++) {
      const std::int64_t block = a.tables[row * a.table_width + b];
      if (block < 0 || block >= a.num_blocks) {
        throw std::invalid_argument("paged_decode_attention: block " + std::to_string(block) +
                                    " is outside the pool of " + std::to_string(a.num_blocks));
      }
    }
  }
}

void paged_decode_attention(const PagedDecode& a, int threads) {
  for_shares(a.rows * a.heads_kv, threads, [&a](std::int64_t first, std::int64_t last) {
    Scratch scratch;
    for (std::int64_t task = first; task < last; task++) {
      attend_one(a, task / a.heads_kv, task % a.heads_kv, scratch);
    }
  });
}

}  // namespace lmd
