// Fused decode attention, pass 2 of 2: one threadgroup per (batch, kv head, chunk of 8 query rows), one SIMD
// group per query row at a time, lane l owning dims [l*E, l*E + E). For each row:
//   0. learned sinks (gpt-oss): the softmax starts at (m, l) = (the row's sink logit, 1), a token of value 0;
//   1. the float16 sinks and window (model basis) by online softmax: s = q·k (+ an additive mask), acc_f += p·v;
//   2. merge the S partials of pass 1 by log-sum-exp, shifted by q·μ (the key mean, exact for softmax);
//   3. one inverse rotation of the merged compressed accumulator, then
//      out = (acc_f + Πᵀ acc_c + l_c·ν) / l,   l_c = the compressed tokens' share of l.
//      Without ROTV (values in channel groups or a rotation other than a power-of-two WHT) the kernel writes
//      out = (acc_f + l_c·ν) / l and outc = acc_c / l (rotated basis), and the host adds outc's inverse
//      rotation (tq_mlx.attention.unrotate): one small op per step instead of a rotation matrix per head here.
// Inputs: q (B, H, RL, DK) float32 = scale·q, model basis; qmu (B, H, RL) float32 = q·μ; ks, vs (sinks) and
//   kw, vw (window): (B, H, n, D) float16 strided views; pm, pl (B, H, S, RL), pacc (B, H, S, RL, DV) from
//   pass 1; vmean (B, H, DV) float32 = ν; vsigns (DV) float32 (value rotation signs);
//   lsink (Hq) float32: learned sink logits per query head (has sinks); amask: the array mask, element
//   (b, query head, query token, column) at b·sb + head·sh + token·si + column (strides 0 where it broadcasts),
//   columns in the view's token order (sinks, N compressed, window);
//   params int32 [H, RL, L, S, n_sinks, n_window, has qmu, has ν, sink limit, window limit, has sinks, N, sb,
//   sh, si]: float token t of the sinks (window) is visible to query token i iff t <= sink (window) limit + i.
// Outputs: out (B, H, RL, DV) TO (T; float32 without ROTV), outc (B, H, RL, DV) float32 (without ROTV).
// Template: T, TO, DK, DV, ROTV, MASK (0 none or causal, 1 bool, 2 additive array mask), MT (its type).
// Lane l owns dims [l*E, l*E + E) of D, E = ceil(D/32).
constexpr int EK = (DK + 31) / 32;
constexpr int EV = (DV + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint nsg = simdgroups_per_threadgroup;
const uint bh = threadgroup_position_in_grid.y;
const uint chunk = threadgroup_position_in_grid.z;
const uint nchunks = threadgroups_per_grid.z;
const int H = params[0];
const int RL = params[1];
const int L = params[2];
const int S = params[3];
const int ns = params[4];
const int nw = params[5];
const bool has_qmu = params[6] != 0;
const bool has_mean = params[7] != 0;
const bool has_sinks = params[10] != 0;
const int N = params[11];
const uint b = bh / uint(H);
const uint h = bh % uint(H);
const float rs = 1.0f / sqrt(float(DV));

const auto ks_bh = ks + b * ks_strides[0] + h * ks_strides[1];
const auto vs_bh = vs + b * vs_strides[0] + h * vs_strides[1];
const auto kw_bh = kw + b * kw_strides[0] + h * kw_strides[1];
const auto vw_bh = vw + b * vw_strides[0] + h * vw_strides[1];

for (int r = int(chunk * nsg + sg); r < RL; r += int(nchunks * nsg)) {
  const size_t row = size_t(bh) * RL + r;
  const int qi = r % L;
  const int head = int(h) * (RL / L) + r / L;  // query head
  const size_t moff = size_t(b) * params[12] + size_t(head) * params[13] + size_t(qi) * params[14];
  float qv[EK];
  for (int e = 0; e < EK; ++e) {
    qv[e] = (DK % 32 == 0 || lane * EK + e < uint(DK)) ? q[row * DK + lane * EK + e] : 0.0f;
  }
  float m = has_sinks ? lsink[head] : -FLT_MAX;
  float l = has_sinks ? 1.0f : 0.0f;
  float acc[EV];
  for (int e = 0; e < EV; ++e) {
    acc[e] = 0.0f;
  }
  // 1. Float tokens: sinks, then the window.
  for (int f = 0; f < ns + nw; ++f) {
    const bool sink = f < ns;
    const int t = sink ? f : f - ns;
    const auto kp = sink ? ks_bh + t * ks_strides[2] + lane * EK * ks_strides[3]
                                 : kw_bh + t * kw_strides[2] + lane * EK * kw_strides[3];
    const auto vp = sink ? vs_bh + t * vs_strides[2] + lane * EV * vs_strides[3]
                                 : vw_bh + t * vw_strides[2] + lane * EV * vw_strides[3];
    const int64_t kstep = sink ? ks_strides[3] : kw_strides[3];
    const int64_t vstep = sink ? vs_strides[3] : vw_strides[3];
    float d = 0.0f;
    for (int e = 0; e < EK; ++e) {
      if (DK % 32 == 0 || lane * EK + e < uint(DK)) {
        d += qv[e] * float(kp[e * kstep]);
      }
    }
    d = simd_sum(d);
    const bool visible = t <= params[sink ? 8 : 9] + qi;
    const MT mv = MASK != 0 ? amask[moff + (sink ? t : ns + N + t)] : MT(0);  // columns: sinks, codes, window
    const float sc = tq_mask_score<MASK>(d, visible, mv);
    const float mn = max(m, sc);
    const float alpha = fast::exp(m - mn);
    const float p = fast::exp(sc - mn);
    l = l * alpha + p;
    m = mn;
    for (int e = 0; e < EV; ++e) {
      const float v = (DV % 32 == 0 || lane * EV + e < uint(DV)) ? float(vp[e * vstep]) : 0.0f;
      acc[e] = acc[e] * alpha + p * v;
    }
  }
  // 2. Merge pass 1's partials (compressed tokens, rotated basis).
  const float qm = has_qmu ? qmu[row] : 0.0f;
  float lc = 0.0f;
  float accc[EV];
  for (int e = 0; e < EV; ++e) {
    accc[e] = 0.0f;
  }
  for (int s = 0; s < S; ++s) {
    const size_t o = (size_t(bh) * S + s) * RL + r;
    const float ms = pm[o] + qm;
    const float ls = pl[o];
    const float mn = max(m, ms);
    const float a1 = fast::exp(m - mn);
    const float a2 = fast::exp(ms - mn);
    l = l * a1 + ls * a2;
    lc = lc * a1 + ls * a2;
    m = mn;
    for (int e = 0; e < EV; ++e) {
      acc[e] *= a1;
      const float pc = (DV % 32 == 0 || lane * EV + e < uint(DV)) ? pacc[o * DV + lane * EV + e] : 0.0f;
      accc[e] = accc[e] * a1 + pc * a2;
    }
  }
  // 3. Back to the model basis: one inverse rotation per row, then the value mean.
  if (ROTV) {
    tq_wht<ROTV ? EV : 1>(accc, lane);
  }
  for (int e = 0; e < EV; ++e) {
    const uint j = lane * EV + e;
    if (DV % 32 == 0 || j < uint(DV)) {
      const float mu = has_mean ? lc * vmean[bh * DV + j] : 0.0f;
      if (ROTV) {
        out[row * DV + j] = TO((acc[e] + accc[e] * rs * vsigns[j] + mu) / l);
      } else {
        out[row * DV + j] = TO((acc[e] + mu) / l);
        outc[row * DV + j] = accc[e] / l;
      }
    }
  }
}
