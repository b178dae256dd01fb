// Blocked (flash-style) attention for the CPU, forward and backward, registered as the torch ops
// xeontune::attention_forward and xeontune::attention_backward (autograd: train/attention.py).
//
// softmax(q k^T * scale) v over q, k, v of shape (batch, heads, tokens, head) whose last dimension is
// contiguous (the layout a diffusers processor's view/transpose gives). The products run through torch's
// own brgemm micro-kernel (at::native::cpublas::brgemm: oneDNN's ukernel where this torch has it, else
// torch's gemm): a bf16 head's in bf16 with fp32 sums where that brgemm takes bf16 (an AVX-512 CPU; the
// "bf16 products" section below), else in fp32 with the bf16 inputs widened once per head. The softmax
// statistics are fp32 either way.
//
// Why not torch's SDPA: its backward runs in parallel over batch x heads only, so at batch 1 a node
// with more cores than heads leaves the rest idle. Here the backward of each head runs in parallel over
// key blocks (each task owns its rows of dK and dV, dQ is summed from per-thread copies), or over query
// blocks where the keys are few (cross-attention's 77: each task owns its rows of dQ, dK and dV summed).
// The forward runs in parallel over batch x heads x query blocks, as torch's does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
#ifndef XT_QB
#define XT_QB 64
#endif
#ifndef XT_KB
#define XT_KB 256
#endif
#ifndef XT_BKB
#define XT_BKB 64
#endif
#ifndef XT_BQB
#define XT_BQB 64
#endif
constexpr int64_t kQueryBlock = XT_QB;  // rows of a forward task
constexpr int64_t kKeyBlock = XT_KB;   // keys per forward step
constexpr int64_t kBackwardKeyBlock = XT_BKB;
constexpr int64_t kBackwardQueryBlock = XT_BQB;

// C (M x N, ld_c) = A (M x K, ld_a) B (K x N, ld_b) [+ C]: row-major fp32
inline void matmul(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
}

// A (batch, heads, tokens, head) tensor's rows as pointers: row r of head (b, h)
template <typename T>
struct Rows {
  const T* data;
  int64_t batch_stride, head_stride, row_stride;
  Rows(const at::Tensor& t)
      : data(t.const_data_ptr<T>()), batch_stride(t.stride(0)), head_stride(t.stride(1)), row_stride(t.stride(2)) {}
  const T* row(int64_t b, int64_t h, int64_t r) const {
    return data + b * batch_stride + h * head_stride + r * row_stride;
  }
};

// rows [first, last) of head (b, h), widened to fp32, row by row from ``dst`` on (ld ``head``)
template <typename T>
void widen_rows(const Rows<T>& src, int64_t b, int64_t h, int64_t first, int64_t last, int64_t head, float* dst) {
  for (int64_t r = first; r < last; ++r) {
    const T* in = src.row(b, h, r);
    for (int64_t d = 0; d < head; ++d) dst[(r - first) * head + d] = static_cast<float>(in[d]);
  }
}

// Transposed copies are kept in panels: the ``panel`` tokens from token j0 on are one (head x n) matrix at
// ``j0 * head``, ld n (n = panel, or what the last one holds). A product then reads its block with a stride
// of n floats, not of all the tokens (4096 floats: 16 KB apart, the same cache sets row after row).
inline int64_t panel_at(int64_t r, int64_t head, int64_t tokens, int64_t panel, int64_t d) {
  const int64_t j0 = r - r % panel, n = std::min(panel, tokens - j0);
  return j0 * head + d * n + (r - j0);
}

// rows [first, last) of head (b, h), widened to fp32 and transposed into ``dst``'s panels
template <typename T>
void widen_panels(const Rows<T>& src, int64_t b, int64_t h, int64_t first, int64_t last, int64_t head, float* dst,
                  int64_t tokens, int64_t panel) {
  for (int64_t r = first; r < last; ++r) {
    const T* in = src.row(b, h, r);
    for (int64_t d = 0; d < head; ++d) dst[panel_at(r, head, tokens, panel, d)] = static_cast<float>(in[d]);
  }
}

// a vector's lanes summed / their largest (by hand: at::vec::vec_reduce_all's signature differs by ISA)
inline float sum_lanes(const Vec& x) {
  float lanes[Vec::size()];
  x.store(lanes);
  float total = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) total += lanes[i];
  return total;
}

inline float max_lanes(const Vec& x) {
  float lanes[Vec::size()];
  x.store(lanes);
  float top = lanes[0];
  for (int64_t i = 1; i < Vec::size(); ++i) top = std::max(top, lanes[i]);
  return top;
}

