// TurboQuant encode for the codes the WHT kernel (encode.metal) does not cover: head dims that are not a power
// of two (80, 96, ...) and fractional bits (2.5, 3.5: channel groups of D0 and D - D0 dims, each with its own
// rotation, codebook and norm, in a per-head channel order). One SIMD group per token: centering and the
// channel order into threadgroup memory, then per group its norm, a dense rotation read from device memory
// (row i of Π_g by lane i % 32), the Lloyd-Max index, and at the end every packed word written once.
// A dense rotation instead of a padded transform: padding 80 or 96 dims to 128 would store and read 1.6x or
// 1.33x the code bytes of every token for the cache's lifetime; Π_g costs D_g² floats, read from cache per
// token here and never at decode time (attention rotates queries, not codes).
// Inputs:  x (N, D) T, rows ordered (batch, kv head, token); mean (B*H, D) float32 (model order, if params[1]);
//          order (H, D) int32: quantizer position j of head h is model channel order[h][j];
//          rot float32 [Π_0 (D0 x D0) | Π_1 (D1 x D1)], row-major; bnd float32 [boundaries_0 | boundaries_1];
//          cent float32 [centroids_0 | centroids_1] (read with CN);
//          params int32 [tokens per (batch, head), has_mean, H].
// Outputs: codes (N, W) uint32 (group 0's W0 words, then group 1's); norms (N, G) NT (half or uint8_t).
// Template: T, NT, D, G (1 or 2), D0 (group 0's dims; D when G = 1), B0, B1, W0, W, CN (norm correction: each
// group's norm stored as |x| / |c[idx]|). Grid: 32 threads per row.
constexpr int D1 = D - D0;
constexpr int NB0 = (1 << B0) - 1;
constexpr int NB1 = G == 2 ? (1 << B1) - 1 : 0;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint row = thread_position_in_grid.x / 32;

threadgroup float bt[NB0 + NB1];
constexpr int NC = CN ? (1 << B0) + (G == 2 ? 1 << B1 : 0) : 1;
threadgroup float ct[NC];  // centroids (CN): MLX passes a small table in the constant address space
threadgroup float xs[8 * D];   // per SIMD group: the centered token in quantizer order
threadgroup uchar cs[8 * D];   // per SIMD group: its indices
for (uint i = thread_index_in_threadgroup; i < uint(NB0 + NB1); i += threads_per_threadgroup.x) {
  bt[i] = bnd[i];
}
for (uint i = thread_index_in_threadgroup; CN && i < uint(NC); i += threads_per_threadgroup.x) {
  ct[i] = cent[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const uint bh = row / uint(params[0]);
const uint h = bh % uint(params[2]);
const bool has_mean = params[1] != 0;
threadgroup float* xg = xs + sg * D;
threadgroup uchar* cg = cs + sg * D;
for (uint j = lane; j < uint(D); j += 32) {
  const uint c = uint(order[h * D + j]);
  xg[j] = float(x[row * D + c]) - (has_mean ? mean[bh * D + c] : 0.0f);
}
simdgroup_barrier(mem_flags::mem_threadgroup);
const float n0 = tq_encode_group<B0, D0, CN>(xg, cg, rot, bt, ct, lane);
float n1 = 0.0f;
if (G == 2) {
  n1 = tq_encode_group<B1, (G == 2 ? D1 : 1), CN>(xg + D0, cg + D0, rot + D0 * D0, bt + NB0, ct + (1 << B0),
                                                  lane);
}
simdgroup_barrier(mem_flags::mem_threadgroup);
for (uint w = lane; w < uint(W); w += 32) {
  codes[row * W + w] = w < uint(W0) ? tq_pack_word<B0, D0>(cg, w) : tq_pack_word<B1, (G == 2 ? D1 : 1)>(cg + D0, w - W0);
}
if (lane == 0) {
  norms[row * G] = tq_store_norm<NT>(n0);
  if (G == 2) {
    norms[row * G + 1] = tq_store_norm<NT>(n1);
  }
}
