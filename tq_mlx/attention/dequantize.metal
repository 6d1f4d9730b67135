// Dequantize compressed tokens to the model basis (for long prefill chunks, where a float matmul wins):
//   x = |x|·Πᵀ c[idx] (+ √(π/2)/D·γ·Sᵀz with QJL) + mean
// One SIMD group per token; its packed words are staged once into threadgroup memory, then lane l
// decodes elements [l*E, l*E + E), runs the inverse rotation with shuffles and writes them.
// Inputs (strided views, indexed with their strides): codes (B, H, n, W) uint32, norms (B, H, n, 1)
//   float16 or uint8 (tq_norm), qjlw (B, H, n, D/32) uint32 and gamma (B, H, n) as the norms (QJL); tables float32
//   [signs (D) | entries (tq_entries: 2^B centroids, or a trellis codebook) | qjl scale]; proj (D, D) float32 S;
//   mean (B*H, D) float32;
//   params int32 [n, H, has_mean].
// Output: out (B, H, n, D) T. Template: T, D, B (MSE bits), QJL, W (packed words per token:
// tq_mlx.packing.packed_words), TR (trellis codes: their codebook is read from `tables`, not staged). Grid: 32
// threads per token.
constexpr int E = D / 32;
constexpr int NC = tq_entries(TR, B);
constexpr bool TRL = tq_trellis(TR, B);
constexpr int WJ = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint row = thread_position_in_grid.x / 32;
const uint n = uint(params[0]);
const uint t = row % n;
const uint bh = row / n;
const uint b = bh / uint(params[1]);
const uint h = bh % uint(params[1]);

threadgroup float cent[TRL ? 1 : NC];
constexpr int TW = 8 * W;  // up to 8 SIMD groups per threadgroup
constexpr int TJ = QJL ? 8 * WJ : 1;
threadgroup uint words[TW];
threadgroup uint jwords[TJ];
for (uint i = thread_index_in_threadgroup; !TRL && i < uint(NC); i += threads_per_threadgroup.x) {
  cent[i] = tables[D + i];
}
threadgroup uint* tw = words + sg * W;
// `auto`: MLX passes inputs of fewer than 8 elements in the constant address space.
const auto cw = codes + b * codes_strides[0] + h * codes_strides[1] + t * codes_strides[2];
for (uint w = lane; w < uint(W); w += 32) {
  tw[w] = cw[w * codes_strides[3]];
}
threadgroup uint* tj = jwords + sg * WJ;
if (QJL) {
  const auto jw = qjlw + b * qjlw_strides[0] + h * qjlw_strides[1] + t * qjlw_strides[2];
  for (uint w = lane; w < uint(WJ); w += 32) {
    tj[w] = jw[w * qjlw_strides[3]];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const float nrm = tq_norm(norms[b * norms_strides[0] + h * norms_strides[1] + t * norms_strides[2]]);
float v[E];
for (int e = 0; e < E; ++e) {
  v[e] = TRL ? tables[D + tq_entry<B, D, TR>(tw, lane * E + e)] : cent[tq_code<B, D>(tw, lane * E + e)];
}
tq_wht<E>(v, lane);
const float rs = nrm / sqrt(float(D));
const bool has_mean = params[2] != 0;
float x[E];
for (int e = 0; e < E; ++e) {
  uint j = lane * E + e;
  x[e] = v[e] * rs * tables[j] + (has_mean ? mean[bh * D + j] : 0.0f);
}
if (QJL) {
  // Sᵀz for this lane's columns j: Σ_i S[i][j]·z_i with z_i = ±1 from bit i of the staged words.
  const float g = tables[D + NC] *
                  tq_norm(gamma[b * gamma_strides[0] + h * gamma_strides[1] + t * gamma_strides[2]]);
  for (int e = 0; e < E; ++e) {
    uint j = lane * E + e;
    float z = 0.0f;
    for (int i = 0; i < D; ++i) {
      float s = proj[i * D + j];
      z += ((tj[i / 32] >> (i % 32)) & 1u) ? s : -s;
    }
    x[e] += g * z;
  }
}
device T* o = out + row * D + lane * E;
for (int e = 0; e < E; ++e) {
  o[e] = T(x[e]);
}
