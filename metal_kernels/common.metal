// Helpers shared by the tq-mlx kernels: passed to mx.fast.metal_kernel as `header=` (after MLX's preamble,
// which already includes <metal_stdlib> and `using namespace metal`). Metal is C++14: no `if constexpr`,
// so compile-time branches below are plain `if`s on template constants that the compiler folds.

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

// Code j of a vector packed as tq_mlx/packing.py does: widths 1, 2, 4, 8 hold 32/B codes per word, code j
// at bits [B*(j % (32/B)), ...); 3 bits are a 2-bit plane (D/16 words) followed by a 1-bit plane (high bit).
// `words` may point to device or threadgroup memory.
template <int B, int D, typename P>
METAL_FUNC uint tq_code(P words, uint j) {
  if (B == 3) {
    uint lo = (words[j / 16] >> (2 * (j % 16))) & 3u;
    uint hi = (words[D / 16 + j / 32] >> (j % 32)) & 1u;
    return lo | (hi << 2);
  }
  const uint per = 32 / B;
  return (words[j / per] >> (B * (j % per))) & ((1u << B) - 1u);
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
