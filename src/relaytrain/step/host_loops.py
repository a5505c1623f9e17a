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
scale, and each code found without a search: a table over the top 17 bits of the value's fp32
pattern gives the last map value at or below the bucket's lowest value, one comparison with
the next value finishes it (no bucket holds more than one map value above its lowest: checked
when the table is made), and torchao's rounding to the nearer of that value and the next
follows; 4-bit codes are packed two to a byte as torchao packs them. The state is torchao's
own (codes, a scale per block, the map), so a checkpoint is the same file either way. Every
fp32 operation is torchao's, in its order, without fused multiply-adds (`-ffp-contract=off`),
and the step's scalars (bias corrections, decay) are torch's own 0-dim results: the weights and
codes equal torchao's compiled update bit for bit (tests/test_host_loops.py).

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

static inline int32_t ordered(float x) {  // the fp32 pattern as an int32 in the values' order
  int32_t bits; std::memcpy(&bits, &x, 4);
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

static inline uint8_t nearest(float x, const float* qmap, const int16_t* floors, int32_t top) {
  int32_t below = floors[(ordered(x) >> 15) + (1 << 16)];
  if (below < top && x >= qmap[below + 1]) below += 1;  // the one map value a bucket may hold
  int32_t above = below < top ? below + 1 : top;
  float low = qmap[below], high = qmap[above];
  float residual = x - low;
  return (uint8_t)(residual >= (high - low) * 0.5f ? above : below);
}

// A code of 8 bits, or of 4 packed two to a byte (torchao's order: the even element's in the high half).
static inline int32_t code_at(const uint8_t* codes, int64_t i, bool four) {
  return four ? ((i & 1) ? (codes[i >> 1] & 15) : (codes[i >> 1] >> 4)) : codes[i];
}

static inline float torch_lerp(float start, float end, float weight) {  // torch's formula
  return std::fabs(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

void adamw_lowbit_step(torch::Tensor p, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scale,
                      torch::Tensor m_qmap, torch::Tensor m_floors, torch::Tensor v_codes, torch::Tensor v_scale,
                      torch::Tensor v_qmap, torch::Tensor v_floors, double decay, double lr, double bias1,
                      double root_bias2, double weight1, double weight2, double eps, bool four) {
  float* w = p.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  uint8_t* mc = m_codes.data_ptr<uint8_t>(); float* ms = m_scale.data_ptr<float>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>(); float* vs = v_scale.data_ptr<float>();
  const float* mq = m_qmap.data_ptr<float>(); const float* vq = v_qmap.data_ptr<float>();
  const int16_t* mf = m_floors.data_ptr<int16_t>(); const int16_t* vf = v_floors.data_ptr<int16_t>();
  const int64_t blocks = m_scale.numel(), block = p.numel() / blocks;
  const float d = (float)decay, rate = (float)lr, b1 = (float)bias1, rb2 = (float)root_bias2;
  const float w1 = (float)weight1, w2 = (float)weight2, e = (float)eps;
  const int32_t m_top = (int32_t)m_qmap.numel() - 1, v_top = (int32_t)v_qmap.numel() - 1;
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    std::vector<float> m(block), v(block);
    for (int64_t b = first; b < last; ++b) {
      const int64_t o = b * block;
      for (int64_t i = 0; i < block; ++i) {  // decode: lookups
        m[i] = mq[code_at(mc, o + i, four)] * ms[b];
        v[i] = vq[code_at(vc, o + i, four)] * vs[b];
      }
      float m_max = 0.0f, v_max = 0.0f;
      for (int64_t i = 0; i < block; ++i) {  // AdamW: arithmetic only, vectorized
        float wi = w[o + i];
        wi = wi - d * wi;
        const float gi = g[o + i];
        const float mi = torch_lerp(m[i], gi, w1);
        const float vi = torch_lerp(v[i], gi * gi, w2);
        const float denom = std::sqrt(vi) / rb2 + e;
        w[o + i] = wi - rate * (mi / b1) / denom;
        m[i] = mi; v[i] = vi;
        m_max = std::fabs(mi) > m_max ? std::fabs(mi) : m_max;
        v_max = std::fabs(vi) > v_max ? std::fabs(vi) : v_max;
      }
      m_max = m_max > 1e-12f ? m_max : 1e-12f; v_max = v_max > 1e-12f ? v_max : 1e-12f;
      for (int64_t i = 0; i < block; ++i) {  // torchao's normalization: a division, vectorized
        m[i] = m[i] / m_max;
        v[i] = v[i] / v_max;
      }
      if (four) {  // the codes: lookups, two to a byte
        for (int64_t i = 0; i < block; i += 2) {
          mc[(o + i) >> 1] = (uint8_t)((nearest(m[i], mq, mf, m_top) << 4) | nearest(m[i + 1], mq, mf, m_top));
          vc[(o + i) >> 1] = (uint8_t)((nearest(v[i], vq, vf, v_top) << 4) | nearest(v[i + 1], vq, vf, v_top));
        }
      } else {
        for (int64_t i = 0; i < block; ++i) {
          mc[o + i] = nearest(m[i], mq, mf, m_top);
          vc[o + i] = nearest(v[i], vq, vf, v_top);
        }
      }
      ms[b] = m_max; vs[b] = v_max;
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
_FLOORS: dict[bytes, torch.Tensor] = {}


def host_loops(wanted: bool = True):
    """The built loops (`optim.host_loops`), or None where not wanted or they cannot be built
    (said once; torch's and torchao's kernels run then)."""
    if not wanted:
        return None
    if not _OP:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load_inline

            if not (Path(_get_build_directory(_NAME, verbose=False)) / f"{_NAME}.so").exists():
                print("relaytrain: building its C++ host loops (optim.host_loops) with the C++ compiler: about 30 s, "
                      "once", file=sys.stderr, flush=True)
            _OP["op"] = load_inline(_NAME, _SOURCE + _ROUNDING_SOURCE,
                                    functions=["adamw_lowbit_step", "round_to_bf16"],
                                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a failed build: torch's kernels
            _OP["failure"] = err
            print(f"relaytrain: optim.host_loops: relaytrain's C++ loops did not build ({type(err).__name__}: "
                  f"{first_line(err)[:160]}); the host updates run torch's and torchao's kernels "
                  f"(optim.host_loops=false says so without trying)", file=sys.stderr, flush=True)
    return _OP.get("op")


QUANTIZED = {"OptimState8bit": 8, "OptimState4bit": 4}  # torchao's state classes, by their width


def fits(p: torch.Tensor, state: dict) -> bool:
    """Whether the op steps `p`: a contiguous fp32 host tensor whose two moments are torchao's
    8- or 4-bit states (tensors too small to quantize keep fp32 moments and torchao's update)."""
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and all(type(state[k]).__name__ in QUANTIZED for k in ("exp_avg", "exp_avg_sq")))


@torch.no_grad()
def adamw_lowbit_host(op, p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, exp_avg, exp_avg_sq,
                      lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
    """One AdamW update of `p` as torchao's `single_param_adam` makes it (AdamW, no AMSGrad),
    in the op; its scalars are computed here by torch's 0-dim operations, as torchao's are."""
    decay = lr * weight_decay
    bias1, root_bias2 = 1 - beta1 ** step, (1 - beta2 ** step).sqrt()
    m, v = exp_avg, exp_avg_sq
    op.adamw_lowbit_step(p, grad.float().contiguous(), m.codes, m.scale, m.qmap, floors(m.qmap), v.codes, v.scale,
                         v.qmap, floors(v.qmap), float(decay), float(lr), float(bias1), float(root_bias2),
                         1 - beta1, 1 - beta2, eps, QUANTIZED[type(m).__name__] == 4)


def floors(qmap: torch.Tensor) -> torch.Tensor:
    """For every bucket of fp32 values, the last code whose value is at most the bucket's lowest
    (made once per map); no bucket may hold more than one map value above its lowest."""
    key = qmap.numpy().tobytes()
    if key not in _FLOORS:
        buckets = 1 << (32 - _BUCKET_SHIFT)
        lowest = ((torch.arange(buckets, dtype=torch.int64) - (1 << (31 - _BUCKET_SHIFT))) << _BUCKET_SHIFT).int()
        values = (lowest ^ (lowest >> 31).bitwise_and_(0x7FFFFFFF)).view(torch.float32)  # the order is an involution
        found = (torch.searchsorted(qmap, values, right=True) - 1).clamp_(0, qmap.numel() - 1)
        finite = torch.isfinite(values)
        found[~finite] = 0
        if int((found[1:] - found[:-1])[finite[1:] & finite[:-1]].max()) > 1:
            raise ValueError("a map with two values inside one bucket of the host kernel's table")
        _FLOORS[key] = found.to(torch.int16)
    return _FLOORS[key]
