// CPU reference attention (see reference.h).
#include "reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "flash3/flash3_c.h"  // dtype codes, without the CUDA headers flash3.h needs

namespace flash3::ref {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x rounded to a binary format with `mbits` stored mantissa bits and normal exponents
// [emin, emax] (subnormals below 2^emin, +-inf from 2^(emax+1) up), ties to even.
double round_format(double x, int mbits, int emin, int emax) {
  if (!std::isfinite(x) || x == 0.0) return x;
  const double ulp = std::ldexp(1.0, std::max(std::ilogb(x), emin) - mbits);
  const double r = std::nearbyint(x / ulp) * ulp;  // scaling by a power of two is exact
  return std::fabs(r) >= std::ldexp(1.0, emax + 1) ? std::copysign(HUGE_VAL, x) : r;
}

float round_half(float x) { return half_bits_to_float(float_to_half_bits(x)); }
float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// Runs fn(i) once for every i in [0, n), spread over all hardware threads.
template <class Fn>
void parallel_for(int64_t n, Fn fn) {
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i; (i = next++) < n;) fn(i);
  };
  const int64_t nthreads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n);
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < nthreads; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

// Query row i sees keys [first_key, last_key] (Problem's mask: causal, aligned bottom-right,
// and the window); none where first_key > last_key.
int64_t last_key(const Problem& p, int64_t i) {
  const int64_t sk = p.seqlen_k, right = p.causal ? 0 : p.window_right;
  return right < 0 ? sk - 1 : std::max<int64_t>(-1, std::min(sk - 1, i + sk - p.seqlen_q + right));
}
int64_t first_key(const Problem& p, int64_t i) {
  return p.window_left < 0 ? 0 : std::max<int64_t>(0, i + p.seqlen_k - p.seqlen_q - p.window_left);
}
// [first, last] of row i, or [0, -1] when it sees no key.
void key_range(const Problem& p, int64_t i, int64_t& first, int64_t& last) {
  first = first_key(p, i);
  last = last_key(p, i);
  if (first > last) first = 0, last = -1;
}

// Query rows are processed in blocks of kRows (per batch and head): each K and V row is loaded
// once per block, and the q.k dot products of a block vectorize across its rows while each one
// is still summed in order over the head dim.
constexpr int kRows = 16;

