// The activation of the sparse FFN Metal bodies (sparse_ffn_act.metal, quantized_sparse_ffn_act.metal), part of
// their header: flashllm_ext.mlx prepends it, the SIMT build includes it before them.
//
// activation: 0 relu, 1 silu, 2 gelu, 3 gelu_tanh (flashllm_ext.ops.ACTIVATIONS codes).
inline float ffn_activate(float v, int activation) {
  if (activation == 0) {
    return v < 0.f ? 0.f : v;  // NaN stays NaN, as torch's relu
  }
  if (activation == 1) {
    return v / (1.f + exp(-v));
  }
  if (activation == 3) {
    return 0.5f * v * (1.f + precise::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  }
  // MSL has no erf: Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7).
  const float z = fabs(v) * 0.70710678118654752f;
  const float k = 1.f / (1.f + 0.3275911f * z);
  const float poly =
      k * (0.254829592f + k * (-0.284496736f + k * (1.421413741f + k * (-1.453152027f + k * 1.061405429f))));
  const float erf_z = 1.f - poly * exp(-z * z);
  return 0.5f * v * (1.f + (v < 0.f ? -erf_z : erf_z));
}