// p[i] = exp(s[i] * scale - shift), returned: their sum
inline float exp_row(float* p, const float* s, int64_t n, float scale, float shift) {
  const Vec vscale(scale), vshift(shift);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec x = (Vec::loadu(s + i) * vscale - vshift).exp_u20();
    x.store(p + i);
    sum = sum + x;
  }
  float total = sum_lanes(sum);
  for (; i < n; ++i) {
    p[i] = std::exp(s[i] * scale - shift);
    total += p[i];
  }
  return total;
}

inline float max_row(const float* s, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) top = at::vec::maximum(top, Vec::loadu(s + i));
  float m = max_lanes(top);
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

template <typename T>
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             float scale) {
  const int64_t batch = q.size(0), heads = q.size(1), lq = q.size(2), head = q.size(3), lk = k.size(2);
  const Rows<T> qr(q), kr(k), vr(v);
  // per head: k transposed (head x lk) and v (lk x head), in fp32, made once and read by every query block
  std::vector<float> kt(batch * heads * head * lk), vf(batch * heads * lk * head);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      widen_panels(kr, bh / heads, bh % heads, 0, lk, head, kt.data() + bh * head * lk, lk, kKeyBlock);
      widen_rows(vr, bh / heads, bh % heads, 0, lk, head, vf.data() + bh * lk * head);
    }
  });
  const int64_t blocks = (lq + kQueryBlock - 1) / kQueryBlock;
  T* o = out.data_ptr<T>();  // (batch, lq, heads, head) in memory
  float* l_out = lse.data_ptr<float>();  // (batch, heads, lq)
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kQueryBlock * head), s(kQueryBlock * kKeyBlock), acc(kQueryBlock * head);
    std::vector<float> m(kQueryBlock), l(kQueryBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / heads, h = bh % heads;
      const int64_t first = (task % blocks) * kQueryBlock, rows = std::min(kQueryBlock, lq - first);
      widen_rows(qr, b, h, first, first + rows, head, qf.data());
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      const float* kt_h = kt.data() + bh * head * lk;
      const float* v_h = vf.data() + bh * lk * head;
      for (int64_t j = 0; j < lk; j += kKeyBlock) {
        const int64_t keys = std::min(kKeyBlock, lk - j);
        matmul(rows, keys, head, qf.data(), head, kt_h + j * head, keys, s.data(), keys, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * keys;
          const float top = std::max(m[r], max_row(sr, keys) * scale);
          const float kept = std::exp(m[r] - top);  // 0 at the first block (m = -inf)
          l[r] = l[r] * kept + exp_row(sr, sr, keys, scale, top);
          m[r] = top;
          if (j > 0) {
            float* ar = acc.data() + r * head;
            for (int64_t d = 0; d < head; ++d) ar[d] *= kept;
          }
        }
        matmul(rows, head, keys, s.data(), keys, v_h + j * head, head, acc.data(), head, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        T* dst = o + ((b * lq + first + r) * heads + h) * head;
        for (int64_t d = 0; d < head; ++d) dst[d] = static_cast<T>(acc[r * head + d] * inv);
        l_out[(b * heads + h) * lq + first + r] = m[r] + std::log(l[r]);
      }
    }
  });
}

// One (query block, key block) pair of the backward, from fp32 copies of one head:
//   S^T = K_j Q_i^T, P^T = exp(S^T * scale - lse_i), dV_j += P^T dO_i, dP^T = V_j dO_i^T,
//   dS^T = P^T (dP^T - delta_i), dK_j += dS^T Q_i, dQ_i^T += K_j^T dS^T (dK, dQ scaled once at the end; dQ
// is summed transposed, head x tokens, so that every product reads dS^T as it is made: no transpose a pair)
struct HeadCopies {
  int64_t lq, lk, head;
  const float *q, *q_t, *k, *k_t, *v, *dout, *dout_t, *lse, *delta;
};

struct PairBuffers {
  static constexpr bool kBf16Products = false;
  std::vector<float> pt, dpt;
  explicit PairBuffers(int64_t size) : pt(size), dpt(size) {}
};