// Attention in precision T, with rnd() applied where attention_fwd_lowp says (kFp8: where
// attention_fwd_fp8_plain says).
template <class T, bool kFp8 = false, class Rnd>
void attention(const Problem& p, const double* q, const double* k, const double* v, double* out,
               double* lse, const std::vector<int>* rows, Rnd rnd) {
  std::vector<int> all_rows;
  if (rows == nullptr) {
    all_rows.resize(p.seqlen_q);
    std::iota(all_rows.begin(), all_rows.end(), 0);
    rows = &all_rows;
  }
  for (int i : *rows) {
    if (i < 0 || i >= p.seqlen_q) {
      throw std::out_of_range("flash3::ref: row " + std::to_string(i) + " is not in [0, seqlen_q)");
    }
  }
  const int64_t d = p.head_dim, sq = p.seqlen_q, sk = p.seqlen_k, nrows = static_cast<int64_t>(rows->size());
  const int64_t group = p.nheads / p.nheads_kv, nblocks = (nrows + kRows - 1) / kRows;
  const int64_t ntasks = int64_t{p.batch} * p.nheads * nblocks;
  const T scale = static_cast<T>(p.scale);
  const T softcap = static_cast<T>(p.softcap);
  auto cap = [&](T x) { return p.softcap > 0 ? softcap * std::tanh(x / softcap) : x; };

  parallel_for(ntasks, [&](int64_t task) {
    std::vector<T> qt(d * kRows), s(sk * kRows), o(d * kRows);  // qt is [d][kRows]; s, o by row
    const int64_t b = task / nblocks / p.nheads, h = task / nblocks % p.nheads;
    const int64_t r0 = task % nblocks * kRows;
    const int64_t nr = std::min<int64_t>(kRows, nrows - r0);
    const double* kbase = k + (b * sk * p.nheads_kv + h / group) * d;
    const double* vbase = v + (b * sk * p.nheads_kv + h / group) * d;
    const int64_t kv_row = p.nheads_kv * d;
    int64_t first[kRows], last[kRows];  // row r of the block sees keys [first[r], last[r]]
    int64_t max_last = -1;
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = r < nr ? (*rows)[r0 + r] : 0;
      first[r] = 0, last[r] = -1;
      if (r < nr) key_range(p, i, first[r], last[r]);
      max_last = std::max(max_last, last[r]);
      for (int64_t c = 0; c < d; ++c) {
        const T qc = r < nr ? static_cast<T>(q[((b * sq + i) * p.nheads + h) * d + c]) : T(0);
        qt[c * kRows + r] = kFp8 ? qc : rnd(qc * scale);
      }
    }
    for (int64_t j = 0; j <= max_last; ++j) {
      T acc[kRows] = {};
      for (int64_t c = 0; c < d; ++c) {
        const T kc = static_cast<T>(kbase[j * kv_row + c]);
        for (int r = 0; r < kRows; ++r) acc[r] += qt[c * kRows + r] * kc;
      }
      for (int r = 0; r < kRows; ++r) s[r * sk + j] = kFp8 ? cap(acc[r] * scale) : rnd(cap(rnd(acc[r])));
    }
    std::fill(o.begin(), o.end(), T(0));
    T row_lse[kRows], row_sum[kRows];
    for (int r = 0; r < nr; ++r) {
      T* sr = s.data() + r * sk;
      T m = -std::numeric_limits<T>::infinity(), sum = 0;
      for (int64_t j = first[r]; j <= last[r]; ++j) m = std::max(m, sr[j]);
      for (int64_t j = first[r]; j <= last[r]; ++j) sum += (sr[j] = std::exp(sr[j] - m));
      for (int64_t j = first[r]; j <= last[r]; ++j) sr[j] = kFp8 ? static_cast<T>(round_e4m3(sr[j])) : rnd(sr[j] / sum);
      row_lse[r] = last[r] < 0 ? std::numeric_limits<T>::infinity() : m + std::log(sum);
      row_sum[r] = sum;
    }
    for (int64_t j = 0; j <= max_last; ++j) {
      const double* vj = vbase + j * kv_row;
      for (int r = 0; r < nr; ++r) {
        if (j < first[r] || j > last[r]) continue;
        const T pj = s[r * sk + j];
        T* orow = o.data() + r * d;
        for (int64_t c = 0; c < d; ++c) orow[c] += pj * static_cast<T>(vj[c]);
      }
    }
    for (int r = 0; r < nr; ++r) {
      const int64_t i = (*rows)[r0 + r];
      const T div = kFp8 && last[r] >= 0 ? row_sum[r] : T(1);
      for (int64_t c = 0; c < d; ++c) out[((b * sq + i) * p.nheads + h) * d + c] = rnd(o[r * d + c] / div);
      if (lse != nullptr) lse[(b * p.nheads + h) * sq + i] = row_lse[r];
    }
  });
}

