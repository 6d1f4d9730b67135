// Temporal decay: compressed tokens re-coded at fewer bits in their own rotated basis (TurboQuantMSE.recode):
// per code group, the unit vector c[idx]/|c[idx]| takes the new codebook's nearest codes and the norm becomes
// the decoded vector's, stored·|c[idx]| (over |c'[idx']| with CN). No rotation: the decayed codes share the fresh
// codes' groups and rotations, so attention reads both with one rotated query. One SIMD group per token.
// Inputs:  codes (N, W) uint32, norms (N, G) half or uint8_t (tq_norm); tables float32 [old centroids
//          (2^B0, then 2^B1 if G = 2) | new boundaries (2^C0 - 1, then 2^C1 - 1) | new centroids (2^C0, 2^C1)].
// Outputs: out (N, V) uint32 (group 0's V0 words, then group 1's); onorms (N, G) NT.
// Template: NT, D, G (1 or 2), D0 (group 0's dims; D when G = 1), B0, B1 (old bits), C0, C1 (new bits),
// W0, W, V0, V (old and new words: group 0's, all), CN (norms corrected). Grid: 32 threads per row.
constexpr int D1 = D - D0;
constexpr int NO = (1 << B0) + (G == 2 ? 1 << B1 : 0);
constexpr int NB = (1 << C0) - 1 + (G == 2 ? (1 << C1) - 1 : 0);
constexpr int NN = (1 << C0) + (G == 2 ? 1 << C1 : 0);
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint row = thread_position_in_grid.x / 32;

threadgroup float co[NO];
threadgroup float bt[NB];
threadgroup float cn[NN];
threadgroup uint ws[8 * W];    // per SIMD group: the token's old words
threadgroup uchar cs[8 * D];   // per SIMD group: its new indices
for (uint i = thread_index_in_threadgroup; i < uint(NO + NB + NN); i += threads_per_threadgroup.x) {
  const float t = tables[i];
  if (i < uint(NO)) {
    co[i] = t;
  } else if (i < uint(NO + NB)) {
    bt[i - NO] = t;
  } else {
    cn[i - NO - NB] = t;
  }
}
threadgroup uint* tw = ws + sg * W;
for (uint w = lane; w < uint(W); w += 32) {
  tw[w] = codes[row * W + w];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

threadgroup uchar* cg = cs + sg * D;
float n[2] = {0.0f, 0.0f};
for (int g = 0; g < G; ++g) {
  const int dg = g == 0 ? D0 : D1;
  const threadgroup float* cold = co + (g == 0 ? 0 : 1 << B0);
  const threadgroup float* bnd = bt + (g == 0 ? 0 : (1 << C0) - 1);
  const threadgroup float* cnew = cn + (g == 0 ? 0 : 1 << C0);
  float ss = 0.0f;
  for (int j = int(lane); j < dg; j += 32) {
    const float c = cold[g == 0 ? tq_code<B0, D0>(tw, uint(j)) : tq_code<B1, (G == 2 ? D1 : 1)>(tw + W0, uint(j))];
    ss += c * c;
  }
  const float r = sqrt(simd_sum(ss));
  const float inv = r > 0.0f ? 1.0f / r : 1.0f;
  float cc = 0.0f;
  for (int j = int(lane); j < dg; j += 32) {
    const float c = cold[g == 0 ? tq_code<B0, D0>(tw, uint(j)) : tq_code<B1, (G == 2 ? D1 : 1)>(tw + W0, uint(j))];
    const uint idx = g == 0 ? tq_index<C0>(c * inv, bnd) : tq_index<(G == 2 ? C1 : C0)>(c * inv, bnd);
    cg[(g == 0 ? 0 : D0) + j] = uchar(idx);
    cc += cnew[idx] * cnew[idx];
  }
  float nrm = tq_norm(norms[row * G + uint(g)]) * r;
  if (CN) {
    cc = simd_sum(cc);
    nrm = cc > 0.0f ? nrm / sqrt(cc) : nrm;
  }
  n[g] = nrm;
}
simdgroup_barrier(mem_flags::mem_threadgroup);
for (uint w = lane; w < uint(V); w += 32) {
  out[row * V + w] = w < uint(V0) ? tq_pack_word<C0, D0>(cg, w) : tq_pack_word<C1, (G == 2 ? D1 : 1)>(cg + D0, w - V0);
}
if (lane == 0) {
  onorms[row * G] = tq_store_norm<NT>(n[0]);
  if (G == 2) {
    onorms[row * G + 1] = tq_store_norm<NT>(n[1]);
  }
}