void backward_pair(const HeadCopies& c, int64_t qi, int64_t rows, int64_t kj, int64_t keys, float scale,
                   PairBuffers& buf, float* dq_t, float* dk, float* dv) {
  const int64_t head = c.head;
  float* pt = buf.pt.data();
  float* dpt = buf.dpt.data();
  matmul(keys, rows, head, c.k + kj * head, head, c.q_t + qi * head, rows, pt, rows, false);
  matmul(keys, rows, head, c.v + kj * head, head, c.dout_t + qi * head, rows, dpt, rows, false);
  const float* lse = c.lse + qi;
  const float* delta = c.delta + qi;
  const Vec vscale(scale);
  for (int64_t r = 0; r < keys; ++r) {
    float* p = pt + r * rows;
    float* dp = dpt + r * rows;
    int64_t i = 0;
    for (; i + Vec::size() <= rows; i += Vec::size()) {
      Vec x = (Vec::loadu(p + i) * vscale - Vec::loadu(lse + i)).exp_u20();
      x.store(p + i);
      (x * (Vec::loadu(dp + i) - Vec::loadu(delta + i))).store(dp + i);  // dS^T, in place of dP^T
    }
    for (; i < rows; ++i) {
      p[i] = std::exp(p[i] * scale - lse[i]);
      dp[i] = p[i] * (dp[i] - delta[i]);
    }
  }
  matmul(keys, head, rows, pt, rows, c.dout + qi * head, head, dv, head, true);
  matmul(keys, head, rows, dpt, rows, c.q + qi * head, head, dk, head, true);
  matmul(head, rows, keys, c.k_t + kj * head, keys, dpt, rows, dq_t + qi * head, rows, true);
}

template <typename T>
void write_rows(T* dst, int64_t b, int64_t h, int64_t heads, int64_t tokens, int64_t head, const float* src,
                int64_t first, int64_t last, float scale) {  // into (batch, tokens, heads, head) memory
  for (int64_t r = first; r < last; ++r) {
    T* out = dst + ((b * tokens + r) * heads + h) * head;
    for (int64_t d = 0; d < head; ++d) out[d] = static_cast<T>(src[r * head + d] * scale);
  }
}

template <typename T>
void write_panels(T* dst, int64_t b, int64_t h, int64_t heads, int64_t tokens, int64_t head, const float* src,
                  int64_t panel, float scale) {  // transposed panels (widen_panels) into (batch, tokens, heads, head)
  at::parallel_for(0, tokens, 256, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      T* out = dst + ((b * tokens + r) * heads + h) * head;
      for (int64_t d = 0; d < head; ++d) out[d] = static_cast<T>(src[panel_at(r, head, tokens, panel, d)] * scale);
    }
  });
}

// What the pairs of one head sum into, fp32: dQ (transposed panels), dK, dV, and per-thread copies of what
// several tasks add to (dQ by key blocks, dK and dV by query blocks)
struct Sums {
  int64_t lq, lk, head, threads, q_blocks, k_blocks;
  bool by_keys;
  std::vector<float> dq_t, dk, dv;
  std::vector<std::vector<float>> partial;
  std::vector<char> used;
  Sums(int64_t lq_, int64_t lk_, int64_t head_)
      : lq(lq_), lk(lk_), head(head_), threads(at::get_num_threads()),
        q_blocks((lq_ + kBackwardQueryBlock - 1) / kBackwardQueryBlock),
        k_blocks((lk_ + kBackwardKeyBlock - 1) / kBackwardKeyBlock),
        // over key blocks where they are enough to keep every thread busy (self-attention), else over query
        // blocks (few keys: cross-attention)
        by_keys(k_blocks >= std::min(threads, q_blocks)), dq_t(lq_ * head_), dk(lk_ * head_), dv(lk_ * head_),
        partial(threads, std::vector<float>((by_keys ? lq_ : lk_) * head_ * (by_keys ? 1 : 2))), used(threads) {}
};

