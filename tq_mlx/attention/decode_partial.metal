// Fused decode attention, pass 1 of 2 (split-K): one threadgroup per (split of the compressed tokens,
// batch·kv head, chunk of query rows). All query rows of the kv head's GQA group (R heads × L tokens)
// are handled together, so every compressed byte of the split is read from device memory once.
// Per tile of 32 tokens:
//   1. stage the tile's key words, norms (and QJL words, γ) in threadgroup memory, each word read once;
//   2. scores, lane = token: s = |k|·Σ_j q'_j c[idx_j] (+ √(π/2)/D·γ·Σ_j (Sq)_j z_j); online softmax per row
//      (m, l), rescaling the accumulators; sparse V drops weights exp(s - m) below ε/n (n = the split's
//      tokens): each dropped one is < ε/n of the split's final max weight, so together < ε·l of the split
//      (l counts them still), and |out - exact| <= ε·max_i |v_i - ν| for every row (tq_mlx/attention/launch.py);
//   3. stage the value words of tokens some row kept (sparse V also skips their reads);
//   4. lane = value dims [l*EV, l*EV + EV): acc += p·|v|·c[idx], in the rotated basis.
// Codes are one group, or two for fractional bits (dims [0, D0) at one bit more, [D0, D) after them, each
// with its own centroids and norm); the rotated basis is the groups' bases side by side, so scores and the
// value accumulator never leave it here, whatever the rotations are.
// Writes (m, l, acc) per row and split; pass 2 merges them with the float16 tokens.
// Inputs: q (B, H, RL, DK) float32 = Π(scale·q) (keys' rotated basis); qs (B, H, RL, DK) float32 = S·scale·q
//   (QJL); kc (B, H, N, WK) uint32, kn (B, H, N, KG) float16 or uint8 (tq_norm), kj (B, H, N, ceil(DK/32)) uint32, kg (B, H, N)
//   float16, vc (B, H, N, WV) uint32, vn (B, H, N, VG) float16: strided views of the cache;
//   tables float32 [key entries (tq_entries: 2^KB centroids or a trellis codebook, then group 1's if KG = 2) |
//   value entries (same) | qjl scale | ε];
//   amask: the array mask (MASK 1 bool, 2 additive), read at (row, n_sinks + t) as decode_merge.metal does;
//   rterms (B, H, RL, 2·NP) float32, rfreqs (NP) float32: keys centered before RoPE (tq_rope_scores), NP > 0;
//   params int32 [H, N, RL, L, tokens per split, causal limit, n_sinks, sb, sh, si, position of token 0]:
//   compressed token t is visible to query token i iff t <= causal limit + i (and the mask shows it).
// Outputs: pm, pl (B, H, S, RL) float32; pacc (B, H, S, RL, DV) float32.
// Template: DK, DV, KB, VB (MSE bits; of group 0), QJL, KEQV (keys are values), MASK, MT (the mask's type),
// NR (rows per threadgroup, a power of two), NP (RoPE pairs of centered keys, 0: none), KG, KD0, KB1,
// WK0, KT and VG, VD0, VB1, WV0, VT (groups, group 0's dims, group 1's bits, group 0's words, trellis codes),
// and the layout from
// tq_mlx.attention._partial_layout: WK, WV (packed words per key / value token), WS, WJS (row strides of the
// staged words) and TG_* (the threadgroup arrays' sizes), so the host's memory budget is the kernel's.
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
const uint split = threadgroup_position_in_grid.x;
const uint nsplit = threadgroups_per_grid.x;
const uint bh = threadgroup_position_in_grid.y;
const int H = params[0];
const int N = params[1];
const int RL = params[2];
const int L = params[3];
const int climit = params[5];
const int ns = params[6];
const int pos0 = params[10];  // the position of compressed token 0 (RoPE terms)
const uint b = bh / uint(H);
const uint h = bh % uint(H);
const int r0 = int(threadgroup_position_in_grid.z) * NR;
const int nrows = min(NR, RL - r0);
const int t_begin = int(split) * params[4];
const int t_end = min(N, t_begin + params[4]);

