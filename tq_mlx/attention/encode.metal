// Fused TurboQuant encode of a block of new tokens, one SIMD group per token vector (lane l: elements
// [l*E, l*E + E)): centering, norm, rotation, Lloyd-Max index, packing; with QJL also the residual's norm
// and the sign bits of S·r (TurboQuantProd: MSE stage at B bits plus 1 QJL bit).
// Inputs:  x (N, D) T, rows ordered (batch, kv head, token); mean (B*H, D) float32 (used if params[1]);
//          tables float32 [signs (D) | boundaries (2^B - 1) | centroids (2^B)]; proj (D, D) float32 S (QJL);
//          params int32 [tokens per (batch, head), has_mean].
// Outputs: codes (N, W) uint32; norms (N,) NT; qjl (N, D/32) uint32 and gamma (N,) NT (QJL).
// Template: T, NT (the stored norms' type: half, or uint8_t for the log code), D, B (MSE bits), QJL, W (packed
// words per token: tq_mlx.packing.packed_words), CN (norm correction: store |x| / |c[idx]|, quantizer.py). Grid: 32 threads per row, at most 8 SIMD groups per threadgroup.
constexpr int E = D / 32;
constexpr int NC = 1 << B;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint row = thread_position_in_grid.x / 32;

// Boundaries and centroids in threadgroup memory: lanes index them with different codes, which is
// conflict-free for <= 32 entries and avoids divergent constant-memory reads.
threadgroup float bnd[NC];
threadgroup float cent[NC];
constexpr int RESID = QJL ? 8 * D : 1;
threadgroup float resid[RESID];
for (uint i = thread_index_in_threadgroup; i < uint(NC); i += threads_per_threadgroup.x) {
  cent[i] = tables[D + NC - 1 + i];
  if (i + 1 < uint(NC)) {
    bnd[i] = tables[D + i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const uint bh = row / uint(params[0]);
const bool has_mean = params[1] != 0;
float v[E];
float ss = 0.0f;
for (int e = 0; e < E; ++e) {
  uint j = lane * E + e;
  v[e] = float(x[row * D + j]) - (has_mean ? mean[bh * D + j] : 0.0f);
  ss += v[e] * v[e];
}
const float nrm = sqrt(simd_sum(ss));
const float inv = nrm > 0.0f ? 1.0f / nrm : 1.0f;  // a zero vector keeps codes 0 and norm 0
float y[E];
for (int e = 0; e < E; ++e) {
  y[e] = v[e] * inv * tables[lane * E + e];
}
tq_wht<E>(y, lane);
const float rs = 1.0f / sqrt(float(D));
uint code[E];
for (int e = 0; e < E; ++e) {
  code[e] = tq_index<B>(y[e] * rs, bnd);
}
// Bit planes (tq_lo_bits, tq_hi_bits): the low plane's D·LB/32 words, then for 3, 5 and 6 bits the high plane's.
constexpr int LB = tq_lo_bits(B);
constexpr int HB = tq_hi_bits(B);
device uint* out = codes + row * W;
tq_pack_plane<LB, E>(code, 0, lane, out);
if (HB > 0) {
  tq_pack_plane<(HB > 0 ? HB : 1), E>(code, LB, lane, out + D * LB / 32);
}
float cc = 0.0f;  // |c[idx]|², for the norm correction
if (CN) {
  for (int e = 0; e < E; ++e) {
    cc += cent[code[e]] * cent[code[e]];
  }
  cc = simd_sum(cc);
}
const NT nrm_s = tq_store_norm<NT>(CN && cc > 0.0f ? nrm / sqrt(cc) : nrm);
if (lane == 0) {
  norms[row] = nrm_s;
}

if (QJL) {
  // Residual r = x - |x|·Πᵀc[idx] in the model basis, with the stored norm as the reference does.
  float xr[E];
  for (int e = 0; e < E; ++e) {
    xr[e] = cent[code[e]];
  }
  tq_wht<E>(xr, lane);
  threadgroup float* rg = resid + sg * D;
  float rr = 0.0f;
  for (int e = 0; e < E; ++e) {
    uint j = lane * E + e;
    float r = v[e] - tq_norm(nrm_s) * (xr[e] * rs * tables[j]);
    rg[j] = r;
    rr += r * r;
  }
  const float gam = sqrt(simd_sum(rr));
  simdgroup_barrier(mem_flags::mem_threadgroup);
  // Sign bits of z = S r: lane computes rows [lane*E, lane*E + E) of S against the whole residual.
  uint zb[E];
  for (int e = 0; e < E; ++e) {
    const device float* srow = proj + (lane * E + e) * D;
    float z = 0.0f;
    for (int j = 0; j < D; ++j) {
      z += srow[j] * rg[j];
    }
    zb[e] = z >= 0.0f ? 1u : 0u;
  }
  tq_pack_plane<1, E>(zb, 0, lane, qjl + row * (D / 32));
  if (lane == 0) {
    gamma[row] = tq_store_norm<NT>(gam);
  }
}
