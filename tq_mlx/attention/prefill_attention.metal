// Fused prefill attention on the codes (flash-attention style): one threadgroup per (batch·kv head, tile of NR
// query rows), one pass over every token of the cache with one online softmax (m, l) per row (starting at
// (the row's learned sink logit, 1) with learned sinks: a token of value 0), so neither a
// float copy of the cache nor a rows x context score matrix nor any partial result ever reaches device memory.
// Query rows of a kv head are its GQA group's R heads x L tokens (row = head_in_group·L + token), so each
// compressed byte is read from device memory once per query tile.
//   1. float tokens (sinks, then the window; model basis), tiles of 32: lane = token for scores (its key row
//      read from device memory: float tokens are few), lane = value dims for acc_f += p·v;
//   2. compressed tokens, tiles of 32 (as decode_partial.metal): key words and norms (QJL words, γ) staged in
//      threadgroup memory, each word read once; s = |k|·Σ_j q'_j c[idx_j] (+ QJL term) + q·μ; the same online
//      softmax, rescaling acc_f and the compressed accumulator acc_c (rotated basis) together; sparse V as in
//      decode_partial (weights < ε/N of the running max are neither read nor added, still counted in l: the
//      output moves by at most ε·max_i |v_i - ν|); the kept tokens' value words staged, then lane = dims;
//   3. per row: one inverse WHT of acc_c, out = (acc_f + s_v·Πᵀacc_c + l_c·ν) / l  (l_c: compressed share of l).
//      Without ROTV (values in channel groups, or a rotation other than a power-of-two WHT) the kernel writes
//      out = (acc_f + l_c·ν) / l and outc = acc_c / l, and the host adds s_v·Πᵀ outc (attention.unrotate).
// Codes are one group or two (fractional bits), as in decode_partial.metal.
// Inputs: qf (B, H, RL, DK) float32 = scale·q (model basis); qr (B, H, RL, DK) float32 = Π(s_k·scale·q);
//   qs (B, H, RL, DK) float32 = S·s_k·scale·q (QJL); qmu (B, H, RL) float32 = scale·q·μ; ksink, vsink, kwin, vwin
//   (B, H, n, D) float strided views; kc, kn, kj, kg, vc, vn: the compressed views (as decode_partial);
//   tables float32 [key entries | value entries | qjl scale | sparse V ε] (as decode_partial); vsigns (DV) float32; vmean
//   (B·H, DV) float32 = ν; vscale (B·H) float32 = s_v;
//   lsink (Hq) float32 learned sink logits; amask the array mask, read at (row, column) as decode_merge.metal;
//   rterms (B, H, RL, 2·NP) float32, rfreqs (NP) float32: keys centered before RoPE (tq_rope_scores), NP > 0;
//   params int32 [H, N, RL, L, n_sinks, n_window, compressed limit, sink limit, window limit, has qmu, has ν,
//   has s_v, has sinks, sb, sh, si, position of compressed token 0]: token t of a part is visible to query
//   token i iff t <= that part's limit + i (and the mask shows it).
// Outputs: out (B, H, RL, DV) TO (T; float32 without ROTV), outc (B, H, RL, DV) float32 (without ROTV).
// Template: T, TO, DK, DV, KB, VB, QJL, KEQV (keys are values), MASK (0 none or causal, 1 bool, 2 additive),
// MT (its type), NR, NP (RoPE pairs of centered keys, 0: none), KG, KD0, KB1, WK0, KT, VG, VD0, VB1, WV0, VT, ROTV and
// tq_mlx.attention._prefill_layout's
// WK, WV, WS, WJS, TG_* (threadgroup array sizes, so the host's memory budget is the kernel's).
constexpr int EV = (DV + 31) / 32;
constexpr int WJ = (DK + 31) / 32;
constexpr int NKC = tq_entries(KT, KB) + (KG == 2 ? tq_entries(KT, KB1) : 0);  // key entries; values' follow
constexpr int NVC = tq_entries(VT, VB) + (VG == 2 ? tq_entries(VT, VB1) : 0);
// Trellis codebooks (KT, VT: every group of the side) are read from `tables` where they lie: two would fill
// threadgroup memory. Lloyd-Max centroids are staged: SKC key centroids, then SVC value centroids.
constexpr bool KTR = tq_trellis(KT, KB);
constexpr bool VTR = tq_trellis(VT, VB);
constexpr int SKC = KTR ? 0 : NKC;
constexpr int SVC = VTR ? 0 : NVC;
constexpr int NSG = NR < 8 ? NR : 8;
constexpr int NT = 32 * NSG;
constexpr int RPS = NR / NSG;  // rows per SIMD group: rows sg, sg + NSG, ...

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint bh = threadgroup_position_in_grid.y;
const int H = params[0];
const int N = params[1];
const int RL = params[2];
const int L = params[3];
const int ns = params[4];
const int nw = params[5];
const int climit = params[6];
const int slimit = params[7];
const int wlimit = params[8];
const bool has_qmu = params[9] != 0;
const bool has_mean = params[10] != 0;
const bool has_vscale = params[11] != 0;
const bool has_sinks = params[12] != 0;
const int pos0 = params[16];  // the position of compressed token 0 (RoPE terms)
const uint b = bh / uint(H);
const uint h = bh % uint(H);
const int r0 = int(threadgroup_position_in_grid.z) * NR;
const int nrows = min(NR, RL - r0);

