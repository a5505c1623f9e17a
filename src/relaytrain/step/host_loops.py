"""relaytrain's C++ loops for the host (`optim.host_loops`): torchao's AdamW8bit and AdamW4bit
updates, and the stochastic rounding of bf16 masters.

**Low-bit AdamW.** torchao compiles its update (`single_param_adam`) once per tensor shape. On
a GPU that is a fused, bandwidth-bound kernel; on a CPU the compiled loop is scalar and each
value's code is a branchless binary search of the map (eight dependent lookups in 8 bits, four
in 4), 38 and 100 times torch's fused fp32 AdamW's time on the 2-core VM
(`lowbit.HOST_TIME_VS_FP32`). torch's eager kernels do no better (2026-11-30: `searchsorted`
alone took 110 ms for 4 M values, the whole 8-bit update in chunks 147 ms against torchao's 95).
This loop makes the same update block by block (256 values in 8 bits, 128 in 4; the blocks
shared out over torch's threads): decode both moments, AdamW's rule in fp32, each block's new
scale, and each code found without a search. torchao's code is monotone in the value, so a
table over the top 17 bits of the value's fp32 pattern (in value order) holds, per bucket, the
code of its lowest value and the offset inside the bucket where the code turns to the next one
(`code_table`, made once per map from torchao's own rule; a bucket where the code would turn
twice is refused when the table is made): one lookup and one comparison a value. With AVX2
eight values go at once (gathers for the 8-bit map and the table, the 4-bit map held in two
registers); elsewhere the same steps run one value at a time. 4-bit codes are packed two to a
byte as torchao packs them. The state is torchao's own (codes, a scale per block, the map), so
a checkpoint is the same file either way. Every fp32 operation is torchao's, in its order,
without fused multiply-adds (`-ffp-contract=off`), and the step's scalars (bias corrections,
decay) are torch's own 0-dim results: the codes and scales equal torchao's compiled update bit
for bit, and the weights did too on an AVX-512 CPU; on this AVX2 VM torchao's compiled kernel
rounds about 4 % of the weights one ulp apart (tests/test_host_loops.py).

**Rounding.** `step.rounding`'s draws and rule in one pass: integer arithmetic, the same bits
as its chunked torch operations.

torch builds them with ninja and the C++ compiler on first use (about 30 s), cached under
~/.cache/torch_extensions; where that fails, torch's and torchao's kernels run, said once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from relaytrain.utils.errors import first_line

_BUCKET_SHIFT = 15  # a value's bucket: its fp32 pattern's top 17 bits, in value order (1/256 of the value wide)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int32_t ordered(float x) {  // the fp32 pattern as an int32 in the values' order
  int32_t bits; std::memcpy(&bits, &x, 4);
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// A value's code: its bucket's entry holds the code at the bucket's lowest value (the low byte)
// and the offset into the bucket from which the next code applies (1 << 15: none does).
static inline int32_t encode(float x, const int32_t* table) {
  const int32_t o = ordered(x);
  const int32_t entry = table[(o >> 15) + (1 << 16)];
  return (entry & 0xFF) + ((o & 0x7FFF) >= (entry >> 8) ? 1 : 0);
}

static inline float torch_lerp(float start, float end, float weight) {  // torch's formula
  return std::fabs(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

struct Rule { float decay, rate, bias1, root_bias2, weight1, weight2, eps; };

// AdamW on one value: torchao's operations in its order.
static inline float adamw(float w, float g, float& m, float& v, const Rule& r) {
  w = w - r.decay * w;
  m = torch_lerp(m, g, r.weight1);
  v = torch_lerp(v, g * g, r.weight2);
  const float denom = std::sqrt(v) / r.root_bias2 + r.eps;
  return w - r.rate * (m / r.bias1) / denom;
}

#if defined(__AVX2__)
static inline __m256 lerp8(__m256 start, __m256 end, float weight) {
  const __m256 diff = _mm256_sub_ps(end, start);
  return std::fabs(weight) < 0.5f ? _mm256_add_ps(start, _mm256_mul_ps(_mm256_set1_ps(weight), diff))
                                  : _mm256_sub_ps(end, _mm256_mul_ps(diff, _mm256_set1_ps(1.0f - weight)));
}

template <bool four> static inline __m256 decode8(const float* qmap, const int32_t* codes) {  // map values, eight at a time
  const __m256i index = _mm256_loadu_si256((const __m256i*)codes);
  if constexpr (!four) return _mm256_i32gather_ps(qmap, index, 4);
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(qmap), index);  // 16 values: two registers
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(qmap + 8), index);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));  // bit 3 picks
}

static inline __m256i encode8(__m256 x, const int32_t* table) {  // `encode`, eight at a time
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i o = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7FFFFFFF)));
  const __m256i entry = _mm256_i32gather_epi32(table, _mm256_add_epi32(_mm256_srai_epi32(o, 15), _mm256_set1_epi32(1 << 16)), 4);
  const __m256i before = _mm256_cmpgt_epi32(_mm256_srai_epi32(entry, 8), _mm256_and_si256(o, _mm256_set1_epi32(0x7FFF)));
  return _mm256_add_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)), _mm256_andnot_si256(before, _mm256_set1_epi32(1)));
}
#endif

// Codes of 8 bits, or of 4 packed two to a byte (torchao's order: the even element's in the high half).
static inline void unpack(const uint8_t* codes, int32_t* out, int64_t n, bool four) {
  if (four) for (int64_t i = 0; i < n; i += 2) { out[i] = codes[i >> 1] >> 4; out[i + 1] = codes[i >> 1] & 15; }
  else for (int64_t i = 0; i < n; ++i) out[i] = codes[i];
}

static inline void pack(const int32_t* in, uint8_t* codes, int64_t n, bool four) {
  if (four) for (int64_t i = 0; i < n; i += 2) codes[i >> 1] = (uint8_t)((in[i] << 4) | in[i + 1]);
  else for (int64_t i = 0; i < n; ++i) codes[i] = (uint8_t)in[i];
}

struct Moment { uint8_t* codes; float* scale; const float* qmap; const int32_t* table; };

// One block: decode both moments, AdamW, the block's new scales, the new codes.
template <bool four>
static void step_block(float* w, const float* g, const Moment& M, const Moment& V, int64_t b, int64_t n, const Rule& r,
                       int32_t* cm, int32_t* cv, float* m, float* v) {
  const int64_t o = b * n, byte = four ? o / 2 : o;
  unpack(M.codes + byte, cm, n, four); unpack(V.codes + byte, cv, n, four);
  const float m_scale = M.scale[b], v_scale = V.scale[b];
  float m_max = 0.0f, v_max = 0.0f;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m_top = _mm256_setzero_ps(), v_top = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 mi = _mm256_mul_ps(decode8<four>(M.qmap, cm + i), _mm256_set1_ps(m_scale));
    __m256 vi = _mm256_mul_ps(decode8<four>(V.qmap, cv + i), _mm256_set1_ps(v_scale));
    __m256 wi = _mm256_loadu_ps(w + o + i);
    const __m256 gi = _mm256_loadu_ps(g + o + i);
    wi = _mm256_sub_ps(wi, _mm256_mul_ps(_mm256_set1_ps(r.decay), wi));
    mi = lerp8(mi, gi, r.weight1);
    vi = lerp8(vi, _mm256_mul_ps(gi, gi), r.weight2);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(r.root_bias2)), _mm256_set1_ps(r.eps));
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(r.rate), _mm256_div_ps(mi, _mm256_set1_ps(r.bias1))), denom);
    _mm256_storeu_ps(w + o + i, _mm256_sub_ps(wi, step));
    _mm256_storeu_ps(m + i, mi); _mm256_storeu_ps(v + i, vi);
    m_top = _mm256_max_ps(_mm256_andnot_ps(sign, mi), m_top);  // a NaN leaves the maximum as it was, as below
    v_top = _mm256_max_ps(_mm256_andnot_ps(sign, vi), v_top);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, m_top); _mm256_store_ps(lanes + 8, v_top);
  for (int k = 0; k < 8; ++k) { m_max = lanes[k] > m_max ? lanes[k] : m_max; v_max = lanes[8 + k] > v_max ? lanes[8 + k] : v_max; }
#endif
  for (; i < n; ++i) {
    float mi = M.qmap[cm[i]] * m_scale, vi = V.qmap[cv[i]] * v_scale;
    w[o + i] = adamw(w[o + i], g[o + i], mi, vi, r);
    m[i] = mi; v[i] = vi;
    m_max = std::fabs(mi) > m_max ? std::fabs(mi) : m_max;
    v_max = std::fabs(vi) > v_max ? std::fabs(vi) : v_max;
  }
  m_max = m_max > 1e-12f ? m_max : 1e-12f; v_max = v_max > 1e-12f ? v_max : 1e-12f;
  i = 0;  // torchao's normalization (a division), then each value's code
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_si256((__m256i*)(cm + i), encode8(_mm256_div_ps(_mm256_loadu_ps(m + i), _mm256_set1_ps(m_max)), M.table));
    _mm256_storeu_si256((__m256i*)(cv + i), encode8(_mm256_div_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(v_max)), V.table));
  }
#endif
  for (; i < n; ++i) { cm[i] = encode(m[i] / m_max, M.table); cv[i] = encode(v[i] / v_max, V.table); }
  pack(cm, M.codes + byte, n, four); pack(cv, V.codes + byte, n, four);
  M.scale[b] = m_max; V.scale[b] = v_max;
}

void adamw_lowbit_step(torch::Tensor p, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scale,
                      torch::Tensor m_qmap, torch::Tensor m_table, torch::Tensor v_codes, torch::Tensor v_scale,
                      torch::Tensor v_qmap, torch::Tensor v_table, double decay, double lr, double bias1,
                      double root_bias2, double weight1, double weight2, double eps, bool four) {
  float* w = p.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  const Moment M{m_codes.data_ptr<uint8_t>(), m_scale.data_ptr<float>(), m_qmap.data_ptr<float>(), m_table.data_ptr<int32_t>()};
  const Moment V{v_codes.data_ptr<uint8_t>(), v_scale.data_ptr<float>(), v_qmap.data_ptr<float>(), v_table.data_ptr<int32_t>()};
  const Rule r{(float)decay, (float)lr, (float)bias1, (float)root_bias2, (float)weight1, (float)weight2, (float)eps};
  const int64_t blocks = m_scale.numel(), n = p.numel() / blocks;
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    std::vector<int32_t> cm(n), cv(n);
    std::vector<float> m(n), v(n);
    for (int64_t b = first; b < last; ++b) {
      if (four) step_block<true>(w, g, M, V, b, n, r, cm.data(), cv.data(), m.data(), v.data());
      else step_block<false>(w, g, M, V, b, n, r, cm.data(), cv.data(), m.data(), v.data());
    }
  });
}
"""