// every (query block, key block) pair of one head through ``pair(qi, rows, kj, keys, buffers, dq_t, dk, dv)``
template <typename Buffers, typename Pair>
void sum_pairs(Sums& w, const Pair& pair) {
  const int64_t lq = w.lq, lk = w.lk, head = w.head;
  std::fill(w.used.begin(), w.used.end(), 0);
  if (w.by_keys) {
    std::fill(w.dk.begin(), w.dk.end(), 0.f);
    std::fill(w.dv.begin(), w.dv.end(), 0.f);
    at::parallel_for(0, w.k_blocks, 1, [&](int64_t begin, int64_t end) {
      Buffers buf(kBackwardQueryBlock * kBackwardKeyBlock);
      const int64_t tid = at::get_thread_num();
      float* dq_mine = w.partial[tid].data();
      if (!w.used[tid]) std::fill(w.partial[tid].begin(), w.partial[tid].end(), 0.f);
      w.used[tid] = 1;
      for (int64_t jb = begin; jb < end; ++jb) {
        const int64_t kj = jb * kBackwardKeyBlock, keys = std::min(kBackwardKeyBlock, lk - kj);
        for (int64_t qi = 0; qi < lq; qi += kBackwardQueryBlock)
          pair(qi, std::min(kBackwardQueryBlock, lq - qi), kj, keys, buf, dq_mine, w.dk.data() + kj * head,
               w.dv.data() + kj * head);
      }
      if (Buffers::kBf16Products) at::native::cpublas::brgemm_release(true);
    });
    std::fill(w.dq_t.begin(), w.dq_t.end(), 0.f);
    at::parallel_for(0, lq * head, 4096, [&](int64_t first, int64_t last) {
      for (int64_t t = 0; t < w.threads; ++t)
        if (w.used[t])
          for (int64_t i = first; i < last; ++i) w.dq_t[i] += w.partial[t][i];
    });
  } else {
    std::fill(w.dq_t.begin(), w.dq_t.end(), 0.f);
    at::parallel_for(0, w.q_blocks, 1, [&](int64_t begin, int64_t end) {
      Buffers buf(kBackwardQueryBlock * kBackwardKeyBlock);
      const int64_t tid = at::get_thread_num();
      float* dk_mine = w.partial[tid].data();
      float* dv_mine = dk_mine + lk * head;
      if (!w.used[tid]) std::fill(w.partial[tid].begin(), w.partial[tid].end(), 0.f);
      w.used[tid] = 1;
      for (int64_t ib = begin; ib < end; ++ib) {
        const int64_t qi = ib * kBackwardQueryBlock, rows = std::min(kBackwardQueryBlock, lq - qi);
        for (int64_t kj = 0; kj < lk; kj += kBackwardKeyBlock)
          pair(qi, rows, kj, std::min(kBackwardKeyBlock, lk - kj), buf, w.dq_t.data(), dk_mine + kj * head,
               dv_mine + kj * head);
      }
      if (Buffers::kBf16Products) at::native::cpublas::brgemm_release(true);
    });
    std::fill(w.dk.begin(), w.dk.end(), 0.f);
    std::fill(w.dv.begin(), w.dv.end(), 0.f);
    for (int64_t t = 0; t < w.threads; ++t) {
      if (!w.used[t]) continue;
      for (int64_t i = 0; i < lk * head; ++i) {
        w.dk[i] += w.partial[t][i];
        w.dv[i] += w.partial[t][lk * head + i];
      }
    }
  }
}

// delta_r = sum_d O[r, d] dO[r, d] over rows [first, last) of head (b, h)
template <typename T>
void row_dots(const Rows<T>& out, const Rows<T>& dout, int64_t b, int64_t h, int64_t first, int64_t last,
              int64_t head, float* delta) {
  for (int64_t r = first; r < last; ++r) {
    const T* o = out.row(b, h, r);
    const T* g = dout.row(b, h, r);
    float sum = 0.f;
    for (int64_t d = 0; d < head; ++d) sum += static_cast<float>(o[d]) * static_cast<float>(g[d]);
    delta[r] = sum;
  }
}

template <typename T>
void write_all(Sums& w, int64_t b, int64_t h, int64_t heads, float scale, at::Tensor& dq, at::Tensor& dk,
               at::Tensor& dv) {
  write_panels(dq.data_ptr<T>(), b, h, heads, w.lq, w.head, w.dq_t.data(), kBackwardQueryBlock, scale);
  write_rows(dk.data_ptr<T>(), b, h, heads, w.lk, w.head, w.dk.data(), 0, w.lk, scale);
  write_rows(dv.data_ptr<T>(), b, h, heads, w.lk, w.head, w.dv.data(), 0, w.lk, 1.f);
}

template <typename T>
void backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, float scale, at::Tensor& dq, at::Tensor& dk,
              at::Tensor& dv) {
  const int64_t batch = q.size(0), heads = q.size(1), lq = q.size(2), head = q.size(3), lk = k.size(2);
  const Rows<T> qr(q), kr(k), vr(v), dor(dout), outr(out);
  std::vector<float> qf(lq * head), q_t(head * lq), kf(lk * head), k_t(head * lk), vf(lk * head), dof(lq * head),
      do_t(head * lq), delta(lq);
  Sums w(lq, lk, head);
  const float* lse_all = lse.const_data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      at::parallel_for(0, std::max(lq, lk), 64, [&](int64_t first, int64_t last) {
        const int64_t q0 = std::min(first, lq), q1 = std::min(last, lq), k0 = std::min(first, lk);
        const int64_t k1 = std::min(last, lk);
        widen_rows(qr, b, h, q0, q1, head, qf.data() + q0 * head);
        widen_panels(qr, b, h, q0, q1, head, q_t.data(), lq, kBackwardQueryBlock);
        widen_rows(dor, b, h, q0, q1, head, dof.data() + q0 * head);
        widen_panels(dor, b, h, q0, q1, head, do_t.data(), lq, kBackwardQueryBlock);
        widen_rows(kr, b, h, k0, k1, head, kf.data() + k0 * head);
        widen_panels(kr, b, h, k0, k1, head, k_t.data(), lk, kBackwardKeyBlock);
        widen_rows(vr, b, h, k0, k1, head, vf.data() + k0 * head);
        row_dots(outr, dor, b, h, q0, q1, head, delta.data());
      });
      const HeadCopies c{lq, lk, head, qf.data(), q_t.data(), kf.data(), k_t.data(), vf.data(), dof.data(),
                         do_t.data(), lse_all + (b * heads + h) * lq, delta.data()};
      sum_pairs<PairBuffers>(w, [&](int64_t qi, int64_t rows, int64_t kj, int64_t keys, PairBuffers& buf,
                                    float* dq_t, float* dk_, float* dv_) {
        backward_pair(c, qi, rows, kj, keys, scale, buf, dq_t, dk_, dv_);
      });
      write_all<T>(w, b, h, heads, scale, dq, dk, dv);
    }
  }
}