threadgroup float q_tg[TG_Q];       // the tile's query rows: model basis (float tokens), then rotated (codes)
threadgroup float qs_tg[TG_QS];     // S·q rows (QJL)
threadgroup uint words[TG_W];       // a compressed tile's key words, then its value words
threadgroup uint jwords[TG_J];      // its QJL words
threadgroup float tok_norm[TG_NORM];
threadgroup float tok_gamma[TG_GAMMA];
threadgroup float p_tg[TG_P];       // softmax weights (0 = skipped), row-major (row, token)
threadgroup uint keep_tg[TG_KEEP];  // per SIMD group: tokens some of its rows kept
threadgroup float cent[TG_C];       // staged centroids: SKC keys', then SVC values'
threadgroup float rope_tg[TG_R];    // RoPE terms [A | B] per row (NP > 0)
threadgroup float rfreq_tg[TG_F];   // RoPE frequencies
threadgroup float rl_tg[TG_RL];     // cos, sin of φ_l per (l, pair)
threadgroup float rh_tg[TG_RH];     // cos, sin of θ_h per (block of the tile, pair)

for (int i = int(tid); i < NR * DK; i += NT) {
  int r = i / DK;
  q_tg[i] = r < nrows ? qf[(size_t(bh) * RL + r0 + r) * DK + i % DK] : 0.0f;
}
for (int i = int(tid); i < SKC + SVC; i += NT) {
  cent[i] = tables[i < SKC ? i : NKC + i - SKC];
}
for (int i = int(tid); NP > 0 && i < NR * 2 * NP; i += NT) {
  const int r = i / (2 * NP);
  rope_tg[i] = r < nrows ? rterms[(size_t(bh) * RL + r0 + r) * 2 * NP + i % (2 * NP)] : 0.0f;
}
for (int i = int(tid); i < NP; i += NT) {
  rfreq_tg[i] = rfreqs[i];
}
if (NP > 0) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tq_rope_stage_l<NP>(rl_tg, rfreq_tg, tid, NT);
}
const float qjl_scale = tables[NKC + NVC];
// Divided by the compressed tokens' count: the dropped mass stays below ε of l at any context length.
const float sparse = tables[NKC + NVC + 1] / float(max(1, N));

// `auto`: MLX passes an input of fewer than 8 elements in the constant address space.
const auto ks_bh = ksink + b * ksink_strides[0] + h * ksink_strides[1];
const auto vs_bh = vsink + b * vsink_strides[0] + h * vsink_strides[1];
const auto kw_bh = kwin + b * kwin_strides[0] + h * kwin_strides[1];
const auto vw_bh = vwin + b * vwin_strides[0] + h * vwin_strides[1];
const auto kc_bh = kc + b * kc_strides[0] + h * kc_strides[1];
const auto kn_bh = kn + b * kn_strides[0] + h * kn_strides[1];
const auto kj_bh = kj + b * kj_strides[0] + h * kj_strides[1];
const auto kg_bh = kg + b * kg_strides[0] + h * kg_strides[1];
const auto vc_bh = vc + b * vc_strides[0] + h * vc_strides[1];
const auto vn_bh = vn + b * vn_strides[0] + h * vn_strides[1];