// The backward in precision T, with rnd() applied where attention_bwd_lowp says (the identity
// for double). One (batch, query head) at a time, in head order: a pass over blocks of query rows
// computes qs, P and dS (kept as seqlen_q x seqlen_k matrices) and dq; then a pass over blocks
// of keys reads P and dS column-wise for this head's dK, dV and adds them, rounded, to the sums
// of its kv head. Each pass splits its blocks over the threads; no two blocks write the same
// element. Every sum runs in order (over the head dim, keys or rows) and vectorizes across the
// rows, keys or head-dim entries of a block instead.
template <class T, class Rnd>
void attention_backward(const Problem& p, const double* q, const double* k, const double* v,
                        const double* dout, double* dq, double* dk, double* dv, Rnd rnd) {
  const int64_t d = p.head_dim, sq = p.seqlen_q, sk = p.seqlen_k, hk = p.nheads_kv;
  const int64_t group = p.nheads / hk, q_row = p.nheads * d, kv_row = hk * d;  // seqlen row strides
  const int64_t qblocks = (sq + kRows - 1) / kRows, kblocks = (sk + kRows - 1) / kRows;
  const T scale = static_cast<T>(p.scale);
  std::vector<T> dk_sum(size_t(p.batch) * sk * kv_row, T(0)), dv_sum(dk_sum.size(), T(0));
  std::vector<T> qs(size_t(sq) * d), P(size_t(sq) * sk), dS(size_t(sq) * sk);  // of one head
  std::vector<T> tanh_s(p.softcap > 0 ? size_t(sq) * sk : 0);  // softcap: tanh(S / softcap)

  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.nheads; ++h) {
      // Row i of q, dout, dq at [i * q_row]; row j of k, v and of the sums at [j * kv_row].
      const double *qh = q + b * sq * q_row + h * d, *doh = dout + b * sq * q_row + h * d;
      const double *kh = k + (b * sk * hk + h / group) * d, *vh = v + (b * sk * hk + h / group) * d;
      double* dqh = dq + b * sq * q_row + h * d;
      T *dk_h = dk_sum.data() + (b * sk * hk + h / group) * d, *dv_h = dv_sum.data() + (b * sk * hk + h / group) * d;

      parallel_for(qblocks, [&](int64_t blk) {
        const int64_t i0 = blk * kRows, nr = std::min<int64_t>(kRows, sq - i0);
        std::vector<T> qt(d * kRows, T(0)), dot(d * kRows, T(0));  // qs and dO of the block, [d][kRows]
        int64_t first[kRows], last[kRows];  // row i0 + r sees keys [first[r], last[r]]
        int64_t max_last = -1;
        for (int64_t r = 0; r < kRows; ++r) {
          first[r] = 0, last[r] = -1;
          if (r < nr) key_range(p, i0 + r, first[r], last[r]);
          max_last = std::max(max_last, last[r]);
          for (int64_t c = 0; c < d && r < nr; ++c) {
            const int64_t i = i0 + r;
            qt[c * kRows + r] = qs[i * d + c] = rnd(static_cast<T>(qh[i * q_row + c]) * scale);
            dot[c * kRows + r] = static_cast<T>(doh[i * q_row + c]);
          }
        }
        // S = qs k^T and dP = dO v^T, parked in P and dS.
        for (int64_t j = 0; j <= max_last; ++j) {
          T s_acc[kRows] = {}, dp_acc[kRows] = {};
          for (int64_t c = 0; c < d; ++c) {
            const T kc = static_cast<T>(kh[j * kv_row + c]), vc = static_cast<T>(vh[j * kv_row + c]);
            for (int r = 0; r < kRows; ++r) {
              s_acc[r] += qt[c * kRows + r] * kc;
              dp_acc[r] += dot[c * kRows + r] * vc;
            }
          }
          for (int64_t r = 0; r < nr; ++r) {
            T sv = rnd(s_acc[r]);
            if (p.softcap > 0) {
              const T t = std::tanh(sv / static_cast<T>(p.softcap));
              tanh_s[(i0 + r) * sk + j] = t;
              sv = rnd(static_cast<T>(p.softcap) * t);
            }
            P[(i0 + r) * sk + j] = sv;
            dS[(i0 + r) * sk + j] = rnd(dp_acc[r]);
          }
        }
        // P = softmax(S) as attention_fwd_lowp computes it, D, dS; 0 where masked. Softcap: dS
        // of the capped scores times the derivative of the cap, 1 - tanh^2.
        for (int64_t r = 0; r < nr; ++r) {
          T *pr = P.data() + (i0 + r) * sk, *dsr = dS.data() + (i0 + r) * sk;
          const int64_t lo = first[r], hi = last[r];
          T m = -std::numeric_limits<T>::infinity(), sum = 0, dsum = 0;
          for (int64_t j = lo; j <= hi; ++j) m = std::max(m, pr[j]);
          for (int64_t j = lo; j <= hi; ++j) sum += (pr[j] = std::exp(pr[j] - m));
          for (int64_t j = lo; j <= hi; ++j) pr[j] = rnd(pr[j] / sum);
          for (int64_t j = lo; j <= hi; ++j) dsum += pr[j] * dsr[j];
          for (int64_t j = lo; j <= hi; ++j) dsr[j] = rnd(pr[j] * (dsr[j] - dsum));
          if (p.softcap > 0) {
            const T* tr = tanh_s.data() + (i0 + r) * sk;
            for (int64_t j = lo; j <= hi; ++j) dsr[j] = rnd(dsr[j] * (T(1) - tr[j] * tr[j]));
          }
          std::fill(pr, pr + lo, T(0));
          std::fill(dsr, dsr + lo, T(0));
          std::fill(pr + hi + 1, pr + sk, T(0));
          std::fill(dsr + hi + 1, dsr + sk, T(0));
        }
        // dq = scale * (dS k).
        std::vector<T> acc(nr * d, T(0)), kj(d);
        for (int64_t j = 0; j <= max_last; ++j) {
          for (int64_t c = 0; c < d; ++c) kj[c] = static_cast<T>(kh[j * kv_row + c]);
          for (int64_t r = 0; r < nr; ++r) {
            if (j < first[r] || j > last[r]) continue;
            const T ds = dS[(i0 + r) * sk + j];
            T* ar = acc.data() + r * d;
            for (int64_t c = 0; c < d; ++c) ar[c] += ds * kj[c];
          }
        }
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t c = 0; c < d; ++c) dqh[(i0 + r) * q_row + c] = rnd(rnd(acc[r * d + c]) * scale);
        }
      });

      parallel_for(kblocks, [&](int64_t blk) {
        const int64_t j0 = blk * kRows, nk = std::min<int64_t>(kRows, sk - j0);
        std::vector<T> dk_acc(nk * d, T(0)), dv_acc(nk * d, T(0)), doi(d);
        for (int64_t i = 0; i < sq; ++i) {
          int64_t fi, li;
          key_range(p, i, fi, li);
          if (li < j0 || fi >= j0 + nk) continue;  // row i sees no key of this block
          for (int64_t c = 0; c < d; ++c) doi[c] = static_cast<T>(doh[i * q_row + c]);
          const T* qsi = qs.data() + i * d;
          for (int64_t r = std::max<int64_t>(0, fi - j0); r < nk && j0 + r <= li; ++r) {
            const T pij = P[i * sk + j0 + r], dsij = dS[i * sk + j0 + r];
            T *dkr = dk_acc.data() + r * d, *dvr = dv_acc.data() + r * d;
            for (int64_t c = 0; c < d; ++c) {
              dvr[c] += pij * doi[c];
              dkr[c] += dsij * qsi[c];
            }
          }
        }
        for (int64_t r = 0; r < nk; ++r) {
          for (int64_t c = 0; c < d; ++c) {
            dk_h[(j0 + r) * kv_row + c] += rnd(dk_acc[r * d + c]);
            dv_h[(j0 + r) * kv_row + c] += rnd(dv_acc[r * d + c]);
          }
        }
      });
    }
  }
  for (size_t x = 0; x < dk_sum.size(); ++x) {
    dk[x] = rnd(dk_sum[x]);
    dv[x] = rnd(dv_sum[x]);
  }
}

}  // namespace

