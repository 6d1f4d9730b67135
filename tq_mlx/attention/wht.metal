// Randomized Walsh-Hadamard rotation of rows of D values, power-of-two D (tq_mlx/rotation.py):
//   forward  y = H (x * s) / sqrt(D)        inverse  x = H y / sqrt(D) * s
// One SIMD group per row, lane l holding elements [l*E, l*E + E). Output float32.
// Inputs: x (rows, D) T, signs (D) float32, inverse (bool scalar). Template: T, D. Grid: 32 threads per row.
constexpr int E = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.x / 32;
const uint base = row * D + lane * E;

float v[E];
for (int e = 0; e < E; ++e) {
  float s = inverse ? 1.0f : signs[lane * E + e];
  v[e] = float(x[base + e]) * s;
}
tq_wht<E>(v, lane);
const float scale = 1.0f / sqrt(float(D));
for (int e = 0; e < E; ++e) {
  float s = inverse ? signs[lane * E + e] : 1.0f;
  y[base + e] = v[e] * scale * s;
}
