// Helpers shared by the tq-mlx kernels: passed to mx.fast.metal_kernel as `header=` (after MLX's preamble,
// which already includes <metal_stdlib> and `using namespace metal`). Metal is C++14: no `if constexpr`,
// so compile-time branches below are plain `if`s on template constants that the compiler folds.

// A stored norm (or QJL γ) as float: float16, or a log code of tq_mlx/quant/quantizer.py (NORM_DTYPES). int8, the
// fine code: -128 is zero, 127 not a number, c in -127..126 is 2^(c / 32 + 1/2). uint8, the coarse code: 0 is
// zero, 255 not a number, c in 1..254 is 2^((c - 128) / 16).
METAL_FUNC float tq_norm(half x) {
  return float(x);
}
METAL_FUNC float tq_norm(int8_t c) {
  return c == -128 ? 0.0f : (c == 127 ? NAN : exp2(float(c) / 32.0f + 0.5f));
}
METAL_FUNC float tq_norm(uint8_t c) {
  return c == 0 ? 0.0f : (c == 255 ? NAN : exp2((float(c) - 128.0f) / 16.0f));
}

// A norm in the stored type N (half, int8_t or uint8_t), as tq_mlx.quant.quantizer.saturate stores it (the log
// codes: round to the nearest 1/32 or 1/16 octave, saturating; below half the smallest code, zero).
template <typename N>
METAL_FUNC N tq_store_norm(float n);
template <>
METAL_FUNC half tq_store_norm<half>(float n) {
  return half(n);
}
template <>
METAL_FUNC int8_t tq_store_norm<int8_t>(float n) {
  if (isnan(n)) {
    return int8_t(127);
  }
  if (n < exp2(-127.0f / 32.0f + 0.5f - 1.0f)) {
    return int8_t(-128);
  }
  return int8_t(clamp(rint(32.0f * (log2(n) - 0.5f)), -127.0f, 126.0f));
}
template <>
METAL_FUNC uint8_t tq_store_norm<uint8_t>(float n) {
  if (isnan(n)) {
    return uint8_t(255);
  }
  if (n < exp2(-127.0f / 16.0f - 1.0f)) {
    return uint8_t(0);
  }
  return uint8_t(clamp(rint(16.0f * log2(n)) + 128.0f, 1.0f, 254.0f));
}