void attention_fwd_fp64(const Problem& p, const double* q, const double* k, const double* v,
                        double* out, double* lse, const std::vector<int>* rows) {
  attention<double>(p, q, k, v, out, lse, rows, [](double x) { return x; });
}

void attention_fwd_lowp(const Problem& p, DType dtype, const double* q, const double* k,
                        const double* v, double* out, double* lse, const std::vector<int>* rows) {
  switch (static_cast<int>(dtype)) {
    case FLASH3_FLOAT16: return attention<float>(p, q, k, v, out, lse, rows, round_half);
    case FLASH3_BFLOAT16: return attention<float>(p, q, k, v, out, lse, rows, round_bf16);
  }
  throw std::invalid_argument("flash3::ref::attention_fwd_lowp: dtype must be float16 or bfloat16");
}

// e4m3 (OCP float8_e4m3fn): 3 mantissa bits, normal exponents [-6, 8], no infinities; finite
// values beyond 448 saturate to +-448 (as cvt.rn.satfinite).
double round_e4m3(double x) {
  const double r = round_format(x, 3, -6, 8);
  return std::fabs(r) > 448.0 ? std::copysign(448.0, x) : r;
}

void attention_fwd_fp8_plain(const Problem& p, const double* q, const double* k, const double* v, double* out,
                             double* lse, const std::vector<int>* rows) {
  attention<float, true>(p, q, k, v, out, lse, rows, round_bf16);
}