// --- bf16 products on bf16 instructions (AVX512-BF16's vdpbf16ps, AMX tiles) ----------------------------
// Where torch's brgemm takes bf16 (oneDNN's ukernel: an AVX-512 CPU), a bf16 head's products run in bf16
// with fp32 sums, as torch's own flash attention does on AMX; the fp32 path above widens bf16 to fp32 and
// would leave those instructions idle. B comes in the VNNI layout that vdpbf16ps reads: rows 2i and 2i+1
// interleaved, element (k, n) at (k / 2) * 2 * ld + 2 * n + k % 2; an odd K is padded with a zero row (and A
// with a zero column). The softmax statistics, dQ's sums and the dK/dV sums stay fp32.
using BF16 = c10::BFloat16;

inline void matmul_bf16(int64_t m, int64_t n, int64_t k, const BF16* a, int64_t lda, const BF16* b_vnni, int64_t ldb,
                        float* c, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b_vnni, c, /*is_vnni=*/true);
}

inline int64_t even(int64_t n) { return n + (n & 1); }

// Whether this torch and CPU run bf16 brgemm on VNNI input as laid out here: tried once on a product of small
// integers (exact in bf16 and fp32) against the plain one, so that a brgemm wanting another layout (AMX's, not
// measured) fails it. Where torch's brgemm refuses VNNI (an error, caught: AVX2) the fp32 path runs.
bool vnni_products() {
#ifdef XT_NO_VNNI
  return false;
#else
  static const bool works = [] {
    constexpr int64_t m = 5, n = 37, k = 42;  // odd N, K not a multiple of a tile's 32: as the heads' blocks
    BF16 a[m * k], b[k * n];
    float c[m * n];
    for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<float>(i % 7 - 3);
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < n; ++j) b[(kk / 2) * 2 * n + 2 * j + (kk & 1)] = static_cast<float>((kk * n + j) % 5 - 2);
    try {
      matmul_bf16(m, n, k, a, k, b, n, c, n, false);
      at::native::cpublas::brgemm_release(true);
    } catch (...) {
      return false;
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float want = 0.f;
        for (int64_t kk = 0; kk < k; ++kk) want += static_cast<float>(a[i * k + kk]) * static_cast<float>((kk * n + j) % 5 - 2);
        if (c[i * n + j] != want) return false;
      }
    return true;
  }();
  return works;
#endif
}

// rows [first, first + count) of head (b, h) as B of a product that reads them transposed (X^T, head x count):
// VNNI pairs of one row's neighbouring elements, ld count
void vnni_transposed(const Rows<BF16>& src, int64_t b, int64_t h, int64_t first, int64_t count, int64_t head,
                     BF16* dst) {
  for (int64_t n = 0; n < count; ++n) {
    const BF16* in = src.row(b, h, first + n);
    for (int64_t i = 0; i < head / 2; ++i) {
      dst[(i * count + n) * 2] = in[2 * i];
      dst[(i * count + n) * 2 + 1] = in[2 * i + 1];
    }
  }
}

// rows [first, first + count) of head (b, h) as B (count x head) in VNNI, ld head, an odd count padded
void vnni_rows(const Rows<BF16>& src, int64_t b, int64_t h, int64_t first, int64_t count, int64_t head, BF16* dst) {
  for (int64_t r = 0; r < even(count); ++r) {
    const BF16* in = r < count ? src.row(b, h, first + r) : nullptr;
    for (int64_t d = 0; d < head; ++d) dst[(r / 2) * 2 * head + 2 * d + (r & 1)] = in ? in[d] : BF16(0.f);
  }
}