_ROUNDING_SOURCE = r"""
void round_to_bf16(torch::Tensor x, torch::Tensor out, int64_t key) {  // step/rounding.py's draws and rule
  const int32_t* bits = reinterpret_cast<const int32_t*>(x.data_ptr<float>());
  int16_t* rounded = reinterpret_cast<int16_t*>(out.data_ptr<at::BFloat16>());
  const uint32_t k = (uint32_t)key;
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      uint32_t h = (uint32_t)i * 0x9E3779B1u + k;
      h ^= h >> 16; h *= 0x7FEB352Du;
      h ^= h >> 15; h *= 0x846CA68Bu;
      h ^= h >> 16;
      const int32_t b = bits[i];
      rounded[i] = (int16_t)((b >> 16) + ((uint32_t)(b & 0xFFFF) > (h & 0xFFFFu) ? 1 : 0));
    }
  });
}
"""

_NAME = "relaytrain_host_loops"
_OP: dict = {}  # "op": the built module, or "failure": why it did not build
_TABLES: dict[bytes, torch.Tensor] = {}


def host_loops(wanted: bool = True):
    """The built loops (`optim.host_loops`), or None where not wanted or they cannot be built
    (said once; torch's and torchao's kernels run then)."""
    if not wanted:
        return None
    if not _OP:
        try:
            from torch.utils.cpp_extension import _get_build_directory

            if not (Path(_get_build_directory(_NAME, verbose=False)) / f"{_NAME}.so").exists():
                print("relaytrain: building its C++ host loops (optim.host_loops) with the C++ compiler: about 30 s, "
                      "once", file=sys.stderr, flush=True)
            _OP["op"] = build_loops()
        except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a failed build: torch's kernels
            _OP["failure"] = err
            print(f"relaytrain: optim.host_loops: relaytrain's C++ loops did not build ({type(err).__name__}: "
                  f"{first_line(err)[:160]}); the host updates run torch's and torchao's kernels "
                  f"(optim.host_loops=false says so without trying)", file=sys.stderr, flush=True)
    return _OP.get("op")