uint8_t double_to_e4m3_bits(double x) {
  const double r = round_e4m3(x);
  const uint8_t sign = std::signbit(r) ? 0x80 : 0;
  const double a = std::fabs(r);
  if (a == 0.0) return sign;
  if (a < 0x1p-6) return sign | static_cast<uint8_t>(a * 0x1p9);  // subnormal: units of 2^-9
  const int e = std::ilogb(a);
  const int m = static_cast<int>(std::ldexp(a, -e) * 8.0) - 8;
  return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
}

double e4m3_bits_to_double(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  const double a = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -a : a;
}

void attention_bwd_fp64(const Problem& p, const double* q, const double* k, const double* v,
                        const double* dout, double* dq, double* dk, double* dv) {
  attention_backward<double>(p, q, k, v, dout, dq, dk, dv, [](double x) { return x; });
}

void attention_bwd_lowp(const Problem& p, DType dtype, const double* q, const double* k,
                        const double* v, const double* dout, double* dq, double* dk, double* dv) {
  switch (static_cast<int>(dtype)) {
    case FLASH3_FLOAT16: return attention_backward<float>(p, q, k, v, dout, dq, dk, dv, round_half);
    case FLASH3_BFLOAT16: return attention_backward<float>(p, q, k, v, dout, dq, dk, dv, round_bf16);
  }
  throw std::invalid_argument("flash3::ref::attention_bwd_lowp: dtype must be float16 or bfloat16");
}

uint16_t float_to_half_bits(float f) {
  const uint32_t x = bits(f), ax = x & 0x7fffffffu;
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  if (ax > 0x7f800000u) return sign | 0x7e00u | ((ax >> 13) & 0x3ffu);  // NaN: a quiet NaN
  if (ax >= 0x38800000u) {  // >= 2^-14: a normal half, or +-inf (the rounding carries into it)
    const uint32_t r = (ax + 0xfffu + ((ax >> 13) & 1u)) >> 13;  // drop 13 bits, ties to even
    return sign | static_cast<uint16_t>(std::min(r - (112u << 10), 0x7c00u));
  }
  return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 0x1p24f));  // subnormal: units of 2^-24
}

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return from_bits(sign | bits(std::ldexp(static_cast<float>(m), -24)));
  return from_bits(sign | ((e == 31 ? 255 : e + 112) << 23) | (m << 13));
}

uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float bf16_bits_to_float(uint16_t b) { return from_bits(uint32_t{b} << 16); }

double round_to(DType dtype, double x) {
  switch (static_cast<int>(dtype)) {
    case FLASH3_FLOAT16: return round_format(x, 10, -14, 15);
    case FLASH3_BFLOAT16: return round_format(x, 7, -126, 127);
    case FLASH3_FLOAT32: return static_cast<float>(x);
  }
  throw std::invalid_argument("flash3::ref::round_to: dtype must be float16, bfloat16 or float32");
}

}  // namespace flash3::ref
