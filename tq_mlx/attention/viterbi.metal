// The trellis encoder (tq_mlx/quant/trellis.py viterbi): the B-bit symbols of each vector of D rotated unit
// coordinates whose windowed decoding (tq_trellis) is closest in squared error, every vector from state 0. One
// threadgroup per vector: the codebook (2^L floats) and the vector are staged in threadgroup memory, then per
// coordinate each thread takes states s = tid, tid + NT, ... of the 2^(L-B) the window's older bits can hold,
// keeps the least cost over the 2^B states it can come from (ties to the smaller oldest symbol, as the
// reference's argmin) and writes that choice to `back`; one thread then walks the choices back from the least
// final cost (ties to the smaller state).
// Inputs: y (N, D) float32 (a code group's rotated unit coordinates), book (2^L) float32 (at y's scale).
// Outputs: sym (N, D) uint32; back (N, D, S) uint8, the choices (scratch: the launcher bounds N by its size).
// Template: B (bits), L (window bits, trellis.WINDOW_BITS), D, NT (threads per threadgroup, <= S).
constexpr int T = 1 << B;        // a step's symbols
constexpr int S = 1 << (L - B);  // states: the window's older L - B bits
constexpr int U = S / T;         // the part of a state that stays in the next one
// States not reachable yet (the first L/B - 1 steps) start this far: finite, as Metal's fast math assumes no
// infinities; never on a best path, which starts at state 0 and stays below it.
constexpr float FAR = 1e30f;
const uint tid = thread_index_in_threadgroup;
const uint v = threadgroup_position_in_grid.x;

threadgroup float bk[1 << L];
threadgroup float cost[2 * S];  // this step's costs, then the next step's (alternating halves)
threadgroup float ys[D];
for (uint i = tid; i < uint(1 << L); i += NT) {
  bk[i] = book[i];
}
for (uint i = tid; i < uint(D); i += NT) {
  ys[i] = y[size_t(v) * D + i];
}
for (uint s = tid; s < uint(S); s += NT) {
  cost[s] = s == 0 ? 0.0f : FAR;
}
device uchar* bv = back + size_t(v) * D * S;
for (int i = 0; i < D; ++i) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup float* cur = cost + (i & 1) * S;
  threadgroup float* nxt = cost + ((i + 1) & 1) * S;
  const float yi = ys[i];
  for (uint s = tid; s < uint(S); s += NT) {
    // the window (oldest o, then s): it comes from state o·U + (s >> B) and decodes to bk[o·S + s]
    const float d0 = yi - bk[s];
    float best = cur[s >> B] + d0 * d0;
    uint choice = 0;
    for (int o = 1; o < T; ++o) {
      const float d = yi - bk[o * S + int(s)];
      const float c = cur[o * U + int(s >> B)] + d * d;
      if (c < best) {
        best = c;
        choice = uint(o);
      }
    }
    nxt[s] = best;
    bv[size_t(i) * S + s] = uchar(choice);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
if (tid == 0) {
  const threadgroup float* last = cost + (D & 1) * S;
  uint state = 0;
  for (uint s = 1; s < uint(S); ++s) {
    if (last[s] < last[state]) {
      state = s;
    }
  }
  for (int i = D - 1; i >= 0; --i) {
    sym[size_t(v) * D + i] = state & uint(T - 1);
    state = uint(bv[size_t(i) * S + state]) * uint(U) + (state >> B);
  }
}