// p[i] = bf16(exp(s[i] * scale - shift)), an odd n's pad element 0; returned: the fp32 values' sum
inline float exp_row_bf16(BF16* p, const float* s, int64_t n, float scale, float shift) {
  using VecB = at::vec::Vectorized<BF16>;
  const Vec vscale(scale), vshift(shift);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + VecB::size() <= n; i += VecB::size()) {
    const Vec x0 = (Vec::loadu(s + i) * vscale - vshift).exp_u20();
    const Vec x1 = (Vec::loadu(s + i + Vec::size()) * vscale - vshift).exp_u20();
    sum = sum + x0 + x1;
    at::vec::convert_float_bfloat16(x0, x1).store(p + i);
  }
  float total = sum_lanes(sum);
  for (; i < n; ++i) {
    const float x = std::exp(s[i] * scale - shift);
    p[i] = BF16(x);
    total += x;
  }
  if (n & 1) p[n] = BF16(0.f);
  return total;
}

// x's lanes in bf16 at out
inline void store_bf16(const Vec& x, BF16* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), at::vec::cvtfp32_bf16(static_cast<__m512>(x)));
#else
  float lanes[Vec::size()];
  x.store(lanes);
  at::vec::convert(lanes, out, Vec::size());
#endif
}

// a[0..Vec::size()) and b[0..Vec::size()) in bf16, interleaved a0 b0 a1 b1 ... into out (VNNI's row pairs)
inline void store_pairs(const Vec& a, const Vec& b, BF16* out) {
  const at::vec::Vectorized<BF16> both = at::vec::convert_float_bfloat16(a, b);  // a's lanes, then b's
#if defined(CPU_CAPABILITY_AVX512)
  static const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(order, static_cast<__m512i>(both)));
#else
  BF16 lanes[2 * Vec::size()];
  both.store(lanes);
  for (int64_t i = 0; i < Vec::size(); ++i) {
    out[2 * i] = lanes[i];
    out[2 * i + 1] = lanes[Vec::size() + i];
  }
#endif
}