def build_loops(name: str = _NAME, extra_flags: tuple[str, ...] | list[str] = ()):
    """The loops as torch's cpp_extension builds them under `name` (cached under
    ~/.cache/torch_extensions), for this machine's CPU; `extra_flags` after relaytrain's (the tests
    build the path a CPU without AVX2 runs with -mno-avx2)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(name, _SOURCE + _ROUNDING_SOURCE, functions=["adamw_lowbit_step", "round_to_bf16"],
                       extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", *extra_flags],
                       extra_ldflags=["-fopenmp"], verbose=False)


QUANTIZED = {"OptimState8bit": 8, "OptimState4bit": 4}  # torchao's state classes, by their width


def fits(p: torch.Tensor, exp_avg, exp_avg_sq) -> bool:
    """Whether the op steps `p`: a contiguous fp32 host tensor whose two moments are torchao's
    8- or 4-bit states (tensors too small to quantize keep fp32 moments and torchao's update)."""
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and all(type(m).__name__ in QUANTIZED for m in (exp_avg, exp_avg_sq)))


@torch.no_grad()
def adamw_lowbit_host(op, p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, exp_avg, exp_avg_sq,
                      lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
    """One AdamW update of `p` as torchao's `single_param_adam` makes it (AdamW, no AMSGrad),
    in the op; its scalars are computed here by torch's 0-dim operations, as torchao's are."""
    decay = lr * weight_decay
    bias1, root_bias2 = 1 - beta1 ** step, (1 - beta2 ** step).sqrt()
    m, v = exp_avg, exp_avg_sq
    op.adamw_lowbit_step(p, grad.float().contiguous(), m.codes, m.scale, m.qmap, code_table(m.qmap), v.codes, v.scale,
                         v.qmap, code_table(v.qmap), float(decay), float(lr), float(bias1), float(root_bias2),
                         1 - beta1, 1 - beta2, eps, QUANTIZED[type(m).__name__] == 4)


def code_table(qmap: torch.Tensor) -> torch.Tensor:
    """For every bucket of fp32 values (the top 17 bits of the pattern, in value order): the code
    torchao gives the bucket's lowest value, and (from bit 8) the offset into the bucket from which
    it gives the next code, 1 << 15 where it gives one code throughout. Made once per map; a bucket
    where torchao's codes change twice is refused (no map relaytrain steps has one). NaN and the
    infinities get code 0 (torchao's code of NaN; normalized moments are at most 1 in size)."""
    key = qmap.numpy().tobytes()
    if key not in _TABLES:
        width = 1 << _BUCKET_SHIFT
        lowest = (torch.arange(1 << (32 - _BUCKET_SHIFT), dtype=torch.int64) - (1 << (31 - _BUCKET_SHIFT))) * width
        first, last = _torchao_codes(qmap, lowest), _torchao_codes(qmap, lowest + width - 1)
        finite = torch.isfinite(_values(lowest)) & torch.isfinite(_values(lowest + width - 1))
        if int((last - first)[finite].max()) > 1:
            raise ValueError("a map whose codes change twice inside one bucket of the host kernel's table")
        below, above = torch.zeros_like(lowest), torch.full_like(lowest, width - 1)  # bisect where the code turns
        for _ in range(_BUCKET_SHIFT):
            middle = (below + above) // 2
            turned = _torchao_codes(qmap, lowest + middle) > first
            above, below = torch.where(turned, middle, above), torch.where(turned, below, middle)
        offset = torch.where((last > first) & finite, above, torch.full_like(above, width))
        _TABLES[key] = torch.where(finite, first | (offset << 8), width << 8).to(torch.int32)
    return _TABLES[key]


def _values(ordered: torch.Tensor) -> torch.Tensor:
    """fp32 values from their patterns in value order (int64 holding int32s; the order is an involution)."""
    bits = ordered.to(torch.int32)
    return (bits ^ (bits >> 31).bitwise_and_(0x7FFFFFFF)).view(torch.float32)


def _torchao_codes(qmap: torch.Tensor, ordered: torch.Tensor) -> torch.Tensor:
    """torchao's codes of the values (`quantize_8bit_with_qmap`: the last map value at most the value,
    rounded up where the residual reaches half the step), for a sorted map."""
    x, top = _values(ordered), qmap.numel() - 1
    below = (torch.searchsorted(qmap, x, right=True) - 1).clamp_(0, top)
    above = (below + 1).clamp_(max=top)
    return torch.where(x - qmap[below] >= (qmap[above] - qmap[below]) * 0.5, above, below)