// Unnormalized Walsh-Hadamard transform (Sylvester order, H[i][j] = (-1)^popcount(i & j), the order of
// mx.hadamard_transform) of one vector of 32*E floats spread over a SIMD group: lane l holds elements
// [l*E, l*E + E) in v. log2(E) stages run inside the lane, the last 5 across lanes with simd_shuffle_xor.
// Every lane of the SIMD group must call it (uniform control flow).
template <int E>
METAL_FUNC void tq_wht(thread float* v, uint lane) {
  for (int h = 1; h < E; h <<= 1) {
    for (int i = 0; i < E; ++i) {
      if ((i & h) == 0) {
        float a = v[i];
        float b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
  for (ushort m = 1; m < 32; m <<= 1) {
    for (int i = 0; i < E; ++i) {
      float o = simd_shuffle_xor(v[i], m);
      // Element index bit m*E is lane bit m: the upper element of each pair takes (a - b).
      v[i] = (lane & m) ? (o - v[i]) : (v[i] + o);
    }
  }
}

// Bit planes of tq_mlx/packing.py: a code of B bits is stored as a low plane of tq_lo_bits(B) bits per code and,
// for 3, 5 and 6 bits, a high plane of the other tq_hi_bits(B) bits after it (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2);
// 1, 2, 4 and 8 bits are one plane. A plane of P bits holds 32/P codes per word, code j at bits
// [P*(j % (32/P)), ...), so no code straddles two words. Compile-time constants: every width is its own variant.
inline constexpr int tq_lo_bits(int b) {
  return b == 3 ? 2 : (b == 5 || b == 6 ? 4 : b);
}
inline constexpr int tq_hi_bits(int b) {
  return b - tq_lo_bits(b);
}

// Trellis codes (tq_mlx/quant/trellis.py): a group of 2..6 bits whose side has T != 0 decodes coordinate j
// through a codebook of 2^L entries, indexed by the window of its last L/B symbols (the newest in the low bits,
// those before the group's first coordinate 0); L is trellis.WINDOW_BITS (12; 10 at 5 bits). Other widths keep
// their 2^B Lloyd-Max centroids. A side's entries (centroids or codebooks) lie group after group.
inline constexpr bool tq_trellis(int T, int b) {
  return T != 0 && b >= 2 && b <= 6;
}
inline constexpr int tq_window(int b) {
  return b == 5 ? 10 : 12;
}
inline constexpr int tq_entries(int T, int b) {
  return tq_trellis(T, b) ? 1 << tq_window(b) : 1 << b;
}

// Code j of a vector of D codes packed in bit planes as above (the high plane starts after the low plane's
// ceil(D / (32 / tq_lo_bits(B))) words). `words` may point to device or threadgroup memory.
template <int B, int D, typename P>
METAL_FUNC uint tq_code(P words, uint j) {
  constexpr int LB = tq_lo_bits(B);
  constexpr int HB = tq_hi_bits(B) > 0 ? tq_hi_bits(B) : 1;  // (no high plane: unused)
  constexpr uint PL = 32 / LB;  // codes per low-plane word
  constexpr uint PH = 32 / HB;  // codes per high-plane word
  const uint lo = (words[j / PL] >> (LB * (j % PL))) & ((1u << LB) - 1u);
  if (tq_hi_bits(B) == 0) {
    return lo;
  }
  const uint hi = (words[(D + PL - 1) / PL + j / PH] >> (HB * (j % PH))) & ((1u << HB) - 1u);
  return lo | (hi << LB);
}

// The entry of code j (< DG) of a group at B bits (tq_code): the code itself, or with trellis codes (TR) the
// window of codes j, j-1, ... (tq_trellis), read one code at a time.
template <int B, int DG, int TR, typename P>
METAL_FUNC uint tq_entry(P words, uint j) {
  uint idx = tq_code<B, DG>(words, j);
  if (tq_trellis(TR, B)) {
    for (int t = 1; t < tq_window(B) / B; ++t) {
      if (j >= uint(t)) {
        idx |= tq_code<B, DG>(words, j - uint(t)) << (B * t);
      }
    }
  }
  return idx;
}

// Σ_j q_r[j]·cent[entry_j] over the DG codes (B bits) of one code group packed at `w`, added into s[k] for
// this SIMD group's RPS query rows r = sg + k·NSG of `q` (rows of DQ floats, already offset to the group's
// first dim). Word-major: CK codes share one low-plane word, and with a high plane (3, 5, 6 bits) CK·HB bits of
// one high-plane word (3 bits: 16 codes, 16 bits; 5: 8 codes, 8 bits; 6: 8 codes, 16 bits). Trellis codes (TR)
// roll their window along the codes in order; their codebook (`cent`, any address space) is read where it lies.
template <int B, int DG, int RPS, int NSG, int DQ, int TR, typename C>
METAL_FUNC void tq_group_scores(const threadgroup uint* w, C cent, const threadgroup float* q, uint sg,
                                thread float* s) {
  constexpr bool TRL = tq_trellis(TR, B);
  constexpr uint WM = (1u << tq_window(B)) - 1u;  // a trellis window's bits
  uint win = 0;
  constexpr int LB = tq_lo_bits(B);
  constexpr bool HIGH = tq_hi_bits(B) > 0;
  constexpr int HB = HIGH ? tq_hi_bits(B) : 1;
  constexpr int CK = 32 / LB;  // codes per low-plane word
  constexpr int PH = 32 / HB;  // codes per high-plane word (a multiple of CK)
  constexpr int LO = (DG + CK - 1) / CK;  // words of the low plane
  for (int j0 = 0; j0 < DG; j0 += CK) {
    const uint lo = w[j0 / CK];
    const uint hi = HIGH ? w[LO + j0 / PH] >> (HB * (j0 % PH)) : 0u;
    for (int i = 0; i < CK; ++i) {
      if (DG % CK == 0 || j0 + i < DG) {
        const uint low = (lo >> (LB * i)) & ((1u << LB) - 1u);
        const uint code = HIGH ? (low | (((hi >> (HB * i)) & ((1u << HB) - 1u)) << LB)) : low;
        win = TRL ? (((win << B) | code) & WM) : code;
        const float c = cent[win];
        for (int k = 0; k < RPS; ++k) {
          s[k] += q[(int(sg) + k * NSG) * DQ + j0 + i] * c;
        }
      }
    }
  }
}

// A token's key scores s[k] = Σ_g |k|_g · Σ_j q_r[j]·c_g[idx_j] for this SIMD group's RPS query rows (rows of D
// floats in `q`, the keys' rotated basis), over its code groups: one, or two for fractional bits (dims [0, D0)
// at B0 bits in words [0, W0) with norms[0], dims [D0, D) at B1 bits after them with norms[1]). cent holds group
// 0's entries (tq_entries: 2^B0 centroids, or a trellis codebook with TR), then group 1's.
template <int B0, int D0, int B1, int W0, int G, int D, int RPS, int NSG, int TR, typename C>
METAL_FUNC void tq_key_scores(const threadgroup uint* w, C cent, const threadgroup float* q,
                              const threadgroup float* norms, uint sg, thread float* s) {
  for (int k = 0; k < RPS; ++k) {
    s[k] = 0.0f;
  }
  tq_group_scores<B0, D0, RPS, NSG, D, TR>(w, cent, q, sg, s);
  for (int k = 0; k < RPS; ++k) {
    s[k] *= norms[0];
  }
  if (G == 2) {
    float s1[RPS];
    for (int k = 0; k < RPS; ++k) {
      s1[k] = 0.0f;
    }
    tq_group_scores<B1, D - D0, RPS, NSG, D, TR>(w + W0, cent + tq_entries(TR, B0), q + D0, sg, s1);
    for (int k = 0; k < RPS; ++k) {
      s[k] += s1[k] * norms[1];
    }
  }
}

// Keys centered before RoPE (tq_mlx/rope.py): a token at position p = 8h + l adds q·R(p) μ0 to its scores, less
// its constant part (the host's q·μ term): Σ_k A_k cos(θ_hk + φ_lk) + B_k sin(θ_hk + φ_lk) over the NP channel
// pairs, θ_h = (8h)·f and φ_l = l·f in float32 and added by angle addition, as the reference does. The 8 φ_l
// are staged once per threadgroup (tq_rope_stage_l), the θ_h of a tile's positions once per tile (at most 5
// blocks for 32 positions: tq_rope_stage_h), so no token takes a sine. Tables hold (cos, sin) per (block, pair).
// A variant without RoPE pairs (NP = 0) instantiates the stages too, behind its `if (NP > 0)`, where their loops
// never run: they divide by np (NP, or 1 for NP = 0), so that dead code divides by no zero.
constexpr int TQ_ROPE_SPLIT = 8;
constexpr int TQ_ROPE_BLOCKS = 5;  // blocks of 8 positions a tile of 32 positions touches, at most

template <int NP>
METAL_FUNC void tq_rope_stage_l(threadgroup float* lcs, const threadgroup float* freqs, uint tid, uint nt) {
  constexpr int np = NP > 0 ? NP : 1;
  for (uint i = tid; i < uint(TQ_ROPE_SPLIT * NP); i += nt) {
    const float a = float(i / np) * freqs[i % np];
    lcs[2 * i] = precise::cos(a);
    lcs[2 * i + 1] = precise::sin(a);
  }
}

// θ_h for the blocks from p0 / 8 on (p0 >= 0: the tile's first position).
template <int NP>
METAL_FUNC void tq_rope_stage_h(threadgroup float* hcs, const threadgroup float* freqs, int p0, uint tid, uint nt) {
  constexpr int np = NP > 0 ? NP : 1;
  const int h0 = p0 / TQ_ROPE_SPLIT;
  for (uint i = tid; i < uint(TQ_ROPE_BLOCKS * NP); i += nt) {
    const float a = float((h0 + int(i / np)) * TQ_ROPE_SPLIT) * freqs[i % np];
    hcs[2 * i] = precise::cos(a);
    hcs[2 * i + 1] = precise::sin(a);
  }
}

// terms holds each row's [A_1..A_NP, B_1..B_NP] (rows of 2·NP floats); pos is the token's position, p0 the
// tile's first (whose blocks hcs holds).
template <int NP, int RPS, int NSG>
METAL_FUNC void tq_rope_scores(const threadgroup float* terms, const threadgroup float* hcs,
                               const threadgroup float* lcs, int pos, int p0, uint sg, thread float* s) {
  const threadgroup float* hb = hcs + 2 * NP * (pos / TQ_ROPE_SPLIT - p0 / TQ_ROPE_SPLIT);
  const threadgroup float* lb = lcs + 2 * NP * (pos % TQ_ROPE_SPLIT);
  for (int j = 0; j < NP; ++j) {
    const float ch = hb[2 * j], sh = hb[2 * j + 1], cl = lb[2 * j], sl = lb[2 * j + 1];
    const float c = ch * cl - sh * sl;
    const float sn = sh * cl + ch * sl;
    for (int k = 0; k < RPS; ++k) {
      const threadgroup float* t = terms + (int(sg) + k * NSG) * 2 * NP;
      s[k] += t[j] * c + t[NP + j] * sn;
    }
  }
}

// Dim j (< D) of a token's codes in the rotated basis, norm applied: the codes are one group (D0 = D) or two
// (dims [0, D0) at B0 bits in words [0, W0) with norm n0, dims [D0, D) at B1 bits after them with norm n1;
// fractional bits). cent holds group 0's 2^B0 centroids, then group 1's (Lloyd-Max codes: trellis codes roll their
// window in tq_value_dims).
template <int B0, int D0, int B1, int D, int W0, typename P, typename C>
METAL_FUNC float tq_value(P w, uint j, C cent, float n0, float n1) {
  if (D0 == D || j < uint(D0)) {
    return cent[tq_code<B0, D0>(w, j)] * n0;
  }
  return cent[(1 << B0) + tq_code<B1, (D > D0 ? D - D0 : 1)>(w + W0, j - uint(D0))] * n1;
}

// A lane's dims [lane*EV, lane*EV + EV) of a token's values in the rotated basis, norms applied (tq_value;
// norms[0], and norms[1] for a second group); 0 past D. Trellis codes: the lane's first dim of each group gathers
// its window (tq_entry), the next dims roll it on by one code each, as the score loop does.
template <int B0, int D0, int B1, int D, int W0, int G, int EV, int TR, typename C>
METAL_FUNC void tq_value_dims(const threadgroup uint* w, C cent, const threadgroup float* norms, uint lane,
                              thread float* c) {
  if (!tq_trellis(TR, B0)) {
    for (int e = 0; e < EV; ++e) {
      const uint j = lane * EV + e;
      c[e] = (D % 32 == 0 || j < uint(D)) ? tq_value<B0, D0, B1, D, W0>(w, j, cent, norms[0], norms[G - 1])
                                           : 0.0f;
    }
    return;
  }
  constexpr int D1 = D > D0 ? D - D0 : 1;
  uint win = 0;
  for (int e = 0; e < EV; ++e) {
    const uint j = lane * EV + e;
    if (D % 32 != 0 && j >= uint(D)) {
      c[e] = 0.0f;
    } else if (D0 == D || j < uint(D0)) {
      win = e == 0 ? tq_entry<B0, D0, TR>(w, j)
                   : ((win << B0) | tq_code<B0, D0>(w, j)) & ((1u << tq_window(B0)) - 1u);
      c[e] = cent[win] * norms[0];
    } else {
      const uint k = j - uint(D0);
      win = e == 0 || k == 0 ? tq_entry<B1, D1, TR>(w + W0, k)
                             : ((win << B1) | tq_code<B1, D1>(w + W0, k)) & ((1u << tq_window(B1)) - 1u);
      c[e] = cent[tq_entries(TR, B0) + win] * norms[G - 1];
    }
  }
}

// Word w of DG codes of B bits (one code per element of `c`), packed as tq_code reads them: the low plane's
// words, then the high plane's (3, 5, 6 bits).
template <int B, int DG, typename P>
METAL_FUNC uint tq_pack_word(P c, uint w) {
  constexpr uint LB = tq_lo_bits(B);
  constexpr uint HB = tq_hi_bits(B) > 0 ? tq_hi_bits(B) : 1;
  constexpr uint LO = (DG + 32 / LB - 1) / (32 / LB);  // words of the low plane
  const bool high = tq_hi_bits(B) > 0 && w >= LO;
  const uint width = high ? HB : LB;
  const uint per = 32 / width;
  const uint first = (high ? w - LO : w) * per;
  const uint shift = high ? LB : 0u;
  uint bits = 0;
  for (uint i = 0; i < per && first + i < uint(DG); ++i) {
    bits |= ((uint(c[first + i]) >> shift) & ((1u << width) - 1u)) << (width * i);
  }
  return bits;
}

// Packs one bit plane: bits [shift, shift + B) of the E codes a lane holds (elements [lane*E, lane*E + E))
// into the B-bit words of `out`. When a word spans several lanes they OR their fields together with
// shuffles and one lane stores it, so every word is written exactly once. Uniform control flow required.
template <int B, int E>
METAL_FUNC void tq_pack_plane(thread const uint* code, uint shift, uint lane, device uint* out) {
  const int P = 32 / B;  // codes per word
  const uint mask = (1u << B) - 1u;
  if (E <= P) {
    const int LPW = E <= P ? P / E : 1;  // lanes per word
    uint bits = 0;
    for (int e = 0; e < E; ++e) {
      bits |= ((code[e] >> shift) & mask) << (B * ((lane * E + e) % P));
    }
    for (ushort m = 1; m < LPW; m <<= 1) {
      bits |= simd_shuffle_xor(bits, m);
    }
    if (lane % LPW == 0) {
      out[lane / LPW] = bits;
    }
  } else {
    const int WPL = E > P ? E / P : 1;  // words per lane
    for (int w = 0; w < WPL; ++w) {
      uint bits = 0;
      for (int i = 0; i < P; ++i) {
        bits |= ((code[w * P + i] >> shift) & mask) << (B * i);
      }
      out[lane * WPL + w] = bits;
    }
  }
}

// The Lloyd-Max index of a rotated unit coordinate t: the number of the 2^B - 1 sorted boundaries below it, by
// binary search (NaN compares false everywhere and gives 0, like the reference).
template <int B>
METAL_FUNC uint tq_index(float t, const threadgroup float* bnd) {
  uint idx = 0;
  for (int s = B - 1; s >= 0; --s) {
    const uint c = idx + (1u << s);
    if (t > bnd[c - 1]) {
      idx = c;
    }
  }
  return idx;
}

// Encodes one code group of a token (encode_dense.metal): its DG values at xg (centered, quantizer order) get
// their norm, the dense rotation P (DG x DG, row-major: y = P·x/|x|) and Lloyd-Max indices (binary search over
// the 2^B - 1 boundaries `bnd`), written to cg as one byte per dim. Returns the norm, or with CN the corrected
// norm |x| / |c[idx]| (centroids `cent`). Lane l takes rows l, l + 32, ...; every lane of the SIMD group must
// call it.
template <int B, int DG, bool CN>
METAL_FUNC float tq_encode_group(const threadgroup float* xg, threadgroup uchar* cg, const device float* P,
                                 const threadgroup float* bnd, const threadgroup float* cent, uint lane) {
  float ss = 0.0f;
  for (uint j = lane; j < uint(DG); j += 32) {
    ss += xg[j] * xg[j];
  }
  const float nrm = sqrt(simd_sum(ss));
  const float inv = nrm > 0.0f ? 1.0f / nrm : 1.0f;  // a zero vector keeps codes 0 and norm 0
  float cc = 0.0f;
  for (uint i = lane; i < uint(DG); i += 32) {
    float y = 0.0f;
    const device float* row = P + i * DG;
    for (int j = 0; j < DG; ++j) {
      y += row[j] * xg[j];
    }
    const uint idx = tq_index<B>(y * inv, bnd);
    cg[i] = uchar(idx);
    if (CN) {
      cc += cent[idx] * cent[idx];
    }
  }
  if (CN) {
    cc = simd_sum(cc);
    return cc > 0.0f ? nrm / sqrt(cc) : nrm;
  }
  return nrm;
}

// A score under an array mask (tq_mlx.attention: MASK 0 none or causal, 1 bool, 2 additive) at one (query row,
// token): m is the mask's element there (any value when MASK is 0). A hidden token scores -FLT_MAX, as in the
// reference (tq_mlx.attention); an additive mask adds to the score.
template <int MASK, typename M>
METAL_FUNC float tq_mask_score(float s, bool visible, M m) {
  if (MASK == 1) {
    visible = visible && bool(m);
  }
  if (MASK == 2) {
    s += float(m);
  }
  return visible ? s : -FLT_MAX;
}