void forward_vnni(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                  float scale) {
  const int64_t batch = q.size(0), heads = q.size(1), lq = q.size(2), head = q.size(3), lk = k.size(2);
  const Rows<BF16> qr(q), kr(k), vr(v);
  // per head and key block: K^T (head x keys) and V (keys x head) in VNNI, at j * head
  const int64_t per_head = (lk + 1) * head;
  std::vector<BF16> kt(batch * heads * per_head), vv(batch * heads * per_head);
  const int64_t key_blocks = (lk + kKeyBlock - 1) / kKeyBlock;
  at::parallel_for(0, batch * heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / key_blocks, j = (t % key_blocks) * kKeyBlock, keys = std::min(kKeyBlock, lk - j);
      vnni_transposed(kr, bh / heads, bh % heads, j, keys, head, kt.data() + bh * per_head + j * head);
      vnni_rows(vr, bh / heads, bh % heads, j, keys, head, vv.data() + bh * per_head + j * head);
    }
  });
  const int64_t blocks = (lq + kQueryBlock - 1) / kQueryBlock;
  BF16* o = out.data_ptr<BF16>();
  float* l_out = lse.data_ptr<float>();
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kQueryBlock * kKeyBlock), acc(kQueryBlock * head), m(kQueryBlock), l(kQueryBlock);
    std::vector<BF16> p(kQueryBlock * even(kKeyBlock));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / heads, h = bh % heads;
      const int64_t first = (task % blocks) * kQueryBlock, rows = std::min(kQueryBlock, lq - first);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < lk; j += kKeyBlock) {
        const int64_t keys = std::min(kKeyBlock, lk - j);
        matmul_bf16(rows, keys, head, qr.row(b, h, first), qr.row_stride, kt.data() + bh * per_head + j * head, keys,
                    s.data(), keys, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * keys;
          const float top = std::max(m[r], max_row(sr, keys) * scale);
          const float kept = std::exp(m[r] - top);
          l[r] = l[r] * kept + exp_row_bf16(p.data() + r * even(keys), sr, keys, scale, top);
          m[r] = top;
          if (j > 0) {
            float* ar = acc.data() + r * head;
            for (int64_t d = 0; d < head; ++d) ar[d] *= kept;
          }
        }
        matmul_bf16(rows, head, even(keys), p.data(), even(keys), vv.data() + bh * per_head + j * head, head,
                    acc.data(), head, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        BF16* dst = o + ((b * lq + first + r) * heads + h) * head;
        for (int64_t d = 0; d < head; ++d) dst[d] = static_cast<BF16>(acc[r * head + d] * inv);
        l_out[(b * heads + h) * lq + first + r] = m[r] + std::log(l[r]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

// One (query block, key block) pair of the backward on bf16 products (backward_pair's steps; K, V and their
// blocks read straight from the tensors as A, Q and dO made VNNI once per head)
struct HeadVnni {
  const Rows<BF16>* k;
  const Rows<BF16>* v;
  int64_t b, h, head;
  const BF16 *q_t, *dout_t, *q, *dout, *k_t;  // VNNI: Q^T, dO^T (panels), Q, dO (row pairs); K^T plain panels
  const float *lse, *delta;
};

struct VnniBuffers {
  static constexpr bool kBf16Products = true;  // AMX's tile state is released after them
  std::vector<float> pt, dpt;
  std::vector<BF16> p, ds, ds_vnni;
  explicit VnniBuffers(int64_t size) : pt(size), dpt(size), p(size + kBackwardKeyBlock), ds(size + kBackwardKeyBlock),
                                       ds_vnni(size + kBackwardQueryBlock) {}
};

void backward_pair_vnni(const HeadVnni& c, int64_t qi, int64_t rows, int64_t kj, int64_t keys, float scale,
                        VnniBuffers& buf, float* dq_t, float* dk, float* dv) {
  const int64_t head = c.head;
  float* pt = buf.pt.data();
  float* dpt = buf.dpt.data();
  matmul_bf16(keys, rows, head, c.k->row(c.b, c.h, kj), c.k->row_stride, c.q_t + qi * head, rows, pt, rows, false);
  matmul_bf16(keys, rows, head, c.v->row(c.b, c.h, kj), c.v->row_stride, c.dout_t + qi * head, rows, dpt, rows,
              false);
  // P^T and dS^T = P^T (dP^T - delta) a pair of key rows at a time, written once each as bf16: P^T and dS^T
  // (A of dV's and dK's products, ld even(rows)) and dS^T's row pairs interleaved (B of dQ^T's, VNNI)
  const float* lse = c.lse + qi;
  const float* delta = c.delta + qi;
  const int64_t ld = even(rows);
  BF16* p = buf.p.data();
  BF16* ds = buf.ds.data();
  BF16* ds_vnni = buf.ds_vnni.data();
  const Vec vscale(scale);
  for (int64_t r = 0; r < keys; r += 2) {
    const bool second = r + 1 < keys;  // an odd last key's partner row is 0 (VNNI's pad)
    const float* s0 = pt + r * rows;
    const float* s1 = pt + (second ? r + 1 : r) * rows;
    const float* g0 = dpt + r * rows;
    const float* g1 = dpt + (second ? r + 1 : r) * rows;
    BF16* pair = ds_vnni + r * rows;  // (r / 2) * 2 * rows
    int64_t i = 0;
    for (; i + Vec::size() <= rows; i += Vec::size()) {
      const Vec l = Vec::loadu(lse + i), d = Vec::loadu(delta + i);
      const Vec p0 = (Vec::loadu(s0 + i) * vscale - l).exp_u20();
      const Vec ds0 = p0 * (Vec::loadu(g0 + i) - d);
      Vec p1(0.f), ds1(0.f);
      if (second) {
        p1 = (Vec::loadu(s1 + i) * vscale - l).exp_u20();
        ds1 = p1 * (Vec::loadu(g1 + i) - d);
      }
      store_bf16(p0, p + r * ld + i);
      store_bf16(ds0, ds + r * ld + i);
      if (second) {
        store_bf16(p1, p + (r + 1) * ld + i);
        store_bf16(ds1, ds + (r + 1) * ld + i);
      }
      store_pairs(ds0, ds1, pair + 2 * i);
    }
    for (; i < rows; ++i) {
      const float q0 = std::exp(s0[i] * scale - lse[i]), e0 = q0 * (g0[i] - delta[i]);
      const float q1 = second ? std::exp(s1[i] * scale - lse[i]) : 0.f, e1 = second ? q1 * (g1[i] - delta[i]) : 0.f;
      p[r * ld + i] = BF16(q0);
      ds[r * ld + i] = BF16(e0);
      if (second) {
        p[(r + 1) * ld + i] = BF16(q1);
        ds[(r + 1) * ld + i] = BF16(e1);
      }
      pair[2 * i] = BF16(e0);
      pair[2 * i + 1] = BF16(e1);
    }
    if (ld != rows) {  // A's pad column
      p[r * ld + rows] = ds[r * ld + rows] = BF16(0.f);
      if (second) p[(r + 1) * ld + rows] = ds[(r + 1) * ld + rows] = BF16(0.f);
    }
  }
  matmul_bf16(keys, head, even(rows), buf.p.data(), even(rows), c.dout + qi * head, head, dv, head, true);
  matmul_bf16(keys, head, even(rows), buf.ds.data(), even(rows), c.q + qi * head, head, dk, head, true);
  matmul_bf16(head, rows, even(keys), c.k_t + kj * head, even(keys), buf.ds_vnni.data(), rows, dq_t + qi * head, rows,
              true);
}

void backward_vnni(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, float scale, at::Tensor& dq, at::Tensor& dk,
                   at::Tensor& dv) {
  const int64_t batch = q.size(0), heads = q.size(1), lq = q.size(2), head = q.size(3), lk = k.size(2);
  const Rows<BF16> qr(q), kr(k), vr(v), dor(dout), outr(out);
  std::vector<BF16> q_t(lq * head), do_t(lq * head), qv((lq + 1) * head), dov((lq + 1) * head), k_t((lk + 1) * head);
  std::vector<float> delta(lq);
  Sums w(lq, lk, head);
  const int64_t qb = kBackwardQueryBlock, kb = kBackwardKeyBlock;
  const float* lse_all = lse.const_data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      at::parallel_for(0, std::max(w.q_blocks, w.k_blocks), 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (t < w.q_blocks) {
            const int64_t qi = t * qb, rows = std::min(qb, lq - qi);
            vnni_transposed(qr, b, h, qi, rows, head, q_t.data() + qi * head);
            vnni_transposed(dor, b, h, qi, rows, head, do_t.data() + qi * head);
            vnni_rows(qr, b, h, qi, rows, head, qv.data() + qi * head);
            vnni_rows(dor, b, h, qi, rows, head, dov.data() + qi * head);
            row_dots(outr, dor, b, h, qi, qi + rows, head, delta.data());
          }
          if (t < w.k_blocks) {  // K^T's panels, plain (A of dQ^T's product), an odd block's pad column 0
            const int64_t kj = t * kb, keys = std::min(kb, lk - kj), ld = even(keys);
            BF16* dst = k_t.data() + kj * head;
            for (int64_t n = 0; n < ld; ++n) {
              const BF16* in = n < keys ? kr.row(b, h, kj + n) : nullptr;
              for (int64_t d = 0; d < head; ++d) dst[d * ld + n] = in ? in[d] : BF16(0.f);
            }
          }
        }
      });
      const HeadVnni c{&kr, &vr, b, h, head, q_t.data(), do_t.data(), qv.data(), dov.data(), k_t.data(),
                       lse_all + (b * heads + h) * lq, delta.data()};
      sum_pairs<VnniBuffers>(w, [&](int64_t qi, int64_t rows, int64_t kj, int64_t keys, VnniBuffers& buf,
                                    float* dq_t, float* dk_, float* dv_) {
        backward_pair_vnni(c, qi, rows, kj, keys, scale, buf, dq_t, dk_, dv_);
      });
      write_all<BF16>(w, b, h, heads, scale, dq, dk, dv);
    }
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "xeontune attention: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu(), "xeontune attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "xeontune attention: q, k, v of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "xeontune attention: fp32 or bf16");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3) && k.sizes() == v.sizes(),
              "xeontune attention: shapes do not match");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "xeontune attention: the last dimension must be contiguous");
}