threadgroup float q_tg[TG_Q];       // rotated query rows
threadgroup float qs_tg[TG_QS];     // S·q rows (QJL)
threadgroup uint words[TG_W];       // the tile's key words, then its value words
threadgroup uint jwords[TG_J];      // the tile's QJL words
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
  size_t src = (size_t(bh) * RL + r0 + r) * DK + i % DK;
  q_tg[i] = r < nrows ? q[src] : 0.0f;
  if (QJL) {
    qs_tg[i] = r < nrows ? qs[src] : 0.0f;
  }
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
// Divided by the split's length, so the dropped mass stays below ε of the softmax sum at any context length.
const float sparse = tables[NKC + NVC + 1] / float(max(1, t_end - t_begin));

// `auto`: MLX passes an input of fewer than 8 elements (a tiny cache) in the constant address space.
const auto kc_bh = kc + b * kc_strides[0] + h * kc_strides[1];
const auto kn_bh = kn + b * kn_strides[0] + h * kn_strides[1];
const auto kj_bh = kj + b * kj_strides[0] + h * kj_strides[1];
const auto kg_bh = kg + b * kg_strides[0] + h * kg_strides[1];
const auto vc_bh = vc + b * vc_strides[0] + h * vc_strides[1];
const auto vn_bh = vn + b * vn_strides[0] + h * vn_strides[1];

float m[RPS];
float l[RPS];
float acc[RPS][EV];
size_t moff[RPS];  // each row's mask row, at column n_sinks (the first compressed token)
for (int k = 0; k < RPS; ++k) {
  const int row = r0 + int(sg) + k * NSG;
  const int head = int(h) * (RL / L) + row / L;  // query head
  moff[k] = size_t(b) * params[7] + size_t(head) * params[8] + size_t(row % L) * params[9] + ns;
  m[k] = -FLT_MAX;
  l[k] = 0.0f;
  for (int e = 0; e < EV; ++e) {
    acc[k][e] = 0.0f;
  }
}

for (int t0 = t_begin; t0 < t_end; t0 += 32) {
  const int nt = min(32, t_end - t0);
  // 1. Stage keys.
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

  // 2. Scores and online softmax: lane = token of the tile, this SIMD group's rows.
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
    // Masked tokens score -FLT_MAX, as in the reference; tokens past the split's end do not exist.
    const bool visible = t <= climit + (r0 + r) % L;
    const MT mv = (MASK != 0 && valid && r < nrows) ? amask[moff[k] + t] : MT(0);
    const float sk = valid ? tq_mask_score<MASK>(s[k], visible, mv) : -FLT_MAX;
    const float mn = max(m[k], simd_max(sk));
    const float alpha = fast::exp(m[k] - mn);
    const float p = valid ? fast::exp(sk - mn) : 0.0f;
    l[k] = l[k] * alpha + simd_sum(p);
    m[k] = mn;
    for (int e = 0; e < EV; ++e) {
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

  // 3. Stage the values some row kept.
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

  // 4. Accumulate values in the rotated basis: lane = value dims. The tile's sum first, then one add to acc:
  // tiny weights added one by one to a large acc lose their low bits (a 4e-4 bias over 20k tokens).
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

for (int k = 0; k < RPS; ++k) {
  const int r = int(sg) + k * NSG;
  if (r < nrows) {
    const size_t o = (size_t(bh) * nsplit + split) * RL + r0 + r;
    if (lane == 0) {
      pm[o] = m[k];
      pl[o] = l[k];
    }
    for (int e = 0; e < EV; ++e) {
      if (DV % 32 == 0 || lane * EV + e < uint(DV)) {
        pacc[o * DV + lane * EV + e] = acc[k][e];
      }
    }
  }
}
