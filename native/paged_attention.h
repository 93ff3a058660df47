// Decode attention on CPU straight from the paged KV pool: one new token per sequence
// attends to its context where its blocks lie, with no copy of the context into a
// padded batch first (the torch backend's SDPA path copies every context block of every
// layer, then runs CPU flash attention, slow for the 1-8 query rows of a kv head). Two
// passes per (sequence, kv head): scores for each key and query head of the group, their
// softmax (AVX2 exp), then the values weighted. float32; AVX2 and FMA (omp_team.h's
// check); the (sequence, kv head) pairs are split over torch's OpenMP team (omp_team.h).
#pragma once

#include <cstdint>

namespace lmd {

struct PagedDecode {
  const float* q;  // [rows, heads_kv, groups, dim] contiguous
  std::int64_t rows;
  std::int64_t heads_kv;
  std::int64_t groups;  // query heads per kv head
  std::int64_t dim;
  const float* kv;  // the pool [num_blocks, num_layers, 2, block_size, heads_kv, dim]
  std::int64_t num_blocks;
  std::int64_t num_layers;
  std::int64_t block_size;
  std::int64_t layer;
  const std::int64_t* tables;  // [rows, table_width]: row r's context blocks, in order
  std::int64_t table_width;
  const std::int64_t* positions;  // [rows]: the new token's position p; keys 0..p visible
  std::int64_t window;            // > 0: only keys j with p - j < window
  float scale;
  float* out;  // [rows, heads_kv, groups, dim]
};

// Throws std::invalid_argument naming what is out of range (shapes, a position past the
// table, a block id outside the pool) before anything is read.
void check_paged_decode(const PagedDecode& args);

void paged_decode_attention(const PagedDecode& args, int threads);

}  // namespace lmd