// (batch, heads, tokens, head) whose memory is (batch, tokens, heads, head): what the processor reshapes
// back to (batch, tokens, heads * head) without a copy
at::Tensor like_heads_last(const at::Tensor& q, int64_t tokens) {
  return at::empty({q.size(0), tokens, q.size(1), q.size(3)}, q.options()).transpose(1, 2);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale) {
  check_inputs(q, k, v);
  at::Tensor out = like_heads_last(q, q.size(2));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat)
    forward<float>(q, k, v, out, lse, static_cast<float>(scale));
  else if (q.size(3) % 2 == 0 && vnni_products())
    forward_vnni(q, k, v, out, lse, static_cast<float>(scale));
  else
    forward<c10::BFloat16>(q, k, v, out, lse, static_cast<float>(scale));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  double scale) {
  check_inputs(q, k, v);
  at::Tensor g = grad_out.stride(3) == 1 ? grad_out : grad_out.contiguous();
  at::Tensor o = out.stride(3) == 1 ? out : out.contiguous();
  at::Tensor l = lse.contiguous();
  at::Tensor dq = like_heads_last(q, q.size(2)), dk = like_heads_last(k, k.size(2)), dv = like_heads_last(v, v.size(2));
  if (q.scalar_type() == at::kFloat)
    backward<float>(g.to(at::kFloat), q, k, v, o, l, static_cast<float>(scale), dq, dk, dv);
  else if (q.size(3) % 2 == 0 && vnni_products())
    backward_vnni(g.to(at::kBFloat16), q, k, v, o, l, static_cast<float>(scale), dq, dk, dv);
  else
    backward<c10::BFloat16>(g.to(at::kBFloat16), q, k, v, o, l, static_cast<float>(scale), dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(xeontune, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("bf16_products() -> bool", [] { return vnni_products(); });  // what a bf16 head runs on here
}

TORCH_LIBRARY_IMPL(xeontune, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}