float m[RPS];
float l[RPS];
float lc[RPS];
float qm[RPS];
int qi[RPS];  // query token of each row
size_t moff[RPS];  // each row's mask row
float accf[RPS][EV];
float acc[RPS][EV];
for (int k = 0; k < RPS; ++k) {
  const int r = int(sg) + k * NSG;
  const int head = int(h) * (RL / L) + (r0 + r) / L;  // query head
  m[k] = (has_sinks && r < nrows) ? lsink[head] : -FLT_MAX;
  l[k] = (has_sinks && r < nrows) ? 1.0f : 0.0f;
  lc[k] = 0.0f;
  qm[k] = (has_qmu && r < nrows) ? qmu[size_t(bh) * RL + r0 + r] : 0.0f;
  qi[k] = (r0 + r) % L;
  moff[k] = size_t(b) * params[13] + size_t(head) * params[14] + size_t(qi[k]) * params[15];
  for (int e = 0; e < EV; ++e) {
    accf[k][e] = 0.0f;
    acc[k][e] = 0.0f;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 1. Float tokens f in [0, ns + nw): sinks first, then the window.
for (int f0 = 0; f0 < ns + nw; f0 += 32) {
  const int nt = min(32, ns + nw - f0);
  const bool valid = int(lane) < nt;
  const int f = f0 + int(lane);
  const bool sink = f < ns;
  const int t = sink ? f : f - ns;
  float s[RPS];
  for (int k = 0; k < RPS; ++k) {
    s[k] = 0.0f;
  }
  if (valid) {
    const auto kp = sink ? ks_bh + t * ksink_strides[2] : kw_bh + t * kwin_strides[2];
    const int64_t kstep = sink ? ksink_strides[3] : kwin_strides[3];
    for (int j = 0; j < DK; ++j) {
      const float x = float(kp[j * kstep]);
      for (int k = 0; k < RPS; ++k) {
        s[k] += q_tg[(int(sg) + k * NSG) * DK + j] * x;
      }
    }
  }
  for (int k = 0; k < RPS; ++k) {
    const bool visible = t <= (sink ? slimit : wlimit) + qi[k];
    const bool read = MASK != 0 && valid && int(sg) + k * NSG < nrows;
    const MT mv = read ? amask[moff[k] + (sink ? t : ns + N + t)] : MT(0);  // columns: sinks, codes, window
    const float sk = valid ? tq_mask_score<MASK>(s[k], visible, mv) : -FLT_MAX;
    const float mn = max(m[k], simd_max(sk));
    const float alpha = fast::exp(m[k] - mn);
    const float p = valid ? fast::exp(sk - mn) : 0.0f;
    l[k] = l[k] * alpha + simd_sum(p);
    m[k] = mn;
    for (int e = 0; e < EV; ++e) {
      accf[k][e] *= alpha;
    }
    p_tg[(int(sg) + k * NSG) * 32 + int(lane)] = p;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // lane = value dims [lane*EV, lane*EV + EV)
  for (int tt = 0; tt < nt; ++tt) {
    const int ff = f0 + tt;
    const bool vsink_tok = ff < ns;
    const int vt = vsink_tok ? ff : ff - ns;
    const auto vp = vsink_tok ? vs_bh + vt * vsink_strides[2] : vw_bh + vt * vwin_strides[2];
    const int64_t vstep = vsink_tok ? vsink_strides[3] : vwin_strides[3];
    float v[EV];
    for (int e = 0; e < EV; ++e) {
      v[e] = (DV % 32 == 0 || int(lane) * EV + e < DV) ? float(vp[(int(lane) * EV + e) * vstep]) : 0.0f;
    }
    for (int k = 0; k < RPS; ++k) {
      const float w = p_tg[(int(sg) + k * NSG) * 32 + tt];
      for (int e = 0; e < EV; ++e) {
        accf[k][e] += w * v[e];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// 2. Compressed tokens: the rotated query rows replace the model-basis ones.
for (int i = int(tid); i < NR * DK; i += NT) {
  int r = i / DK;
  size_t src = (size_t(bh) * RL + r0 + r) * DK + i % DK;
  q_tg[i] = r < nrows ? qr[src] : 0.0f;
  if (QJL) {
    qs_tg[i] = r < nrows ? qs[src] : 0.0f;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// Compressed tokens past every row's causal limit are never read (a chunk longer than the window holds some
// of its own tokens compressed; its earlier query tiles skip them). Rows of one tile may span two heads.
const int last_qi = (r0 / L != (r0 + nrows - 1) / L) ? L - 1 : (r0 + nrows - 1) % L;
const int n_seen = min(N, climit + last_qi + 1);
for (int t0 = 0; t0 < n_seen; t0 += 32) {
  const int nt = min(32, n_seen - t0);
  // Stage keys.
  for (int i = int(tid); i < 32 * WK; i += NT) {
    int tok = i / WK;
    int w = i % WK;
    if (tok < nt) {
      words[tok * WS + w] = kc_bh[(t0 + tok) * kc_strides[2] + w * kc_strides[3]];
    }
  }
  if (QJL) {
    for (int i = int(tid); i < 32 * WJ; i += NT) {
      int tok = i / WJ;
      int w = i % WJ;
      if (tok < nt) {
        jwords[tok * WJS + w] = kj_bh[(t0 + tok) * kj_strides[2] + w * kj_strides[3]];
      }
    }
  }
  for (int i = int(tid); i < KG * nt; i += NT) {
    tok_norm[i] = tq_norm(kn_bh[(t0 + i / KG) * kn_strides[2] + (i % KG) * kn_strides[3]]);
  }
  if (QJL && int(tid) < nt) {
    tok_gamma[tid] = tq_norm(kg_bh[(t0 + int(tid)) * kg_strides[2]]);
  }
  if (NP > 0) {
    tq_rope_stage_h<NP>(rh_tg, rfreq_tg, pos0 + t0, tid, NT);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Scores and online softmax: lane = token of the tile, this SIMD group's rows.
  const bool valid = int(lane) < nt;
  const int t = t0 + int(lane);
  float s[RPS];
  if (KTR) {
    tq_key_scores<KB, KD0, KB1, WK0, KG, DK, RPS, NSG, KT>(words + lane * WS, tables, q_tg, tok_norm + lane * KG, sg, s);
  } else {
    tq_key_scores<KB, KD0, KB1, WK0, KG, DK, RPS, NSG, KT>(words + lane * WS, cent, q_tg, tok_norm + lane * KG, sg, s);
  }
  if (NP > 0) {
    tq_rope_scores<NP, RPS, NSG>(rope_tg, rh_tg, rl_tg, pos0 + t, pos0 + t0, sg, s);
  }
  if (QJL) {
    const float g = qjl_scale * tok_gamma[lane];
    const threadgroup uint* tj = jwords + lane * WJS;
    float sj[RPS];
    for (int k = 0; k < RPS; ++k) {
      sj[k] = 0.0f;
    }
    for (int w = 0; w < WJ; ++w) {
      const uint bits = tj[w];
      for (int i = 0; i < 32 && w * 32 + i < DK; ++i) {
        const bool plus = (bits >> i) & 1u;
        for (int k = 0; k < RPS; ++k) {
          const float x = qs_tg[(int(sg) + k * NSG) * DK + w * 32 + i];
          sj[k] += plus ? x : -x;
        }
      }
    }
    for (int k = 0; k < RPS; ++k) {
      s[k] += g * sj[k];
    }
  }
  uint kept = 0;
  for (int k = 0; k < RPS; ++k) {
    const int r = int(sg) + k * NSG;
    const bool visible = t <= climit + qi[k];
    const MT mv = (MASK != 0 && valid && r < nrows) ? amask[moff[k] + ns + t] : MT(0);
    const float sk = valid ? tq_mask_score<MASK>(s[k] + qm[k], visible, mv) : -FLT_MAX;
    const float mn = max(m[k], simd_max(sk));
    const float alpha = fast::exp(m[k] - mn);
    const float p = valid ? fast::exp(sk - mn) : 0.0f;
    const float ps = simd_sum(p);
    l[k] = l[k] * alpha + ps;
    lc[k] = lc[k] * alpha + ps;
    m[k] = mn;
    for (int e = 0; e < EV; ++e) {
      accf[k][e] *= alpha;
      acc[k][e] *= alpha;
    }
    const bool keep = r < nrows && p > sparse;
    p_tg[r * 32 + int(lane)] = keep ? p : 0.0f;
    kept |= uint(uint64_t(simd_ballot(keep)));
  }
  if (lane == 0) {
    keep_tg[sg] = kept;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Stage the values some row kept.
  uint keepmask = 0;
  for (int g = 0; g < NSG; ++g) {
    keepmask |= keep_tg[g];
  }
  // KEQV: the keys are the values (one view, MLA's latent): the key words and norms staged above serve.
  for (int i = int(tid); !KEQV && i < 32 * WV; i += NT) {
    int tok = i / WV;
    int w = i % WV;
    if (tok < nt && ((keepmask >> tok) & 1u)) {
      words[tok * WS + w] = vc_bh[(t0 + tok) * vc_strides[2] + w * vc_strides[3]];
    }
  }
  for (int i = int(tid); !KEQV && i < VG * nt; i += NT) {
    if ((keepmask >> (i / VG)) & 1u) {
      tok_norm[i] = tq_norm(vn_bh[(t0 + i / VG) * vn_strides[2] + (i % VG) * vn_strides[3]]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Values in the rotated basis, lane = value dims: the tile's sum first, then one add to acc (tiny weights
  // added one by one to a large acc lose their low bits).
  float tacc[RPS][EV];
  for (int k = 0; k < RPS; ++k) {
    for (int e = 0; e < EV; ++e) {
      tacc[k][e] = 0.0f;
    }
  }
  for (int tt = 0; tt < nt; ++tt) {
    if (((keepmask >> tt) & 1u) == 0) {
      continue;
    }
    float c[EV];
    if (VTR) {
      tq_value_dims<VB, VD0, VB1, DV, WV0, VG, EV, VT>(words + tt * WS, tables + NKC, tok_norm + tt * VG, lane, c);
    } else {
      tq_value_dims<VB, VD0, VB1, DV, WV0, VG, EV, VT>(words + tt * WS, cent + SKC, tok_norm + tt * VG, lane, c);
    }
    for (int k = 0; k < RPS; ++k) {
      const float w = p_tg[(int(sg) + k * NSG) * 32 + tt];
      if (w != 0.0f) {
        for (int e = 0; e < EV; ++e) {
          tacc[k][e] += w * c[e];
        }
      }
    }
  }
  for (int k = 0; k < RPS; ++k) {
    for (int e = 0; e < EV; ++e) {
      acc[k][e] += tacc[k][e];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// 3. Back to the model basis: one inverse rotation per row (uniform across the SIMD group), scale, mean.
const float rs = (has_vscale ? vscale[bh] : 1.0f) / sqrt(float(DV));
for (int k = 0; k < RPS; ++k) {
  const int r = int(sg) + k * NSG;
  float accc[EV];
  for (int e = 0; e < EV; ++e) {
    accc[e] = acc[k][e];
  }
  if (ROTV) {
    tq_wht<ROTV ? EV : 1>(accc, lane);
  }
  if (r < nrows) {
    const size_t o = (size_t(bh) * RL + r0 + r) * DV;
    for (int e = 0; e < EV; ++e) {
      const uint j = lane * EV + e;
      if (DV % 32 == 0 || j < uint(DV)) {
        const float mu = has_mean ? lc[k] * vmean[bh * DV + j] : 0.0f;
        if (ROTV) {
          out[o + j] = TO((accf[k][e] + accc[e] * rs * vsigns[j] + mu) / l[k]);
        } else {
          out[o + j] = TO((accf[k][e] + mu) / l[k]);
          outc[o + j] = accc[e] / l[k];
        }
      }
    }
  }
}
